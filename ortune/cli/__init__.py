"""The `ortune` command and what only it uses: the HTTP client, the demo, the embedded launcher."""

from ortune.cli.app import app, main

__all__ = ["app", "main"]

"""ortune: the shared kernel (settings, database models and repositories, object store, CLI)."""

__version__ = "0.1.0"

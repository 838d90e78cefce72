"""The `ortune` command: run the service, submit and follow jobs, download models, issue keys."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from ortune.cli.client import APIError, Client
from ortune.cli.follow import follow_with_progress
from ortune.settings import get_settings

app = typer.Typer(
    help="ortune: self-hosted fine-tuning jobs (OpenAI-shaped REST, ONNX Runtime training).",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()
ApiUrl = Annotated[str | None, typer.Option("--api", help="API base URL (default: ORTUNE_API_URL)")]


def _client(api: str | None) -> Client:
    settings = get_settings()
    key = settings.api_key.get_secret_value() if settings.api_key else None
    return Client(api or settings.api_url, api_key=key)


@app.command()
def up(
    worker: Annotated[bool, typer.Option(help="also start a Celery worker")] = True,
    serve: Annotated[bool, typer.Option(help="also start the inference process")] = True,
) -> None:
    """Run migrations, then the API, the inference process and a worker until Ctrl-C (embedded default unless
    ORTUNE_* URLs say)."""
    from ortune.cli.embedded import start

    settings = get_settings()
    with start(settings, worker=worker, serve=serve) as services:
        console.print(f"[green]ortune is up[/] at {settings.api_url} (state: {settings.database_url})")
        if serve:
            console.print(f"inference (ortune serve) at {settings.serve_url}, reached through the API")
        try:
            while (exited := services.exited()) is None:
                time.sleep(0.5)
            console.print("[red]stopping:[/] " + escape(exited))
            raise typer.Exit(1)
        except KeyboardInterrupt:
            console.print("stopping")


@app.command("worker")
def worker_cmd() -> None:
    """Run one Celery worker in the foreground (production nodes)."""
    import os

    from ortune.cli.embedded import child_env, worker_command

    settings = get_settings()
    cmd = worker_command(settings)
    os.execvpe(cmd[0], cmd, child_env(settings))


@app.command("serve")
def serve_cmd() -> None:
    """Run the inference process in the foreground (its own service in production; ORTUNE_SERVE_PORT)."""
    import os

    from ortune.cli.embedded import child_env, serve_command

    settings = get_settings()
    cmd = serve_command(settings)
    os.execvpe(cmd[0], cmd, child_env(settings))


@app.command("setup-ort")
def setup_ort(
    install: Annotated[bool, typer.Option(help="pip-install onnxruntime-training if it is missing")] = False,
) -> None:
    """Make ONNX Runtime training work here: patch and build its torch extensions, then prove it trains."""
    from trainer_core.engine import ort_setup

    try:
        ort_setup.run(install=install)
    except ort_setup.SetupError as exc:
        console.print(f"[red]setup-ort failed:[/] {exc}")
        raise typer.Exit(1) from exc


@app.command()
def migrate() -> None:
    """Bring the database schema to the latest revision."""
    from ortune.db.migrate import upgrade

    upgrade(get_settings().database_url)
    console.print("schema is up to date")


def _load_spec(path: Path) -> dict[str, Any]:
    spec = yaml.safe_load(path.read_text())
    if not isinstance(spec, dict):
        raise typer.BadParameter(f"{path} must hold a mapping of job fields", param_hint="JOB_FILE")
    return spec


@app.command()
def submit(
    job_file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="job spec, YAML or JSON")],
    api: ApiUrl = None,
    follow_job: Annotated[bool, typer.Option("--follow")] = False,
) -> None:
    """Submit a job. training_file/validation_file may be local paths; they are uploaded first."""
    client = _client(api)
    spec = _load_spec(job_file)
    for key in ("training_file", "validation_file"):
        value = spec.get(key)
        if isinstance(value, str) and not value.startswith("file-"):
            local = (job_file.parent / value).resolve()
            uploaded = client.upload(local)
            if uploaded["status"] == "error":
                console.print(f"[red]{local.name}: {uploaded['status_details']}[/]")
                raise typer.Exit(1)
            spec[key] = uploaded["id"]
    try:
        job = client.create_job(**spec)
    except APIError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from exc
    console.print(job["id"])
    if follow_job:
        follow(job["id"], api=api)


@app.command()
def jobs(api: ApiUrl = None, limit: int = 20) -> None:
    """List recent jobs."""
    page = _client(api).get("/v1/fine_tuning/jobs", limit=limit)
    table = Table("id", "model", "status", "backend", "step", "created")
    for job in page["data"]:
        p = job["progress"]
        table.add_row(
            job["id"],
            job["model"],
            job["status"],
            job["backend_used"] or job["backend"],
            f"{p['step']}/{p['total_steps'] or '?'}",
            time.strftime("%Y-%m-%d %H:%M", time.localtime(job["created_at"])),
        )
    console.print(table)


@app.command()
def follow(job_id: str, api: ApiUrl = None, interval: float = 1.0) -> None:
    """Follow a job: a progress bar with step, loss and ETA, and its messages, until it ends."""
    job = follow_with_progress(_client(api), job_id, console, interval)
    if job["status"] != "succeeded":
        err = job.get("error") or {}
        console.print(f"[red]job {job['status']}[/] {err.get('message', '')}")
        raise typer.Exit(1)
    console.print(f"[green]succeeded[/]: {job['fine_tuned_model']} (backend {job['backend_used']})")


@app.command()
def download(
    job_id: str,
    format: Annotated[str, typer.Option("--format", "-f", help="pytorch or onnx")] = "pytorch",
    output: Annotated[Path | None, typer.Option("--output", "-o")] = None,
    api: ApiUrl = None,
) -> None:
    """Download a job's model as a tar archive; resumes a partial file and verifies the sha256."""
    dest = output or Path(f"{job_id}-{format}.tar")
    columns = [
        TextColumn(dest.name),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("download", total=None)
        digest = _client(api).download(
            job_id, format, dest, lambda done, total: bar.update(task, completed=done, total=total)
        )
    console.print(f"{dest} sha256 {digest} [green]verified[/]")


keys = typer.Typer(help="Tenants and API keys, straight in the database (bootstrap; or use /v1/admin).")
app.add_typer(keys, name="keys")


@keys.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="tenant name; created when it does not exist")] = "default",
    name: Annotated[str, typer.Option(help="a label for the key")] = "cli",
    admin: Annotated[bool, typer.Option(help="may manage its own tenant's keys")] = False,
    platform: Annotated[bool, typer.Option(help="may manage every tenant, see nodes and /metrics")] = False,
    max_concurrent_jobs: Annotated[int | None, typer.Option(help="for a new tenant")] = None,
) -> None:
    """Issue an API key and print its secret (shown only this once)."""
    from ortune.db.migrate import upgrade
    from ortune.db.repositories import KeyRepository, TenantRepository
    from ortune.db.session import session_scope

    settings = get_settings()
    upgrade(settings.database_url)
    with session_scope(settings.database_url) as session:
        tenants = TenantRepository(session)
        found = tenants.by_name(tenant) or tenants.create(tenant, max_concurrent_jobs)
        key, secret = KeyRepository(session).issue(found.id, name, admin=admin, platform=platform)
    role = " [platform]" if platform else " [admin]" if admin else ""
    console.print(f"[green]{key.id}[/] for tenant {tenant} ({found.id}){role}:")
    print(secret)


@keys.command("list")
def keys_list(tenant: Annotated[str, typer.Option(help="tenant name")] = "default") -> None:
    """A tenant's keys (prefixes only)."""
    from ortune.db.repositories import KeyRepository, TenantRepository
    from ortune.db.session import session_scope

    with session_scope(get_settings().database_url) as session:
        found = TenantRepository(session).by_name(tenant)
        if found is None:
            console.print(f"[red]no tenant named {tenant!r}[/]")
            raise typer.Exit(1)
        table = Table("id", "name", "prefix", "role", "revoked")
        for k in KeyRepository(session).list(found.id):
            role = "platform" if k.platform else "admin" if k.admin else ""
            table.add_row(k.id, k.name, k.prefix + "…", role, str(k.revoked_at or ""))
    console.print(table)


@keys.command("revoke")
def keys_revoke(key_id: str) -> None:
    """Revoke a key by id (API processes refuse it within api_key_cache_seconds)."""
    from ortune.db.repositories import KeyRepository
    from ortune.db.session import session_scope

    with session_scope(get_settings().database_url) as session:
        if KeyRepository(session).revoke(key_id) is None:
            console.print(f"[red]no API key with id {key_id!r}[/]")
            raise typer.Exit(1)
    console.print(f"revoked {key_id}")


@app.command()
def demo(keep: Annotated[bool, typer.Option(help="leave the service running afterwards")] = False) -> None:
    """Fine-tune all-MiniLM-L6-v2 on the shipped sentiment data end to end and compare accuracy."""
    from ortune.cli.demo import run_demo

    raise typer.Exit(run_demo(console, keep=keep))


def main() -> None:
    """The console script: an API error or an unreachable server is one red line and exit 1."""
    try:
        app()
    except APIError as exc:
        console.print(f"[red]{exc}[/]")
        raise SystemExit(1) from None
    except httpx.TransportError as exc:
        try:
            url = str(exc.request.url)
        except RuntimeError:  # raised before a request was built
            url = get_settings().api_url
        console.print(
            f"[red]cannot reach the ortune API ({url}): {exc}[/]; is it running? (--api, ORTUNE_API_URL)"
        )
        raise SystemExit(1) from None

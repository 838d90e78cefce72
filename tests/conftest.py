"""Fixtures for the two configurations every service test runs against:

- `embedded`: SQLite, Celery over kombu's SQLAlchemy transport on a SQLite file, a local folder;
- `production`: Postgres, Redis and SeaweedFS's S3, all real servers (see tests/services.py).
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from api.main import create_app
from ortune import embedded
from ortune.client import Client
from ortune.db.base import new_id
from ortune.db.migrate import upgrade
from ortune.db.models import File, FileStatus
from ortune.settings import Settings
from tests import services

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "ortune" / "demo_data"
RUN = uuid.uuid4().hex[:8]


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with services.postgres(tmp_path_factory.mktemp("pg")) as url:
        yield url


@pytest.fixture(scope="session")
def pg_template(pg_server: str) -> Iterator[str]:
    """A database migrated once; each test gets a copy (CREATE DATABASE ... TEMPLATE is fast)."""
    name = f"ortune_tpl_{RUN}"
    url = services.create_database(pg_server, name)
    upgrade(url)
    from ortune.db.session import make_engine

    make_engine(url).dispose()
    yield name
    services.drop_database(pg_server, name)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with services.redis(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[services.S3Server]:
    with services.seaweedfs(tmp_path_factory.mktemp("weed")) as server:
        yield server


def embedded_settings(tmp: Path, **overrides: Any) -> Settings:
    return Settings(
        data_dir=tmp / "state",
        api_port=services.free_port(),
        queue=f"ortune.test.{uuid.uuid4().hex[:8]}",
        **overrides,
    )


@pytest.fixture(params=["embedded", "production"])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Settings]:
    """Settings for one configuration, with a fresh, migrated database."""
    if request.param == "embedded":
        s = embedded_settings(tmp_path)
        upgrade(s.database_url)
        yield s
        return
    server = request.getfixturevalue("pg_server")
    template = request.getfixturevalue("pg_template")
    redis_url = request.getfixturevalue("redis_url")
    s3 = request.getfixturevalue("s3")
    name = f"ortune_t_{uuid.uuid4().hex[:10]}"
    url = services.create_database(server, name, template=template)
    yield Settings(
        data_dir=tmp_path / "state",
        database_url=url,
        broker_url=redis_url,
        storage_url=s3.url(f"ortune-{uuid.uuid4().hex[:8]}"),
        s3_access_key=s3.access_key,
        s3_secret_key=s3.secret_key,
        api_port=services.free_port(),
        queue=f"ortune.test.{uuid.uuid4().hex[:8]}",
    )
    from ortune.db.session import make_engine

    make_engine(url).dispose()
    services.drop_database(server, name)


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


def processed_file(session: Session) -> File:
    """A training file's row, checked and ready, for tests that write jobs straight into the database."""
    file = File(
        id=new_id("file"),
        filename="t.jsonl",
        purpose="fine-tune",
        bytes=1,
        sha256="0" * 64,
        object_key="files/x",
        status=FileStatus.processed,
        row_kind="text_label",
    )
    session.add(file)
    session.flush()
    return file


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def upload(client: TestClient, path: Path, **fields: str) -> Any:
    with path.open("rb") as fh:
        return client.post(
            "/v1/files", files={"file": (path.name, fh)}, data={"purpose": "fine-tune", **fields}
        )


@pytest.fixture
def train_file(client: TestClient) -> dict[str, Any]:
    response = upload(client, DEMO / "sentiment_train.jsonl")
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


@pytest.fixture
def service(settings: Settings, tmp_path: Path) -> Iterator[Client]:
    logs = tmp_path / "logs"
    with embedded.start(settings, log_dir=logs):
        yield Client(settings.api_url)
    for log in sorted(logs.glob("*.log")):
        print(f"--- {log.name} (tail)\n" + "".join(log.read_text(errors="replace").splitlines(True)[-40:]))


@contextmanager
def worker_process(settings: Settings, name: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """One more Celery worker (another node, or a successor to a killed one), stopped at the end if it
    still runs."""
    with log.open("ab") as fh:
        proc = subprocess.Popen(
            embedded.worker_command(settings, name=f"{name}-{time.monotonic_ns()}@%h"),
            env=embedded.child_env(settings),
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(60)


def events(client: Client, job_id: str) -> list[dict[str, Any]]:
    """All of a job's events, oldest first (the API pages them newest first)."""
    out: list[dict[str, Any]] = []
    after = None
    while True:
        page = client.get(f"/v1/fine_tuning/jobs/{job_id}/events", limit=100, after=after)
        out += page["data"]
        if not page["has_more"]:
            return list(reversed(out))
        after = page["data"][-1]["id"]


def wait_for(client: Client, job_id: str, statuses: set[str], timeout: float = 300) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.job(job_id)
        if job["status"] in statuses:
            return job
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} still {job['status']} after {timeout}s: {job}")

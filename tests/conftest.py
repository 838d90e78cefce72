"""Fixtures for the two configurations every service test runs against:

- `embedded`: SQLite, Celery over kombu's SQLAlchemy transport on a SQLite file, a local folder;
- `production`: Postgres, Redis and SeaweedFS's S3, all real servers (see tests/services.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from ortune.cli import embedded
from ortune.cli.client import Client
from ortune.db.migrate import upgrade
from ortune.settings import Settings
from tests import services
from tests.support import DEMO, TEST_DEFAULTS, embedded_settings, upload

pytest_plugins = ["tests.timing"]  # per-file and per-fixture times at the end of every run

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
        serve_port=services.free_port(),
        queue=f"ortune.test.{uuid.uuid4().hex[:8]}",
        **TEST_DEFAULTS,
    )
    from ortune.db.session import make_engine

    make_engine(url).dispose()
    services.drop_database(server, name)


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


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

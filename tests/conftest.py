"""Fixtures for the two configurations service tests run against:

- `embedded`: SQLite, Celery over kombu's SQLAlchemy transport on a SQLite file, a local folder;
- `production`: Postgres, Redis and SeaweedFS's S3, all real servers (see tests/services.py).

A test runs on both unless it names one (`@pytest.mark.parametrize("config", [...], indirect=True)`): the
README's test matrix says which run where and why. Under pytest-xdist (`make test` runs two processes)
each process has its own servers and shared deployments; only the tests that build network namespaces
share a group (`HOSTS_GROUP`), so they never run at the same time as each other.
"""

from __future__ import annotations

import os
import uuid

# Under xdist each test process gets its share of the cores for the trainers it starts (inherited by the
# processes of its deployments): two processes of two threads each on two cores spend a quarter of their
# time fighting over them (measured: three e2e jobs 69 s -> 52 s). Set before anything imports torch.
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from ortune.cli.client import Client
from ortune.db.migrate import upgrade
from ortune.settings import Settings
from tests import services
from tests.deployments import Deployment, Deployments
from tests.support import DEMO, TEST_DEFAULTS, embedded_settings, upload

pytest_plugins = ["tests.timing"]  # per-file and per-fixture times at the end of every run

RUN = uuid.uuid4().hex[:8]
# Tests that give a job several hosts: their multi-node jobs each want both cores for their ranks' rendezvous
# and collectives, so they run one at a time, on one xdist worker, beside the rest of the suite.
HOSTS_GROUP = {"tests/e2e/test_hosts.py", "tests/e2e/test_two_nodes.py"}


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Each test a unit of work of its own but the hosts group, which goes whole to one worker. (xdist's
    own `loadgroup` marks groups by renaming items, which pytest 9.2's node ids no longer allow.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Grouped(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "hosts" if nodeid.split("::")[0] in HOSTS_GROUP else nodeid

    return Grouped(config, log)


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
def config(request: pytest.FixtureRequest) -> str:
    """The configuration a test runs on: `embedded` or `production`. Both unless the test says (with
    `@pytest.mark.parametrize("config", [...], indirect=True)`) where only one differs for it."""
    return str(request.param)


def _settings(request: pytest.FixtureRequest, config: str, tmp: Path) -> Settings:
    """Settings for one configuration, on a fresh, migrated database (dropped with the fixture's scope)."""
    if config == "embedded":
        s = embedded_settings(tmp)
        upgrade(s.database_url)
        return s
    server = request.getfixturevalue("pg_server")
    template = request.getfixturevalue("pg_template")
    redis_url = request.getfixturevalue("redis_url")
    s3 = request.getfixturevalue("s3")
    name = f"ortune_t_{uuid.uuid4().hex[:10]}"
    url = services.create_database(server, name, template=template)

    def drop() -> None:
        from ortune.db.session import make_engine

        make_engine(url).dispose()
        services.drop_database(server, name)

    request.addfinalizer(drop)
    return Settings(
        data_dir=tmp / "state",
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


@pytest.fixture
def settings(request: pytest.FixtureRequest, config: str, tmp_path: Path) -> Settings:
    """Settings for the test's configuration, with a fresh, migrated database of its own."""
    return _settings(request, config, tmp_path)


@pytest.fixture(scope="session")
def deployments(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployments]:
    root = tmp_path_factory.mktemp("deployments")
    running = Deployments(lambda config: _settings(request, config, root / config), root)
    yield running
    running.close()


@pytest.fixture
def deployment(config: str, deployments: Deployments) -> Deployment:
    """The running deployment of the test's configuration that e2e tests share (tests/deployments.py)."""
    return deployments.get(config)


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
def service(deployment: Deployment, request: pytest.FixtureRequest) -> Iterator[Client]:
    """A client of the shared deployment, as a tenant of the test's own."""
    offsets = deployment.log_offsets()
    client = deployment.tenant_client(request.node.name)
    yield client
    deployment.print_logs_since(offsets)
    deployment.settle(client)

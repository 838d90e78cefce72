"""The object-store contract on a folder and on SeaweedFS's S3, and migrations on SQLite and Postgres."""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import anyio
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import text
from sqlalchemy.orm import Session

from api import reads
from api.deps import Reader
from ortune.db.base import Base, new_id, utcnow
from ortune.db.migrate import upgrade
from ortune.db.models import Job, JobStatus
from ortune.db.repositories import EventRepository, JobRepository
from ortune.db.session import make_engine, session_scope
from ortune.settings import Settings
from ortune.storage import LocalStore, ObjectNotFound, ObjectStore, StorageError, open_store
from tests import services
from tests.support import job_spec, processed_file


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "local":
        yield LocalStore(tmp_path / "objects")
    else:
        s3 = request.getfixturevalue("s3")
        yield open_store(
            s3.url(f"t-{uuid.uuid4().hex[:8]}"), access_key=s3.access_key, secret_key=s3.secret_key
        )


def test_store_contract(store: ObjectStore, tmp_path: Path) -> None:
    data = bytes(range(256)) * 10000
    store.put_fileobj("jobs/a/x.bin", io.BytesIO(data))
    assert store.stat("jobs/a/x.bin").size == len(data)
    assert b"".join(store.iter_range("jobs/a/x.bin")) == data
    assert b"".join(store.iter_range("jobs/a/x.bin", 100, 199)) == data[100:200]
    store.get_to_path("jobs/a/x.bin", tmp_path / "copy.bin")
    assert (tmp_path / "copy.bin").read_bytes() == data
    store.delete("jobs/a/x.bin")
    with pytest.raises(ObjectNotFound):
        store.stat("jobs/a/x.bin")
    with pytest.raises(ObjectNotFound):
        store.get_to_path("jobs/a/x.bin", tmp_path / "gone.bin")
    store.ping()


def test_the_test_s3_server_holds_a_bucket_for_every_test_of_a_run(tmp_path: Path) -> None:
    """CI once failed four tests with S3 InternalError: SeaweedFS gives each bucket volumes of its
    own, and its default slot count (free disk / volume size) ran out after about 80 buckets."""
    with services.seaweedfs(tmp_path) as s3:
        for n in range(160):
            bucket = open_store(
                s3.url(f"t-{n}-{uuid.uuid4().hex[:6]}"), access_key=s3.access_key, secret_key=s3.secret_key
            )
            bucket.put_fileobj("x", io.BytesIO(b"x" * 1000))
            assert bucket.stat("x").size == 1000


@pytest.mark.parametrize("key", ["../etc/passwd", "a/../../b", "/abs", "a//b", "", "a/.hidden/../x"])
def test_unsafe_keys_are_refused(store: ObjectStore, key: str) -> None:
    with pytest.raises(StorageError):
        store.put_fileobj(key, io.BytesIO(b"x"))


def _schema_diff(url: str) -> list[object]:
    with make_engine(url).connect() as conn:
        return list(
            compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
        )


def test_migrations_build_the_schema_on_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'm.db'}"
    upgrade(url)
    upgrade(url)  # idempotent
    assert _schema_diff(url) == []


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_0007_keeps_the_operators_admin_keys_platform_wide(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Admin keys made before scoping: the default tenant's (the operator's) stay platform-wide, other
    tenants' become admins of their own tenant only."""
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'm.db'}"
    else:
        server, name = request.getfixturevalue("pg_server"), f"ortune_mig_{uuid.uuid4().hex[:8]}"
        url = services.create_database(server, name)
        request.addfinalizer(lambda: (make_engine(url).dispose(), services.drop_database(server, name)))
    upgrade(url, "0006")
    with make_engine(url).begin() as conn:
        conn.execute(
            text("INSERT INTO tenants (id, name, created_at) VALUES ('t-1', 'acme', CURRENT_TIMESTAMP)")
        )
        for key, tenant, admin in (
            ("k-op", "default", True),
            ("k-acme", "t-1", True),
            ("k-user", "default", False),
        ):
            conn.execute(
                text(
                    "INSERT INTO api_keys (id, tenant_id, name, prefix, sha256, admin, created_at) "
                    "VALUES (:id, :tenant, 'k', 'p', :id, :admin, CURRENT_TIMESTAMP)"
                ),
                {"id": key, "tenant": tenant, "admin": admin},
            )
    upgrade(url)
    with make_engine(url).connect() as conn:
        rows = dict(conn.execute(text("SELECT id, platform FROM api_keys")).tuples().all())
    assert {k: bool(v) for k, v in rows.items()} == {"k-op": True, "k-acme": False, "k-user": False}


def test_migrations_build_the_schema_on_postgres(pg_server: str) -> None:
    name = f"ortune_mig_{uuid.uuid4().hex[:8]}"
    url = services.create_database(pg_server, name)
    try:
        upgrade(url)
        assert _schema_diff(url) == []
    finally:
        make_engine(url).dispose()
        services.drop_database(pg_server, name)


@pytest.mark.parametrize("config", ["production"], indirect=True)
def test_reads_skip_the_transaction_and_writers_keep_theirs(settings: Settings) -> None:
    """The API's reads run in autocommit (one round trip each), on connections of their own; a unit of work
    is still one transaction."""

    def in_a_transaction(session: Session) -> bool:
        # now() is the start of the transaction: the same in two statements only inside one transaction
        first = session.execute(text("SELECT now()")).scalar()
        session.execute(text("SELECT pg_sleep(0.01)"))
        return bool(first == session.execute(text("SELECT now()")).scalar())

    async def api_read() -> bool:
        reader = Reader(settings.database_url)
        try:
            return await reader(in_a_transaction)
        finally:
            await reader.close()

    def unit_of_work() -> bool:
        with session_scope(settings.database_url) as session:
            return in_a_transaction(session)

    for _ in range(3):  # interleaved, so that a connection passed between the two would show
        assert not anyio.run(api_read)
        assert unit_of_work()


def test_reads_on_the_driver_give_what_sqlalchemy_gives(settings: Settings) -> None:
    """The API's hot reads skip SQLAlchemy's execution (api.reads, on asyncpg or sqlite3): every column
    must come back as SQLAlchemy reads it, with the same Python types (UTC datetimes, enums, JSON), None
    included."""
    with session_scope(settings.database_url) as session:
        train = processed_file(session)
        full = Job(
            id=new_id("ftjob"),
            model="tiny-bert",
            task="sequence-classification",
            training_file_id=train.id,
            status=JobStatus.failed,
            spec=job_spec(labels=["é ✓", "b"]),
            seed=7,
            user_metadata={"team": "nlp"},
            backend_requested="ort",
            error={"code": "x", "message": "boom", "param": None},
            result={"eval_accuracy": 0.9},
            trained_tokens=2**40,
            started_at=utcnow() - timedelta(minutes=5),
            finished_at=utcnow(),
        )
        bare = Job(
            id=new_id("ftjob"),
            model="tiny-bert",
            task="causal-lm",
            training_file_id=train.id,
            status=JobStatus.queued,
            spec=job_spec("causal-lm"),
            seed=0,
            backend_requested="torch",
        )
        JobRepository(session).add(full)
        JobRepository(session).add(bare)
        events = EventRepository(session)
        events.add(full.id, "plain")
        events.add(full.id, "Step 1", type="metrics", data={"step": 1, "loss": [0.5, None]}, level="warning")
        for i in range(3):
            events.add(full.id, f"message {i}")
    queries = [
        (reads.JOB, {"job_id": full.id}),
        (reads.JOB, {"job_id": bare.id}),
        (reads.JOB, {"job_id": "ftjob-none"}),
        (reads.EVENTS, {"job_id": full.id, "limit": 3}),
        (reads.EVENTS, {"job_id": bare.id, "limit": 3}),
        (reads.EVENTS, {"job_id": "ftjob-none", "limit": 3}),
    ]
    with session_scope(settings.database_url) as session:
        expected = [reads.run_in_session(session, stmt, params) for stmt, params in queries]
        newest = expected[3][-1].id
        queries.append((reads.EVENTS_BEFORE, {"job_id": full.id, "after": newest, "limit": 10}))
        expected.append(reads.run_in_session(session, *queries[-1]))

    async def on_the_driver() -> list[list[reads.Row]]:
        direct = reads.direct_reads(settings.database_url)
        try:
            return [await direct.fetch(stmt, params) for stmt, params in queries]
        finally:
            await direct.close()

    got = anyio.run(on_the_driver)
    assert got == expected
    assert [len(rows) for rows in got] == [1, 1, 0, 3, 1, 0, 2]  # a job without events: one row, id None
    assert got[4][0].id is None and got[4][0].tenant_id == got[1][0].tenant_id
    for rows_got, rows_expected in zip(got, expected, strict=True):
        for row_got, row_expected in zip(rows_got, rows_expected, strict=True):
            for key, value in vars(row_expected).items():
                assert type(getattr(row_got, key)) is type(value), key  # 1 == 1.0, a naive == aware: no
    job = got[0][0]
    assert job.status is JobStatus.failed and job.finished_at.tzinfo is not None
    assert job.user_metadata == {"team": "nlp"} and job.spec.labels[0] == "é ✓"

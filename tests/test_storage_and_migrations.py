"""The object-store contract on a folder and on SeaweedFS's S3, and migrations on SQLite and Postgres."""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import text

from ortune.db.base import Base
from ortune.db.migrate import upgrade
from ortune.db.session import make_engine, session_scope
from ortune.settings import Settings
from ortune.storage import LocalStore, ObjectNotFound, ObjectStore, StorageError, open_store
from tests import services


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


def test_migrations_build_the_schema_on_postgres(pg_server: str) -> None:
    name = f"ortune_mig_{uuid.uuid4().hex[:8]}"
    url = services.create_database(pg_server, name)
    try:
        upgrade(url)
        assert _schema_diff(url) == []
    finally:
        make_engine(url).dispose()
        services.drop_database(pg_server, name)


@pytest.mark.parametrize("settings", ["production"], indirect=True)
def test_reads_skip_the_transaction_and_writers_keep_theirs(settings: Settings) -> None:
    """The API's reads run in autocommit (one round trip each), on connections of their own; a unit of work
    is still one transaction."""

    def one_transaction(autocommit: bool) -> bool:
        with session_scope(settings.database_url, autocommit=autocommit) as session:
            session.execute(text("SELECT pg_sleep(0.01)"))
            # now() is the start of the transaction: later than it only inside one that began earlier
            return bool(session.execute(text("SELECT now() < statement_timestamp()")).scalar())

    for _ in range(3):  # interleaved, so that a connection passed between the two would show
        assert not one_transaction(autocommit=True)
        assert one_transaction(autocommit=False)

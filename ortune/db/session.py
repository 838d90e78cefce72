"""Engines and sessions. The caller (a request dependency or a task wrapper) owns the transaction."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # API and worker write the same file: WAL lets readers go on while one writes, and busy_timeout
    # turns "database is locked" into a short wait.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


# Each Postgres pool keeps 20 connections, the API's usual concurrency (20 polling clients in bench/api_load):
# connections past pool_size are overflow, closed on return and opened again on the next request, a fork on
# the server each time.
POOL: dict[str, Any] = {"pool_size": 20, "max_overflow": 20}


@lru_cache(maxsize=8)
def make_engine(url: str) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database:
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_pre_ping=True, **POOL)


def limit_postgres_sessions(url: str, limits: dict[str, int], *, application_name: str) -> None:
    """Set `limits` (`lock_timeout`, `statement_timeout`, `idle_in_transaction_session_timeout`, in ms) and
    `application_name` (what `pg_stat_activity` shows an operator) on every connection this process opens
    to `url` from now on; the API and each worker call it at start. SQLite: nothing."""
    engine = make_engine(url)  # the sessions' and the autocommit reads' engines share its pool
    if engine.dialect.name != "postgresql":
        return

    def apply(dbapi_conn: Any, _record: Any) -> None:
        # in autocommit: a SET inside a transaction that is later rolled back would be undone with it
        dbapi_conn.autocommit = True
        with dbapi_conn.cursor() as cur:
            for name, ms in limits.items():
                cur.execute(f"SET {name} = {int(ms)}")
            cur.execute("SELECT set_config('application_name', %s, false)", (application_name,))
        dbapi_conn.autocommit = False

    event.listen(engine.pool, "connect", apply)
    engine.pool.dispose()  # connections opened before now get the limits too, as they are opened again


def worker_application_name(worker: str) -> str:
    """How a worker's connections name themselves to Postgres (`pg_stat_activity.application_name`)."""
    return f"ortune-worker {worker}"


class CannotEndTransactions(RuntimeError):
    """This connection's role may not see or signal another role's connections."""


def end_transactions_of(session: Session, application_name: str) -> int:
    """Terminate the connections of `application_name` that are inside a transaction, so the row locks
    they hold go; how many (always 0 on SQLite, which has no server to end them).

    For a worker given up for lost: its idle-in-transaction timeout does not fire while it is frozen
    midway through a pipelined batch (psycopg's `executemany`: Postgres waits for the batch's Sync, its
    timer not started), and a frozen client never reads a socket that filled. Needs the worker's role, or
    `pg_signal_backend` and `pg_read_all_stats` (another role's sessions show no state without it);
    otherwise `CannotEndTransactions` (or the server's refusal) is raised for the caller to report."""
    if session.get_bind().dialect.name != "postgresql":
        return 0
    rows = session.execute(
        text(
            "SELECT pid, usename, state IS NULL FROM pg_stat_activity WHERE application_name = :name "
            "AND pid <> pg_backend_pid() AND (xact_start IS NOT NULL OR state IS NULL)"
        ),
        {"name": application_name},
    ).all()
    if hidden := sorted({str(role) for _, role, unseen in rows if unseen}):
        raise CannotEndTransactions(
            f"this database role cannot see the state of {application_name}'s connections (role "
            f"{', '.join(hidden)}): connect as that role, or grant pg_signal_backend and pg_read_all_stats"
        )
    kill = text("SELECT pg_terminate_backend(:pid)")
    return sum(bool(session.execute(kill, {"pid": pid}).scalar()) for pid, _, _ in rows)


@lru_cache(maxsize=8)
def session_factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(make_engine(url), expire_on_commit=False)


@lru_cache(maxsize=8)
def read_session_factory(url: str) -> sessionmaker[Session]:
    """Sessions for reads that need no transaction: each statement commits by itself. (The API's reads on
    Postgres use `async_read_session_factory` instead.)"""
    return sessionmaker(
        make_engine(url).execution_options(isolation_level="AUTOCOMMIT"), expire_on_commit=False
    )


@lru_cache(maxsize=8)
def async_read_session_factory(
    url: str, limits: tuple[tuple[str, int], ...] = ()
) -> async_sessionmaker[AsyncSession] | None:
    """The API's reads on Postgres (its GETs), on the event loop, through asyncpg; None for SQLite.

    A read's ORM code runs unchanged through `AsyncSession.run_sync`, with no hop to a thread pool: the hop
    and the threads' fight for the GIL were half of a poll's CPU and most of its tail latency
    (bench/api_load). The pool is the reads' own and its connections stay in autocommit: a read is one round
    trip, where a transaction costs BEGIN and COMMIT too, and switching a shared pool's connections in and out
    of autocommit at every checkout cost more CPU than the query. Nor do they ping a connection before each
    use: a read that meets a dead one is retried once (api.deps.Reader; the pool is invalidated by then),
    which costs nothing while the database is up. No overflow: past 20 reads at once, a read waits for a
    connection (the hot reads have a pool of their own besides, ortune.db.reads). `limits`: session settings
    (lock and statement timeouts, ms) set as each connection opens.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        return None
    engine = create_async_engine(
        parsed.set(drivername="postgresql+asyncpg"),
        isolation_level="AUTOCOMMIT",
        pool_reset_on_return=None,
        json_deserializer=orjson.loads,
        pool_size=POOL["pool_size"],
        max_overflow=0,
        connect_args={"server_settings": {name: str(ms) for name, ms in limits}},
    )
    return async_sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope(url: str, *, autocommit: bool = False) -> Iterator[Session]:
    """A unit of work: commit on success, roll back on error. `autocommit`: no transaction, for reads."""
    session = (read_session_factory if autocommit else session_factory)(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def advisory_xact_lock(session: Session, name: str) -> None:
    """Hold the lock `name` until this session's transaction ends: callers that take it run one at a time.

    On Postgres an advisory transaction lock (released by commit or rollback, so never leaked). SQLite, the
    embedded mode, has one writer and one worker process, so there is nothing to take there.
    """
    if session.get_bind().dialect.name == "postgresql":
        key = zlib.crc32(name.encode())  # a stable 32-bit key; advisory keys are bigint
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})

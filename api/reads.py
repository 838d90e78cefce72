"""The API's hottest reads as Core statements, run on the database driver itself.

A dashboard polls a job and its events every couple of seconds, per open tab. Through SQLAlchemy one such
statement cost about 330 µs of CPU here, against 80 µs for asyncpg's own `fetch` (bench/api_load), and it was
most of a poll. So these few statements, and only these, skip SQLAlchemy's execution: each is compiled once
for the backend's dialect and run on the event loop, on Postgres on a small asyncpg pool, on SQLite on one
read-only sqlite3 connection. Their rows still pass through the column types' own result processors (UTC
datetimes, enums, JSON, decoded by orjson), so a row reads exactly as the ORM object would; `run_in_session`
runs the same statements through SQLAlchemy, which a test holds equal.

Rows come back as namespaces with the model's attribute names, which the response models read as they read
ORM objects. Statements must be module constants: they are compiled once and cached by identity.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import asyncpg
import orjson
from sqlalchemy import BigInteger, Select, bindparam, inspect, select, true
from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg
from sqlalchemy.dialects.sqlite.pysqlite import SQLiteDialect_pysqlite
from sqlalchemy.engine import Dialect, make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from ortune.db.models import Job, JobEvent

Row = SimpleNamespace


def _columns(model: type[Any]) -> list[Any]:
    """Every mapped column, labelled with its attribute name (`user_metadata`, not the column `metadata`)."""
    return [getattr(model, a.key).label(a.key) for a in inspect(model).column_attrs]


JOB = select(*_columns(Job)).where(Job.id == bindparam("job_id"))


def _events_page(newer_than_cursor: bool) -> Select[Any]:
    """A page of a job's events, newest first, beside the job's tenant: one round trip, one snapshot.

    No row: no such job. One row with `id` None: the job, without events on this page. `limit` is one past
    the page, to tell whether there is more; `after` (with the cursor) is the id of the last event seen.
    """
    events = select(*_columns(JobEvent)).where(JobEvent.job_id == bindparam("job_id"))
    if newer_than_cursor:
        events = events.where(JobEvent.id < bindparam("after", type_=BigInteger))
    page = events.order_by(JobEvent.id.desc()).limit(bindparam("limit")).subquery()
    return (
        select(Job.tenant_id.label("tenant_id"), *page.c)
        .select_from(Job)
        .outerjoin(page, true())
        .where(Job.id == bindparam("job_id"))
        .order_by(page.c.id.desc())
    )


EVENTS = _events_page(newer_than_cursor=False)
EVENTS_BEFORE = _events_page(newer_than_cursor=True)


def run_in_session(session: Session, stmt: Select[Any], params: dict[str, Any]) -> list[Row]:
    """The statement through SQLAlchemy, on any backend."""
    return [Row(**m) for m in session.execute(stmt, params).mappings()]


@dataclass(frozen=True)
class _Compiled:
    sql: str
    binds: tuple[str, ...]
    fixed: dict[str, Any]  # the values of the binds a statement fixes itself (SQLite's OFFSET -1 with LIMIT)
    keys: tuple[str, ...]
    processors: tuple[tuple[str, Callable[[Any], Any]], ...]  # the columns whose type has one


class DirectReads:
    """Runs the statements above on a driver's own connection: compiled once per statement for `dialect`,
    rows through the columns' result processors for it."""

    dialect: Dialect

    def __init__(self) -> None:
        self._compiled: dict[Select[Any], _Compiled] = {}

    async def fetch(self, stmt: Select[Any], params: dict[str, Any]) -> list[Row]:
        c = self._compiled.get(stmt) or self._compile(stmt)
        values = {**c.fixed, **params}
        records = await self._records(c.sql, [values[name] for name in c.binds])
        rows = [Row(**dict(zip(c.keys, r, strict=True))) for r in records]
        for key, process in c.processors:
            for row in rows:
                setattr(row, key, process(getattr(row, key)))
        return rows

    async def close(self) -> None:
        pass

    async def _records(self, sql: str, args: Sequence[Any]) -> Sequence[Iterable[Any]]:
        raise NotImplementedError

    def _compile(self, stmt: Select[Any]) -> _Compiled:
        compiled = stmt.compile(dialect=self.dialect)
        columns = list(stmt.selected_columns)
        processors = [
            (str(col.key), col.type.dialect_impl(self.dialect).result_processor(self.dialect, None))
            for col in columns
        ]
        c = _Compiled(
            sql=str(compiled),
            binds=tuple(compiled.positiontup or ()),
            fixed={name: b.value for name, b in compiled.binds.items() if not b.required},
            keys=tuple(str(col.key) for col in columns),
            processors=tuple((key, p) for key, p in processors if p is not None),
        )
        self._compiled[stmt] = c
        return c


class PgReads(DirectReads):
    """An asyncpg pool, opened on first use in the API's event loop."""

    dialect = PGDialect_asyncpg(paramstyle="numeric_dollar")

    def __init__(self, database_url: str, max_size: int = 20, limits: dict[str, int] | None = None) -> None:
        super().__init__()
        self.dsn = make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)
        self.max_size = max_size
        self.server_settings = {
            name: str(ms) for name, ms in (limits or {}).items()
        }  # lock/statement timeouts
        self._pool: asyncpg.Pool | None = None
        self._opening = asyncio.Lock()  # the first requests arrive together: one pool, not one each

    async def close(self) -> None:
        """Close the pool; a later read opens a new one (an app may be started and stopped more than once)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    async def _opened(self) -> asyncpg.Pool:
        async with self._opening:
            if self._pool is None:
                self._pool = await asyncpg.create_pool(
                    self.dsn,
                    min_size=0,
                    max_size=self.max_size,
                    init=_json_codecs,
                    reset=_keep,
                    server_settings=self.server_settings,
                )
            return self._pool

    async def _records(self, sql: str, args: Sequence[Any]) -> Sequence[Iterable[Any]]:
        # A connection the database closed (a restart) is noticed by the pool, which opens a new one on the
        # next acquire; a read that was on it when it went is a 503, and the client's retry succeeds.
        with unreachable_as_operational_error(sql):
            async with (self._pool or await self._opened()).acquire() as conn:
                return await conn.fetch(sql, *args)


class SqliteReads(DirectReads):
    """One read-only sqlite3 connection, used on the event loop itself.

    These statements take microseconds (a key lookup, a page of 20 by an index), and in WAL mode a reader
    never waits for the writer, so a trip to a thread would cost far more than the read. A lock that does
    hold it (a checkpoint) waits at most `busy_ms`, then is a 503.
    """

    dialect = SQLiteDialect_pysqlite(json_deserializer=orjson.loads)

    def __init__(self, database_url: str, busy_ms: int = 200) -> None:
        super().__init__()
        self.path = make_url(database_url).database or ":memory:"
        self.busy_ms = busy_ms
        self._conn: sqlite3.Connection | None = None

    async def close(self) -> None:
        """Close the connection; a later read opens a new one."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    async def _records(self, sql: str, args: Sequence[Any]) -> Sequence[Iterable[Any]]:
        try:
            if self._conn is None:
                # check_same_thread off: a test client may run the loop on another thread per request; calls
                # never overlap, they all come from the one loop
                self._conn = sqlite3.connect(self.path, check_same_thread=False)
                self._conn.execute(f"PRAGMA busy_timeout={self.busy_ms}")
                self._conn.execute("PRAGMA query_only=ON")
            return self._conn.execute(sql, args).fetchall()
        except sqlite3.OperationalError as exc:
            raise OperationalError(sql, None, exc) from exc


def direct_reads(database_url: str, limits: dict[str, int] | None = None) -> DirectReads:
    if make_url(database_url).get_backend_name() == "sqlite":
        return SqliteReads(database_url)
    return PgReads(database_url, limits=limits)


@contextmanager
def unreachable_as_operational_error(what: str) -> Iterator[None]:
    """A Postgres that asyncpg cannot reach, or a read that waited past the session's lock or statement
    timeout, raised as SQLAlchemy's OperationalError: the shape the API answers with a 503 (database_busy
    by the error's sqlstate). (SQLAlchemy's own asyncpg dialect lets a refused connection through as a bare
    OSError.)"""
    try:
        yield
    except (
        OSError,
        asyncpg.PostgresConnectionError,
        asyncpg.exceptions.OperatorInterventionError,  # shutdowns, cannot-connect-now, statement_timeout
        asyncpg.exceptions.LockNotAvailableError,  # lock_timeout
    ) as exc:
        raise OperationalError(what, None, exc) from exc


async def _keep(conn: asyncpg.Connection) -> None:
    """No reset on release: these connections only ever run the SELECTs above, which leave no session state
    (locks, LISTENs, settings) behind; asyncpg's default reset is one more round trip per read."""


async def _json_codecs(conn: asyncpg.Connection) -> None:
    for name in ("json", "jsonb"):
        await conn.set_type_codec(
            name, encoder=lambda v: orjson.dumps(v).decode(), decoder=orjson.loads, schema="pg_catalog"
        )

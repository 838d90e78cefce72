"""The API's hottest reads as Core statements, run straight on asyncpg on Postgres.

A dashboard polls a job and its events every couple of seconds, per open tab. Through SQLAlchemy one such
statement cost about 330 µs of CPU here, against 80 µs for asyncpg's own `fetch` (bench/api_load), and it was
most of a poll. So these few statements, and only these, skip SQLAlchemy's execution on Postgres: each is
compiled once for the asyncpg dialect and run on a connection of a small asyncpg pool. Their rows still pass
through the column types' own result processors (UTC datetimes, enums), with jsonb decoded by orjson, so a
row reads exactly as the ORM object would. On SQLite, and in tests that compare the two, the same statements
run through a Session.

Rows come back as namespaces with the model's attribute names, which the response models read as they read
ORM objects. Statements must be module constants: they are compiled once and cached by identity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import asyncpg
import orjson
from sqlalchemy import BigInteger, Select, bindparam, inspect, select
from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from ortune.db.models import Job, JobEvent

Row = SimpleNamespace


def _columns(model: type[Any]) -> list[Any]:
    """Every mapped column, labelled with its attribute name (`user_metadata`, not the column `metadata`)."""
    return [getattr(model, a.key).label(a.key) for a in inspect(model).column_attrs]


JOB = select(*_columns(Job)).where(Job.id == bindparam("job_id"))
JOB_TENANT = select(Job.tenant_id.label("tenant_id")).where(Job.id == bindparam("job_id"))
_EVENTS = select(*_columns(JobEvent)).where(JobEvent.job_id == bindparam("job_id"))
# newest first; `limit` one past the page, to tell whether there is more
EVENTS = _EVENTS.order_by(JobEvent.id.desc()).limit(bindparam("limit"))
EVENTS_BEFORE = (
    _EVENTS.where(JobEvent.id < bindparam("after", type_=BigInteger))
    .order_by(JobEvent.id.desc())
    .limit(bindparam("limit"))
)


def run_in_session(session: Session, stmt: Select[Any], params: dict[str, Any]) -> list[Row]:
    """The statement through SQLAlchemy, on any backend."""
    return [Row(**m) for m in session.execute(stmt, params).mappings()]


@dataclass(frozen=True)
class _Compiled:
    sql: str
    binds: tuple[str, ...]
    keys: tuple[str, ...]
    processors: tuple[Callable[[Any], Any] | None, ...]


class PgReads:
    """An asyncpg pool that runs the statements above, opened on first use in the API's event loop."""

    dialect = PGDialect_asyncpg(paramstyle="numeric_dollar")

    def __init__(self, database_url: str, max_size: int = 20) -> None:
        self.dsn = make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)
        self.max_size = max_size
        self._pool: asyncpg.Pool | None = None
        self._compiled: dict[Select[Any], _Compiled] = {}

    async def fetch(self, stmt: Select[Any], params: dict[str, Any]) -> list[Row]:
        c = self._compiled.get(stmt) or self._compile(stmt)
        args = [params[name] for name in c.binds]
        records = await self._fetch(c.sql, args)
        return [
            Row(**{k: (v if p is None else p(v)) for k, p, v in zip(c.keys, c.processors, r, strict=True)})
            for r in records
        ]

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()

    async def _fetch(self, sql: str, args: Sequence[Any]) -> list[asyncpg.Record]:
        # A connection the database closed (a restart) is noticed by the pool, which opens a new one on the
        # next acquire; a read that was on it when it went is a 503, and the client's retry succeeds.
        with unreachable_as_operational_error(sql):
            if self._pool is None:
                self._pool = await asyncpg.create_pool(
                    self.dsn, min_size=0, max_size=self.max_size, init=_json_codecs, reset=_keep
                )
            async with self._pool.acquire() as conn:
                return await conn.fetch(sql, *args)

    def _compile(self, stmt: Select[Any]) -> _Compiled:
        compiled = stmt.compile(dialect=self.dialect)
        columns = list(stmt.selected_columns)
        c = _Compiled(
            sql=str(compiled),
            binds=tuple(compiled.positiontup or ()),
            keys=tuple(str(col.key) for col in columns),
            processors=tuple(
                col.type.dialect_impl(self.dialect).result_processor(self.dialect, None) for col in columns
            ),
        )
        self._compiled[stmt] = c
        return c


@contextmanager
def unreachable_as_operational_error(what: str) -> Iterator[None]:
    """A Postgres that asyncpg cannot reach, raised as SQLAlchemy's OperationalError: the shape the API
    answers with a 503. (SQLAlchemy's own asyncpg dialect lets a refused connection through as a bare
    OSError.)"""
    try:
        yield
    except (
        OSError,
        asyncpg.CannotConnectNowError,
        asyncpg.PostgresConnectionError,
        asyncpg.ConnectionDoesNotExistError,
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

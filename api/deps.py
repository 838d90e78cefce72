"""Request dependencies as Annotated aliases. The session dependency owns the transaction."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated, Any, TypeVar

import anyio
from fastapi import Depends, Request
from sqlalchemy import Select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from api import reads
from ortune.db.session import async_read_session_factory, session_scope
from ortune.settings import Settings
from ortune.storage import ObjectStore

# Settings and store are async so that FastAPI runs them on the event loop: a sync dependency costs a hop to
# the thread pool and back, a large part of a poll's time (bench/api_load).


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_session(request: Request) -> Iterator[Session]:
    # Sync on purpose: FastAPI runs a sync generator's exit shielded from cancellation, so a client that
    # disconnects mid-request cannot leak the pooled connection (an async version here did, in
    # bench/api_load, until the pool ran dry and every request stalled).
    with session_scope(request.app.state.settings.database_url) as session:
        yield session


async def get_store(request: Request) -> ObjectStore:
    store: ObjectStore = request.app.state.store
    return store


T = TypeVar("T")


class Reader:
    """A read's whole unit of work, session to response model, in one call: `await read(work)`.

    On Postgres the work runs on the event loop through an asyncpg session (`AsyncSession.run_sync` runs the
    same ORM code, awaiting the driver underneath). On SQLite it runs in one trip to the thread pool; a sync
    handler with `SessionDep` would make several (the dependency's enter and exit, the handler, FastAPI's
    check of its response), and those trips were most of a poll's time (bench/api_load).

    A read is shielded from cancellation: it takes milliseconds, and a client that goes away mid-read must
    not leave its pooled connection half checked in.
    """

    def __init__(self, database_url: str, limits: dict[str, int] | None = None) -> None:
        """`limits`: the Postgres session settings (lock and statement timeouts, ms) of every read connection,
        as `ortune.db.session.limit_postgres_sessions` sets them on the API's other connections."""
        self.database_url = database_url
        frozen = tuple(sorted((limits or {}).items()))
        self._async = async_read_session_factory(database_url, frozen)
        self._direct = reads.direct_reads(database_url, dict(frozen))

    async def rows(self, stmt: Select[Any], **params: Any) -> list[reads.Row]:
        """One of `api.reads`' statements, on the driver itself (see there)."""
        with anyio.CancelScope(shield=True):
            found = await self._direct.fetch(stmt, params)
        return found

    async def one(self, stmt: Select[Any], **params: Any) -> reads.Row | None:
        found = await self.rows(stmt, **params)
        return found[0] if found else None

    async def __call__(self, work: Callable[[Session], T]) -> T:
        with anyio.CancelScope(shield=True):
            try:
                result = await self._once(work)
            except DBAPIError as exc:
                # a pooled connection the database dropped (a restart): the pool has been invalidated, and a
                # read is safe to run again on a fresh connection; a database still down raises again, a 503
                if not exc.connection_invalidated:
                    raise
                result = await self._once(work)
        return result

    async def _once(self, work: Callable[[Session], T]) -> T:
        if self._async is None:
            return await anyio.to_thread.run_sync(self._in_thread, work)
        with reads.unreachable_as_operational_error("a read"):
            async with self._async() as session:
                return await session.run_sync(work)

    async def close(self) -> None:
        if self._async is not None:
            await self._async.kw["bind"].dispose()
        await self._direct.close()

    def _in_thread(self, work: Callable[[Session], T]) -> T:
        with session_scope(self.database_url, autocommit=True) as session:
            return work(session)


async def get_reader(request: Request) -> Reader:
    reader: Reader = request.app.state.reader
    return reader


SettingsDep = Annotated[Settings, Depends(get_settings)]
ReadDep = Annotated[Reader, Depends(get_reader)]
# scope="function": commit before the response is sent. With the default ("request") the commit ran after
# the response, so a client that created a job and fetched it at once could be answered 404.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
StoreDep = Annotated[ObjectStore, Depends(get_store)]

"""Request dependencies as Annotated aliases. The session dependency owns the transaction."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated, TypeVar

import anyio
from fastapi import Depends, Request
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from ortune.db.session import session_scope
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
    """A read's whole unit of work in one trip to the thread pool: session, queries and response model.

    A sync handler with `SessionDep` makes several trips per request (the dependency's enter and exit, the
    handler, and FastAPI's validation of a sync handler's response each go to the pool and back); under 20
    polling clients those trips, not the query, were most of a poll's time (bench/api_load). Read handlers
    are `async def` and hand one function to the pool; FastAPI then checks their response on the loop. A
    client that goes away cannot leak the connection: the thread finishes its `session_scope` regardless."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url

    async def __call__(self, work: Callable[[Session], T]) -> T:
        return await anyio.to_thread.run_sync(self._run, work)

    def _run(self, work: Callable[[Session], T]) -> T:
        try:
            return self._once(work)
        except DBAPIError as exc:
            # a pooled connection the database dropped (a restart): the pool has been invalidated, and a read
            # is safe to run again on a fresh connection; a database still down raises again, a 503
            if not exc.connection_invalidated:
                raise
            return self._once(work)

    def _once(self, work: Callable[[Session], T]) -> T:
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

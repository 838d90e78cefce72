"""Request dependencies as Annotated aliases. The session dependency owns the transaction."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
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


SettingsDep = Annotated[Settings, Depends(get_settings)]
# scope="function": commit before the response is sent. With the default ("request") the commit ran after
# the response, so a client that created a job and fetched it at once could be answered 404.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
StoreDep = Annotated[ObjectStore, Depends(get_store)]

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse
from sqlalchemy.orm import Session

from api.auth import CallerDep
from api.caller import Caller
from api.deps import ReadDep, SessionDep, SettingsDep, StoreDep
from api.errors import ERRORS, APIError
from api.schemas import FileDeleted, FileObject, Page, page
from api.services import files, idempotency, quota
from api.services.uploads import receive
from ortune.db.base import new_id
from ortune.db.models import File
from ortune.db.repositories import FileRepository
from ortune.db.session import advisory_xact_lock, session_scope
from ortune.settings import Settings
from trainer_core import tasks

router = APIRouter(prefix="/v1/files", tags=["files"], responses=ERRORS)
ENDPOINT = "POST /v1/files"

UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": list(files.PURPOSES)},
                        "task": {"type": "string", "enum": list(tasks.NAMES)},
                    },
                }
            }
        },
    }
}


@router.post("", response_model=FileObject, openapi_extra=UPLOAD_BODY)
async def upload_file(
    request: Request, response: Response, store: StoreDep, settings: SettingsDep, caller: CallerDep
) -> FileObject:
    """Upload a JSONL or CSV training file (multipart, streamed to storage and checked row by row). With an
    `Idempotency-Key`, a retry of the same upload returns the file the first one created."""
    key = idempotency.key_of(request)
    await run_in_threadpool(
        _room, settings, caller
    )  # before the body is read: a full tenant sends it for nothing
    upload = await receive(request, settings.job_work_dir / "uploads", settings.max_upload_bytes)
    digest = idempotency.fingerprint(upload.sha256, upload.filename, sorted(upload.fields.items()))
    # No transaction is open across an await, and every database call runs in a worker thread: a request
    # waiting on a lock never holds up the event loop, and so never the other requests.
    try:
        replayed = await run_in_threadpool(_replay, settings, caller, key, digest)
        if replayed is None:
            file = await files.check_and_store(store, settings, caller, upload, new_id("file"))
    finally:
        if upload.path is not None:
            upload.path.unlink(missing_ok=True)
    if replayed is None:
        try:
            recorded = await run_in_threadpool(_record, settings, caller, key, digest, file)
        except APIError:
            await run_in_threadpool(store.delete, file.object_key)  # refused: nothing of it stays
            raise
        if recorded is file:
            return FileObject.of(file)
        # a request with the same key recorded its file first: this copy is not needed
        await run_in_threadpool(store.delete, file.object_key)
        replayed = recorded
    idempotency.mark_replayed(response)
    return FileObject.of(replayed)


def _replay(settings: Settings, caller: Caller, key: str | None, digest: str) -> File | None:
    with session_scope(settings.database_url) as session:
        found = idempotency.replay(session, settings, caller, key, endpoint=ENDPOINT, digest=digest)
        return None if found is None else files.get(session, caller, found)


def _room(settings: Settings, caller: Caller) -> None:
    with session_scope(settings.database_url) as session:
        quota.check_storage(session, settings, caller)


def _record(settings: Settings, caller: Caller, key: str | None, digest: str, file: File) -> File:
    """The key and the file's row in one short transaction; the file a same-key request recorded first."""
    with session_scope(settings.database_url) as session:
        claim = idempotency.claim(
            session, settings, caller, key, endpoint=ENDPOINT, digest=digest, new_id=file.id
        )
        if claim.existing is not None:
            return files.get(session, caller, claim.existing)
        # A tenant's uploads check and record one at a time, so that together they never pass its limit;
        # under a lock of their own, not the tenant's row, which a job create holds (an upload must not
        # wait on it). Held for this short transaction only, never while a body is read or stored.
        advisory_xact_lock(session, f"uploads:{caller.tenant_id}")
        quota.check_storage(session, settings, caller, file.bytes, f"the upload {file.filename!r}")
        return FileRepository(session).add(file)


@router.get("", response_model=Page[FileObject])
async def list_files(
    read: ReadDep,
    caller: CallerDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    purpose: str | None = None,
) -> Page[FileObject]:
    """List files, newest first."""

    def work(session: Session) -> Page[FileObject]:
        rows, more = FileRepository(session).list(
            tenant_id=caller.tenant_id, after=after, limit=limit, purpose=purpose
        )
        return page([FileObject.of(f) for f in rows], more)

    return await read(work)


@router.get("/{file_id}", response_model=FileObject)
async def retrieve_file(file_id: str, read: ReadDep, caller: CallerDep) -> FileObject:
    """Retrieve a file's metadata and check results."""
    return await read(lambda session: FileObject.of(files.get(session, caller, file_id)))


@router.get(
    "/{file_id}/content",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
def file_content(file_id: str, session: SessionDep, store: StoreDep, caller: CallerDep) -> StreamingResponse:
    """Download a file's bytes as uploaded."""
    file = files.get(session, caller, file_id)
    return StreamingResponse(
        store.iter_range(file.object_key),
        media_type="application/octet-stream",
        headers={"Content-Length": str(file.bytes), "X-Ortune-Sha256": file.sha256},
    )


@router.delete("/{file_id}", response_model=FileDeleted)
def delete_file(file_id: str, session: SessionDep, store: StoreDep, caller: CallerDep) -> FileDeleted:
    """Delete a file that no unfinished job uses."""
    files.delete(session, store, caller, file_id)
    return FileDeleted(id=file_id)

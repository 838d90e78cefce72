from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from api.deps import SessionDep, SettingsDep, StoreDep
from api.schemas import FileDeleted, FileObject, Page, page
from api.services import files
from api.services.uploads import receive
from ortune.db.repositories import FileRepository

router = APIRouter(prefix="/v1/files", tags=["files"])

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
                        "task": {"type": "string", "enum": ["sequence-classification", "causal-lm"]},
                    },
                }
            }
        },
    }
}


@router.post("", response_model=FileObject, openapi_extra=UPLOAD_BODY)
async def upload_file(
    request: Request, session: SessionDep, store: StoreDep, settings: SettingsDep
) -> FileObject:
    """Upload a JSONL or CSV training file (multipart, streamed to storage and checked row by row)."""
    upload = await receive(request, settings.job_work_dir / "uploads", settings.max_upload_bytes)
    return FileObject.of(await files.create(session, store, settings, upload))


@router.get("", response_model=Page[FileObject])
def list_files(
    session: SessionDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    purpose: str | None = None,
) -> Page[FileObject]:
    """List files, newest first."""
    rows, more = FileRepository(session).list(after=after, limit=limit, purpose=purpose)
    data = [FileObject.of(f) for f in rows]
    return page(data, more)


@router.get("/{file_id}", response_model=FileObject)
def retrieve_file(file_id: str, session: SessionDep) -> FileObject:
    """Retrieve a file's metadata and check results."""
    return FileObject.of(files.get(session, file_id))


@router.get(
    "/{file_id}/content",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
def file_content(file_id: str, session: SessionDep, store: StoreDep) -> StreamingResponse:
    """Download a file's bytes as uploaded."""
    file = files.get(session, file_id)
    return StreamingResponse(
        store.iter_range(file.object_key),
        media_type="application/octet-stream",
        headers={"Content-Length": str(file.bytes), "X-Ortune-Sha256": file.sha256},
    )


@router.delete("/{file_id}", response_model=FileDeleted)
def delete_file(file_id: str, session: SessionDep, store: StoreDep) -> FileDeleted:
    """Delete a file that no unfinished job uses."""
    files.delete(session, store, file_id)
    return FileDeleted(id=file_id)

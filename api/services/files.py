"""Files: check an upload row by row, then store it. A file that fails the check is kept with
status `error` and details naming the lines, as OpenAI reports a file that failed processing."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sqlalchemy.orm import Session

from api.caller import Caller
from api.errors import APIError, Conflict, NotFound
from api.services.uploads import Upload
from ortune.db.models import File, FileStatus
from ortune.db.repositories import FileRepository, TenantRepository
from ortune.settings import Settings
from ortune.storage import ObjectStore
from trainer_core import tasks
from trainer_core.data import media, rows

PURPOSES = ("fine-tune",)


def _validate_form(upload: Upload) -> tuple[str, str, str | None]:
    purpose = upload.fields.get("purpose")
    if upload.path is None or upload.filename is None:
        raise APIError("missing required field 'file'", param="file", code="invalid_upload")
    if purpose is None:
        raise APIError("missing required field 'purpose'", param="purpose", code="invalid_upload")
    if purpose not in PURPOSES:
        raise APIError(
            f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}",
            param="purpose",
            code="invalid_purpose",
        )
    fmt = rows.file_format(upload.filename) or media.archive_format(upload.filename)
    if fmt is None:
        raise APIError(
            f"{upload.filename!r}: unsupported file type; upload .jsonl or .csv, or images or audio as "
            ".zip, .tar or .tar.gz",
            param="file",
            code="invalid_file_format",
        )
    task = upload.fields.get("task") or None
    if task is not None and task not in tasks.NAMES:
        raise APIError(f"task must be one of {', '.join(tasks.NAMES)}", param="task", code="invalid_task")
    return purpose, fmt, task


async def check_and_store(
    store: ObjectStore, settings: Settings, caller: Caller, upload: Upload, file_id: str
) -> File:
    """Check the upload row by row and put it in storage, off the event loop and outside any transaction;
    the file's row, not yet added to a session. The upload's temporary file is gone afterwards."""
    try:
        purpose, fmt, task = _validate_form(upload)
        assert upload.path is not None and upload.filename is not None
        path: Path = upload.path
        if fmt in ("zip", "tar"):  # read member by member from the spooled upload, nothing unpacked
            limits = media.Limits(
                settings.max_archive_members, settings.max_archive_bytes, settings.max_compression_ratio
            )
            report = await asyncio.to_thread(
                media.check_archive,
                path,
                fmt,
                limits=limits,
                compressed_size=upload.size,
                max_rows=settings.max_rows,
                task=task,
            )
        else:
            report = await asyncio.to_thread(
                rows.check_file,
                path,
                fmt,
                max_rows=settings.max_rows,
                task=task,
                max_chars=settings.max_row_chars,
            )
        key = f"files/{file_id}.{fmt}"
        await asyncio.to_thread(store.put_path, key, path)
    finally:
        if upload.path is not None:
            upload.path.unlink(missing_ok=True)
    labels = sorted(report.labels, key=str) if report.labels else None
    return File(
        id=file_id,
        tenant_id=caller.tenant_id,
        filename=Path(upload.filename).name[:255] or "upload",
        purpose=purpose,
        bytes=upload.size,
        sha256=upload.sha256,
        object_key=key,
        status=FileStatus.processed if report.ok else FileStatus.error,
        status_details=report.details(),
        row_kind=report.kind,
        row_count=report.rows,
        labels=labels,
    )


def get(session: Session, caller: Caller, file_id: str) -> File:
    file = FileRepository(session).get(file_id)
    if file is None or file.tenant_id != caller.tenant_id:  # another tenant's file does not exist for you
        raise NotFound(f"no file with id {file_id!r}", param="file_id", code="file_not_found")
    return file


def delete(session: Session, store: ObjectStore, caller: Caller, file_id: str) -> None:
    """The file marked deleted and committed, then its bytes removed: a row never names an object already
    gone (a failed delete of the bytes leaves an orphan object, not a broken file)."""
    # the lock a job create takes before it reads its files: a create on this file meanwhile is either
    # seen by the in-use check, or waits and then finds the file gone
    TenantRepository(session).lock(caller.tenant_id)
    repo = FileRepository(session)
    file = get(session, caller, file_id)
    if repo.in_use(file_id):
        raise Conflict(
            f"file {file_id} is used by a job that has not finished; cancel it first",
            param="file_id",
            code="file_in_use",
        )
    repo.mark_deleted(file)
    session.commit()
    store.delete(file.object_key)

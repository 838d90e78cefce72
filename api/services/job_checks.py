"""What a job request's files must be: the caller's, processed, of rows its task and method train on, and
for a classifier labels that make a classification."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from api.caller import Caller
from api.errors import APIError, NotFound
from api.schemas import JobCreate
from ortune.db.models import File, FileStatus, Job
from ortune.db.repositories import FileRepository
from trainer_core import rows


def file(session: Session, caller: Caller, file_id: str, param: str, task: str | None) -> File:
    found = FileRepository(session).get(file_id)
    if found is None or found.tenant_id != caller.tenant_id:
        raise NotFound(f"no file with id {file_id!r}", param=param, code="file_not_found")
    if found.status != FileStatus.processed:
        raise APIError(
            f"file {file_id} failed its checks: {found.status_details}", param=param, code="invalid_file"
        )
    if task is not None and found.row_kind not in rows.TASK_KINDS[task]:
        raise APIError(
            f"task {task} needs rows with {rows.required_columns(task)}; file {file_id} holds "
            f"{found.row_kind} rows",
            param=param,
            code="invalid_file",
        )
    return found


def method(req: JobCreate, train: File) -> None:
    """The method and the training file's rows belong together: DPO learns from preference pairs only."""
    name = req.method.type if req.method else "supervised"
    if train.row_kind in rows.METHOD_KINDS[name]:
        return
    if name == "dpo":
        message = (
            f"method dpo trains on preference rows {rows.required_columns('dpo', by='method')}; "
            f"file {train.id} holds {train.row_kind} rows"
        )
    else:
        message = (
            f"file {train.id} holds preference rows, which train with method dpo "
            '({"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1}}})'
        )
    raise APIError(message, param="training_file", code="invalid_file")


def lora(req: JobCreate, task: str) -> None:
    """LoRA adapts text models here; an image, audio or speech model trains whole."""
    if req.lora() is not None and task not in ("sequence-classification", "causal-lm"):
        raise APIError(
            f"lora is for text models; a {task} job fine-tunes the whole model (leave lora out)",
            param="method.supervised.lora",
        )


def labels(train: File, valid: File | None, source: Job | None, task: str, model: str) -> list[Any]:
    """A classifier's labels (the training file's): at least two, the validation file's among them, and
    those of the model it continues from."""
    found: list[Any] = list(train.labels or [])
    if task not in rows.CLASSIFICATION_TASKS:
        return found
    if len(found) < 2:
        raise APIError(
            f"{task} needs at least two distinct labels in the training file",
            param="training_file",
            code="invalid_file",
        )
    unseen = {str(x) for x in (valid.labels or [])} - {str(x) for x in found} if valid else set()
    if unseen:
        raise APIError(
            f"validation labels not in the training file: {', '.join(sorted(unseen))}",
            param="validation_file",
            code="invalid_file",
        )
    if source is not None:
        theirs = [str(x) for x in source.spec.labels]
        if [str(x) for x in found] != theirs:
            raise APIError(
                f"the training file's labels ({', '.join(map(str, found))}) are not those {model} was "
                f"trained on ({', '.join(theirs)}): a classifier goes on with its own labels",
                param="training_file",
                code="invalid_file",
            )
    return found

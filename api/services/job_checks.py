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
from trainer_core import methods, tasks
from trainer_core.data import rows
from trainer_core.spec import Method, Supervised


def file(session: Session, caller: Caller, file_id: str, param: str, task: str | None) -> File:
    found = FileRepository(session).get(file_id)
    if found is None or found.tenant_id != caller.tenant_id:
        raise NotFound(f"no file with id {file_id!r}", param=param, code="file_not_found")
    if found.status != FileStatus.processed:
        raise APIError(
            f"file {file_id} failed its checks: {found.status_details}", param=param, code="invalid_file"
        )
    wanted = tasks.get(task).row_kinds if task is not None else ()
    if task is not None and found.row_kind not in wanted:
        raise APIError(
            f"task {task} needs rows with {rows.required_columns(wanted)}; file {file_id} holds "
            f"{found.row_kind} rows",
            param=param,
            code="invalid_file",
        )
    return found


def method(chosen: Method, train: File, task: str, backend: str) -> None:
    """The method, its task and the training file's rows belong together (DPO learns from preference pairs
    of a causal LM only), and its options with them; backend ort only where ORT can train it."""
    info = methods.get(chosen.type)
    packing = isinstance(chosen, Supervised) and chosen.packing
    if packing and not tasks.get(task).token_loss:
        raise APIError(
            f"packing joins causal-LM rows into full sequences; a {task} job has nothing to pack",
            param="method.supervised.packing",
        )
    if packing and backend == "ort":
        raise APIError(
            "backend ort does not train packed sequences yet; use backend auto or torch", param="backend"
        )
    if info.ort_problem is not None and backend == "ort":
        raise APIError(
            f"backend ort cannot train this job: {info.ort_problem}; use auto or torch", param="backend"
        )
    if task not in info.tasks:
        raise APIError(
            f"method {info.name} trains {', '.join(info.tasks)}, not {task}",
            param="method",
            code="invalid_file",
        )
    if train.row_kind in info.row_kinds:
        return
    named = f"{' or '.join(info.row_kinds)} " if len(info.row_kinds) == 1 else ""
    message = (
        f"method {info.name} trains on {named}rows {rows.required_columns(info.row_kinds)}; file {train.id} "
        f"holds {train.row_kind} rows"
    )
    if (other := methods.for_rows(train.row_kind)) is not None:
        message += f", which train with method {other.name} ({other.hint})"
    raise APIError(message, param="training_file", code="invalid_file")


def lora(req: JobCreate, task: str) -> None:
    """LoRA adapts text models here; an image, audio or speech model trains whole."""
    if req.lora() is not None and not tasks.get(task).lora:
        raise APIError(
            f"lora is for text models; a {task} job fine-tunes the whole model (leave lora out)",
            param="method.supervised.lora",
        )


def labels(train: File, valid: File | None, source: Job | None, task: str, model: str) -> list[Any]:
    """A classifier's labels (the training file's): at least two, the validation file's among them, and
    those of the model it continues from."""
    found: list[Any] = list(train.labels or [])
    if not tasks.get(task).classifies:
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

"""A succeeded job's result file, as OpenAI attaches one: its step metrics as CSV, a file of the job's tenant
(purpose `fine-tune-results`) listed in the job's `result_files` and read through `/v1/files/{id}/content`."""

from __future__ import annotations

import csv
import hashlib
import io

from sqlalchemy.orm import Session

from ortune.db.base import new_id
from ortune.db.models import File, FileStatus, Job
from ortune.db.repositories import FileRepository, JobRepository, MetricRepository
from ortune.db.session import session_scope
from ortune.settings import Settings
from ortune.storage import ObjectStore

# our series under the column names OpenAI's step-metrics file uses, where it has one
COLUMNS = {
    "train_loss": "train_loss",
    "eval_loss": "valid_loss",
    "eval_accuracy": "valid_accuracy",
    "eval_wer": "valid_wer",
    "eval_preference_accuracy": "valid_preference_accuracy",
    "reward_margin": "train_reward_margin",
    "reward_accuracy": "train_reward_accuracy",
    "eval_reward_margin": "valid_reward_margin",
    "eval_reward_accuracy": "valid_reward_accuracy",
    "learning_rate": "learning_rate",
    "grad_norm": "grad_norm",
    "samples_per_second": "samples_per_second",
}


def step_metrics_csv(session: Session, job_id: str) -> tuple[bytes, int]:
    """The job's metrics, a row per step and a column per series it has (empty where a step has none)."""
    series = MetricRepository(session).series(job_id, list(COLUMNS))
    names = [n for n in COLUMNS if n in series]
    by_step: dict[int, dict[str, float]] = {}
    for name in names:
        for step, value in series[name]:
            by_step.setdefault(step, {})[COLUMNS[name]] = value
    out = io.StringIO()
    writer = csv.DictWriter(out, ["step", *(COLUMNS[n] for n in names)], lineterminator="\n")
    writer.writeheader()
    for step in sorted(by_step):
        writer.writerow({"step": step, **by_step[step]})
    return out.getvalue().encode(), len(by_step)


def store(settings: Settings, objects: ObjectStore, job: Job) -> File:
    """Write the step-metrics file to object storage: the file's row, not added yet. The metrics are read in
    a transaction of their own: on SQLite a transaction that reads, waits on storage and then writes can
    find its snapshot stale and fail at once ("database is locked"), so the caller's transaction writes
    first."""
    with session_scope(settings.database_url) as session:
        data, rows = step_metrics_csv(session, job.id)
    file_id = new_id("file")
    key = f"files/{file_id}.csv"
    objects.put_fileobj(key, io.BytesIO(data))
    return File(
        id=file_id,
        tenant_id=job.tenant_id,
        filename="step_metrics.csv",
        purpose="fine-tune-results",
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        object_key=key,
        status=FileStatus.processed,
        row_count=rows,
    )


def record(session: Session, job: Job, file: File) -> None:
    """Add the stored file and list it in the job's `result_files`."""
    FileRepository(session).add(file)
    current = JobRepository(session).get(job.id)
    if current is not None:
        current.result = {**(current.result or {}), "result_files": [file.id]}

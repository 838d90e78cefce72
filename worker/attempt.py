"""One attempt of a job on this worker: claiming it, beating its heartbeat, and ending it by its outcome.

Only a `queued` job is claimed (compare-and-set to `running`, attempt + 1), so a redelivered task finds
nothing to do, and every later write names the attempt, so a worker the sweep gave up on cannot overwrite
the attempt that replaced it.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ortune import lifecycle
from ortune.db.models import Assignment, File, Job, JobStatus
from ortune.db.repositories import EventRepository, FileRepository, JobRepository, NodeRepository
from ortune.db.session import session_scope
from ortune.settings import Settings
from ortune.storage import StorageUnavailable
from worker import results
from worker.staging import store_of

log = logging.getLogger(__name__)
WORKER = f"{os.uname().nodename}:{os.getpid()}"
# Set when this worker is asked to shut down (SIGTERM: a deploy, a node drain): the running attempt
# checkpoints and is requeued, for this or another worker to continue, instead of holding the shutdown.
DRAINING = threading.Event()


@dataclass
class Outcome:
    # None: the attempt was superseded (the sweep requeued the job); nothing of it is written back.
    status: JobStatus | None
    error: dict[str, Any] | None = None

    @classmethod
    def failed(cls, code: str, message: str) -> Outcome:
        return cls(JobStatus.failed, {"code": code, "message": message})

    @classmethod
    def worker_error(cls, exc: BaseException, what: str = "") -> Outcome:
        return cls.failed("worker_error", f"{what}{type(exc).__name__}: {exc}")


@dataclass
class Claimed:
    job: Job
    train: File
    valid: File | None
    # what the trainer may see: CUDA_VISIBLE_DEVICES for the device this attempt holds, {} off a node
    device_env: dict[str, str] = field(default_factory=dict)


class Heartbeat(threading.Thread):
    """Beats `heartbeat_at` for one attempt until stopped; the sweep requeues an attempt that goes quiet."""

    def __init__(self, settings: Settings, job_id: str, attempt: int) -> None:
        super().__init__(daemon=True, name=f"heartbeat-{job_id}")
        self.settings, self.job_id, self.attempt = settings, job_id, attempt
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.settings.heartbeat_seconds):
            try:
                with session_scope(self.settings.database_url) as session:
                    JobRepository(session).beat(self.job_id, self.attempt, WORKER)
            except Exception:  # the database is down: the next beat tries again
                log.warning("heartbeat of %s failed", self.job_id, exc_info=True)

    def stop(self) -> None:
        self.stopped.set()


def claim(settings: Settings, job_id: str) -> Claimed | None:
    """Claim a queued single-process job and a device for it on this node; None when there is nothing to
    do (another worker has it, it is not queued, it is a multi-process job, or every device is held)."""
    with session_scope(settings.database_url) as session:
        jobs = JobRepository(session)
        job = jobs.get(job_id, for_update=True)
        if job is None or job.status != JobStatus.queued or job.world_size > 1:
            return None  # a multi-process job is the scheduler's (worker/scheduler.py)
        attempt = lifecycle.claim(session, job, WORKER)
        if attempt is None:
            return None
        device_env = _take_device(session, settings, job_id, attempt)
        if device_env is None:
            session.rollback()  # stays queued; the sweep sends it again once a device is free
            jobs.update(job_id, enqueued_at=None)
            return None
        session.refresh(job)
        return Claimed(job, *FileRepository(session).of_job(job), device_env=device_env)


def status_of(settings: Settings, job_id: str) -> JobStatus | None:
    with session_scope(settings.database_url) as session:
        return JobRepository(session).status(job_id)


def _take_device(session: Session, settings: Settings, job_id: str, attempt: int) -> dict[str, str] | None:
    """Account for the device this attempt uses on this worker's node, so the scheduler does not place
    a multi-process job's rank on it meanwhile; the trainer's environment that shows it that device alone.
    None when every device of the node is held."""
    nodes = NodeRepository(session)
    node = nodes.get(settings.node_name)
    if node is None:  # not a registered node (a job run by hand): nothing to account for
        return {}
    taken = {a.device for a in nodes.live_assignments([node.name])}
    free = [d for d in range(node.devices) if d not in taken]
    if not free:
        return None
    try:
        with session.begin_nested():
            session.add(
                Assignment(job_id=job_id, attempt=attempt, node_name=node.name, node_rank=0, device=free[0])
            )
    except IntegrityError:  # the scheduler gave it away a moment ago
        return None
    return device_env(node.device_kind, [free[0]])


def device_env(kind: str, devices: list[int]) -> dict[str, str]:
    """The trainer sees only its own devices. A single-process trainer that saw every GPU would be wrapped
    in DataParallel by the Trainer, silently multiplying the batch by the GPU count; a CPU node's trainer
    sees none."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, devices)) if kind == "cuda" else ""}


def finish(settings: Settings, job: Job, outcome: Outcome) -> None:
    """Write the attempt's outcome back through the lifecycle (a superseded attempt only says so)."""
    attempt = job.attempt
    # stored before the transaction, which then only records it: no transaction spans a storage call
    stored = _store_results(settings, job) if outcome.status == JobStatus.succeeded else None
    with session_scope(settings.database_url) as session:
        match outcome.status:
            case None:
                lifecycle.superseded(session, job.id, attempt, WORKER)
                return
            case JobStatus.succeeded:
                # fenced first: an attempt that was superseded while it finished attaches nothing
                if lifecycle.succeed(session, job, attempt):
                    _attach_results(session, job, stored)
                    stored = None
            case JobStatus.failed:
                lifecycle.fail(
                    session, job.id, attempt, outcome.error or {"code": "unknown", "message": None}
                )
            case JobStatus.queued:  # this worker is shutting down; the job goes on elsewhere
                lifecycle.requeue_drained(session, settings, job, attempt, WORKER)
            case JobStatus.paused:
                lifecycle.paused_stopped(session, job, attempt)
            case _:
                lifecycle.cancelled_stopped(session, job.id, attempt)
        lifecycle.nudge_search(session, settings, job)
    if isinstance(stored, File):  # not attached: the attempt was superseded as it finished
        store_of(settings).delete(stored.object_key)


def _store_results(settings: Settings, job: Job) -> File | StorageUnavailable:
    """The job's step-metrics file (worker/results.py), stored; its row is not added yet. The model is
    stored already: a storage refusal here costs the job that file only."""
    try:
        return results.store(settings, store_of(settings), job)
    except StorageUnavailable as exc:
        return exc


def _attach_results(session: Session, job: Job, stored: File | StorageUnavailable | None) -> None:
    if isinstance(stored, File):
        results.record(session, job, stored)
    elif stored is not None:
        EventRepository(session).add(
            job.id, f"The step-metrics result file could not be stored: {stored}", level="warn"
        )


def requeue_unstorable(settings: Settings, job: Job, exc: StorageUnavailable, what: str) -> str:
    """Object storage refused a write this attempt must have (`what`: a model, a tokenized store, a node's
    checkpoint part): the job goes on as a new attempt from its last complete checkpoint, now rather than
    after the heartbeat timeout, and a store that stays down fails it after `max_attempts`. Any node of the
    attempt may say so; the others find it superseded and stop."""
    log.warning("job %s: object storage refused %s; requeued", job.id, what, exc_info=exc)
    requeue(settings, job, f"object storage refused a write of {what} ({exc})")
    release(settings, job, settings.node_name, 1, "storage_unavailable")
    return "requeued"


def requeue(settings: Settings, job: Job, because: str) -> None:
    """This attempt cannot go on for a fault outside the job: a new attempt, as for a lost one."""
    with session_scope(settings.database_url) as session:
        current = JobRepository(session).get(job.id)
        if current is not None and current.attempt == job.attempt:
            lifecycle.requeue_lost(session, settings, current, 0, because=because)


def release(
    settings: Settings, job: Job, node_name: str, exit_code: int | None, error: str | None = None
) -> None:
    """Give back the devices this node held for the attempt."""
    with session_scope(settings.database_url) as session:
        NodeRepository(session).release(job.id, job.attempt, node_name, exit_code=exit_code, error=error)

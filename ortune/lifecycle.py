"""Every change of a job's status, by name: claim, place, succeed, fail, requeue (drained or lost), pause,
resume, cancel, and a search's start and end.

Each transition owns the states it may start from and the event a user sees, and is a compare-and-set in SQL
(`JobRepository.transition`), on the attempt too where a worker that may have been superseded asks: so races
resolve in the database, and a transition that lost returns False and writes nothing. Nothing else writes
`Job.status`. Callers own the transaction; messages that move the job on are sent after it commits.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from ortune.db.base import utcnow
from ortune.db.models import Job, JobStatus
from ortune.db.repositories import CheckpointRepository, EventRepository, JobRepository
from ortune.queue import enqueue_for, enqueue_search, on_commit
from ortune.settings import Settings

CANCELLABLE = (JobStatus.validating_files, JobStatus.queued, JobStatus.running, JobStatus.paused)
PAUSABLE = (JobStatus.queued, JobStatus.running)
RUNNING = (JobStatus.running,)


def _resume_point(session: Session, job: Job, *, none: str) -> tuple[str, dict[str, Any]]:
    latest = next(iter(CheckpointRepository(session).complete(job.id, job.spec.distributed.nodes)), None)
    where = f"the checkpoint at step {latest.step}" if latest else none
    return where, {"checkpoint_step": latest.step if latest else None}


def _send_after_commit(session: Session, settings: Settings, job: Job) -> None:
    job_id, send = job.id, enqueue_for(job)
    on_commit(session, lambda: send(settings, job_id))


def _start_attempt(session: Session, job: Job, worker: str) -> int | None:
    """queued -> running as attempt + 1, held by `worker`; the attempt number, or None."""
    attempt = job.attempt + 1
    started = JobRepository(session).transition(
        job.id,
        JobStatus.running,
        only_from=[JobStatus.queued],
        attempt=attempt,
        started_at=job.started_at or utcnow(),
        heartbeat_at=utcnow(),
        worker=worker,
    )
    return attempt if started else None


def claim(session: Session, job: Job, worker: str) -> int | None:
    """A single-process worker takes a queued job as a new attempt; the attempt number, or None."""
    if (attempt := _start_attempt(session, job, worker)) is not None:
        EventRepository(session).add(
            job.id,
            f"Attempt {attempt} started on worker {worker}",
            data={"attempt": attempt, "worker": worker},
        )
    return attempt


def place(session: Session, job: Job, lead_worker: str, where: str, data: dict[str, Any]) -> int | None:
    """The scheduler starts a queued multi-process job as a new attempt on the nodes `where` says."""
    if (attempt := _start_attempt(session, job, lead_worker)) is not None:
        EventRepository(session).add(
            job.id, f"Attempt {attempt} placed on {where}", data={"attempt": attempt, **data}
        )
    return attempt


def succeed(session: Session, job: Job, attempt: int) -> bool:
    """The attempt finished and stored its models (a pause that came too late to stop it counts too)."""
    name = f"ft:{job.model}:{job.suffix or 'ortune'}:{job.id}"
    if not JobRepository(session).transition(
        job.id,
        JobStatus.succeeded,
        only_from=[JobStatus.running, JobStatus.paused],
        on_attempt=attempt,
        finished_at=utcnow(),
        fine_tuned_model=name,
        worker=None,
    ):
        return False
    stored = JobRepository(session).get(job.id)
    failed = ((stored.result if stored else None) or {}).get("failed_artifacts") or {}
    without = f" (without its {', '.join(failed)} model, whose export failed: see above)" if failed else ""
    EventRepository(session).add(job.id, f"The job has successfully completed: {name}{without}")
    return True


def fail(session: Session, job_id: str, attempt: int | None, error: dict[str, Any]) -> bool:
    """running -> failed, with the error the job shows."""
    if not JobRepository(session).transition(
        job_id,
        JobStatus.failed,
        only_from=RUNNING,
        on_attempt=attempt,
        finished_at=utcnow(),
        error=error,
        worker=None,
    ):
        return False
    EventRepository(session).add(job_id, f"The job failed: {error.get('message')}", level="error")
    return True


def requeue_drained(session: Session, settings: Settings, job: Job, attempt: int, worker: str) -> bool:
    """running -> queued: the worker shut down after checkpointing; the job goes on elsewhere."""
    where, data = _resume_point(session, job, none="the start")
    if not JobRepository(session).transition(
        job.id, JobStatus.queued, only_from=RUNNING, on_attempt=attempt, worker=None, enqueued_at=None
    ):
        return False
    EventRepository(session).add(job.id, f"Requeued from {where}: worker {worker} shut down", data=data)
    _send_after_commit(session, settings, job)
    return True


def requeue_lost(
    session: Session,
    settings: Settings,
    job: Job,
    silent_s: float,
    *,
    gone: bool = False,
    because: str | None = None,
) -> JobStatus | None:
    """A running attempt whose heartbeat stopped, whose worker process is `gone` (found dead by a new
    worker on its host), or that ended `because` of a fault outside the job (object storage down): queued
    again as a new attempt, or failed once `max_attempts` attempts were lost. The status it moved to, or
    None when it had moved on already."""
    jobs, lost = JobRepository(session), job.lost_attempts + 1
    if because:
        said = f"Attempt {job.attempt} lost: {because}"
    elif gone:
        said = (
            f"Attempt {job.attempt} lost: worker {job.worker} is gone (a new worker on its host found its "
            "process dead)"
        )
    else:
        said = f"Attempt {job.attempt} lost: worker {job.worker} sent no heartbeat for {silent_s:.0f}s"
    where, resume = _resume_point(session, job, none="the start (no checkpoint stored)")
    data = {"attempt": job.attempt, "last_step": job.step, **resume, "lost_attempts": lost}
    if lost >= settings.max_attempts:
        message = f"{said}; {lost} attempts were lost, the limit is {settings.max_attempts}"
        if not jobs.transition(
            job.id,
            JobStatus.failed,
            only_from=RUNNING,
            on_attempt=job.attempt,
            finished_at=utcnow(),
            error={"code": "attempts_exhausted", "message": message},
            worker=None,
            lost_attempts=lost,
        ):
            return None
        EventRepository(session).add(job.id, message, level="error", data=data)
        return JobStatus.failed
    if not jobs.transition(
        job.id,
        JobStatus.queued,
        only_from=RUNNING,
        on_attempt=job.attempt,
        worker=None,
        enqueued_at=None,
        lost_attempts=lost,
    ):
        return None
    EventRepository(session).add(
        job.id,
        f"{said}; requeued as attempt {job.attempt + 1}, resuming from {where}",
        level="warn",
        data=data,
    )
    _send_after_commit(session, settings, job)
    return JobStatus.queued


def pause(session: Session, job: Job) -> bool:
    """queued or running -> paused: a queued job is held, a running one is asked to checkpoint and stop."""
    if not JobRepository(session).transition(job.id, JobStatus.paused, only_from=PAUSABLE):
        return False
    held = job.worker is not None
    EventRepository(session).add(
        job.id,
        "Pause requested: the trainer saves a checkpoint and stops" if held else "Job paused while queued",
        data={"step": job.step},
    )
    return True


def paused_stopped(session: Session, job: Job, attempt: int) -> bool:
    """The paused job's trainer checkpointed and exited: the worker lets go of it."""
    said, none = "Paused; the worker is free", "the start (no checkpoint yet)"
    return _let_go_paused(session, job, attempt, said, none, "info")


def pause_lost(session: Session, job: Job) -> bool:
    """The worker checkpointing a paused job died: the job stays paused, let go of, and resumes from its
    latest stored checkpoint."""
    said, none = (
        f"Paused; worker {job.worker} was lost while it checkpointed",
        "the start (no checkpoint stored)",
    )
    return _let_go_paused(session, job, job.attempt, said, none, "warn")


def _let_go_paused(session: Session, job: Job, attempt: int, said: str, none: str, level: str) -> bool:
    """paused -> paused without its worker: the job is let go of, to resume from its latest checkpoint."""
    job_id = job.id
    where, data = _resume_point(session, job, none=none)
    if not JobRepository(session).transition(
        job_id, JobStatus.paused, only_from=[JobStatus.paused], on_attempt=attempt, worker=None
    ):
        return False
    EventRepository(session).add(job_id, f"{said}. Resume continues from {where}", level=level, data=data)
    return True


def resume(session: Session, settings: Settings, job: Job) -> bool:
    """paused -> queued; the next attempt continues from the latest checkpoint."""
    if not JobRepository(session).transition(
        job.id, JobStatus.queued, only_from=[JobStatus.paused], worker=None, enqueued_at=None
    ):
        return False
    EventRepository(session).add(job.id, "Job resumed: queued for its next attempt")
    _send_after_commit(session, settings, job)  # a multi-process job goes back to the scheduler
    return True


def cancel(session: Session, settings: Settings, job: Job) -> bool:
    """Any unfinished job -> cancelled, with a search's trials; a trial's search moves on to its next one."""
    jobs, events = JobRepository(session), EventRepository(session)
    if not jobs.transition(job.id, JobStatus.cancelled, only_from=CANCELLABLE, finished_at=utcnow()):
        return False
    events.add(job.id, "Job cancelled by request")
    for trial in jobs.children(job.id):
        if jobs.transition(trial.id, JobStatus.cancelled, only_from=CANCELLABLE, finished_at=utcnow()):
            events.add(trial.id, f"Job cancelled with its search {job.id}")
    nudge_search(session, settings, job)
    return True


def cancelled_stopped(session: Session, job_id: str, attempt: int) -> None:
    """The cancelled job's trainer is gone: the worker lets go of it."""
    JobRepository(session).transition(
        job_id, JobStatus.cancelled, only_from=[JobStatus.cancelled], on_attempt=attempt, worker=None
    )
    EventRepository(session).add(job_id, "Training stopped after the job was cancelled")


def superseded(session: Session, job_id: str, attempt: int, worker: str) -> None:
    """Nothing changes: the attempt learnt that the job moved on without it; the events say so."""
    EventRepository(session).add(
        job_id, f"Attempt {attempt} on {worker} stopped: the job moved on without it (requeued or ended)"
    )


def nudge_search(session: Session, settings: Settings, job: Job) -> None:
    """A trial ended: its search starts the next one (after commit)."""
    if job.parent_id is not None:
        parent = job.parent_id
        on_commit(session, lambda: enqueue_search(settings, parent))


def start_search(session: Session, job_id: str, description: str) -> bool:
    """queued -> running for a search job (its trials are the jobs that train)."""
    if not JobRepository(session).transition(
        job_id, JobStatus.running, only_from=[JobStatus.queued], started_at=utcnow()
    ):
        return False
    EventRepository(session).add(job_id, f"Hyperparameter search: {description}")
    return True


def search_failed(session: Session, job_id: str, error: dict[str, Any], result: dict[str, Any]) -> bool:
    if not JobRepository(session).transition(
        job_id, JobStatus.failed, only_from=RUNNING, finished_at=utcnow(), error=error, result=result
    ):
        return False
    EventRepository(session).add(job_id, f"The search failed: {error['message']}", level="error")
    return True


def search_succeeded(session: Session, job_id: str, best: Job, result: dict[str, Any], summary: str) -> bool:
    """The search ends with its best trial's model, metrics and backend."""
    if not JobRepository(session).transition(
        job_id,
        JobStatus.succeeded,
        only_from=RUNNING,
        finished_at=utcnow(),
        result=result,
        fine_tuned_model=best.fine_tuned_model,
        backend_used=best.backend_used,
        backend_reason=best.backend_reason,
        trained_tokens=best.trained_tokens,
    ):
        return False
    EventRepository(session).add(job_id, f"The search has completed: {summary}")
    return True

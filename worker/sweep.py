"""The sweep: what no single task can notice, found from the database every `sweep_seconds`.

- A running attempt whose heartbeat stopped (its worker died, or lost the database for too long) is marked
  lost and the job queued again as a new attempt, which resumes from the latest checkpoint; after
  `max_attempts` lost attempts the job fails instead.
- A queued job that no worker took (its message never reached the broker, or died with a Redis that was
  restarted) is sent again; the claim's compare-and-set makes a duplicate message harmless.
- A running search whose nudge was lost is nudged again.
- Idempotency keys past their lifetime are dropped.

Every worker runs one in a thread; on Postgres, `FOR UPDATE SKIP LOCKED` lets sweeps of several workers
share the rows instead of racing for them.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy import delete, or_, select
from sqlalchemy.orm import Session

from ortune.db.base import utcnow
from ortune.db.models import IdempotencyKey, Job, JobStatus
from ortune.db.repositories import CheckpointRepository, EventRepository, JobRepository
from ortune.db.session import session_scope
from ortune.nodes import NodeRepository
from ortune.queue import enqueue_for, on_commit
from ortune.settings import Settings
from worker import scheduler

log = logging.getLogger(__name__)
FRESH_S = 10.0  # a job queued this recently may still be on its way to the broker


@dataclass
class Report:
    requeued: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    resent: list[str] = field(default_factory=list)
    expired_keys: int = 0


def _lost(session: Session, settings: Settings, job: Job, report: Report) -> None:
    jobs, events = JobRepository(session), EventRepository(session)
    silent = (utcnow() - job.heartbeat_at).total_seconds() if job.heartbeat_at else float("inf")
    latest = CheckpointRepository(session).latest(job.id)
    lost = job.lost_attempts + 1
    NodeRepository(session).release_attempt(job.id, job.attempt)  # its devices are free again
    said = f"Attempt {job.attempt} lost: worker {job.worker} sent no heartbeat for {silent:.0f}s"
    data = {
        "attempt": job.attempt,
        "last_step": job.step,
        "checkpoint_step": latest.step if latest else None,
        "lost_attempts": lost,
    }
    if lost >= settings.max_attempts:
        error = {
            "code": "attempts_exhausted",
            "message": f"{said}; {lost} attempts were lost, the limit is {settings.max_attempts}",
        }
        if jobs.transition(
            job.id,
            JobStatus.failed,
            only_from=[JobStatus.running],
            on_attempt=job.attempt,
            finished_at=utcnow(),
            error=error,
            worker=None,
            lost_attempts=lost,
        ):
            events.add(job.id, error["message"], level="error", data=data)
            report.failed.append(job.id)
        return
    if jobs.transition(
        job.id,
        JobStatus.queued,
        only_from=[JobStatus.running],
        on_attempt=job.attempt,
        worker=None,
        enqueued_at=None,
        lost_attempts=lost,
    ):
        where = f"the checkpoint at step {latest.step}" if latest else "the start (no checkpoint stored)"
        events.add(
            job.id,
            f"{said}; requeued as attempt {job.attempt + 1}, resuming from {where}",
            level="warn",
            data=data,
        )
        job_id, send = job.id, enqueue_for(job)
        on_commit(session, lambda: send(settings, job_id))
        report.requeued.append(job.id)


def sweep(settings: Settings) -> Report:
    report = Report()
    now = utcnow()
    with session_scope(settings.database_url) as session:
        stale = (
            select(Job)
            .where(
                Job.status == JobStatus.running,
                Job.worker.is_not(None),
                Job.heartbeat_at < now - timedelta(seconds=settings.heartbeat_timeout_seconds),
            )
            .with_for_update(skip_locked=True)
        )
        for job in session.scalars(stale).all():
            _lost(session, settings, job, report)

    with session_scope(settings.database_url) as session:
        resend_before = now - timedelta(seconds=settings.requeue_after_seconds)
        forgotten = select(Job).where(
            or_(
                Job.status == JobStatus.queued,
                # a running search (no worker of its own) waits on nudges from its trials
                (Job.status == JobStatus.running) & Job.worker.is_(None) & Job.heartbeat_at.is_(None),
            ),
            or_(
                Job.enqueued_at.is_(None) & (Job.created_at < now - timedelta(seconds=FRESH_S)),
                Job.enqueued_at < resend_before,
            ),
        )
        for job in session.scalars(forgotten.with_for_update(skip_locked=True)).all():
            search = job.spec.get("hyperparameter_search") is not None
            if job.status == JobStatus.running and not search:
                continue
            job.enqueued_at = now  # until the send after commit stamps it again
            job_id, send = job.id, enqueue_for(job)
            on_commit(session, lambda send=send, job_id=job_id: send(settings, job_id))  # type: ignore[misc]
            report.resent.append(job.id)

    with session_scope(settings.database_url) as session:
        cutoff = now - timedelta(hours=settings.idempotency_key_hours)
        result = session.execute(delete(IdempotencyKey).where(IdempotencyKey.created_at < cutoff))
        report.expired_keys = int(result.rowcount or 0)  # type: ignore[attr-defined]
    if report.requeued or report.failed or report.resent:
        log.info("sweep: %s", report)
    return report


class Sweeper(threading.Thread):
    """Every `sweep_seconds` beside the worker's tasks, until stopped: beat this node's heartbeat, sweep,
    and place waiting multi-process jobs."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(daemon=True, name="ortune-sweep")
        self.settings = settings
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.settings.sweep_seconds):
            try:
                with session_scope(self.settings.database_url) as session:
                    NodeRepository(session).beat(self.settings.node_name)
                sweep(self.settings)
                scheduler.dispatch(self.settings)
            except Exception:  # the database is down: try again next round
                log.warning("sweep failed", exc_info=True)

    def stop(self) -> None:
        self.stopped.set()

"""Jobs: reads, the compare-and-set that `ortune.lifecycle` changes a status with, and the worker's
bookkeeping (heartbeat, progress)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, or_, select, update

from ortune.db.base import utcnow
from ortune.db.models import Artifact, Job, JobStatus
from ortune.db.repositories.base import Repository, keyset_after, page_anchor

# An attempt's writes count while its job is running or paused on it (a cancelled one's last events too);
# once the job is queued again, failed by the sweep or on a later attempt, they are a stale writer's.
LIVE_ATTEMPT = (JobStatus.running, JobStatus.paused, JobStatus.cancelled)


class JobRepository(Repository):
    def add(self, job: Job) -> Job:
        self.session.add(job)
        self.session.flush()
        return job

    def get(self, job_id: str, *, for_update: bool = False) -> Job | None:
        stmt = select(Job).where(Job.id == job_id)
        if for_update:
            stmt = stmt.with_for_update()
        return self.session.scalars(stmt).first()

    def tenant_of(self, job_id: str) -> str | None:
        """The job's tenant, without loading the job (its spec is the bulk of the row)."""
        return self.session.scalar(select(Job.tenant_id).where(Job.id == job_id))

    def list(
        self,
        *,
        tenant_id: str,
        after: str | None,
        limit: int,
        status: JobStatus | None = None,
        metadata: dict[str, str] | None = None,
    ) -> tuple[list[Job], bool]:
        """A tenant's jobs newest first, optionally of one status and carrying every `metadata` pair."""
        stmt = select(Job).where(Job.tenant_id == tenant_id)
        if status is not None:
            stmt = stmt.where(Job.status == status)
        for key, value in (metadata or {}).items():
            stmt = stmt.where(Job.user_metadata[key].as_string() == value)
        stmt = keyset_after(stmt, Job, page_anchor(self.session, Job, after, tenant_id))
        rows = list(
            self.session.scalars(stmt.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1))
        )
        return rows[:limit], len(rows) > limit

    def transition(
        self,
        job_id: str,
        to: JobStatus,
        *,
        only_from: Iterable[JobStatus],
        on_attempt: int | None = None,
        **values: Any,
    ) -> bool:
        """Compare-and-set on status (and attempt, for a worker that may have been superseded): the single
        way a job's status changes, so races resolve in SQL. Only `ortune.lifecycle` calls it."""
        stmt = update(Job).where(Job.id == job_id, Job.status.in_(list(only_from)))
        if on_attempt is not None:
            stmt = stmt.where(Job.attempt == on_attempt)
        stmt = stmt.values(status=to, **values).execution_options(synchronize_session=False)
        changed = self.session.execute(stmt).rowcount == 1  # type: ignore[attr-defined]
        self.session.flush()
        return changed

    def update(self, job_id: str, *, attempt: int | None = None, **values: Any) -> None:
        stmt = update(Job).where(Job.id == job_id)
        if attempt is not None:
            stmt = stmt.where(Job.attempt == attempt)
        self.session.execute(stmt.values(**values))
        self.session.flush()

    def holds(self, job_id: str, attempt: int) -> bool:
        """Whether `attempt` is still the job's live attempt, and it stays so until this transaction ends
        (FOR SHARE: a requeue's update of the row waits). Writes of a superseded attempt check this first."""
        stmt = (
            select(Job.id)
            .where(Job.id == job_id, Job.attempt == attempt, Job.status.in_(LIVE_ATTEMPT))
            .with_for_update(read=True)
        )
        return self.session.scalars(stmt).first() is not None

    def status(self, job_id: str, *, attempt: int | None = None) -> JobStatus | None:
        """The job's status; None when it does not exist (or is now on another attempt than `attempt`)."""
        stmt = select(Job.status).where(Job.id == job_id)
        if attempt is not None:
            stmt = stmt.where(Job.attempt == attempt)
        return self.session.scalar(stmt)

    def beat(self, job_id: str, attempt: int, worker: str) -> None:
        """The heartbeat of the attempt `worker` holds; a superseded attempt's beat changes nothing."""
        self.session.execute(
            update(Job)
            .where(Job.id == job_id, Job.attempt == attempt, Job.worker == worker)
            .values(heartbeat_at=utcnow())
        )

    def silent_running(self, since: datetime) -> Sequence[Job]:
        """Running attempts held by a worker that has not beaten since `since`, locked (others skipped)."""
        stmt = select(Job).where(
            Job.status == JobStatus.running, Job.worker.is_not(None), Job.heartbeat_at < since
        )
        return self.session.scalars(stmt.with_for_update(skip_locked=True)).all()

    def silent_paused(self, since: datetime) -> Sequence[Job]:
        """Paused jobs still held by a worker (it was checkpointing them) that has not beaten since `since`,
        locked (others skipped)."""
        stmt = select(Job).where(
            Job.status == JobStatus.paused, Job.worker.is_not(None), Job.heartbeat_at < since
        )
        return self.session.scalars(stmt.with_for_update(skip_locked=True)).all()

    def silent_workers(self, since: datetime) -> Sequence[str]:
        """The workers holding a running or paused attempt that has not beaten since `since` (not locked:
        their own transactions may hold those rows)."""
        stmt = select(Job.worker).where(
            Job.status.in_([JobStatus.running, JobStatus.paused]),
            Job.worker.is_not(None),
            Job.heartbeat_at < since,
        )
        return sorted({w for w in self.session.scalars(stmt.distinct()) if w})

    def held_on_host(self, host: str) -> Sequence[Job]:
        """Running or paused attempts held by a worker of `host` (workers are named `host:pid`), locked
        (others skipped)."""
        stmt = select(Job).where(
            Job.status.in_([JobStatus.running, JobStatus.paused]), Job.worker.like(f"{host}:%")
        )
        return self.session.scalars(stmt.with_for_update(skip_locked=True)).all()

    def unsent(self, created_before: datetime, sent_before: datetime) -> Sequence[Job]:
        """Jobs waiting on a message that may never have reached a worker, locked (others skipped): queued
        jobs, and running searches (no worker of their own), that were never sent and are not brand new,
        or were last sent before `sent_before`."""
        stmt = select(Job).where(
            or_(
                Job.status == JobStatus.queued,
                (Job.status == JobStatus.running) & Job.worker.is_(None) & Job.heartbeat_at.is_(None),
            ),
            or_(
                Job.enqueued_at.is_(None) & (Job.created_at < created_before),
                Job.enqueued_at < sent_before,
            ),
        )
        return self.session.scalars(stmt.with_for_update(skip_locked=True)).all()

    def waiting_gangs(self) -> Sequence[Job]:
        """Queued multi-process jobs in the order the scheduler places them: priority, then age."""
        stmt = (
            select(Job)
            .where(Job.status == JobStatus.queued, Job.world_size > 1)
            .order_by(Job.priority.desc(), Job.created_at, Job.id)
        )
        return self.session.scalars(stmt.with_for_update(skip_locked=True)).all()

    def children(self, parent_id: str) -> Sequence[Job]:
        """A search's trials, oldest first."""
        stmt = select(Job).where(Job.parent_id == parent_id).order_by(Job.created_at, Job.id)
        return self.session.scalars(stmt).all()

    def count_by_status(self) -> dict[JobStatus, int]:
        stmt = select(Job.status, func.count()).group_by(Job.status)
        return {status: n for status, n in self.session.execute(stmt)}

    def fine_tuned_models(self, tenant_id: str) -> Sequence[tuple[str, datetime]]:
        """The tenant's fine-tuned models that still have their files (DELETE /v1/models removes them)."""
        stmt = select(Job.fine_tuned_model, Job.finished_at).where(
            Job.tenant_id == tenant_id,
            Job.status == JobStatus.succeeded,
            Job.fine_tuned_model.is_not(None),
            select(Artifact.job_id).where(Artifact.job_id == Job.id).exists(),
        )
        return [(m, t or utcnow()) for m, t in self.session.execute(stmt) if m]

    def by_fine_tuned_model(self, tenant_id: str, model: str) -> Job | None:
        stmt = select(Job).where(Job.tenant_id == tenant_id, Job.fine_tuned_model == model)
        return self.session.scalars(stmt).first()

    def starting_from(self, tenant_id: str, job: Job) -> Sequence[str]:
        """The tenant's unfinished jobs that start from `job`'s fine-tuned model or one of its checkpoints
        (`ft:...:<job id>:ckpt-step-N`), which they fetch when an attempt starts."""
        stmt = select(Job.id).where(
            Job.tenant_id == tenant_id,
            or_(Job.model == job.fine_tuned_model, Job.model.like(f"ft:%:{job.id}:ckpt-step-%")),
            Job.status.in_([s for s in JobStatus if not s.terminal]),
        )
        return self.session.scalars(stmt.order_by(Job.created_at)).all()

"""The sweep: what no single task can notice, found from the database every `sweep_seconds`.

- A running attempt whose heartbeat stopped (its worker died, or lost the database for too long) is marked
  lost and the job queued again as a new attempt, which resumes from the latest checkpoint; after
  `max_attempts` lost attempts the job fails instead. A silent worker's open transactions are ended first
  (Postgres), so a worker frozen inside one cannot keep its job's row from the sweep.
- A queued job that no worker took (its message never reached the broker, or died with a Redis that was
  restarted) is sent again; the claim's compare-and-set makes a duplicate message harmless.
- A paused job whose worker died while it checkpointed is let go of (it resumes from its latest checkpoint),
  and devices still held by attempts that are over are freed.
- A running search whose nudge was lost is nudged again.
- Idempotency keys past their lifetime are dropped.

A worker that starts also reaps at once the attempts of dead workers on its own host (`reap_predecessors`).

Every worker runs one in a thread; on Postgres, `FOR UPDATE SKIP LOCKED` lets sweeps of several workers
share the rows instead of racing for them.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import psutil
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from ortune import lifecycle
from ortune.db.base import utcnow
from ortune.db.models import Job, JobStatus
from ortune.db.repositories import IdempotencyRepository, JobRepository, NodeRepository
from ortune.db.session import (
    CannotEndTransactions,
    end_transactions_of,
    session_scope,
    worker_application_name,
)
from ortune.queue import enqueue_for, on_commit
from ortune.settings import Settings
from worker import scheduler
from worker.attempt import WORKER

log = logging.getLogger(__name__)
FRESH_S = 10.0  # a job queued this recently may still be on its way to the broker


@dataclass
class Report:
    requeued: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    resent: list[str] = field(default_factory=list)
    let_go: list[str] = field(default_factory=list)  # paused jobs whose pausing worker was lost
    released: int = 0  # device assignments of attempts that were over
    expired_keys: int = 0
    ended_transactions: dict[str, int] = field(default_factory=dict)  # of silent workers, by worker


def _lost(session: Session, settings: Settings, job: Job, report: Report, *, gone: bool = False) -> None:
    silent = (utcnow() - job.heartbeat_at).total_seconds() if job.heartbeat_at else float("inf")
    NodeRepository(session).release_attempt(job.id, job.attempt)  # its devices are free again
    moved = lifecycle.requeue_lost(session, settings, job, silent, gone=gone)
    if moved == JobStatus.failed:
        report.failed.append(job.id)
    elif moved == JobStatus.queued:
        report.requeued.append(job.id)


def _pause_lost(session: Session, job: Job, report: Report) -> None:
    NodeRepository(session).release_attempt(job.id, job.attempt)
    if lifecycle.pause_lost(session, job):
        report.let_go.append(job.id)


def _end_transactions_of_silent_workers(settings: Settings, since: datetime, report: Report) -> None:
    """A worker frozen inside a transaction (SIGSTOP, a VM pause) holds its job's row, which the locked
    selects below skip: its open transactions are ended first, so the next round finds the job."""
    with session_scope(settings.database_url) as session:
        silent = JobRepository(session).silent_workers(since)
    for worker in silent:
        try:
            with session_scope(settings.database_url) as session:
                if ended := end_transactions_of(session, worker_application_name(worker)):
                    report.ended_transactions[worker] = ended
        except (DBAPIError, CannotEndTransactions) as exc:  # another database role's connections
            log.warning("could not end the transactions of silent worker %s: %s", worker, exc)


def sweep(settings: Settings) -> Report:
    report = Report()
    now = utcnow()
    since = now - timedelta(seconds=settings.heartbeat_timeout_seconds)
    _end_transactions_of_silent_workers(settings, since, report)
    with session_scope(settings.database_url) as session:
        for job in JobRepository(session).silent_running(since):
            _lost(session, settings, job, report)
        for job in JobRepository(session).silent_paused(since):
            _pause_lost(session, job, report)
        nodes = NodeRepository(session)
        for assignment in nodes.stale():  # an attempt that ended without letting go of its devices
            nodes.release(
                assignment.job_id, assignment.attempt, assignment.node_name, exit_code=None, error="stale"
            )
            report.released += 1

    with session_scope(settings.database_url) as session:
        unsent = JobRepository(session).unsent(
            created_before=now - timedelta(seconds=FRESH_S),
            sent_before=now - timedelta(seconds=settings.requeue_after_seconds),
        )
        for job in unsent:
            if job.status == JobStatus.running and not job.spec.is_search:
                continue
            job.enqueued_at = now  # until the send after commit stamps it again
            job_id, send = job.id, enqueue_for(job)
            on_commit(session, lambda send=send, job_id=job_id: send(settings, job_id))  # type: ignore[misc]
            report.resent.append(job.id)

    with session_scope(settings.database_url) as session:
        cutoff = now - timedelta(hours=settings.idempotency_key_hours)
        report.expired_keys = IdempotencyRepository(session).expire_before(cutoff)
    if any(
        (
            report.requeued,
            report.failed,
            report.resent,
            report.let_go,
            report.released,
            report.ended_transactions,
        )
    ):
        log.info("sweep: %s", report)
    return report


def reap_predecessors(settings: Settings) -> Report:
    """At a worker's start: the running attempts of workers of this host whose process is gone are lost now,
    not after `heartbeat_timeout_seconds` (a service restarted after a crash trained again only a minute
    later). A worker with this one's own name (a container restarted with the same hostname and pid) is
    gone too."""
    host, _, _ = WORKER.rpartition(":")
    report = Report()
    with session_scope(settings.database_url) as session:
        for job in JobRepository(session).held_on_host(host):
            pid = (job.worker or "").rpartition(":")[2]
            if job.worker == WORKER or (pid.isdigit() and not psutil.pid_exists(int(pid))):
                if job.status == JobStatus.paused:
                    _pause_lost(session, job, report)
                else:
                    _lost(session, settings, job, report, gone=True)
    if report.requeued or report.failed:
        log.info("reaped the attempts of dead workers on %s: %s", host, report)
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

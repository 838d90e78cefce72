"""The Celery app both sides share: the API sends tasks by name, the worker registers them.

Tasks carry ids only, are acknowledged late (a worker lost mid-task leaves the message for another) and
are sent only after the row they name is committed (see `on_commit`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from celery import Celery
from kombu import Exchange
from kombu import Queue as KombuQueue
from sqlalchemy import event
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_random

from ortune.db.base import utcnow
from ortune.db.models import Job
from ortune.db.repositories import JobRepository
from ortune.db.session import session_scope
from ortune.settings import Settings, get_settings

RUN_JOB = "ortune.run_job"
ADVANCE_SEARCH = "ortune.advance_search"
DISPATCH = "ortune.dispatch"
RUN_RANK = "ortune.run_rank"
log = logging.getLogger(__name__)


@lru_cache(maxsize=4)
def celery_app(broker_url: str | None = None, queue: str | None = None) -> Celery:
    settings = get_settings()
    broker = broker_url or settings.broker_url
    app = Celery("ortune", broker=broker)
    app.conf.update(
        task_default_queue=queue or settings.queue,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        accept_content=["json"],
    )
    if broker.startswith("sqla+"):
        _poll_sqlalchemy_broker_faster()
    return app


def _poll_sqlalchemy_broker_faster() -> None:
    """kombu's SQLAlchemy transport polls (Redis pushes); its 1 s default was most of the embedded
    submit-to-start latency, and a SELECT on a local SQLite file every 0.1 s costs next to nothing. The
    `polling_interval` transport option cannot be used: this transport passes every option on to
    `create_engine`, which rejects it; so the transport's class default is set instead."""
    from kombu.transport import sqlalchemy

    sqlalchemy.Transport.polling_interval = 0.1


def enqueue_job(settings: Settings, job_id: str) -> None:
    celery_app(settings.broker_url, settings.queue).send_task(RUN_JOB, args=[job_id], queue=settings.queue)
    _mark_enqueued(settings, job_id)


def enqueue_search(settings: Settings, job_id: str) -> None:
    """Ask the search task to look at a search job again (it started, or one of its trials finished)."""
    app = celery_app(settings.broker_url, settings.queue)
    app.send_task(ADVANCE_SEARCH, args=[job_id], queue=settings.queue)
    _mark_enqueued(settings, job_id)


def enqueue_dispatch(settings: Settings, job_id: str) -> None:
    """Ask any worker to place queued multi-process jobs on free devices (worker/scheduler.py)."""
    celery_app(settings.broker_url, settings.queue).send_task(DISPATCH, args=[job_id], queue=settings.queue)
    _mark_enqueued(settings, job_id)


def enqueue_for(job: Job) -> Callable[[Settings, str], None]:
    """The message that moves this job on: a search advances, a multi-process job waits for the scheduler,
    any other job goes to the shared queue. Chosen now, sent after commit (the row may be gone by then)."""
    if job.spec.is_search:
        return enqueue_search
    return enqueue_dispatch if job.world_size > 1 else enqueue_job


def send_rank(settings: Settings, node_queue: str, rank: dict[str, Any]) -> None:
    """One node's part of a multi-process job, on that node's own queue."""
    celery_app(settings.broker_url, settings.queue).send_task(RUN_RANK, args=[rank], queue=node_queue)


def _mark_enqueued(settings: Settings, job_id: str) -> None:
    """Record the hand-off, so the sweep can tell a job whose message never reached a worker."""
    with session_scope(settings.database_url) as session:
        JobRepository(session).update(job_id, enqueued_at=utcnow())


def ping_broker(settings: Settings) -> None:
    with celery_app(settings.broker_url, settings.queue).connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, timeout=2)


def declare_queues(settings: Settings, *names: str) -> None:
    """Create the embedded broker's queues before anyone consumes them.

    kombu's SQLAlchemy transport creates its tables and queue rows on first use, guarded only by a lock
    inside one process, so two workers starting together on a fresh broker file race there ("UNIQUE
    constraint failed: kombu_queue.name"). Here losing that race is harmless: a fresh connection tries again
    and finds what the winner made. Redis needs none of this.
    """
    if not settings.broker_url.startswith("sqla+"):
        return
    app = celery_app(settings.broker_url, settings.queue)
    for attempt in Retrying(
        retry=retry_if_exception_type(SQLAlchemyError),
        stop=stop_after_attempt(10),
        wait=wait_random(0.05, 0.5),
        reraise=True,
    ):
        with attempt, app.connection_for_write() as conn:
            channel = conn.default_channel
            for name in names:
                KombuQueue(name, Exchange(name, type="direct"), routing_key=name)(channel).declare()


def on_commit(session: Session, fn: Callable[[], Any]) -> None:
    """Run fn after the session's transaction commits (never if it rolls back)."""
    session.info.setdefault("on_commit", []).append(fn)


@event.listens_for(Session, "after_commit")
def _run_on_commit(session: Session) -> None:
    # The transaction is already durable: a failed callback (a broker that is down) is logged, not raised,
    # and the job stays `queued` in the database for the sweep to send again.
    for fn in session.info.pop("on_commit", []):
        try:
            fn()
        except Exception:
            log.exception("after-commit callback failed")


@event.listens_for(Session, "after_rollback")
def _drop_on_commit(session: Session) -> None:
    session.info.pop("on_commit", None)

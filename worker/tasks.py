"""Thin, idempotent tasks: ids in, the runner does the work; a redelivered task finds the job claimed."""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task
from celery.exceptions import Reject

from ortune.queue import ADVANCE_SEARCH, DISPATCH, RUN_JOB, RUN_RANK
from ortune.settings import get_settings
from worker import distributed, runner, scheduler, search
from worker.attempt import DRAINING

log = logging.getLogger(__name__)


@shared_task(name=RUN_JOB, acks_late=True, ignore_result=True)
def run_job(job_id: str) -> None:
    if DRAINING.is_set():  # shutting down: leave the message to another worker
        raise Reject("this worker is shutting down", requeue=True)
    outcome = runner.run(get_settings(), job_id)
    log.info("job %s: %s", job_id, outcome)


@shared_task(name=ADVANCE_SEARCH, acks_late=True, ignore_result=True)
def advance_search(job_id: str) -> None:
    outcome = search.advance(get_settings(), job_id)
    log.info("search %s: %s", job_id, outcome)


@shared_task(name=DISPATCH, acks_late=True, ignore_result=True)
def dispatch(job_id: str) -> None:
    started = scheduler.dispatch(get_settings())
    log.info("dispatch (nudged by %s): started %s", job_id, started or "nothing")


@shared_task(name=RUN_RANK, acks_late=True, ignore_result=True)
def run_rank(task: dict[str, Any]) -> None:
    outcome = distributed.run_rank(get_settings(), task)
    log.info("job %s node rank %s: %s", task.get("job_id"), task.get("node_rank"), outcome)

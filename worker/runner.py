"""Run one attempt of a single-process job: claim it, stage data, model and resume point, run the trainer,
write the outcome back (worker/attempt.py, staging.py, trainer_process.py). A multi-process job's nodes run
theirs through worker/distributed.py."""

from __future__ import annotations

import logging
import sys

from ortune.db.models import JobStatus
from ortune.settings import Settings
from worker import attempt
from worker.attempt import Heartbeat, Outcome
from worker.staging import stage, store_of
from worker.trainer_process import TrainerProcess

log = logging.getLogger(__name__)


def run(settings: Settings, job_id: str) -> str:
    claimed = attempt.claim(settings, job_id)
    if claimed is None:
        return f"not claimed (status {attempt.status_of(settings, job_id)})"
    job = claimed.job
    heartbeat = Heartbeat(settings, job.id, job.attempt)
    heartbeat.start()
    try:
        store = store_of(settings)
        spec = stage(settings, store, job, claimed.train, claimed.valid)
        outcome = TrainerProcess(settings, store, job, spec).run()
    except Exception as exc:
        log.exception("job %s failed in the worker", job_id)
        outcome = Outcome.worker_error(exc)
    finally:
        heartbeat.stop()
    attempt.finish(settings, job, outcome)
    attempt.release(settings, job, settings.node_name, 0 if outcome.status == JobStatus.succeeded else 1)
    return outcome.status.value if outcome.status else "superseded"


if __name__ == "__main__":  # run one job by hand: python -m worker.runner ftjob-...
    from ortune.settings import get_settings

    logging.basicConfig(level=logging.INFO)
    print(run(get_settings(), sys.argv[1]))

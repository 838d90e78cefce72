"""Run one attempt of a single-process job: claim it, stage its stores, model and resume point, tokenize what
no one has yet, run the trainer, write the outcome back and clear the attempt's disk (worker/attempt.py,
staging.py, stores.py, trainer_process.py). A multi-process job's nodes run theirs through
worker/distributed.py."""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
from pathlib import Path

from sqlalchemy.exc import OperationalError

from ortune.db.models import Job, JobStatus
from ortune.db.repositories import EventRepository
from ortune.db.session import session_scope
from ortune.settings import Settings
from ortune.storage import ObjectStore, StorageUnavailable
from trainer_core.data import datastore
from worker import attempt, stores
from worker.attempt import Heartbeat, Outcome
from worker.staging import FileMissing, Staged, attempt_dir, stage, store_of
from worker.trainer_process import TrainerProcess

log = logging.getLogger(__name__)


def run(settings: Settings, job_id: str) -> str:
    claimed = attempt.claim(settings, job_id)
    if claimed is None:
        return f"not claimed (status {attempt.status_of(settings, job_id)})"
    job = claimed.job
    heartbeat = Heartbeat(settings, job.id, job.attempt)
    heartbeat.start()
    staged: Staged | None = None
    try:
        store = store_of(settings)
        staged = stage(settings, store, job, claimed.train, claimed.valid)
        outcome = tokenize(settings, store, job, staged, claimed.device_env)
        if outcome.status == JobStatus.running:
            outcome = TrainerProcess(settings, store, job, staged.spec, env=claimed.device_env).run()
        keep_built(settings, store, job, staged)  # the stores the trainer built as it started
    except OperationalError:
        # The database stayed away past the relay's patience: like a lost heartbeat, not a failed job. The
        # trainer is already dead; once the database is back the sweep requeues the job (its heartbeat
        # stopped) and frees the device.
        log.warning("job %s: lost the database; its attempt is left to the sweep", job_id, exc_info=True)
        heartbeat.stop()
        clear(settings, attempt_dir(settings, job), staged)
        return "lost"
    except StorageUnavailable as exc:  # a model or a tokenized store; the trainer is dead already
        heartbeat.stop()
        clear(settings, attempt_dir(settings, job), staged)
        return attempt.requeue_unstorable(settings, job, exc, "this attempt's output")
    except FileMissing as exc:
        outcome = Outcome.failed("file_missing", str(exc))
    except Exception as exc:
        log.exception("job %s failed in the worker", job_id)
        outcome = Outcome.worker_error(exc)
    finally:
        heartbeat.stop()
    attempt.finish(settings, job, outcome)
    attempt.release(settings, job, settings.node_name, 0 if outcome.status == JobStatus.succeeded else 1)
    clear(settings, attempt_dir(settings, job), staged)
    return outcome.status.value if outcome.status else "superseded"


def tokenize(
    settings: Settings, store: ObjectStore, job: Job, staged: Staged, env: dict[str, str] | None = None
) -> Outcome:
    """Build the stores nobody has made yet with `trainer_core.data.prepare` (progress relayed) and keep them
    in object storage for every later attempt, trial, rank and job. `running` when training can go on."""
    if not staged.to_build or staged.in_trainer:
        return Outcome(JobStatus.running)
    outcome = TrainerProcess(settings, store, job, staged.spec, env=env, prepare=True).run()
    if outcome.status == JobStatus.running:
        keep_built(settings, store, job, staged)
    return outcome


def keep_built(settings: Settings, store: ObjectStore, job: Job, staged: Staged) -> None:
    """Upload each store this attempt built that is whole, once."""
    workdir = Path(staged.spec.output_dir).parent
    for built in [s for s in staged.to_build if datastore.is_whole(s.path)]:
        staged.to_build.remove(built)
        size = stores.keep(store, built, workdir)
        with session_scope(settings.database_url) as session:
            EventRepository(session).add(
                job.id,
                f"Stored the tokenized {built.file.filename} for later attempts and jobs ({size:,} bytes)",
                data={"store": built.key, "bytes": size, "phase": "tokenizing"},
            )


def clear(settings: Settings, workdir: Path, staged: Staged | None) -> None:
    """The attempt's files are stored (or the attempt is over): free the disk, and keep the node's cache of
    stores within its bound."""
    shutil.rmtree(workdir, ignore_errors=True)
    for parent in workdir.parents:  # the job's folder too, once no attempt or node of it is left
        if parent == settings.job_work_dir or not parent.is_relative_to(settings.job_work_dir):
            break
        with contextlib.suppress(OSError):
            parent.rmdir()
    in_use = {
        Path(p) for p in ((staged.spec.train_store, staged.spec.validation_store) if staged else ()) if p
    }
    if staged and staged.spec.model_path and Path(staged.spec.model_path).is_relative_to(settings.cache_dir):
        in_use.add(Path(staged.spec.model_path).parent)  # an ft: base: <cache>/models/<sha256>/pytorch
    for name in stores.evict(settings, in_use):
        log.info("evicted %s from this node's cache", name)


if __name__ == "__main__":  # run one job by hand: python -m worker.runner ftjob-...
    from ortune.settings import get_settings

    logging.basicConfig(level=logging.INFO)
    print(run(get_settings(), sys.argv[1]))

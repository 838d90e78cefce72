"""Run one attempt of a job: claim it, stage data, model and the checkpoint to resume from, launch
trainer_core, relay its events, store the results.

The body is keyed by the job's status and attempt: only a `queued` job is claimed (compare-and-set to
`running`, attempt + 1), so a redelivered task finds nothing to do, and every later write names the attempt,
so a worker the sweep gave up on cannot overwrite the attempt that replaced it. A heartbeat thread beats
while the attempt lives. The training process runs in its own process group and dies with this one
(PR_SET_PDEATHSIG): a cancel kills all of it, a pause asks it (SIGTERM) to checkpoint and exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ortune.db.base import new_id, utcnow
from ortune.db.models import Artifact, Assignment, Checkpoint, File, Job, JobStatus, Node
from ortune.db.repositories import ArtifactRepository, CheckpointRepository, EventRepository, JobRepository
from ortune.db.session import session_scope
from ortune.nodes import NodeRepository
from ortune.queue import enqueue_for, enqueue_search, on_commit
from ortune.settings import Settings
from ortune.storage import ObjectStore, open_store, sha256_file
from trainer_core import registry, rows
from trainer_core.spec import ResolvedHyperparameters, TrainingSpec
from worker.relay import Relay, reader

log = logging.getLogger(__name__)
WORKER = f"{os.uname().nodename}:{os.getpid()}"
# Set when this worker is asked to shut down (SIGTERM: a deploy, a node drain): the running attempt
# checkpoints and is requeued, for this or another worker to continue, instead of holding the shutdown.
DRAINING = threading.Event()
STOPPED_ON_REQUEST = 3  # trainer_core.launch's exit status after a SIGTERM: checkpointed and stopped


@dataclass
class Outcome:
    # None: the attempt was superseded (the sweep requeued the job); nothing of it is written back.
    status: JobStatus | None
    error: dict[str, Any] | None = None


def _die_with_parent() -> None:
    """In the trainer's child: a SIGKILLed worker takes its trainer with it (no orphan holding a GPU)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


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
                    session.execute(
                        update(Job)
                        .where(Job.id == self.job_id, Job.attempt == self.attempt, Job.worker == WORKER)
                        .values(heartbeat_at=utcnow())
                    )
            except Exception:  # the database is down: the next beat tries again
                log.warning("heartbeat of %s failed", self.job_id, exc_info=True)

    def stop(self) -> None:
        self.stopped.set()


def _store(settings: Settings) -> ObjectStore:
    return open_store(
        settings.storage_url,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key,
        region=settings.s3_region,
    )


def _pack(directory: Path, archive: Path) -> tuple[int, str]:
    with tarfile.open(archive, "w") as tar:
        tar.add(directory, arcname=directory.name)
    return archive.stat().st_size, sha256_file(archive)


def _claim(settings: Settings, job_id: str) -> tuple[Job, File, File | None] | None:
    with session_scope(settings.database_url) as session:
        jobs = JobRepository(session)
        job = jobs.get(job_id, for_update=True)
        if job is None or job.status != JobStatus.queued or job.world_size > 1:
            return None  # a multi-process job is the scheduler's (worker/scheduler.py)
        attempt = job.attempt + 1
        if not jobs.transition(
            job_id,
            JobStatus.running,
            only_from=[JobStatus.queued],
            attempt=attempt,
            started_at=job.started_at or utcnow(),
            heartbeat_at=utcnow(),
            worker=WORKER,
        ):
            return None
        if not _take_device(session, settings, job_id, attempt):
            session.rollback()  # stays queued; the sweep sends it again once a device is free
            jobs.update(job_id, enqueued_at=None)
            return None
        EventRepository(session).add(
            job_id,
            f"Attempt {attempt} started on worker {WORKER}",
            data={"attempt": attempt, "worker": WORKER},
        )
        session.refresh(job)
        train = session.get(File, job.training_file_id)
        valid = session.get(File, job.validation_file_id) if job.validation_file_id else None
        assert train is not None
        return job, train, valid


def _take_device(session: Session, settings: Settings, job_id: str, attempt: int) -> bool:
    """Account for the device this attempt uses on this worker's node, so the scheduler does not place
    a multi-process job's rank on it meanwhile. False when every device of the node is held."""
    node = session.get(Node, settings.node_name)
    if node is None:  # not a registered node (a job run by hand): nothing to account for
        return True
    taken = {a.device for a in NodeRepository(session).live_assignments([node.name])}
    free = [d for d in range(node.devices) if d not in taken]
    if not free:
        return False
    try:
        with session.begin_nested():
            session.add(
                Assignment(job_id=job_id, attempt=attempt, node_name=node.name, node_rank=0, device=free[0])
            )
    except IntegrityError:  # the scheduler gave it away a moment ago
        return False
    return True


def _stage(
    settings: Settings,
    store: ObjectStore,
    job: Job,
    train: File,
    valid: File | None,
    workdir: Path | None = None,
    *,
    upload_spec: bool = True,
) -> TrainingSpec:
    """Download data, model and resume point into the attempt's folder; `upload_spec` is False on the
    nodes of a multi-process job other than rank 0's, which speaks for the job."""
    workdir = workdir or settings.job_work_dir / job.id / f"attempt-{job.attempt}"
    data = workdir / "data"
    fmt = rows.file_format(train.object_key) or "jsonl"
    store.get_to_path(train.object_key, data / f"train.{fmt}")
    vfmt = rows.file_format(valid.object_key) or "jsonl" if valid else "jsonl"
    if valid is not None:
        store.get_to_path(valid.object_key, data / f"valid.{vfmt}")
    model = registry.resolve(job.model, settings.models_dir)
    resume_from = _resume_point(settings, store, job, workdir, lead=upload_spec)
    s = job.spec
    spec = TrainingSpec(
        job_id=job.id,
        task=s["task"],
        model=job.model,
        model_path=str(model.path) if model.path else None,
        train_file=str(data / f"train.{fmt}"),
        train_format=fmt,
        validation_file=str(data / f"valid.{vfmt}") if valid else None,
        validation_format=vfmt,
        labels=s["labels"],
        output_dir=str(workdir / "out"),
        hyperparameters=ResolvedHyperparameters(**s["resolved_hyperparameters"]),
        backend=s["backend"],
        optim=s["optim"],
        precision=s["precision"],
        seed=job.seed,
        checkpoint_every_steps=s.get("checkpoint_every_steps"),
        distributed=s["distributed"],
        resume_from=resume_from,
        distributed_timeout_seconds=settings.distributed_timeout_seconds,
    )
    spec.dump(workdir / "spec.json")
    if upload_spec:
        store.put_path(f"jobs/{job.id}/spec.json", workdir / "spec.json")
    return spec


def trainer_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _resume_point(
    settings: Settings, store: ObjectStore, job: Job, workdir: Path, *, lead: bool = True
) -> str | None:
    """Fetch the job's latest complete checkpoint (model, optimizer, scheduler, RNG, step) to resume from.

    A multi-process job's checkpoint is complete when every other node has added its part; every node
    unpacks all of them into one directory, as the Trainer (and DeepSpeed) expect."""
    nodes = int(job.spec.get("distributed", {}).get("nodes", 1))
    with session_scope(settings.database_url) as session:
        complete = [
            c for c in CheckpointRepository(session).newest_first(job.id) if len(c.parts or []) >= nodes - 1
        ]
        if not complete:
            if job.attempt > 1 and lead:
                EventRepository(session).add(job.id, "No checkpoint stored yet: this attempt starts over")
            return None
        step, keys = complete[0].step, [complete[0].object_key, *(complete[0].parts or [])]
    target = workdir / "resume"
    for n, key in enumerate(keys):
        archive = workdir / f"resume-{n}.tar"
        store.get_to_path(key, archive)
        with tarfile.open(archive) as tar:
            tar.extractall(target, filter="data")  # refuses absolute paths, links out and device files
        archive.unlink()
    found = next(target.glob("checkpoint-*"), None)
    if found is None:
        raise RuntimeError(f"checkpoint archive {keys[0]} holds no checkpoint-* directory")
    if lead:
        with session_scope(settings.database_url) as session:
            EventRepository(session).add(
                job.id,
                f"Resuming from the checkpoint at step {step} (attempt {job.attempt})",
                data={"resumed_from_step": step, "attempt": job.attempt},
            )
    return str(found)


def _signal(proc: subprocess.Popen[Any], sig: signal.Signals) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)


class Execution:
    """One attempt's subprocess and the handling of what it reports."""

    def __init__(
        self,
        settings: Settings,
        store: ObjectStore,
        job: Job,
        spec: TrainingSpec,
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
        abort_when: Callable[[], str | None] | None = None,
        stop: Callable[[subprocess.Popen[str]], None] | None = None,
    ) -> None:
        self.settings, self.store, self.job, self.spec = settings, store, job, spec
        self.workdir = Path(spec.output_dir).parent
        self.command = command or [
            settings.trainer_python,
            "-m",
            "trainer_core.launch",
            str(self.workdir / "spec.json"),
        ]
        self.extra_env = env or {}
        # Checked at every flush; a reason stops the trainer and fails the attempt (another node failed).
        self.abort_when = abort_when
        # How to ask the trainer to checkpoint and stop (a pause, a drain): SIGTERM to its process group.
        self.stop = stop or (lambda proc: _signal(proc, signal.SIGTERM))
        self.relay = Relay(settings.database_url, job.id, job.attempt)
        self.artifacts: set[str] = set()
        self.result: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.drained = False
        self.stopped_at: int | None = None  # the step the trainer stopped at on request, once it says so

    def run(self) -> Outcome:
        log_path = self.workdir / "trainer.log"
        env = {**trainer_env(), **self.extra_env}
        with log_path.open("w") as log_file:
            proc = subprocess.Popen(
                self.command,
                stdout=subprocess.PIPE,
                stderr=log_file,
                text=True,
                env=env,
                start_new_session=True,
                cwd=self.workdir,
                preexec_fn=_die_with_parent,
            )
            assert proc.stdout is not None
            events: queue.Queue[dict[str, Any] | None] = queue.Queue()
            thread = reader(proc.stdout, events, log_file)
            stopped = self._pump(proc, events)
            thread.join(timeout=5)
            code = proc.wait()
        status = self.relay.flush()
        if stopped is not None:
            return stopped
        if status == JobStatus.cancelled:
            return Outcome(JobStatus.cancelled)
        if status != JobStatus.running and status != JobStatus.paused:
            return Outcome(None)
        if code == 0 and self.result is not None and {"pytorch", "onnx"} <= self.artifacts:
            return Outcome(JobStatus.succeeded)  # finished before a pause could stop it
        stopped_here = code == STOPPED_ON_REQUEST or self.stopped_at is not None
        if stopped_here and self.drained and status == JobStatus.running:
            return Outcome(JobStatus.queued)
        if stopped_here or status == JobStatus.paused:
            return Outcome(JobStatus.paused)
        if self.error is None:
            tail = "".join(deque(log_path.open(errors="replace"), maxlen=6)).strip()
            self.error = {
                "code": "trainer_crashed",
                "message": f"the training process exited with code {code}; last log lines: {tail[-800:]}",
            }
        return Outcome(JobStatus.failed, self.error)

    def _pump(
        self, proc: subprocess.Popen[str], events: queue.Queue[dict[str, Any] | None]
    ) -> Outcome | None:
        """Relay events until the trainer exits. Each flush reads the job's status back: cancelled kills
        the trainer at once, paused asks it to checkpoint and exit, and a job no longer running (requeued
        after this worker was given up for lost) is killed. Returns the outcome when it ended early."""
        last_flush = time.monotonic()
        stop_deadline: float | None = None
        done = False
        while not done:
            try:
                event = events.get(timeout=self.settings.event_flush_seconds)
                if event is None:
                    done = True
                else:
                    self._handle(event)
            except queue.Empty:
                pass
            due = time.monotonic() - last_flush >= self.settings.event_flush_seconds
            if done or due or len(self.relay.batch) >= self.settings.event_batch_size:
                status = self.relay.flush()
                last_flush = time.monotonic()
                if status == JobStatus.cancelled:
                    _signal(proc, signal.SIGKILL)
                    return Outcome(JobStatus.cancelled)
                if status not in (JobStatus.running, JobStatus.paused):
                    _signal(proc, signal.SIGKILL)
                    return Outcome(None)
                if self.abort_when is not None and (reason := self.abort_when()):
                    _signal(proc, signal.SIGKILL)
                    return Outcome(JobStatus.failed, {"code": "rank_failed", "message": reason})
                draining = DRAINING.is_set()
                if (status == JobStatus.paused or draining) and stop_deadline is None:
                    self.stop(proc)  # checkpoint, then exit; its events keep coming
                    stop_deadline = time.monotonic() + self.settings.pause_grace_seconds
                    self.drained = draining
                    if draining:
                        self.relay.message(
                            f"Worker {WORKER} is shutting down: checkpointing to go on elsewhere"
                        )
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                self.relay.message("the trainer did not checkpoint in time; stopped it", level="warn")
                _signal(proc, signal.SIGKILL)
                stop_deadline = float("inf")
        return None

    def _handle(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "checkpoint":
            self._upload_checkpoint(event)
        elif kind == "artifact":
            self._upload_artifact(event)
        elif kind == "result":
            self.result = event
            self.relay.batch.job |= {
                "result": {
                    "metrics": event.get("metrics"),
                    "onnx_max_abs_diff": event.get("onnx_max_abs_diff"),
                },
                "trained_tokens": event.get("trained_tokens"),
            }
        elif kind == "stopped":
            self.stopped_at = int(event.get("step") or 0)
            self.relay.message(
                f"Training stopped on request at step {self.stopped_at}, after saving its checkpoint",
                data={"step": self.stopped_at},
            )
        elif kind == "error":
            self.error = {
                "code": str(event.get("code", "training_error")),
                "message": str(event.get("message")),
            }
            self.relay.message(f"Training failed: {self.error['message']}", level="error")
        else:
            self.relay.add(event)

    def _upload_checkpoint(self, event: dict[str, Any]) -> None:
        path, step = Path(str(event["path"])), int(event["step"])
        if not path.is_dir():
            self.relay.message(f"checkpoint at step {step} was rotated away before upload", level="warn")
            return
        # Events up to the checkpoint go in first: what the database shows never lags a stored checkpoint,
        # so after a lost attempt the events say exactly which steps the next attempt redoes.
        self.relay.flush()
        archive = self.workdir / f"checkpoint-{step}.tar"
        size, digest = _pack(path, archive)
        key = f"jobs/{self.job.id}/checkpoints/step-{step}.tar"
        self.store.put_path(key, archive)
        archive.unlink()
        metrics = {k: v for k, v in (event.get("metrics") or {}).items() if isinstance(v, int | float)}
        with session_scope(self.settings.database_url) as session:
            CheckpointRepository(session).add(
                Checkpoint(
                    id=new_id("ftckpt"),
                    job_id=self.job.id,
                    step=step,
                    object_key=key,
                    bytes=size,
                    sha256=digest,
                    metrics=metrics,
                )
            )
        self.relay.message(f"Checkpoint at step {step} stored ({size:,} bytes)", data={"step": step})

    def _upload_artifact(self, event: dict[str, Any]) -> None:
        fmt, path = str(event["format"]), Path(str(event["path"]))
        archive = self.workdir / f"{fmt}.tar"
        size, digest = _pack(path, archive)
        key = f"jobs/{self.job.id}/artifacts/{fmt}.tar"
        self.store.put_path(key, archive)
        archive.unlink()
        with session_scope(self.settings.database_url) as session:
            ArtifactRepository(session).put(
                Artifact(
                    job_id=self.job.id,
                    format=fmt,
                    object_key=key,
                    bytes=size,
                    sha256=digest,
                    manifest=event.get("manifest") or {},
                )
            )
        self.artifacts.add(fmt)
        self.relay.message(f"Stored the {fmt} model ({size:,} bytes, sha256 {digest[:12]}…)")


def _finish(settings: Settings, job: Job, outcome: Outcome) -> None:
    with session_scope(settings.database_url) as session:
        jobs, events = JobRepository(session), EventRepository(session)
        running, attempt = [JobStatus.running], job.attempt
        if outcome.status is None:
            events.add(
                job.id,
                f"Attempt {attempt} on {WORKER} stopped: the job moved on without it (requeued or ended)",
            )
            return
        if outcome.status == JobStatus.succeeded:
            name = f"ft:{job.model}:{job.suffix or 'ortune'}:{job.id}"
            if jobs.transition(
                job.id,
                JobStatus.succeeded,
                only_from=[JobStatus.running, JobStatus.paused],
                on_attempt=attempt,
                finished_at=utcnow(),
                fine_tuned_model=name,
                worker=None,
            ):
                events.add(job.id, f"The job has successfully completed: {name}")
        elif outcome.status == JobStatus.failed:
            if jobs.transition(
                job.id,
                JobStatus.failed,
                only_from=running,
                on_attempt=attempt,
                finished_at=utcnow(),
                error=outcome.error,
                worker=None,
            ):
                events.add(job.id, f"The job failed: {(outcome.error or {}).get('message')}", level="error")
        elif outcome.status == JobStatus.queued:  # this worker is shutting down; the job goes on elsewhere
            latest = CheckpointRepository(session).latest(job.id)
            if jobs.transition(
                job.id, JobStatus.queued, only_from=running, on_attempt=attempt, worker=None, enqueued_at=None
            ):
                where = f"the checkpoint at step {latest.step}" if latest else "the start"
                events.add(
                    job.id,
                    f"Requeued from {where}: worker {WORKER} shut down",
                    data={"checkpoint_step": latest.step if latest else None},
                )
                job_id, send = job.id, enqueue_for(job)
                on_commit(session, lambda: send(settings, job_id))
        elif outcome.status == JobStatus.paused:
            latest = CheckpointRepository(session).latest(job.id)
            where = f"the checkpoint at step {latest.step}" if latest else "the start (no checkpoint yet)"
            if jobs.transition(
                job.id, JobStatus.paused, only_from=[JobStatus.paused], on_attempt=attempt, worker=None
            ):
                events.add(
                    job.id,
                    f"Paused; the worker is free. Resume continues from {where}",
                    data={"checkpoint_step": latest.step if latest else None},
                )
        else:
            jobs.transition(
                job.id, JobStatus.cancelled, only_from=[JobStatus.cancelled], on_attempt=attempt, worker=None
            )
            events.add(job.id, "Training stopped after the job was cancelled")
        if job.parent_id is not None:
            parent = job.parent_id
            on_commit(session, lambda: enqueue_search(settings, parent))


def run(settings: Settings, job_id: str) -> str:
    claimed = _claim(settings, job_id)
    if claimed is None:
        with session_scope(settings.database_url) as session:
            status = session.scalar(select(Job.status).where(Job.id == job_id))
        return f"not claimed (status {status})"
    job, train, valid = claimed
    heartbeat = Heartbeat(settings, job.id, job.attempt)
    heartbeat.start()
    try:
        store = _store(settings)
        spec = _stage(settings, store, job, train, valid)
        outcome = Execution(settings, store, job, spec).run()
    except Exception as exc:
        log.exception("job %s failed in the worker", job_id)
        outcome = Outcome(
            JobStatus.failed, {"code": "worker_error", "message": f"{type(exc).__name__}: {exc}"}
        )
    finally:
        heartbeat.stop()
    _finish(settings, job, outcome)
    with session_scope(settings.database_url) as session:
        code = 0 if outcome.status == JobStatus.succeeded else 1
        NodeRepository(session).release(job.id, job.attempt, settings.node_name, exit_code=code)
    return outcome.status.value if outcome.status else "superseded"


if __name__ == "__main__":  # run one job by hand: python -m worker.runner ftjob-...
    from ortune.settings import get_settings

    logging.basicConfig(level=logging.INFO)
    print(run(get_settings(), sys.argv[1]))

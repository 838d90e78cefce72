"""The trainer subprocess of an attempt: launching it, relaying its events, storing what it reports, and
the signals that stop it.

The trainer runs in its own process group and dies with this worker (PR_SET_PDEATHSIG): a cancel kills all
of it, a pause or a drain asks it (SIGTERM) to checkpoint and exit. Each flush of its events reads the job's
status back, so a cancel or a pause reaches the trainer within `event_flush_seconds`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from ortune.db.base import new_id
from ortune.db.models import Artifact, Checkpoint, Job, JobStatus
from ortune.db.repositories import ArtifactRepository, CheckpointRepository, JobRepository
from ortune.db.session import session_scope
from ortune.settings import Settings
from ortune.storage import ObjectStore, StorageUnavailable, pack_dir
from trainer_core.contract import EXIT_STOPPED, die_with_parent, log_tail
from trainer_core.spec import TrainingSpec
from worker import integrations, retention
from worker.attempt import DRAINING, WORKER, Outcome
from worker.memory import MemoryWatch
from worker.relay import Relay, reader
from worker.staging import trainer_env

log = logging.getLogger(__name__)


def attempt_prefix(job: Job) -> str:
    """Where an attempt's objects go: one attempt never overwrites another's, even a superseded one that is
    still running somewhere."""
    return f"jobs/{job.id}/attempt-{job.attempt}"


def signal_group(proc: subprocess.Popen[Any], sig: signal.Signals) -> None:
    """Send `sig` to the process group of a child that is still running."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)


def launch(
    command: list[str], *, cwd: Path, env: dict[str, str], stdout: Any, stderr: Any
) -> subprocess.Popen[str]:
    """Start a trainer (or torchrun) in a process group of its own that dies with this worker."""
    return subprocess.Popen(
        command,
        stdout=stdout,
        stderr=stderr,
        text=True,
        env={**trainer_env(), **env},
        start_new_session=True,
        cwd=cwd,
        preexec_fn=die_with_parent,
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


class TrainerProcess:
    """One attempt's subprocess and the handling of what it reports: the trainer, or before it
    (`prepare=True`) `trainer_core.data.prepare` tokenizing the job's files."""

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
        *,
        prepare: bool = False,
    ) -> None:
        self.settings, self.store, self.job, self.spec = settings, store, job, spec
        self.workdir = Path(spec.output_dir).parent
        self.prepare = prepare
        entry = "trainer_core.data.prepare" if prepare else "trainer_core.engine.launch"
        self.command = command or [settings.trainer_python, "-m", entry, str(self.workdir / "spec.json")]
        self.phase = "tokenizing" if prepare else "starting"
        self.peak_memory = 0
        self.extra_env = env or {}
        # Checked at every flush; a reason stops the trainer and fails the attempt (another node failed).
        self.abort_when = abort_when
        # How to ask the trainer to checkpoint and stop (a pause, a drain): SIGTERM to its process group.
        self.stop = stop or (lambda proc: signal_group(proc, signal.SIGTERM))
        self.relay = Relay(
            settings.database_url, job.id, job.attempt, patience_s=settings.heartbeat_timeout_seconds / 2
        )
        # the job's MLflow runs (rank 0's node only: the one that relays and stores); none while tokenizing
        self.tracking = [] if prepare else integrations.runs_for(job, self.relay)
        self.artifacts: set[str] = set()
        self.result: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.drained = False
        self.stopped_at: int | None = None  # the step the trainer stopped at on request, once it says so

    def run(self) -> Outcome:
        for run in self.tracking:
            run.start()
        outcome = self._run()
        for run in self.tracking:
            run.end(outcome.status)
        return outcome

    def _run(self) -> Outcome:
        log_path = self.workdir / ("prepare.log" if self.prepare else "trainer.log")
        limit = self.settings.trainer_memory_bytes
        with log_path.open("w") as log_file:
            proc = launch(
                self.command, cwd=self.workdir, env=self.extra_env, stdout=subprocess.PIPE, stderr=log_file
            )
            watch = MemoryWatch(proc.pid, limit)
            watch.start()
            assert proc.stdout is not None
            events: queue.Queue[dict[str, Any] | None] = queue.Queue()
            thread = reader(proc.stdout, events, log_file)
            try:
                stopped = self._pump(proc, events)
            except BaseException:
                # whatever failed here (the database gone past the relay's patience, storage refusing a
                # write), the trainer and its whole group go first: never a trainer orphaned on the device
                signal_group(proc, signal.SIGKILL)
                proc.wait()
                watch.stop()
                raise
            thread.join(timeout=5)
            code = proc.wait()
            self.peak_memory = watch.stop()
        self._report_memory(watch.exceeded, limit)
        status = self.relay.flush()
        if stopped is not None:
            return stopped
        return self._outcome(status, code, log_path)

    def _report_memory(self, exceeded: bool, limit: int) -> None:
        who, peak = "tokenizer" if self.prepare else "trainer", self.peak_memory
        figures = {"peak_bytes": peak, "limit_bytes": limit, "phase": self.phase}
        if not exceeded:
            self.relay.message(
                f"Peak private memory of the {who}: {_mib(peak)} (limit {_mib(limit)})", data=figures
            )
            return
        self.error = {
            "code": "out_of_memory",
            "message": f"the {who} went over its memory limit of {_mib(limit)} (peak {_mib(peak)}) while "
            f"{self.phase}; raise ORTUNE_TRAINER_MEMORY_LIMIT, or lower batch_size or max_seq_length",
            **figures,
        }

    def _outcome(self, status: JobStatus | None, code: int, log_path: Path) -> Outcome:
        if status == JobStatus.cancelled:
            return Outcome(JobStatus.cancelled)
        if status != JobStatus.running and status != JobStatus.paused:
            return Outcome(None)
        if self.error is not None and self.error["code"] == "out_of_memory":
            return Outcome(JobStatus.failed, self.error)
        if self.prepare and code == 0:
            return Outcome(JobStatus.running)  # the stores are built: go on to train
        if self.prepare and self.drained and status == JobStatus.running:
            return Outcome(JobStatus.queued)
        if code == 0 and self.result is not None and self._artifacts_accounted():
            return Outcome(JobStatus.succeeded)  # finished before a pause could stop it
        stopped_here = code == EXIT_STOPPED or self.stopped_at is not None
        if stopped_here and self.drained and status == JobStatus.running:
            return Outcome(JobStatus.queued)
        if stopped_here or status == JobStatus.paused:
            return Outcome(JobStatus.paused)
        if self.error is not None:
            return Outcome(JobStatus.failed, self.error)
        tail = log_tail(log_path, lines=6)
        what = "tokenizing" if self.prepare else "training"
        if code < 0:
            name = signal.Signals(-code).name
            oom = " (the kernel's OOM killer sends SIGKILL when memory runs out)" if name == "SIGKILL" else ""
            return Outcome.failed(
                "trainer_killed",
                f"the {what} process was killed by {name}{oom} while {self.phase}; last log lines: {tail}",
            )
        return Outcome.failed(
            "trainer_crashed",
            f"the {what} process exited with code {code} while {self.phase}; last log lines: {tail}",
        )

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
                for run in self.tracking:
                    run.flush()
                last_flush = time.monotonic()
                if (ended := self._ended(proc, status)) is not None:
                    return ended
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
                signal_group(proc, signal.SIGKILL)
                stop_deadline = float("inf")
        return None

    def _ended(self, proc: subprocess.Popen[str], status: JobStatus | None) -> Outcome | None:
        """Kill the trainer when the job ended without it (cancelled, moved on, another node failed)."""
        if status == JobStatus.cancelled:
            outcome = Outcome(JobStatus.cancelled)
        elif status not in (JobStatus.running, JobStatus.paused):
            outcome = Outcome(None)
        elif self.abort_when is not None and (reason := self.abort_when()):
            outcome = Outcome.failed("rank_failed", reason)
        else:
            return None
        signal_group(proc, signal.SIGKILL)
        return outcome

    def _handle(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "phase":
            self.phase = str(event.get("name"))
        elif kind in ("metrics", "progress"):
            if self.phase.startswith("training") and event.get("step"):
                self.phase = f"training step {event['step']}"
            self.relay.add(event)
            for run in self.tracking:
                run.add(event)
        elif kind == "checkpoint":
            self._upload_checkpoint(event)
        elif kind == "artifact":
            self._upload_artifact(event)
        elif kind == "result":
            self.result = event
            self.relay.batch.job |= {
                "result": {
                    "metrics": event.get("metrics"),
                    "onnx_max_abs_diff": event.get("onnx_max_abs_diff"),
                    "failed_artifacts": event.get("failed_artifacts") or {},
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

    def _artifacts_accounted(self) -> bool:
        """The PyTorch model is stored, and the ONNX one is stored or its export failed with a reason."""
        failed = set((self.result or {}).get("failed_artifacts") or {})
        return "pytorch" in self.artifacts and "onnx" in self.artifacts | failed

    def _store_dir(self, path: Path, name: str, key: str) -> tuple[int, str]:
        archive = self.workdir / f"{name}.tar"
        size, digest = pack_dir(path, archive)
        self.store.put_path(key, archive)
        archive.unlink()
        return size, digest

    def _upload_checkpoint(self, event: dict[str, Any]) -> None:
        path, step = Path(str(event["path"])), int(event["step"])
        if not path.is_dir():
            self.relay.message(f"checkpoint at step {step} is missing from the work directory", level="warn")
            return
        try:
            self._store_checkpoint(path, step, event)
        finally:  # stored or not, the trainer never reads it again: the disk holds only what is queued
            shutil.rmtree(path, ignore_errors=True)

    def _store_checkpoint(self, path: Path, step: int, event: dict[str, Any]) -> None:
        # Events up to the checkpoint go in first: what the database shows never lags a stored checkpoint,
        # so after a lost attempt the events say exactly which steps the next attempt redoes.
        self.relay.flush()
        key = f"{attempt_prefix(self.job)}/checkpoints/step-{step}.tar"
        try:
            size, digest = self._store_dir(path, f"checkpoint-{step}", key)
        except StorageUnavailable as exc:  # a resume point missed, not a reason to stop training
            (self.workdir / f"checkpoint-{step}.tar").unlink(missing_ok=True)
            self.relay.message(
                f"Checkpoint at step {step} could not be stored ({exc}); training goes on, the next "
                "checkpoint is tried",
                level="warn",
                data={"step": step},
            )
            return
        metrics = {k: v for k, v in (event.get("metrics") or {}).items() if isinstance(v, int | float)}
        checkpoint = Checkpoint(
            id=new_id("ftckpt"),
            job_id=self.job.id,
            step=step,
            object_key=key,
            bytes=size,
            sha256=digest,
            metrics=metrics,
        )
        if not self._record(
            f"checkpoint at step {step}", key, lambda s: CheckpointRepository(s).add(checkpoint)
        ):
            return
        self.relay.message(f"Checkpoint at step {step} stored ({size:,} bytes)", data={"step": step})
        self.relay.flush()  # the step's metrics are in before retention reads them
        retention.apply(self.settings, self.store, self.job)

    def _record(self, what: str, key: str, write: Callable[[Session], None]) -> bool:
        """Record a stored object (`write` adds its row) while this attempt is the job's live one (held so
        until the row is in); a superseded attempt records nothing and deletes the object. False then.

        The delete waits for the transaction's end: no transaction of the worker spans a storage call, which
        on SQLite would hold the deployment's one write lock, and on Postgres the job's row, for as long as
        storage takes (tests/worker/test_transactions.py)."""
        with session_scope(self.settings.database_url) as session:
            live = JobRepository(session).holds(self.job.id, self.job.attempt)
            if live:
                write(session)
        if not live:
            log.warning(
                "job %s: attempt %s was superseded; its %s is dropped", self.job.id, self.job.attempt, what
            )
            self.store.delete(key)
        return live

    def _upload_artifact(self, event: dict[str, Any]) -> None:
        fmt, path = str(event["format"]), Path(str(event["path"]))
        key = f"{attempt_prefix(self.job)}/artifacts/{fmt}.tar"
        size, digest = self._store_dir(path, fmt, key)
        artifact = Artifact(
            job_id=self.job.id,
            format=fmt,
            object_key=key,
            bytes=size,
            sha256=digest,
            manifest=event.get("manifest") or {},
        )
        if not self._record(f"{fmt} model", key, lambda s: ArtifactRepository(s).put(artifact)):
            return
        self.artifacts.add(fmt)
        self.relay.message(f"Stored the {fmt} model ({size:,} bytes, sha256 {digest[:12]}…)")
        for run in self.tracking:
            run.model(fmt, path)

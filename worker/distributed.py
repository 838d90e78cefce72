"""This worker's node, and its part of a multi-process job: one `torchrun` per assigned node.

Rank 0's node relays the job's events (only global rank 0 emits them), stores checkpoints and models and
sets the job's status, as a single-process attempt does. Every other node runs its ranks and watches the
job: a job that stops running (cancelled, failed on another node, requeued) kills its ranks. Each node
releases its devices when its ranks exit and records their exit code and, on failure, the end of its log,
so the job's error names the rank that failed first rather than the ranks that lost it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
from sqlalchemy.exc import OperationalError

from ortune.db.models import Job, JobStatus
from ortune.db.repositories import (
    CheckpointRepository,
    EventRepository,
    FileRepository,
    JobRepository,
    NodeRepository,
)
from ortune.db.session import session_scope
from ortune.settings import Settings
from ortune.storage import ObjectStore, StorageUnavailable, pack_dir
from trainer_core.contract import log_tail
from worker import attempt, runner
from worker.attempt import WORKER, Claimed, Heartbeat, Outcome
from worker.memory import MemoryWatch
from worker.staging import Staged, stage, store_of
from worker.trainer_process import TrainerProcess, attempt_prefix, launch, signal_group

log = logging.getLogger(__name__)
FIRST_FAILURE_WAIT_S = 15.0  # how long rank 0 waits for the other nodes to report how their ranks ended
STAGING_FAILED = -1  # the exit code a node records when it could not even start its ranks


def register(settings: Settings) -> None:
    """Record this worker's node and devices (CUDA GPUs through torch, else `node_devices` CPU slots)."""
    import torch

    gpus = torch.cuda.device_count()
    kind, devices = ("cuda", gpus) if gpus else ("cpu", 1)
    if settings.node_devices is not None:
        devices = settings.node_devices
    with session_scope(settings.database_url) as session:
        NodeRepository(session).register(
            settings.node_name,
            kind=kind,
            devices=devices,
            address=settings.node_address,
            queue=settings.node_queue,
            worker=WORKER,
        )
    log.info("node %s: %d %s device(s), queue %s", settings.node_name, devices, kind, settings.node_queue)


def _torchrun(settings: Settings, task: dict[str, Any], spec_path: Path) -> list[str]:
    return [
        settings.trainer_python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={task['nnodes']}",
        f"--nproc_per_node={task['nproc_per_node']}",
        f"--node_rank={task['node_rank']}",
        f"--master_addr={task['master_addr']}",
        f"--master_port={task['master_port']}",
        "--max_restarts=0",  # a failed rank fails the attempt; the sweep decides about another
        "-m",
        "trainer_core.engine.launch",
        str(spec_path),
    ]


def interface_of(address: str) -> str | None:
    """The network interface that holds `address`, or None."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    return None


def _sockets(settings: Settings) -> dict[str, str]:
    """Bind gloo's and NCCL's sockets to the interface of the node's address. Left alone, they take the
    address the hostname resolves to, which on many hosts (Debian's 127.0.1.1, a network namespace) is a
    loopback that the other nodes then try to reach: found by the two-host test (tests/e2e/test_hosts.py)."""
    interface = interface_of(settings.node_address)
    if interface is None:
        return {}
    return {var: os.environ.get(var, interface) for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}


def _env(settings: Settings, task: dict[str, Any]) -> dict[str, str]:
    devices = ",".join(str(d) for d in task["devices"])
    return _sockets(settings) | {
        "CUDA_VISIBLE_DEVICES": devices,
        "OMP_NUM_THREADS": str(_threads_per_rank(int(task["nproc_per_node"]))),
        # DeepSpeed compiles a communication extension on a node's first ZeRO job; every later one reuses it
        "TORCH_EXTENSIONS_DIR": str(settings.torch_extensions_path),
    }


def _threads_per_rank(nproc: int) -> int:
    """The node's cores shared among its ranks, never more than the worker itself was given
    (OMP_NUM_THREADS in its environment: an operator's cap, or a test process beside others)."""
    cores = os.cpu_count() or 1
    cap = int(os.environ.get("OMP_NUM_THREADS") or cores)
    return max(1, min(cap, cores // nproc))


def _load(settings: Settings, job_id: str, attempt_no: int) -> Claimed | None:
    """The attempt this node was sent, or None (and its devices released) when the job moved on."""
    with session_scope(settings.database_url) as session:
        job = JobRepository(session).get(job_id)
        if job is None or job.attempt != attempt_no or job.status != JobStatus.running:
            NodeRepository(session).release(
                job_id, attempt_no, settings.node_name, exit_code=None, error="stale"
            )
            return None
        return Claimed(job, *FileRepository(session).of_job(job))


def run_rank(settings: Settings, task: dict[str, Any]) -> str:
    job_id, attempt_no, rank = task["job_id"], int(task["attempt"]), int(task["node_rank"])
    loaded = _load(settings, job_id, attempt_no)
    if loaded is None:
        return "stale (the attempt moved on)"
    job = loaded.job
    workdir = settings.job_work_dir / job.id / f"attempt-{attempt_no}" / f"node-{rank}"
    store = store_of(settings)
    try:
        staged = stage(settings, store, job, loaded.train, loaded.valid, workdir, lead=rank == 0)
    except Exception as exc:  # rank 0 aborts the attempt when it sees this (or it fails it itself)
        attempt.release(
            settings, job, settings.node_name, STAGING_FAILED, f"staging failed: {type(exc).__name__}: {exc}"
        )
        if rank == 0:
            attempt.finish(settings, job, Outcome.worker_error(exc, "staging failed: "))
            return "failed while staging"
        raise
    command = _torchrun(settings, task, workdir / "spec.json")
    try:
        if rank == 0:
            return _lead(settings, store, job, staged, command, task)
        return _follow(settings, job, workdir, command, task)
    finally:
        runner.clear(settings, workdir, staged)


def _lead(
    settings: Settings,
    store: ObjectStore,
    job: Job,
    staged: Staged,
    command: list[str],
    task: dict[str, Any],
) -> str:
    heartbeat = Heartbeat(settings, job.id, job.attempt)
    heartbeat.start()
    try:
        outcome = runner.tokenize(settings, store, job, staged)  # the other nodes wait for its stores
        if outcome.status != JobStatus.running:
            raise _Ended(outcome)
        process = TrainerProcess(
            settings,
            store,
            job,
            staged.spec,
            command=command,
            env=_env(settings, task),
            abort_when=lambda: _another_node_failed(settings, job),
            stop=_stop_ranks,
        )
        outcome = process.run()
    except _Ended as ended:
        outcome = ended.outcome
    except OperationalError:  # the database stayed away: like a lost heartbeat (see worker/runner.py)
        log.warning("job %s: lost the database; its attempt is left to the sweep", job.id, exc_info=True)
        heartbeat.stop()
        return "lost"
    except StorageUnavailable as exc:  # its ranks are dead already (TrainerProcess kills them first)
        heartbeat.stop()
        return attempt.requeue_unstorable(settings, job, exc, "rank 0's output")
    except Exception as exc:
        log.exception("job %s failed on rank 0", job.id)
        outcome = Outcome.worker_error(exc)
    finally:
        heartbeat.stop()
    code = 0 if outcome.status == JobStatus.succeeded else 1
    attempt.release(settings, job, settings.node_name, code, (outcome.error or {}).get("message"))
    if outcome.status == JobStatus.failed:
        outcome = Outcome(JobStatus.failed, _first_failure(settings, job, outcome.error))
    attempt.finish(settings, job, outcome)
    return outcome.status.value if outcome.status else "superseded"


class _Ended(Exception):
    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome


def _stop_ranks(proc: subprocess.Popen[str]) -> None:
    """A pause or a drain: SIGTERM to this node's ranks, not to torchrun (which would tear its workers down
    and fail the other nodes). The ranks vote each step (trainer_core.engine.ranks.any_rank), so every rank
    on every node saves the same step, and each exits 0 for its torchrun; rank 0 reports the stop."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(proc.pid).children():
            with contextlib.suppress(psutil.NoSuchProcess):
                if "trainer_core.engine.launch" in child.cmdline():
                    child.send_signal(signal.SIGTERM)


def _another_node_failed(settings: Settings, job: Job) -> str | None:
    """Rank 0 stops at once when another node's ranks failed (they may never reach the rendezvous)."""
    with session_scope(settings.database_url) as session:
        parts = NodeRepository(session).of_attempt(job.id, job.attempt)
        failed = [a for a in parts if a.node_rank != 0 and a.exit_code not in (0, None)]
        return f"node rank {failed[0].node_rank} on {failed[0].node_name} failed" if failed else None


def _first_failure(settings: Settings, job: Job, rank0_error: dict[str, Any] | None) -> dict[str, Any] | None:
    """The error of the node whose ranks failed first: the others mostly fail because it went away."""
    deadline = time.monotonic() + FIRST_FAILURE_WAIT_S
    while True:
        with session_scope(settings.database_url) as session:
            parts = NodeRepository(session).of_attempt(job.id, job.attempt)
            pending = [a for a in parts if a.released_at is None]
            failed = sorted(
                (a for a in parts if a.exit_code not in (0, None) and a.node_rank != 0),
                key=lambda a: a.released_at or a.created_at,
            )
            if failed or not pending or time.monotonic() > deadline:
                break
        time.sleep(0.5)
    if not failed:
        return rank0_error
    first = failed[0]
    return {
        "code": "rank_failed",
        "message": f"node rank {first.node_rank} on {first.node_name} failed (exit code {first.exit_code}) "
        f"and took the attempt with it: {first.error}",
    }


def _upload_parts(settings: Settings, store: ObjectStore, job: Job, workdir: Path, rank: int) -> None:
    """This node's part of each checkpoint rank 0 has recorded (its ranks' RNG state, under ZeRO their
    optimizer shards), so that any node can resume the whole job from object storage."""
    for path in sorted((workdir / "out" / "checkpoints").glob("checkpoint-*")):
        step = int(path.name.rsplit("-", 1)[1])
        with session_scope(settings.database_url) as session:
            recorded = {c.step: c.object_key for c in CheckpointRepository(session).newest_first(job.id)}
        if step not in recorded:
            ours = [s for s, key in recorded.items() if key.startswith(f"{attempt_prefix(job)}/")]
            if any(s > step for s in ours):  # this attempt's rank 0 stores in order: it could not store this
                shutil.rmtree(path)
            continue  # else rank 0 is still saving (or uploading) it
        key = f"{attempt_prefix(job)}/checkpoints/step-{step}.node-{rank}.tar"
        archive = workdir / f"part-{step}.tar"
        _, digest = pack_dir(path, archive)
        store.put_path(key, archive)
        archive.unlink()
        with session_scope(settings.database_url) as session:
            CheckpointRepository(session).add_part(job.id, step, key, digest)
        shutil.rmtree(path)  # stored; this node never reads it again


def _upload_last_parts(settings: Settings, store: ObjectStore, job: Job, workdir: Path, rank: int) -> None:
    """Rank 0 records a checkpoint once it has uploaded it, which can be after this node's ranks exited
    (always so for the checkpoint of a pause): keep adding this node's parts until rank 0 lets go."""
    deadline = time.monotonic() + settings.pause_grace_seconds
    while True:
        with session_scope(settings.database_url) as session:
            lead_done = any(
                a.node_rank == 0 and a.released_at is not None
                for a in NodeRepository(session).of_attempt(job.id, job.attempt)
            )
        _upload_parts(settings, store, job, workdir, rank)
        left = list((workdir / "out" / "checkpoints").glob("checkpoint-*"))
        if lead_done or not left:
            return
        if time.monotonic() > deadline:
            log.warning("job %s: rank 0 never recorded %s", job.id, [p.name for p in left])
            return
        time.sleep(0.5)


def _watch_ranks(
    settings: Settings, job: Job, workdir: Path, rank: int, proc: subprocess.Popen[str], store: ObjectStore
) -> None:
    """Until this node's ranks exit: kill them when the job moves on, and upload their checkpoint parts. A
    database that does not answer is waited out for half the heartbeat timeout, then raised."""
    unreachable_since: float | None = None
    while proc.poll() is None:
        time.sleep(1.0)
        try:
            with session_scope(settings.database_url) as session:
                status = JobRepository(session).status(job.id, attempt=job.attempt)
        except OperationalError:
            unreachable_since = unreachable_since or time.monotonic()
            if time.monotonic() - unreachable_since > settings.heartbeat_timeout_seconds / 2:
                raise
            continue
        unreachable_since = None
        if status not in (JobStatus.running, JobStatus.paused):
            signal_group(proc, signal.SIGKILL)
        _upload_parts(settings, store, job, workdir, rank)


def _follow(settings: Settings, job: Job, workdir: Path, command: list[str], task: dict[str, Any]) -> str:
    log_path, rank = workdir / "trainer.log", int(task["node_rank"])
    with log_path.open("w") as out:
        proc = launch(command, cwd=workdir, env=_env(settings, task), stdout=out, stderr=subprocess.STDOUT)
        watch = MemoryWatch(
            proc.pid, settings.trainer_memory_bytes
        )  # this node's ranks, under the same limit
        watch.start()
        store = store_of(settings)
        try:
            _watch_ranks(settings, job, workdir, rank, proc, store)
        except BaseException as exc:
            # requeued before its ranks die: rank 0 then finds the attempt superseded, not failed
            requeued = isinstance(exc, StorageUnavailable) and attempt.requeue_unstorable(
                settings, job, exc, f"node rank {rank}'s checkpoint part"
            )
            signal_group(proc, signal.SIGKILL)  # never ranks orphaned on the devices
            proc.wait()
            watch.stop()
            if requeued:
                return requeued
            raise
        code = proc.wait()
        peak = watch.stop()
        if code == 0:
            try:
                _upload_last_parts(settings, store, job, workdir, rank)
            except StorageUnavailable as exc:
                return attempt.requeue_unstorable(settings, job, exc, f"node rank {rank}'s checkpoint part")
    error = None
    if watch.exceeded:
        error = (
            f"out of memory: its ranks reached {peak / 2**20:,.0f} MiB of private memory, over the limit of "
            f"{settings.trainer_memory_bytes / 2**20:,.0f} MiB (ORTUNE_TRAINER_MEMORY_LIMIT)"
        )
    elif code != 0:
        error = f"exit code {code}; last log lines: {log_tail(log_path, lines=8)}"
    if error is not None:
        with session_scope(settings.database_url) as session:
            EventRepository(session).add(
                job.id, f"Node rank {rank} on {settings.node_name} failed: {error}", level="error"
            )
    attempt.release(settings, job, settings.node_name, code, error)
    return f"node rank {rank}: exit code {code}"

"""Checkpoints and a slow store: the trainer checkpoints faster than the worker uploads, and no checkpoint
is lost for it. CI caught a job whose step-8 checkpoint vanished unrecorded: the Trainer's own rotation
(save_total_limit=2) deleted its directory while the worker was still storing step 6's. With no rotation,
the other nodes of a job drop the parts their rank 0 could not store."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from ortune.db.base import new_id
from ortune.db.models import Checkpoint, Job, JobEvent, JobStatus
from ortune.db.session import session_scope
from ortune.settings import Settings
from ortune.storage import ObjectStore
from tests.support import job_spec, rows, stored_job, tokenized_spec, wait_until
from trainer_core.spec import Distributed, Hyperparameters
from worker import distributed
from worker.staging import store_of
from worker.trainer_process import TrainerProcess


class HeldStore:
    """The job's real store, whose first checkpoint upload waits until the trainer has written its last
    checkpoint (a slow or distant S3 while a tiny model trains on)."""

    def __init__(self, store: ObjectStore, last: Path) -> None:
        self.store, self.last, self.held = store, last, threading.Event()

    def put_path(self, key: str, path: Path) -> None:
        if "/checkpoints/" in key and not self.held.is_set():
            self.held.set()
            wait_until(f"the trainer to write {self.last.name}", self.last.is_dir, timeout=120)
        self.store.put_path(key, path)

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_checkpoints_written_faster_than_they_upload_are_all_stored_and_then_leave_the_disk(
    settings: Settings, tmp_path: Path
) -> None:
    with session_scope(settings.database_url) as session:
        job = stored_job(session, status=JobStatus.running, attempt=1, spec=job_spec(keep_checkpoints=10))
        session.expunge(job)
    spec = tokenized_spec(tmp_path, "sequence-classification", rows(48), checkpoint_every_steps=1)
    hp = Hyperparameters(max_steps=5, batch_size=8, max_seq_length=32).resolved(48)
    spec = spec.model_copy(update={"job_id": job.id, "hyperparameters": hp, "backend": "torch"})
    spec.dump(tmp_path / "spec.json")
    local = Path(spec.output_dir) / "checkpoints"
    store = HeldStore(store_of(settings), local / "checkpoint-5")

    outcome = TrainerProcess(settings, store, job, spec).run()  # type: ignore[arg-type]

    assert outcome.status == JobStatus.succeeded, outcome.error
    assert store.held.is_set()
    with session_scope(settings.database_url) as session:
        stored = sorted(c.step for c in session.query(Checkpoint).filter_by(job_id=job.id))
        said = [e.message for e in session.query(JobEvent).filter_by(job_id=job.id)]
    assert stored == [1, 2, 3, 4, 5], said
    assert not [m for m in said if "checkpoint at step" in m.lower() and "stored" not in m], said
    assert not list(local.glob("checkpoint-*"))  # each left the disk once stored


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_another_node_drops_a_part_its_rank0_passed_and_keeps_one_it_may_still_store(
    settings: Settings, tmp_path: Path
) -> None:
    """Node 1's parts of steps 10, 20 and 30 when this attempt's rank 0 has recorded 20 only, and an
    earlier attempt recorded 40: 20's part is stored, 10's (rank 0 passed it: it could not store it) is
    dropped, 30's waits for rank 0 (another attempt's 40 says nothing of this one's order)."""
    with session_scope(settings.database_url) as session:
        job = stored_job(session, status=JobStatus.running, attempt=2)
        for step, attempt in ((20, 2), (40, 1)):
            key = f"jobs/{job.id}/attempt-{attempt}/checkpoints/step-{step}.tar"
            session.add(
                Checkpoint(
                    id=new_id("ftckpt"), job_id=job.id, step=step, object_key=key, bytes=1, sha256="0" * 64
                )
            )
        session.flush()
        session.expunge(job)
    local = tmp_path / "out" / "checkpoints"
    for step in (10, 20, 30):
        (local / f"checkpoint-{step}").mkdir(parents=True)
        (local / f"checkpoint-{step}" / "rng_state_1.pth").write_bytes(b"rng")
    store = store_of(settings)

    distributed._upload_parts(settings, store, job, tmp_path, rank=1)

    assert sorted(p.name for p in local.iterdir()) == ["checkpoint-30"]
    with session_scope(settings.database_url) as session:
        parts = {c.step: c.parts for c in session.query(Checkpoint).filter_by(job_id=job.id)}
    assert parts == {20: [f"jobs/{job.id}/attempt-2/checkpoints/step-20.node-1.tar"], 40: None}
    store.stat(parts[20][0])


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_a_part_storage_refuses_requeues_the_job_from_its_last_checkpoint(
    settings: Settings, tmp_path: Path
) -> None:
    """Node 1's ranks checkpoint step 20, which rank 0 has recorded, and storage refuses node 1's part (a
    directory stands where it must go): the attempt is requeued at once, as when a single node cannot
    store its model, and the ranks are stopped. Before, the refusal escaped the node's task and the job
    failed when rank 0 found its peer gone."""
    with session_scope(settings.database_url) as session:
        two_nodes = job_spec(distributed=Distributed(nodes=2, procs_per_node=1))
        job = stored_job(session, status=JobStatus.running, attempt=1, worker="rank0:1", spec=two_nodes)
        key = f"jobs/{job.id}/attempt-1/checkpoints/step-20.tar"
        session.add(
            Checkpoint(id=new_id("ftckpt"), job_id=job.id, step=20, object_key=key, bytes=1, sha256="0" * 64)
        )
        session.flush()
        session.expunge(job)
    root = Path(settings.storage_url.removeprefix("file://"))
    (root / f"jobs/{job.id}/attempt-1/checkpoints/step-20.node-1.tar/in-the-way").mkdir(parents=True)
    ranks = tmp_path / "ranks.py"  # what torchrun and its ranks do here: write a checkpoint, train on
    ranks.write_text(
        "import pathlib, time\n"
        "p = pathlib.Path('out/checkpoints/checkpoint-20')\n"
        "p.mkdir(parents=True)\n"
        "(p / 'rng_state_1.pth').write_bytes(b'rng')\n"
        "time.sleep(120)\n"
    )
    task = {"node_rank": 1, "devices": [0], "nproc_per_node": 1}
    started = time.monotonic()

    said = distributed._follow(settings, job, tmp_path, [sys.executable, str(ranks)], task)

    assert said == "requeued"
    assert time.monotonic() - started < 60  # the ranks were stopped, not waited for
    with session_scope(settings.database_url) as session:
        current = session.get(Job, job.id)
        messages = [e.message for e in session.query(JobEvent).filter_by(job_id=job.id)]
    assert current is not None and current.status == JobStatus.queued
    lost = next(m for m in messages if m.startswith("Attempt 1 lost"))
    assert "object storage refused a write of node rank 1's checkpoint part" in lost
    # step 20 is not complete without node 1's part: the event names where the next attempt really starts
    assert "resuming from the start" in lost

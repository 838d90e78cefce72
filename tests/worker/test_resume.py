"""A resume unpacks only a checkpoint whose bytes are the ones stored: a tampered or damaged archive is
refused before anything in it is unpickled, and the next older checkpoint is used."""

from __future__ import annotations

from pathlib import Path

import pytest

from ortune.db.base import new_id
from ortune.db.models import Checkpoint, Job, JobEvent, JobStatus
from ortune.db.repositories import CheckpointRepository
from ortune.db.session import session_scope
from ortune.settings import Settings
from ortune.storage import ObjectStore, pack_dir
from tests.support import job_spec, stored_job
from trainer_core.spec import Distributed
from worker.staging import resume_point, store_of


def store_checkpoint(
    store: ObjectStore, tmp: Path, key: str, step: int, name: str, data: bytes
) -> tuple[int, str]:
    """A `checkpoint-<step>` folder holding one file, packed and stored under `key`: its size and sha256."""
    folder = tmp / key.replace("/", "_") / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / name).write_bytes(data)
    archive = folder.parent / "packed.tar"
    size, digest = pack_dir(folder, archive)
    store.put_path(key, archive)
    return size, digest


def job_with_checkpoints(settings: Settings, tmp: Path, steps: list[int], nodes: int = 1) -> Job:
    store = store_of(settings)
    spec = job_spec(distributed=Distributed(nodes=nodes))
    with session_scope(settings.database_url) as session:
        job = stored_job(session, status=JobStatus.running, attempt=2, spec=spec, world_size=nodes)
        for step in steps:
            key = f"jobs/{job.id}/checkpoints/{step}.tar"
            state = f'{{"global_step": {step}}}'.encode()
            size, digest = store_checkpoint(store, tmp, key, step, "trainer_state.json", state)
            CheckpointRepository(session).add(
                Checkpoint(
                    id=new_id("ftckpt"), job_id=job.id, step=step, object_key=key, bytes=size, sha256=digest
                )
            )
        return job


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_a_damaged_checkpoint_is_not_unpacked_and_the_older_one_resumes(
    settings: Settings, tmp_path: Path
) -> None:
    job = job_with_checkpoints(settings, tmp_path, [10, 20])
    store = store_of(settings)
    tampered = tmp_path / "tampered.tar"
    tampered.write_bytes(b"\0" * 1024)  # what a damaged or replaced object would read as
    store.put_path(f"jobs/{job.id}/checkpoints/20.tar", tampered)

    found = resume_point(settings, store, job, tmp_path / "work")
    assert found is not None and Path(found).name == "checkpoint-10"
    with session_scope(settings.database_url) as session:
        messages = [e.message for e in session.query(JobEvent).filter_by(job_id=job.id)]
    assert any("20.tar failed its sha256 check" in m and "not unpacked" in m for m in messages)
    assert any(m.startswith("Resuming from the checkpoint at step 10") for m in messages)

    store.put_path(f"jobs/{job.id}/checkpoints/10.tar", tampered)
    assert resume_point(settings, store, job, tmp_path / "work2") is None  # nothing usable: start over


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_another_nodes_damaged_part_is_not_unpacked_either(settings: Settings, tmp_path: Path) -> None:
    """A two-node job's checkpoint: rank 0's archive and node 1's part (under ZeRO, its optimizer shards,
    which a resume unpickles). The part was unpacked unchecked; now it is checked like the main one."""
    job = job_with_checkpoints(settings, tmp_path, [10, 20], nodes=2)
    store = store_of(settings)
    with session_scope(settings.database_url) as session:
        for step in (10, 20):
            key = f"jobs/{job.id}/checkpoints/{step}.node-1.tar"
            _, digest = store_checkpoint(store, tmp_path, key, step, "rng_state_1.pth", b"rank 1")
            assert CheckpointRepository(session).add_part(job.id, step, key, digest)
    tampered = tmp_path / "tampered.tar"
    tampered.write_bytes(b"\0" * 1024)
    store.put_path(f"jobs/{job.id}/checkpoints/20.node-1.tar", tampered)

    found = resume_point(settings, store, job, tmp_path / "work")
    assert found is not None and Path(found).name == "checkpoint-10"
    assert (Path(found) / "rng_state_1.pth").read_bytes() == b"rank 1"  # the good part is there
    with session_scope(settings.database_url) as session:
        messages = [e.message for e in session.query(JobEvent).filter_by(job_id=job.id)]
    assert any("20.node-1.tar failed its sha256 check" in m for m in messages)

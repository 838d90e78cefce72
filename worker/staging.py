"""Stage an attempt on this node's disk: the job's data, its base model, the checkpoint to resume from, and
the `TrainingSpec` the trainer reads."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

from ortune.db.models import File, Job
from ortune.db.repositories import CheckpointRepository, EventRepository
from ortune.db.session import session_scope
from ortune.settings import Settings
from ortune.storage import ObjectStore, open_store, sha256_file
from trainer_core import registry, rows
from trainer_core.spec import TrainingSpec


def store_of(settings: Settings) -> ObjectStore:
    return open_store(
        settings.storage_url,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key,
        region=settings.s3_region,
    )


def pack(directory: Path, archive: Path) -> tuple[int, str]:
    """Tar `directory` (uncompressed: model weights barely compress) into `archive`; its size and sha256."""
    with tarfile.open(archive, "w") as tar:
        tar.add(directory, arcname=directory.name)
    return archive.stat().st_size, sha256_file(archive)


def trainer_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def attempt_dir(settings: Settings, job: Job) -> Path:
    return settings.job_work_dir / job.id / f"attempt-{job.attempt}"


def stage(
    settings: Settings,
    store: ObjectStore,
    job: Job,
    train: File,
    valid: File | None,
    workdir: Path | None = None,
    *,
    lead: bool = True,
) -> TrainingSpec:
    """Download data, model and resume point into the attempt's folder and write its spec.json. `lead` is
    False on the nodes of a multi-process job other than rank 0's, which speaks for the job."""
    workdir = workdir or attempt_dir(settings, job)
    data = workdir / "data"
    fmt = rows.file_format(train.object_key) or "jsonl"
    store.get_to_path(train.object_key, data / f"train.{fmt}")
    vfmt = rows.file_format(valid.object_key) or "jsonl" if valid else "jsonl"
    if valid is not None:
        store.get_to_path(valid.object_key, data / f"valid.{vfmt}")
    model = registry.resolve(job.model, settings.models_dir)
    resume_from = resume_point(settings, store, job, workdir, lead=lead)
    spec = TrainingSpec(
        job_id=job.id,
        model=job.model,
        model_path=str(model.path) if model.path else None,
        train_file=str(data / f"train.{fmt}"),
        train_format=fmt,
        validation_file=str(data / f"valid.{vfmt}") if valid else None,
        validation_format=vfmt,
        output_dir=str(workdir / "out"),
        seed=job.seed,
        resume_from=resume_from,
        distributed_timeout_seconds=settings.distributed_timeout_seconds,
        **job.spec.training_fields(),
    )
    spec.dump(workdir / "spec.json")
    if lead:
        store.put_path(f"jobs/{job.id}/spec.json", workdir / "spec.json")
    return spec


def resume_point(
    settings: Settings, store: ObjectStore, job: Job, workdir: Path, *, lead: bool = True
) -> str | None:
    """Fetch the job's latest complete checkpoint (model, optimizer, scheduler, RNG, step) to resume from.

    A multi-process job's checkpoint is complete when every other node has added its part; every node
    unpacks all of them into one directory, as the Trainer (and DeepSpeed) expect."""
    nodes = job.spec.distributed.nodes
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

"""Stage an attempt on this node's disk: the job's data, its base model, the checkpoint to resume from, and
the `TrainingSpec` the trainer reads."""

from __future__ import annotations

import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ortune.db.models import File, Job, JobStatus
from ortune.db.repositories import CheckpointRepository, EventRepository, JobRepository
from ortune.db.session import session_scope
from ortune.settings import Settings
from ortune.storage import ObjectNotFound, ObjectStore, open_store, sha256_file
from trainer_core.data import datastore, media, rows
from trainer_core.spec import TrainingSpec
from worker import base_models
from worker.stores import Store, fetch, stores_of, wait_for

STORE_WAIT_S = 1800.0  # how long a follower node waits for rank 0's node to tokenize
IN_TRAINER_ROWS = 50_000


def store_of(settings: Settings) -> ObjectStore:
    return open_store(
        settings.storage_url,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key.get_secret_value(),
        region=settings.s3_region,
    )


# What a trainer never needs and must not see: it reads its staged folder and writes events, so the database
# and broker URLs (with their passwords), the API keys and the storage credentials stay with the worker.
WITHHELD_PREFIXES = ("ORTUNE_", "AWS_", "PG", "CELERY_", "REDIS_")


def trainer_env() -> dict[str, str]:
    kept = {k: v for k, v in os.environ.items() if not k.startswith(WITHHELD_PREFIXES)}
    return kept | {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def attempt_dir(settings: Settings, job: Job) -> Path:
    return settings.job_work_dir / job.id / f"attempt-{job.attempt}"


@dataclass
class Staged:
    spec: TrainingSpec
    to_build: list[Store]  # stores nobody has made yet
    # Small files of single-process jobs are tokenized by the trainer itself as it starts: a process of its
    # own would cost more to start (importing transformers) than the tokenizing. Larger ones, and every
    # store a multi-process job's other nodes wait for, are built first by `trainer_core.data.prepare`.
    in_trainer: bool = False


def decided_backend(job: Job) -> dict[str, str] | None:
    """What an earlier attempt of an `auto` job decided, so that a resumed job trains on the same engine."""
    if job.backend_requested != "auto" or job.backend_used is None:
        return None
    return {"used": job.backend_used, "reason": job.backend_reason or ""}


def stage(
    settings: Settings,
    store: ObjectStore,
    job: Job,
    train: File,
    valid: File | None,
    workdir: Path | None = None,
    *,
    lead: bool = True,
) -> Staged:
    """Stage the attempt in its folder: the tokenized stores (from this node's cache or object storage; the
    raw files only where a store must be built), the model and the resume point, and its spec.json. `lead`
    is False on the nodes of a multi-process job other than rank 0's: rank 0's node speaks for the job and
    tokenizes, the others wait for its stores."""
    workdir = workdir or attempt_dir(settings, job)
    data = workdir / "data"
    model = base_models.resolve(settings, store, job)
    stores = [s for s in stores_of(settings, job, model, train, valid) if s is not None]
    to_build = [s for s in stores if not _found(settings, store, job, s, lead=lead)]
    fmt = _format(train.object_key)
    vfmt = _format(valid.object_key) if valid else "jsonl"
    if to_build:
        _fetch_file(store, train, data / f"train.{fmt}", "training")  # a built tokenizer learns from it
        if valid is not None:
            _fetch_file(store, valid, data / f"valid.{vfmt}", "validation")
    resume_from = resume_point(settings, store, job, workdir, lead=lead)
    spec = TrainingSpec(
        job_id=job.id,
        model=job.model,
        model_path=str(model.path) if model.path else None,
        train_file=str(data / f"train.{fmt}"),
        train_format=fmt,
        validation_file=str(data / f"valid.{vfmt}") if valid else None,
        validation_format=vfmt,
        train_store=str(stores[0].path),
        validation_store=str(stores[1].path) if valid else None,
        train_rows=train.row_count,
        output_dir=str(workdir / "out"),
        seed=job.seed,
        resume_from=resume_from,
        distributed_timeout_seconds=settings.distributed_timeout_seconds,
        min_checkpoint_seconds=settings.min_checkpoint_seconds,
        backend_decided=decided_backend(job),
        **job.spec.training_fields(),
    )
    workdir.mkdir(parents=True, exist_ok=True)
    spec.dump(workdir / "spec.json")
    if lead:
        store.put_path(f"jobs/{job.id}/spec.json", workdir / "spec.json")
    small = all((s.file.row_count or 0) < IN_TRAINER_ROWS for s in to_build)
    return Staged(spec, to_build, in_trainer=bool(to_build) and small and job.world_size == 1)


class FileMissing(RuntimeError):
    """A job's file whose bytes are gone from object storage: the job fails naming it (no retry helps)."""


def _fetch_file(store: ObjectStore, file: File, path: Path, role: str) -> None:
    try:
        store.get_to_path(file.object_key, path)
    except ObjectNotFound as exc:
        raise FileMissing(
            f"the {role} file {file.id} ({file.filename}) is gone from object storage ({file.object_key}); "
            "upload it again and create a new job"
        ) from exc


def _found(settings: Settings, store: ObjectStore, job: Job, wanted: Store, *, lead: bool) -> bool:
    """Whether `wanted` is whole on this node now (fetched if need be); a follower node waits for rank 0's."""
    where = "this node's cache" if datastore.is_whole(wanted.path) else "object storage"
    found = fetch(store, wanted) or (
        not lead and wait_for(store, wanted, STORE_WAIT_S, lambda: _attempt_lives(settings, job))
    )
    if found and lead:
        meta = datastore.Meta.read(wanted.path)
        with session_scope(settings.database_url) as session:
            EventRepository(session).add(
                job.id,
                f"Tokenized data reused from {where}: {meta.rows:,} rows of {wanted.file.filename} "
                f"(store {wanted.key[:12]})",
                data={"store": wanted.key, "reused_from": where, "rows": meta.rows, "phase": "tokenizing"},
            )
    elif not found and not lead:
        raise RuntimeError(
            f"rank 0's node did not store the tokenized {wanted.file.id} in {STORE_WAIT_S:.0f}s"
        )
    return found


def _attempt_lives(settings: Settings, job: Job) -> bool:
    with session_scope(settings.database_url) as session:
        status = JobRepository(session).status(job.id, attempt=job.attempt)
    return status in (JobStatus.running, JobStatus.paused)


class CorruptCheckpoint(RuntimeError):
    """A stored checkpoint that is not what was stored: refused before anything in it is unpacked."""


def _unpack(store: ObjectStore, target: Path, digests: dict[str, str | None]) -> Path:
    """Fetch a checkpoint's archives (the main one first, then other nodes' parts) and unpack them into
    `target`, each only once its sha256 is the one recorded: a resume unpickles the optimizer and RNG state
    they hold (under ZeRO, the parts hold optimizer shards)."""
    shutil.rmtree(target, ignore_errors=True)
    keys = list(digests)
    for n, (key, sha256) in enumerate(digests.items()):
        archive = target.parent / f"resume-{n}.tar"
        if sha256 is None:  # a part recorded before parts had digests: nothing to check it against
            raise CorruptCheckpoint(f"checkpoint part {key} has no recorded sha256; it was not unpacked")
        store.get_to_path(key, archive)
        if (got := sha256_file(archive)) != sha256:
            archive.unlink()
            raise CorruptCheckpoint(
                f"checkpoint {key} failed its sha256 check (stored {sha256[:12]}…, read {got[:12]}…); "
                "it was not unpacked"
            )
        with tarfile.open(archive) as tar:
            tar.extractall(target, filter="data")  # refuses absolute paths, links out and device files
        archive.unlink()
    found = next(target.glob("checkpoint-*"), None)
    if found is None:
        raise CorruptCheckpoint(f"checkpoint archive {keys[0]} holds no checkpoint-* directory")
    return found


def resume_point(
    settings: Settings, store: ObjectStore, job: Job, workdir: Path, *, lead: bool = True
) -> str | None:
    """Fetch the job's latest complete checkpoint (model, optimizer, scheduler, RNG, step) to resume from.

    A multi-process job's checkpoint is complete when every other node has added its part; every node
    unpacks all of them into one directory, as the Trainer (and DeepSpeed) expect."""
    nodes = job.spec.distributed.nodes
    with session_scope(settings.database_url) as session:
        complete: list[tuple[int, dict[str, str | None]]] = [
            (c.step, {c.object_key: c.sha256, **{k: (c.part_sha256 or {}).get(k) for k in c.parts or []}})
            for c in CheckpointRepository(session).complete(job.id, nodes)
        ]
    found: Path | None = None
    step = 0
    for checkpoint_step, digests in complete:
        try:
            found, step = _unpack(store, workdir / "resume", digests), checkpoint_step
            break
        except CorruptCheckpoint as exc:  # never unpacked: the next older checkpoint is tried
            if lead:
                with session_scope(settings.database_url) as session:
                    EventRepository(session).add(job.id, str(exc), level="warn")
    if found is None:
        if job.attempt > 1 and lead:
            with session_scope(settings.database_url) as session:
                EventRepository(session).add(job.id, "No checkpoint stored yet: this attempt starts over")
        return None
    if lead:
        with session_scope(settings.database_url) as session:
            EventRepository(session).add(
                job.id,
                f"Resuming from the checkpoint at step {step} (attempt {job.attempt})",
                data={"resumed_from_step": step, "attempt": job.attempt},
            )
    return str(found)


def _format(key: str) -> Any:
    """A stored file's format by its key's suffix: rows (jsonl, csv) or an archive of media (zip, tar)."""
    return rows.file_format(key) or media.archive_format(key) or "jsonl"

"""A job's base model on this node: a registry model, or an earlier job's fine-tuned model (`ft:...`) fetched
from object storage into the node's cache, its archive checked against the recorded sha256 first."""

from __future__ import annotations

from pathlib import Path

from ortune.db.models import Job
from ortune.settings import Settings
from ortune.storage import ArchiveUnusable, ObjectStore, fetch_archive
from trainer_core.models import registry
from worker.stores import USED

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.txt")


class BaseModelUnavailable(RuntimeError):
    """The fine-tuned model a job continues from cannot be had (deleted, or not the bytes recorded)."""


def resolve(settings: Settings, store: ObjectStore, job: Job) -> registry.ModelInfo:
    base = job.spec.base
    if base is None:
        return registry.resolve(job.model, settings.models_dir)
    home = settings.cache_dir / "models" / base.sha256
    # a merged artifact unpacks to pytorch/, a checkpoint archive to checkpoint-N/
    model_dir = home / ("pytorch" if base.checkpoint_step is None else f"checkpoint-{base.checkpoint_step}")
    if not (model_dir / "config.json").is_file():
        _fetch(store, base.object_key, base.sha256, home)
    if not (model_dir / "config.json").is_file():
        raise BaseModelUnavailable(f"the base model's archive {base.object_key} holds no {model_dir.name}/")
    if base.checkpoint_step is not None and not any((model_dir / n).is_file() for n in TOKENIZER_FILES):
        raise BaseModelUnavailable(
            f"checkpoint {base.checkpoint_step} of {base.job_id} holds no tokenizer (it was stored before "
            "checkpoints carried one); continue from the job's fine_tuned_model"
        )
    (home / USED).touch()  # the node cache's recency (worker/stores.py evicts the least recent first)
    return registry.ModelInfo(job.model, "local", model_dir, (job.spec.task,))


def _fetch(store: ObjectStore, key: str, sha256: str, home: Path) -> None:
    try:
        fetch_archive(store, key, sha256, home, "base model's archive")
    except ArchiveUnusable as exc:
        raise BaseModelUnavailable(str(exc)) from exc

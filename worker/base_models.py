"""A job's base model on this node: a registry model, or an earlier job's fine-tuned model (`ft:...`) fetched
from object storage into the node's cache, its archive checked against the recorded sha256 first."""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from pathlib import Path

from ortune.db.models import Job
from ortune.settings import Settings
from ortune.storage import ObjectNotFound, ObjectStore, sha256_file
from trainer_core import registry

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
    return registry.ModelInfo(job.model, "local", model_dir, (job.spec.task,))


def _fetch(store: ObjectStore, key: str, sha256: str, home: Path) -> None:
    home.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home.parent) as tmp:
        archive = Path(tmp) / "model.tar"
        try:
            store.get_to_path(key, archive)
        except ObjectNotFound as exc:
            raise BaseModelUnavailable(f"the base model's archive {key} is gone (was it deleted?)") from exc
        if (got := sha256_file(archive)) != sha256:
            raise BaseModelUnavailable(
                f"the base model's archive {key} failed its sha256 check (recorded {sha256[:12]}…, read "
                f"{got[:12]}…); it was not unpacked"
            )
        with tarfile.open(archive) as tar:
            tar.extractall(Path(tmp) / "model", filter="data")
        shutil.rmtree(home, ignore_errors=True)
        (Path(tmp) / "model").rename(home)  # whole or absent: another attempt never sees half of it

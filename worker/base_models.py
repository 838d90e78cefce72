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


class BaseModelUnavailable(RuntimeError):
    """The fine-tuned model a job continues from cannot be had (deleted, or not the bytes recorded)."""


def resolve(settings: Settings, store: ObjectStore, job: Job) -> registry.ModelInfo:
    base = job.spec.base
    if base is None:
        return registry.resolve(job.model, settings.models_dir)
    home = settings.cache_dir / "models" / base.sha256
    if not (home / "pytorch" / "config.json").is_file():
        _fetch(store, base.object_key, base.sha256, home)
    return registry.ModelInfo(job.model, "local", home / "pytorch", (job.spec.task,))


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

"""The tokenized stores of an attempt (trainer_core.data.datastore): found in this node's cache, fetched from
object storage where an earlier attempt, trial, rank or job left them, or built by `trainer_core.data.prepare`
and then kept in both.

A store lives in object storage beside its file (`files/<file id>/tokenized/<key>.tar`) and on each node in
a cache bounded in bytes, least recently used first out.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ortune.db.models import File, Job
from ortune.settings import Settings
from ortune.storage import ObjectNotFound, ObjectStore, pack_dir
from trainer_core.data import datastore
from trainer_core.models import registry

log = logging.getLogger(__name__)
USED = ".last-used"  # touched on every use: the cache's recency
SHA256 = re.compile(r"[0-9a-f]{64}")  # a cached model's folder: the sha256 of the archive it came from


@dataclass(frozen=True)
class Store:
    key: str
    file: File
    path: Path  # in this node's cache

    @property
    def object_key(self) -> str:
        return f"files/{self.file.id}/tokenized/{self.key}.tar"


def stores_of(
    settings: Settings, job: Job, model: registry.ModelInfo, train: File, valid: File | None
) -> tuple[Store, Store | None]:
    """Where the job's stores are (or will be) on this node: keyed by everything that changes the ids."""
    spec = job.spec
    common: dict[str, Any] = {
        "model": job.model,
        "tokenizer": datastore.tokenizer_fingerprint(model.path),
        "task": spec.task,
        "method": spec.method.type,
        "max_seq_length": spec.resolved_hyperparameters.max_seq_length,
        "labels": spec.labels,
    }
    train_key = datastore.store_key(train.sha256, **common)
    cache = settings.cache_dir / "tokenized"
    train_store = Store(train_key, train, cache / train_key)
    if valid is None:
        return train_store, None
    valid_key = datastore.store_key(valid.sha256, **common, tokenized_with=train_key)
    return train_store, Store(valid_key, valid, cache / valid_key)


def fetch(store: ObjectStore, wanted: Store) -> bool:
    """Make `wanted` whole in the cache: already there, or downloaded. False when it exists nowhere yet."""
    if datastore.is_whole(wanted.path):
        (wanted.path / USED).touch()
        return True
    partial = wanted.path.with_name(f"{wanted.key}.{os.getpid()}.part")
    archive = partial.with_suffix(".tar")
    try:
        store.get_to_path(wanted.object_key, archive)
    except ObjectNotFound:
        return False
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(archive) as tar:
        tar.extractall(partial, filter="data")
    archive.unlink()
    with contextlib.suppress(OSError):  # another attempt on this node unpacked it first: theirs is as good
        (partial / wanted.key).rename(wanted.path)
    shutil.rmtree(partial, ignore_errors=True)
    (wanted.path / USED).touch()
    return datastore.is_whole(wanted.path)


def keep(store: ObjectStore, built: Store, workdir: Path) -> int:
    """Upload a store this node built; its size in bytes."""
    archive = workdir / f"store-{built.key}.tar"
    size, _ = pack_dir(built.path, archive)
    store.put_path(built.object_key, archive)
    archive.unlink()
    (built.path / USED).touch()
    return size


def wait_for(store: ObjectStore, wanted: Store, timeout_s: float, wanted_still: Callable[[], bool]) -> bool:
    """On a node other than rank 0's: wait for rank 0's node to store what it tokenizes, then fetch it; give
    up when the attempt ends meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not fetch(store, wanted):
        if time.monotonic() > deadline or not wanted_still():
            return False
        time.sleep(1.0)
    return True


def evict(settings: Settings, in_use: set[Path]) -> list[str]:
    """Drop the least recently used entries of this node's cache, tokenized stores and the fine-tuned
    models jobs continue from (`ft:` bases, worker/base_models.py), until it fits `cache_max_bytes`; those
    dropped, as `tokenized/<key>` or `models/<sha256>`. What this attempt uses (`in_use`) stays, and
    counts."""
    entries = []
    for path in _cached(settings):
        if path not in in_use:
            used = (path / USED).stat().st_mtime if (path / USED).exists() else 0.0
            entries.append((used, _size(path), path))
    total = sum(size for _, size, _ in entries) + sum(_size(p) for p in in_use if p.is_dir())
    dropped = []
    for _, size, path in sorted(entries):
        if total <= settings.cache_max_bytes:
            break
        shutil.rmtree(path, ignore_errors=True)  # a trainer that maps it keeps its open files
        total -= size
        dropped.append(f"{path.parent.name}/{path.name}")
    return dropped


def _cached(settings: Settings) -> Iterator[Path]:
    """The node cache's whole entries: a store being built, or a model being fetched (a `tmp*` folder
    beside the models, renamed into place once whole), is not one yet."""
    tokenized, models = settings.cache_dir / "tokenized", settings.cache_dir / "models"
    for path in sorted(tokenized.iterdir()) if tokenized.is_dir() else []:
        if path.is_dir() and datastore.is_whole(path):
            yield path
    for path in sorted(models.iterdir()) if models.is_dir() else []:
        if path.is_dir() and SHA256.fullmatch(path.name):
            yield path


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

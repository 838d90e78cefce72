"""The models the inference process holds: a job's ONNX artifact fetched from object storage, checked against
its sha256, unpacked and loaded into ONNX Runtime, in a cache bounded in bytes (least recently used out, and
never a model a request is using)."""

from __future__ import annotations

import json
import shutil
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ortune.storage import ObjectStore, fetch_archive
from serve.models import Classifier, Decoder
from trainer_core import tasks

MANIFEST = "ortune_manifest.json"


class TooLarge(ValueError):
    """A model bigger than the whole cache."""


class NotServed(ValueError):
    """An artifact of a task this server does not serve (its manifest says how it is served)."""


@dataclass(frozen=True)
class Ref:
    """What the API sends: which stored archive a model name stands for."""

    name: str
    object_key: str
    sha256: str


@dataclass
class Entry:
    model: Decoder | Classifier
    bytes: int
    users: int = 0  # requests using the model now: never evicted while any does


class CacheBusy(RuntimeError):
    """No room for a model while every cached one is in use: answered 503 with Retry-After."""


class ModelCache:
    """Models by their archive's sha256, loaded on first use, held within `max_bytes` (the unpacked files'
    size: what ONNX Runtime maps), least recently used out first. A model is held (`use`) for as long as a
    request reads it, and a held model is never evicted, so the bound holds while replies stream: a model
    that does not fit beside the ones in use waits for them (CacheBusy) instead of loading over the bound."""

    def __init__(self, store: ObjectStore, directory: Path, max_bytes: int) -> None:
        self.store, self.directory, self.max_bytes = store, directory, max_bytes
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.lock = threading.Lock()

    @property
    def used(self) -> int:
        return sum(e.bytes for e in self.entries.values())

    def use(self, ref: Ref) -> Lease:
        with self.lock:  # one load at a time: two requests for a new model load it once
            if (entry := self.entries.get(ref.sha256)) is None:
                entry = self._load(ref)
            self.entries.move_to_end(ref.sha256)
            entry.users += 1
            return Lease(self, entry)

    def _load(self, ref: Ref) -> Entry:
        home = self.directory / ref.sha256
        if not (home / "onnx" / MANIFEST).is_file():
            fetch_archive(self.store, ref.object_key, ref.sha256, home, f"{ref.name} ONNX archive")
        size = sum(p.stat().st_size for p in home.rglob("*") if p.is_file())
        if size > self.max_bytes:
            shutil.rmtree(home, ignore_errors=True)
            raise TooLarge(
                f"{ref.name} is {size:,} bytes, more than this server's whole model cache "
                f"({self.max_bytes:,} bytes, ORTUNE_SERVE_CACHE_BYTES)"
            )
        idle = [sha for sha, e in self.entries.items() if e.users == 0]  # least recently used first
        while self.used + size > self.max_bytes:
            if not idle:
                busy = sum(e.bytes for e in self.entries.values())
                raise CacheBusy(
                    f"{ref.name} ({size:,} bytes) does not fit beside the models in use now ({busy:,} of "
                    f"this server's {self.max_bytes:,} bytes, ORTUNE_SERVE_CACHE_BYTES); try again when "
                    "their replies end"
                )
            sha = idle.pop(0)
            del self.entries[sha]
            shutil.rmtree(self.directory / sha, ignore_errors=True)
        entry = Entry(load(home / "onnx"), size)
        self.entries[ref.sha256] = entry
        return entry


class Lease:
    """A model held for one request; `close` (idempotent) lets the cache evict it again."""

    def __init__(self, cache: ModelCache, entry: Entry) -> None:
        self.cache, self.entry, self.model = cache, entry, entry.model
        self.closed = False

    def close(self) -> None:
        with self.cache.lock:
            if not self.closed:
                self.closed = True
                self.entry.users -= 1

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serving(manifest: dict[str, Any]) -> str | None:
    """How an artifact is served: its manifest's `serving`, or for artifacts exported before manifests
    said so, its task's (TaskInfo.serving)."""
    if "serving" in manifest:
        return str(manifest["serving"])
    task = manifest.get("task")
    return tasks.get(task).serving if task in tasks.TASKS else None


def load(directory: Path) -> Decoder | Classifier:
    import onnxruntime as ort

    manifest = json.loads((directory / MANIFEST).read_text())
    kind = LOADERS.get(serving(manifest) or "")
    if kind is None:
        raise NotServed(f"a {manifest.get('task', 'model of unknown task')} artifact is not served here")
    session = ort.InferenceSession(str(directory / "model.onnx"), providers=["CPUExecutionProvider"])
    return kind(directory, session, manifest)


LOADERS: dict[str, type[Decoder] | type[Classifier]] = {"chat": Decoder, "predict": Classifier}

"""Tokenized data on disk: a file's rows tokenized once into memory-mapped columns, so that a trainer's memory
does not grow with the file and every attempt, trial, rank and later job on the same file reuses them.

A store is a directory:

- `ids.u32`: every row's token ids, one after the other (uint32);
- `offsets.i64`: where row i starts in `ids.u32` (n + 1 entries);
- `targets.i64`: per row, the class index (sequence classification) or the number of its tokens that carry
  the loss (causal LM);
- `loss.u8` (causal LM): per token, 1 where it carries the loss (a chat row's assistant turns, a prompt's
  completion), aligned with `ids.u32`;
- `meta.json`: the key, row and token counts, the longest row, a few sample texts for the export's parity
  check; `tokenizer/` when the tokenizer was trained on this very file (the tiny built models).

Only numpy and the standard library here: the worker computes keys without torch or transformers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from trainer_core import tasks

# 2: causal-LM stores carry a per-token loss mask (every assistant turn); 3: the key holds the method, which
# decides how a row is laid out (a DPO pair is two store rows)
VERSION = 3
IGNORE = -100
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def tokenizer_fingerprint(model_path: Path | None) -> str:
    """What identifies a model's tokenizer: the bytes of its files; a built model's is trained on the data,
    so its name (with the file's digest in the key) says it all."""
    if model_path is None:
        return "built"
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = model_path / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def store_key(
    file_sha256: str,
    *,
    model: str,
    tokenizer: str,
    task: str,
    method: str,
    max_seq_length: int,
    labels: list[Any],
    tokenized_with: str | None = None,
) -> str:
    """The key of a file's store: everything that changes its token ids and their layout. A validation
    file is tokenized with the training store's tokenizer, named by `tokenized_with` (the training store's
    key)."""
    labels_ = [str(x) for x in labels]
    parts = [VERSION, file_sha256, model, tokenizer, task, method, max_seq_length, labels_]
    blob = json.dumps([*parts, tokenized_with], separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


@dataclass(frozen=True)
class Meta:
    key: str
    task: str
    rows: int
    tokens: int
    longest: int
    samples: list[str]
    has_tokenizer: bool
    dropped: int = 0  # rows left out: max_seq_length cut every token that carried their loss
    dropped_lines: list[int] = field(default_factory=list)  # the file lines of the first of them

    @classmethod
    def read(cls, store: Path) -> Meta:
        return cls(**json.loads((store / "meta.json").read_text()))


class Store(Protocol):
    """What the trainer reads of any store, token or media (mediastore.MediaStore): row i as its collator
    wants it, each row's length for the bucketed sampler, the meta and the tokenizer kept beside it."""

    path: Path
    meta: Meta
    lengths: np.ndarray

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> dict[str, Any]: ...

    @property
    def tokenizer_dir(self) -> Path | None: ...


class TokenStore:
    """A store opened read-only: row i as the Trainer's collator wants it, from memory-mapped columns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.meta = Meta.read(path)
        self.offsets = np.fromfile(path / "offsets.i64", dtype=np.int64)
        self.targets = np.fromfile(path / "targets.i64", dtype=np.int64)
        size = int(self.offsets[-1])
        # np.memmap cannot map an empty file; a store of empty rows has none of its pages anyway
        self.ids = (
            np.memmap(path / "ids.u32", dtype=np.uint32, mode="r", shape=(size,))
            if size
            else np.zeros(0, np.uint32)
        )
        self.lengths = np.diff(self.offsets)
        self.classifies = tasks.get(self.meta.task).classifies
        loss = path / "loss.u8"
        self.loss = (
            np.memmap(loss, dtype=np.uint8, mode="r", shape=(size,)) if size and loss.is_file() else None
        )

    def __len__(self) -> int:
        return self.meta.rows

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = self.ids[self.offsets[i] : self.offsets[i + 1]].astype(np.int64).tolist()
        target = int(self.targets[i])
        if self.classifies:
            return {"input_ids": ids, "labels": target}
        assert self.loss is not None, f"{self.path} has no loss mask"
        carries = self.loss[self.offsets[i] : self.offsets[i + 1]]
        return {"input_ids": ids, "labels": [t if c else IGNORE for t, c in zip(ids, carries, strict=True)]}

    @property
    def tokenizer_dir(self) -> Path | None:
        return self.path / "tokenizer" if self.meta.has_tokenizer else None


class StoreWriter:
    """Appends tokenized rows to a store being built in `path` (a fresh directory); `close` makes it whole."""

    def __init__(self, path: Path, key: str, task: str) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path, self.key, self.task = path, key, task
        self._ids = (path / "ids.u32").open("wb")
        self._offsets = (path / "offsets.i64").open("wb")
        self._targets = (path / "targets.i64").open("wb")
        self._loss = (path / "loss.u8").open("wb") if not tasks.get(task).classifies else None
        self._offsets.write(np.zeros(1, np.int64).tobytes())
        self.rows = self.tokens = self.longest = self.dropped = 0
        self.dropped_lines: list[int] = []
        self.samples: list[str] = []

    def add(
        self,
        batch_ids: list[list[int]],
        targets: list[int],
        texts: list[str],
        loss: list[list[int]] | None = None,
    ) -> None:
        if self._loss is not None:
            assert loss is not None and len(loss) == len(batch_ids)
            flat_loss = np.fromiter((c for row in loss for c in row), dtype=np.uint8)
            self._loss.write(flat_loss.tobytes())
        lengths = np.fromiter((len(x) for x in batch_ids), dtype=np.int64, count=len(batch_ids))
        flat = np.fromiter((t for ids in batch_ids for t in ids), dtype=np.uint32, count=int(lengths.sum()))
        self._ids.write(flat.tobytes())
        self._offsets.write((self.tokens + np.cumsum(lengths)).astype(np.int64).tobytes())
        self._targets.write(np.asarray(targets, dtype=np.int64).tobytes())
        self.rows += len(batch_ids)
        self.tokens += int(lengths.sum())
        self.longest = max(self.longest, int(lengths.max(initial=0)))
        self.samples += texts[: 8 - len(self.samples)]

    def close(self, *, has_tokenizer: bool = False) -> Meta:
        for fh in (self._ids, self._offsets, self._targets, self._loss):
            if fh is not None:
                fh.close()
        meta = Meta(
            self.key,
            self.task,
            self.rows,
            self.tokens,
            self.longest,
            self.samples,
            has_tokenizer,
            self.dropped,
            self.dropped_lines,
        )
        (self.path / "meta.json").write_text(json.dumps(meta.__dict__))  # written last: a store is whole
        return meta


def is_whole(path: Path) -> bool:
    return (path / "meta.json").is_file()


def batched(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch

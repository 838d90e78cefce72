"""How rows become batches: the length-bucketed sampler, the collator (chat rows: trainer_core.data.chat), and
packing of short rows into full sequences."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from trainer_core.data.datastore import IGNORE


class BucketSampler(torch.utils.data.Sampler[int]):
    """Batches of rows of about the same length, so that padding stays small on variable-length data.

    Each epoch shuffles the rows, sorts each window of `window_batches` batches by length, cuts the windows
    into batches and shuffles the batches, so batches still come in random order. The order is a function of
    (seed, epoch) alone: a run resumed mid-epoch (the Trainer skips the batches it already trained) sees the
    batches an uninterrupted run would have seen.
    """

    def __init__(
        self, lengths: Sequence[int] | np.ndarray, batch_size: int, seed: int, window_batches: int = 64
    ):
        self.lengths = np.asarray(lengths)
        self.batch_size, self.seed, self.window = batch_size, seed, batch_size * window_batches
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def order(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch])
        perm = rng.permutation(len(self.lengths))
        windows = [perm[i : i + self.window] for i in range(0, len(perm), self.window)]
        grouped = np.concatenate(
            [w[np.argsort(-self.lengths[w], kind="stable")] for w in windows] or [np.zeros(0, np.int64)]
        )
        batches = [grouped[i : i + self.batch_size] for i in range(0, len(grouped), self.batch_size)]
        # the last, short batch stays last: the Trainer's batch count and drop_last see what they expect
        full, rest = (batches[:-1], batches[-1:]) if len(grouped) % self.batch_size else (batches, [])
        shuffled = [full[i] for i in rng.permutation(len(full))] + rest
        return np.concatenate(shuffled) if shuffled else grouped

    def __iter__(self) -> Iterator[int]:
        return iter(self.order(self.epoch).tolist())


class Collator:
    """Pads to the longest example in the batch; labels of padding are ignored by the loss. Counts the real
    and the padded positions it makes, for the padding fraction the metrics report."""

    def __init__(self, pad_id: int, *, classifies: bool = False) -> None:
        self.pad_id = pad_id
        self.classifies = classifies  # a class index per row, else a target per token
        self.real = self.padded = 0

    def padding_fraction(self) -> float | None:
        """The part of the positions since the last call that were padding."""
        total, real = self.padded, self.real
        self.real = self.padded = 0
        return None if total == 0 else 1.0 - real / total

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(b["input_ids"]) for b in batch)
        self.real += sum(len(b["input_ids"]) for b in batch)
        self.padded += width * len(batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n] = torch.tensor(b["input_ids"])
            mask[i, :n] = 1
        out = {"input_ids": ids, "attention_mask": mask}
        if self.classifies:
            out["labels"] = torch.tensor([b["labels"] for b in batch], dtype=torch.long)
        else:
            labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
            for i, b in enumerate(batch):
                labels[i, : len(b["labels"])] = torch.tensor(b["labels"])
            out["labels"] = labels
        return out


def pack(lengths: np.ndarray, capacity: int) -> list[np.ndarray]:
    """Rows grouped into sequences of at most `capacity` tokens: longest first, each filled up with the
    shortest rows that still fit (a row longer than `capacity` cannot be: the store is cut at it). The same
    lengths always give the same groups, so a resumed job trains on the sequences it started with."""
    order = np.argsort(-lengths, kind="stable")
    groups: list[np.ndarray] = []
    lo, hi = 0, len(order) - 1
    while lo <= hi:
        group, room = [order[lo]], capacity - int(lengths[order[lo]])
        lo += 1
        while lo <= hi and lengths[order[hi]] <= room:
            group.append(order[hi])
            room -= int(lengths[order[hi]])
            hi -= 1
        groups.append(np.asarray(group, dtype=np.int64))
    return groups


class Packed(torch.utils.data.Dataset[dict[str, Any]]):
    """A causal-LM store read as packed sequences: each item is several rows one after the other, with
    `position_ids` starting again at 0 for each row. Given position ids and no attention mask, transformers
    builds a block-diagonal causal mask from them (masking_utils.find_packed_sequence_indices), so no row
    attends to another; the first token of each row carries no loss (it would be predicted from the row
    before it)."""

    def __init__(self, store: Any, capacity: int) -> None:
        self.store = store
        self.groups = pack(np.asarray(store.lengths), capacity)
        self.lengths = np.array([int(store.lengths[g].sum()) for g in self.groups])
        self.meta = store.meta

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for row in self.groups[i]:
            item = self.store[int(row)]
            ids += item["input_ids"]
            labels += [IGNORE, *item["labels"][1:]]
            positions += range(len(item["input_ids"]))
        return {"input_ids": ids, "labels": labels, "position_ids": positions}


class PackedCollator(Collator):
    """Pads packed sequences: the padding is a segment of its own (positions from 0, no loss), and there is
    no attention mask, so the model takes the segments from the position ids. The job's evaluation rows,
    not packed, come through it too, each a segment of its own."""

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(b["input_ids"]) for b in batch)
        self.real += sum(len(b["input_ids"]) for b in batch)
        self.padded += width * len(batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
        positions = torch.zeros((len(batch), width), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n] = torch.tensor(b["input_ids"])
            labels[i, :n] = torch.tensor(b["labels"])
            # an evaluation row is not packed: one segment from 0
            positions[i, :n] = torch.tensor(b.get("position_ids", range(n)))
            positions[i, n:] = torch.arange(width - n)
        return {"input_ids": ids, "labels": labels, "position_ids": positions}

"""How rows become batches: the length-bucketed sampler and the collator (chat rows: trainer_core.chat)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from trainer_core.datastore import IGNORE


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

    def __init__(self, pad_id: int, task: str) -> None:
        self.pad_id = pad_id
        self.task = task
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
        if self.task == "sequence-classification":
            out["labels"] = torch.tensor([b["labels"] for b in batch], dtype=torch.long)
        else:
            labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
            for i, b in enumerate(batch):
                labels[i, : len(b["labels"])] = torch.tensor(b["labels"])
            out["labels"] = labels
        return out

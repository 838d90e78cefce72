"""Preference tuning (DPO) through TRL's DPOTrainer, reading the job's memory-mapped token stores.

A preference store (data/prepare.py) holds pair i as rows 2i (the prompt with the preferred answer) and 2i + 1
(with the non-preferred one), each with its loss mask on that answer's tokens (chat.answered). TRL tokenizes
its data into an Arrow table of its own; here its dataset is only the pairs' indices, and `PairCollator` reads
the pairs from the store, laid out as TRL's own collator lays them (every preferred sequence, then every
non-preferred one, with a completion mask), so the file is tokenized once and memory stays flat.

The reference is the model the job started from: with LoRA, the base with the adapter switched off (TRL's
own way); otherwise a frozen copy made before training.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from trainer_core.data.batches import BucketSampler, Collator
from trainer_core.data.datastore import TokenStore

SPLITS = ("train", "valid")


class PairCollator(Collator):
    """Batches of `{"split", "pair"}` indices as TRL's DPO loss wants them: `input_ids`, `attention_mask`
    and `completion_mask`, the preferred halves first."""

    def __init__(self, pad_id: int, stores: dict[str, TokenStore]) -> None:
        super().__init__(pad_id)
        self.stores = stores

    def sequences(self, split: str, pair: int) -> list[tuple[np.ndarray, np.ndarray]]:
        store = self.stores[split]
        assert store.loss is not None, f"{store.path} has no loss mask"
        out = []
        for row in (2 * pair, 2 * pair + 1):
            a, b = int(store.offsets[row]), int(store.offsets[row + 1])
            out.append((store.ids[a:b].astype(np.int64), store.loss[a:b].astype(np.int64)))
        return out

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        pairs = [self.sequences(b["split"], int(b["pair"])) for b in batch]
        seqs = [p[0] for p in pairs] + [p[1] for p in pairs]  # preferred first, as TRL's chunk(2) expects
        width = max(len(ids) for ids, _ in seqs)
        self.real += sum(len(ids) for ids, _ in seqs)
        self.padded += width * len(seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(seqs), width), dtype=torch.long)
        completion = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (row, mask) in enumerate(seqs):
            ids[i, : len(row)] = torch.from_numpy(row)
            attention[i, : len(row)] = 1
            completion[i, : len(row)] = torch.from_numpy(mask)
        return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def pair_lengths(store: TokenStore) -> np.ndarray:
    """Each pair's longer side: what its batch pads to."""
    return np.maximum(store.lengths[0::2], store.lengths[1::2])


def index(split: str, store: TokenStore) -> Any:
    """The dataset TRL is given: a pair index per row (the pairs themselves stay in the store)."""
    import datasets

    n = len(store) // 2
    return datasets.Dataset.from_dict({"split": [split] * n, "pair": list(range(n))})


@torch.no_grad()
def preference_accuracy(model: Any, collator: PairCollator, split: str, n: int, batch_size: int) -> float:
    """The share of pairs whose preferred answer the model itself finds likelier (summed log-probability of
    the answer's tokens): what DPO should raise on held-out pairs. TRL's `rewards/accuracies` compares against
    the reference instead, and is 0 by construction before training."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    wins = 0
    try:
        for start in range(0, n, batch_size):
            batch = collator([{"split": split, "pair": i} for i in range(start, min(n, start + batch_size))])
            ids = batch["input_ids"].to(device)
            logits = model(input_ids=ids, attention_mask=batch["attention_mask"].to(device)).logits[:, :-1]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            summed = (logp * batch["completion_mask"][:, 1:].to(device)).sum(-1)
            preferred, other = summed.chunk(2)
            wins += int((preferred > other).sum())
    finally:
        model.train(was_training)
    return wins / max(n, 1)


def trainer_class() -> type:
    """StoreDPOTrainer, built on first use: importing TRL costs seconds that supervised jobs need not pay."""
    from trl import DPOTrainer

    class StoreDPOTrainer(DPOTrainer):
        def __init__(self, *args: Any, train_sampler: BucketSampler, **kwargs: Any) -> None:
            self.job_sampler = train_sampler
            super().__init__(*args, **kwargs)
            self.ort_module = None  # DPO trains under PyTorch (backends.ort_problem)

        @property
        def plain_model(self) -> Any:
            return self.model

        def _prepare_dataset(self, dataset: Any, *args: Any, **kwargs: Any) -> Any:
            return dataset  # already tokenized, in the store

        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            return self.job_sampler

        def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
            collator: PairCollator = self.data_collator  # type: ignore[assignment]
            if self.eval_dataset is not None and "valid" in collator.stores:
                n = len(collator.stores["valid"]) // 2
                accuracy = preference_accuracy(
                    self.accelerator.unwrap_model(self.model),
                    collator,
                    "valid",
                    n,
                    self.args.per_device_eval_batch_size,
                )
                self._metrics["eval"]["preference_accuracy"].append(accuracy)  # TRL's log adds eval_
            return dict(super().evaluate(*args, **kwargs))

    return StoreDPOTrainer


def reference(model: Any) -> Any:
    """The frozen model DPO measures the policy against: None for a PEFT model (TRL switches the adapter
    off), a copy of the starting weights otherwise."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        return None
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref

"""Rows to tokenized examples for each task, and the collators that pad them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trainer_core.spec import TrainingSpec

IGNORE = -100


def render(row: dict[str, Any]) -> tuple[str, str]:
    """(prompt, target) of a generative row; the loss is taken on the target only."""
    if "messages" in row:
        turns = row["messages"]
        head = "".join(f"{m['role']}: {m['content']}\n" for m in turns[:-1])
        last = turns[-1]
        if last["role"] == "assistant":
            return head + "assistant: ", last["content"]
        return "", head + f"{last['role']}: {last['content']}\n"
    if "prompt" in row:
        return row["prompt"], row["completion"]
    return "", row["text"]


def texts_of(rows: Sequence[dict[str, Any]]) -> list[str]:
    if rows and "label" in rows[0]:
        return [r["text"] for r in rows]
    return ["".join(render(r)) for r in rows]


class Examples(torch.utils.data.Dataset[dict[str, Any]]):
    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def encode(rows: Sequence[dict[str, Any]], tokenizer: Any, spec: TrainingSpec) -> Examples:
    max_len = spec.hyperparameters.max_seq_length
    if spec.task == "sequence-classification":
        index = {str(label): i for i, label in enumerate(spec.labels)}
        enc = tokenizer([r["text"] for r in rows], truncation=True, max_length=max_len)
        return Examples(
            [
                {"input_ids": ids, "attention_mask": mask, "labels": index[str(r["label"])]}
                for ids, mask, r in zip(enc["input_ids"], enc["attention_mask"], rows, strict=True)
            ]
        )
    items = []
    eos = tokenizer.eos_token_id
    for r in rows:
        prompt, target = render(r)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
        t_ids = tokenizer(target, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
        ids = (p_ids + t_ids)[:max_len]
        labels = ([IGNORE] * len(p_ids) + t_ids)[:max_len]
        items.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels})
    return Examples(items)


class Collator:
    """Pads to the longest example in the batch; labels of padding are ignored by the loss."""

    def __init__(self, pad_id: int, task: str) -> None:
        self.pad_id = pad_id
        self.task = task

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(b["input_ids"]) for b in batch)
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

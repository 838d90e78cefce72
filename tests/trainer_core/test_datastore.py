"""The tokenized store and the batches made from it: the store holds what direct tokenization gives, the
length-bucketed sampler is a deterministic, resumable shuffle that pads little, and a run resumed mid-epoch
trains on the batches an uninterrupted run would have."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import launch_trainer, rows, write_jsonl
from trainer_core import datastore, prepare
from trainer_core.data import BucketSampler
from trainer_core.datastore import IGNORE
from trainer_core.events import EventStream
from trainer_core.launch import with_stores
from trainer_core.spec import Hyperparameters, TrainingSpec

CHAT = [
    {"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": f"{w} {w}"}]}
    for w in ("hello", "goodbye", "thanks", "please", "yes", "no") * 4
]


def spec_for(tmp: Path, task: str, items: list[dict[str, Any]], **kw: Any) -> TrainingSpec:
    train = write_jsonl(tmp / "train.jsonl", items)
    return with_stores(
        TrainingSpec(
            job_id="ftjob-store",
            task=task,
            model="tiny-bert" if task == "sequence-classification" else "tiny-gpt2",
            train_file=str(train),
            labels=["negative", "positive"] if task == "sequence-classification" else [],
            output_dir=str(tmp / "out"),
            hyperparameters=Hyperparameters(max_seq_length=32).resolved(len(items)),
            **kw,
        )
    )


@pytest.mark.parametrize("task", ["sequence-classification", "causal-lm"])
def test_the_store_holds_what_direct_tokenization_gives(tmp_path: Path, task: str) -> None:
    items = rows(48) if task == "sequence-classification" else CHAT
    spec = spec_for(tmp_path, task, items)
    with (tmp_path / "events").open("w") as out:
        train, valid = prepare.ensure(spec, EventStream(out))
    assert valid is None and len(train) == len(items) and train.meta.rows == len(items)
    tokenizer = prepare.load_tokenizer(spec, train)
    for i, row in enumerate(items):
        got = train[i]
        if task == "sequence-classification":
            want = tokenizer(row["text"], truncation=True, max_length=32)["input_ids"]
            assert got == {"input_ids": want, "labels": ["negative", "positive"].index(row["label"])}
        else:
            prompt = tokenizer(
                "user: " + row["messages"][0]["content"] + "\nassistant: ", add_special_tokens=False
            )
            target = tokenizer(row["messages"][1]["content"], add_special_tokens=False)["input_ids"]
            ids = (prompt["input_ids"] + target + [tokenizer.eos_token_id])[:32]
            assert got["input_ids"] == ids
            n = len(prompt["input_ids"])
            assert got["labels"] == [IGNORE] * n + ids[n:]  # loss on the reply and its end only
    assert train.meta.tokens == sum(len(train[i]["input_ids"]) for i in range(len(train)))
    assert train.lengths.tolist() == [len(train[i]["input_ids"]) for i in range(len(train))]


def test_a_whole_store_is_reused_not_rebuilt(tmp_path: Path) -> None:
    spec = spec_for(tmp_path, "sequence-classification", rows(48))
    with (tmp_path / "events").open("w") as out:
        prepare.ensure(spec, EventStream(out))
        first = (Path(spec.train_store or "") / "ids.u32").stat().st_mtime_ns
        prepare.ensure(spec, EventStream(out))
    assert (Path(spec.train_store or "") / "ids.u32").stat().st_mtime_ns == first
    said = [json.loads(line) for line in (tmp_path / "events").read_text().splitlines()]
    assert sum(e.get("message", "").startswith("Tokenized 48 training rows") for e in said) == 1


def test_store_keys_change_with_what_changes_the_ids() -> None:
    base: dict[str, Any] = {
        "model": "m",
        "tokenizer": "t",
        "task": "causal-lm",
        "max_seq_length": 64,
        "labels": [],
    }
    key = datastore.store_key("sha", **base)
    assert key == datastore.store_key("sha", **base)
    for change in ({"model": "n"}, {"tokenizer": "u"}, {"max_seq_length": 65}, {"labels": ["a"]}):
        assert datastore.store_key("sha", **(base | change)) != key
    assert datastore.store_key("other", **base) != key
    assert datastore.store_key("sha", **base, tokenized_with="k") != key


def test_the_bucket_sampler_is_a_deterministic_resumable_shuffle_that_pads_little() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 128, size=1000)
    sampler = BucketSampler(lengths, batch_size=16, seed=7)
    first = list(sampler)
    assert sorted(first) == list(range(1000))  # every row once
    assert first == list(BucketSampler(lengths, batch_size=16, seed=7))  # by seed alone
    sampler.set_epoch(1)
    assert list(sampler) != first  # each epoch its own order
    sampler.set_epoch(0)
    assert list(sampler) == first  # resumable: epoch 0 again is epoch 0

    def padding(order: list[int]) -> float:
        batches = [lengths[order[i : i + 16]] for i in range(0, len(order), 16)]
        return 1 - sum(b.sum() for b in batches) / sum(b.max() * len(b) for b in batches)

    shuffled = rng.permutation(1000).tolist()
    assert padding(first) < 0.1 < 0.3 < padding(shuffled)
    starts = [first[i] for i in range(0, 1000, 16)]
    assert starts != sorted(starts, key=lambda i: -lengths[i])  # batches come in random order, not by length


def test_a_run_resumed_mid_epoch_trains_on_the_batches_of_an_uninterrupted_one(tmp_path: Path) -> None:
    """6 steps an epoch, a checkpoint at step 4: the resumed run's losses at steps 5 to 8 are those of the
    run that went through (same batches, same order, same state)."""
    items = [{"text": r["text"] * (1 + i % 4), "label": r["label"]} for i, r in enumerate(rows(48))]
    spec = spec_for(
        tmp_path, "sequence-classification", items, checkpoint_every_steps=4, seed=11, backend="torch"
    )
    hp = Hyperparameters(max_steps=8, batch_size=8, learning_rate=1e-3, max_seq_length=64).resolved(48)
    spec = spec.model_copy(update={"hyperparameters": hp})

    def run(s: TrainingSpec, name: str) -> dict[int, float]:
        code, said, stderr = launch_trainer(s, tmp_path / f"{name}.json")
        assert code == 0, stderr
        return {e["step"]: e["train_loss"] for e in said if e["type"] == "metrics" and "train_loss" in e}

    through = run(spec, "through")
    checkpoint = Path(spec.output_dir) / "checkpoints" / "checkpoint-4"
    assert checkpoint.is_dir()
    resumed = run(
        spec.model_copy(update={"resume_from": str(checkpoint), "output_dir": str(tmp_path / "again")}),
        "resumed",
    )
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in (5, 6, 7, 8):
        assert resumed[step] == pytest.approx(through[step], rel=1e-5, abs=1e-6), (step, resumed, through)


@pytest.mark.parametrize(("floor", "expected"), [(0.0, [1, 2, 3, 4, 5, 6]), (3600.0, [6])])
def test_checkpoints_come_no_faster_than_the_services_minimum_interval(
    tmp_path: Path, floor: float, expected: list[int]
) -> None:
    """A checkpoint every step of a fast model: with a floor, only the last step's is taken (it never is
    held back) and one warning says why; without one, every step's."""
    spec = spec_for(tmp_path, "sequence-classification", rows(48), checkpoint_every_steps=1, backend="torch")
    hp = Hyperparameters(max_steps=6, batch_size=8, max_seq_length=32).resolved(48)
    spec = spec.model_copy(update={"hyperparameters": hp, "min_checkpoint_seconds": floor})
    code, said, stderr = launch_trainer(spec, tmp_path / "spec.json")
    assert code == 0, stderr
    assert [e["step"] for e in said if e["type"] == "checkpoint"] == expected
    skipped = [e for e in said if e["type"] == "message" and "skipped" in e["message"]]
    assert len(skipped) == (1 if floor else 0)
    if floor:
        assert "less than 3600 s ago, the minimum interval here" in skipped[0]["message"]

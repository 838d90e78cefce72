"""The tokenized store and the batches made from it: the store holds what direct tokenization gives, the
length-bucketed sampler is a deterministic, resumable shuffle that pads little, and a run resumed mid-epoch
trains on the batches an uninterrupted run would have."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import launch_trainer, rows, tokenized_spec
from trainer_core.data import chat, datastore, prepare
from trainer_core.data.batches import BucketSampler
from trainer_core.data.datastore import IGNORE
from trainer_core.events import EventStream
from trainer_core.spec import Hyperparameters, TrainingSpec

CHAT = [
    {"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": f"{w} {w}"}]}
    for w in ("hello", "goodbye", "thanks", "please", "yes", "no") * 4
]


@pytest.mark.parametrize("task", ["sequence-classification", "causal-lm"])
def test_the_store_holds_what_direct_tokenization_gives(tmp_path: Path, task: str) -> None:
    items = rows(48) if task == "sequence-classification" else CHAT
    spec = tokenized_spec(tmp_path, task, items)
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
            ids, loss = chat.encode(tokenizer, row["messages"], 32)
            assert got == {
                "input_ids": ids,
                "labels": [t if c else IGNORE for t, c in zip(ids, loss, strict=True)],
            }
            reply = tokenizer.decode([t for t in got["labels"] if t != IGNORE])
            assert reply == row["messages"][1]["content"] + "<|im_end|>\n"  # the reply and its end only
    assert train.meta.tokens == sum(len(train[i]["input_ids"]) for i in range(len(train)))
    assert train.lengths.tolist() == [len(train[i]["input_ids"]) for i in range(len(train))]


def test_a_whole_store_is_reused_not_rebuilt(tmp_path: Path) -> None:
    spec = tokenized_spec(tmp_path, "sequence-classification", rows(48))
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
        "method": "supervised",
        "max_seq_length": 64,
        "labels": [],
    }
    key = datastore.store_key("sha", **base)
    assert key == datastore.store_key("sha", **base)
    # the method lays a file out (DPO: two rows a pair), so another method never shares a method's store
    changes = (
        {"model": "n"},
        {"tokenizer": "u"},
        {"max_seq_length": 65},
        {"labels": ["a"]},
        {"method": "dpo"},
    )
    for change in changes:
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
    spec = tokenized_spec(
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
    spec = tokenized_spec(
        tmp_path, "sequence-classification", rows(48), checkpoint_every_steps=1, backend="torch"
    )
    hp = Hyperparameters(max_steps=6, batch_size=8, max_seq_length=32).resolved(48)
    spec = spec.model_copy(update={"hyperparameters": hp, "min_checkpoint_seconds": floor})
    code, said, stderr = launch_trainer(spec, tmp_path / "spec.json")
    assert code == 0, stderr
    assert [e["step"] for e in said if e["type"] == "checkpoint"] == expected
    skipped = [e for e in said if e["type"] == "message" and "skipped" in e["message"]]
    assert len(skipped) == (1 if floor else 0)
    if floor:
        assert "less than 3600 s ago, the minimum interval here" in skipped[0]["message"]


LLAMA_TEMPLATE = (  # the shape of Llama 3's: a BOS, headers, an end-of-turn marker
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.mark.parametrize("template", [None, LLAMA_TEMPLATE])
def test_every_assistant_turn_carries_the_loss_and_nothing_else_token_by_token(
    tmp_path: Path, template: str | None
) -> None:
    """A multi-turn conversation under the model's own template (or the default ChatML one): the tokens
    with loss are exactly those of the two assistant turns with weight, each with its end-of-turn marker;
    the system and user turns, the headers and the `weight: 0` turn carry none."""
    conversation = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "say hello"},
        {"role": "assistant", "content": "hello hello"},
        {"role": "user", "content": "say no"},
        {"role": "assistant", "content": "no thanks", "weight": 0},
        {"role": "user", "content": "say yes"},
        {"role": "assistant", "content": "yes please"},
    ]
    spec = tokenized_spec(tmp_path, "causal-lm", [*CHAT, {"messages": conversation}])
    with (tmp_path / "events").open("w") as out:
        train, _ = prepare.ensure(spec, EventStream(out))
    tokenizer = prepare.load_tokenizer(spec, train)
    tokenizer.bos_token = tokenizer.bos_token or tokenizer.eos_token
    tokenizer.chat_template = template
    ids, loss = chat.encode(tokenizer, conversation, 512)
    end = "<|im_end|>\n" if template is None else "<|eot_id|>"
    assert tokenizer.decode(ids).startswith(tokenizer.bos_token if template else "<|im_start|>system")
    runs, run = [], []  # the contiguous stretches of loss tokens
    for t, c in zip(ids, loss, strict=True):
        if c:
            run.append(t)
        elif run:
            runs, run = [*runs, run], []
    runs += [run] if run else []
    assert [tokenizer.decode(r) for r in runs] == [f"hello hello{end}", f"yes please{end}"]
    assert sum(loss) == sum(len(r) for r in runs)


def test_rows_truncated_to_no_loss_are_left_out_and_said(tmp_path: Path) -> None:
    """max_seq_length 48 cuts the long rows before their reply begins: they would train on nothing (a 0/0
    loss, NaN), so they are left out and counted; a file of nothing else is refused with the reason."""
    long = [{"messages": [{"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "ok"}]}]
    items = CHAT[:6] + long * 3
    spec = tokenized_spec(tmp_path, "causal-lm", items)
    spec = spec.model_copy(
        update={"hyperparameters": spec.hyperparameters.model_copy(update={"max_seq_length": 48})}
    )
    with (tmp_path / "events").open("w") as out:
        train, _ = prepare.ensure(spec, EventStream(out))
    said = [json.loads(line) for line in (tmp_path / "events").read_text().splitlines()]
    assert train.meta.rows == 6 and train.meta.dropped == 3
    assert all(any(c != IGNORE for c in train[i]["labels"]) for i in range(len(train)))
    warn = next(e for e in said if "were left out" in e.get("message", ""))
    assert (
        "3 training rows (line 7, 8, 9) were left out: max_seq_length 48 cut every token that carried "
        "their loss" in warn["message"]
    )
    # truncated_rows: refuse fails the job on the same store (cached: it is checked on every open)
    refuse = spec.model_copy(
        update={"hyperparameters": spec.hyperparameters.model_copy(update={"truncated_rows": "refuse"})}
    )
    with (tmp_path / "events3").open("w") as out, pytest.raises(ValueError) as refused:
        prepare.ensure(refuse, EventStream(out))
    assert "3 training rows (line 7, 8, 9) were left out" in str(refused.value)
    assert "truncated_rows is refuse: raise max_seq_length or shorten them" in str(refused.value)

    (tmp_path / "b").mkdir()
    only_long = tokenized_spec(tmp_path / "b", "causal-lm", long * 4)
    only_long = only_long.model_copy(
        update={"hyperparameters": only_long.hyperparameters.model_copy(update={"max_seq_length": 48})}
    )
    with (tmp_path / "events2").open("w") as out, pytest.raises(ValueError, match="which was all of them"):
        prepare.ensure(only_long, EventStream(out))


def test_the_sequence_limit_is_bounded_by_what_the_model_reads(tmp_path: Path) -> None:
    spec = tokenized_spec(tmp_path, "causal-lm", CHAT)
    spec = spec.model_copy(
        update={"hyperparameters": spec.hyperparameters.model_copy(update={"max_seq_length": 2048})}
    )

    class Tokenizer:
        def __init__(self, most: int) -> None:
            self.model_max_length = most

    assert prepare.seq_limit(spec, Tokenizer(512)) == 512  # a BERT-sized model
    assert prepare.seq_limit(spec, Tokenizer(int(1e30))) == 2048  # transformers' "not said"
    assert prepare.seq_limit(spec, Tokenizer(8192)) == 2048


def test_a_template_that_renders_a_beginning_differently_is_refused(tmp_path: Path) -> None:
    """The turns are found by rendering the conversation's beginnings; a template whose generation prompt
    is not how it renders an assistant turn would misplace the loss, so it is refused with the reason."""
    spec = tokenized_spec(tmp_path, "causal-lm", CHAT)
    with (tmp_path / "events").open("w") as out:
        train, _ = prepare.ensure(spec, EventStream(out))
    tokenizer = prepare.load_tokenizer(spec, train)
    tokenizer.chat_template = chat.DEFAULT_TEMPLATE.replace(
        "<|im_start|>assistant\n{% endif %}", "BOT:{% endif %}"
    )
    with pytest.raises(chat.ChatTemplateError, match="renders a conversation's beginning differently"):
        chat.encode(tokenizer, CHAT[0]["messages"], 64)

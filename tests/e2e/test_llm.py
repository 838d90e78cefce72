"""The LLM path as a team would use it, through the API on a local model cache: LoRA SFT on chat rows with the
model's own chat template, then DPO on preference pairs continuing from that job's model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ortune.cli import embedded
from ortune.cli.client import Client
from ortune.settings import Settings
from tests.support import ANIMALS, TERMINAL, preference_rows, wait_for, write_jsonl
from tests.trainer_core.test_training import prepare_text, tiny_causal_lm

pytestmark = pytest.mark.e2e


def chat_rows(held_out: bool = False) -> list[dict[str, object]]:
    ask = "Which sound does a {} make?" if held_out else "What does a {} say?"
    return [
        {
            "messages": [
                {"role": "system", "content": "You answer in one sentence."},
                {"role": "user", "content": ask.format(animal)},
                {"role": "assistant", "content": f"A {animal} says {sound}."},
            ]
        }
        for animal, sound in ANIMALS.items()
    ] * (2 if held_out else 8)


def hub(root: Path, shape: str) -> Path:
    """A Hugging Face cache holding acme/tiny-<shape>, its tokenizer with ChatML as its chat template."""
    from trainer_core.data import chat
    from trainer_core.models import modeling

    texts = [prepare_text(r) for r in chat_rows() + preference_rows(12)]
    tokenizer = modeling.train_tokenizer("tiny-gpt2", texts * 10)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = chat.DEFAULT_TEMPLATE
    cache = root / f"models--acme--tiny-{shape}"
    tiny_causal_lm(cache / "snapshots" / "r1", tokenizer, shape)
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("r1")
    return root


@pytest.fixture
def llm_service(settings: Settings, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Client]:
    shape = request.node.callspec.params["shape"]
    local = settings.model_copy(update={"models_dir": hub(tmp_path / "hub", shape)})
    with embedded.start(local, log_dir=tmp_path / "logs"):
        yield Client(local.api_url)


@pytest.mark.parametrize(
    ("config", "shape"), [("embedded", "qwen2"), ("production", "llama")], indirect=["config"]
)
def test_lora_sft_then_dpo_on_a_local_chat_model(llm_service: Client, tmp_path: Path, shape: str) -> None:
    service = llm_service
    model = f"acme/tiny-{shape}"
    assert model in [m["id"] for m in service.get("/v1/models")["data"]]
    train = service.upload(write_jsonl(tmp_path / "chat.jsonl", chat_rows()))
    valid = service.upload(write_jsonl(tmp_path / "chat-valid.jsonl", chat_rows(held_out=True)))
    sft = service.create_job(
        model=model,
        training_file=train["id"],
        validation_file=valid["id"],
        suffix="sounds",
        seed=5,  # a job without a seed gets a random one: the figures below would move run to run
        method={
            "type": "supervised",
            "supervised": {
                "hyperparameters": {"n_epochs": 4, "batch_size": 8, "learning_rate": 1e-2},
                "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
            },
        },
    )
    done = wait_for(service, sft["id"], TERMINAL)
    assert done["status"] == "succeeded", done["error"]
    evals = service.get(f"/v1/fine_tuning/jobs/{sft['id']}/metrics", name="eval_loss")["data"]["eval_loss"]
    # a random tiny base whose embeddings and head stay frozen moves slowly under LoRA: 5.90 -> 5.45 here
    assert evals["steps"][0] == 0 and evals["values"][-1] < evals["values"][0] - 0.2, evals
    formats = {a["format"]: a for a in service.get(f"/v1/fine_tuning/jobs/{sft['id']}/artifacts")}
    assert set(formats) == {"adapter", "pytorch", "onnx"}
    greedy = formats["onnx"]["manifest"]["greedy_parity"]
    assert greedy["diverged"] == [] and greedy["prompts"] > 0

    pairs = service.upload(write_jsonl(tmp_path / "pairs.jsonl", preference_rows(48)))
    held_out = service.upload(write_jsonl(tmp_path / "held-out.jsonl", preference_rows(12, held_out=True)))
    dpo = service.create_job(
        model=done["fine_tuned_model"],
        seed=5,
        training_file=pairs["id"],
        validation_file=held_out["id"],
        method={
            "type": "dpo",
            "dpo": {
                "hyperparameters": {"beta": 0.1, "n_epochs": 2, "batch_size": 8, "learning_rate": 5e-3},
                "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
            },
        },
    )
    tuned = wait_for(service, dpo["id"], TERMINAL)
    assert tuned["status"] == "succeeded", tuned["error"]
    accuracy = service.get(f"/v1/fine_tuning/jobs/{dpo['id']}/metrics", name="eval_reward_accuracy")["data"]
    assert accuracy["eval_reward_accuracy"]["values"][-1] >= 0.75, accuracy
    assert tuned["result"]["metrics"]["eval_reward_margin"] > 0

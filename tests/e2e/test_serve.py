"""Trying what was trained: OpenAI's chat and text completions (streamed and not) through the official client,
and label scores from a classifier, served from the jobs' ONNX artifacts by the inference process."""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

import openai
import pytest

from ortune.cli.client import Client
from tests.support import ANIMALS, TERMINAL, rows, wait_for, write_jsonl

pytestmark = pytest.mark.e2e

CHATS = [
    {
        "messages": [
            {"role": "user", "content": f"What does a {a} say?"},
            {"role": "assistant", "content": f"{s}!"},
        ]
    }
    for a, s in ANIMALS.items()
] * 8


def trained(service: Client, tmp_path: Path, **job: Any) -> dict[str, Any]:
    created = service.create_job(**job)
    done = wait_for(service, created["id"], TERMINAL)
    assert done["status"] == "succeeded", done["error"]
    return done


def pytorch_reply(
    service: Client, job_id: str, tmp_path: Path, messages: list[dict[str, str]], n: int
) -> str:
    """What the job's PyTorch model answers greedily, through the same chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer_core.data import chat

    service.download(job_id, "pytorch", tmp_path / "pt.tar")
    with tarfile.open(tmp_path / "pt.tar") as tar:
        tar.extractall(tmp_path, filter="data")
    tok = AutoTokenizer.from_pretrained(tmp_path / "pytorch")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "pytorch").eval()
    text = tok.apply_chat_template(
        messages, chat_template=chat.DEFAULT_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    reply = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=False)
    return str(reply).split("<|im_end|>")[0].split(tok.eos_token)[0]


@pytest.mark.parametrize("config", ["production"], indirect=True)
def test_a_fine_tuned_chat_model_answers_through_the_openai_client(service: Client, tmp_path: Path) -> None:
    train = service.upload(write_jsonl(tmp_path / "chat.jsonl", CHATS))
    done = trained(
        service,
        tmp_path,
        model="tiny-gpt2",
        training_file=train["id"],
        suffix="zoo",
        hyperparameters={"n_epochs": 6, "batch_size": 8, "learning_rate": 3e-3},
    )
    name = done["fine_tuned_model"]
    client = openai.OpenAI(base_url=f"{service.http.base_url}/v1", api_key=service.api_key, max_retries=0)
    messages = [{"role": "user", "content": "What does a cow say?"}]
    answer = client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=12)  # type: ignore[arg-type]
    reply = answer.choices[0].message.content
    assert answer.model == name and answer.choices[0].finish_reason in ("stop", "length")
    assert reply == pytorch_reply(service, done["id"], tmp_path, messages, 12)
    assert answer.usage is not None and answer.usage.prompt_tokens > 0 and answer.usage.completion_tokens > 0
    assert answer.system_fingerprint == "ortune-onnx-kv"  # decoded with the export's KV cache

    chunks = list(
        client.chat.completions.create(
            model=name,
            messages=messages,
            temperature=0,
            max_tokens=12,
            stream=True,  # type: ignore[arg-type]
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply and len([c for c in chunks if c.choices]) >= 2
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == answer.choices[0].finish_reason

    sampled = [
        client.chat.completions.create(model=name, messages=messages, temperature=1.0, seed=7, max_tokens=8)  # type: ignore[arg-type]
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]  # the same seed, the same sample

    text = client.completions.create(
        model=name, prompt="<|im_start|>user\nWhat does a dog say?", max_tokens=5
    )
    assert text.object == "text_completion" and text.usage is not None and text.usage.completion_tokens <= 5

    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="ft:tiny-gpt2:nobody:ftjob-x", messages=messages)  # type: ignore[arg-type]
    assert missing.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=name, messages=messages, max_tokens=8000)  # type: ignore[arg-type]
    assert too_long.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    with pytest.raises(openai.UnprocessableEntityError) as hot:
        client.chat.completions.create(model=name, messages=messages, temperature=3)  # type: ignore[arg-type]
    assert hot.value.body["param"] == "temperature"  # type: ignore[index]


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_a_fine_tuned_classifier_gives_label_scores(service: Client, tmp_path: Path) -> None:
    train = service.upload(write_jsonl(tmp_path / "train.jsonl", rows(64)))
    done = trained(
        service,
        tmp_path,
        model="tiny-bert",
        training_file=train["id"],
        backend="torch",
        hyperparameters={"max_steps": 20, "batch_size": 16, "learning_rate": 2e-3, "max_seq_length": 32},
    )
    texts = [r["text"] for r in rows(4, "sentiment_valid.jsonl")]
    scored = service.http.post("/v1/predict", json={"model": done["fine_tuned_model"], "inputs": texts})
    assert scored.status_code == 200, scored.text
    data = scored.json()["data"]
    assert len(data) == 4 and all({s["label"] for s in d} == {"negative", "positive"} for d in data)
    assert all(abs(sum(s["score"] for s in d) - 1) < 1e-5 and d[0]["score"] >= d[1]["score"] for d in data)
    chat = service.http.post(
        "/v1/chat/completions",
        json={"model": done["fine_tuned_model"], "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 400 and "use /v1/predict" in chat.json()["error"]["message"]

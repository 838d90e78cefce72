"""Real datasets at the limits: a large file trains with the trainer's memory flat in its size, tokenized
once and reused; a trainer over its memory limit fails saying so; attempts leave no disk behind; checkpoint
retention keeps what it says."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from ortune.cli import embedded
from ortune.cli.client import Client
from ortune.settings import Settings
from ortune.storage import ObjectNotFound, open_store
from tests.deployments import Deployment
from tests.support import TERMINAL, checkpoints, events, rows, wait_for, wait_until, write_jsonl

pytestmark = pytest.mark.e2e
WORDS = [
    "the",
    "a",
    "good",
    "bad",
    "movie",
    "phone",
    "service",
    "was",
    "is",
    "not",
    "very",
    "really",
    "great",
    "terrible",
    "slow",
    "fast",
    "kind",
    "rude",
]


def varied_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Text + label rows of 3 to 60 words: lengths vary as in real data, so padding and buckets matter."""
    rng = random.Random(seed)
    return [
        {"text": " ".join(rng.choices(WORDS, k=rng.randint(3, 60))), "label": rng.choice(["neg", "pos"])}
        for _ in range(n)
    ]


def train_job(client: Client, file_id: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny-bert",
        "training_file": file_id,
        "backend": "torch",
        "seed": 3,
        "hyperparameters": {"max_steps": 3, "batch_size": 16, "max_seq_length": 64},
    }
    return client.create_job(**(body | extra))


def peak_of(client: Client, job_id: str) -> int:
    """The trainer's peak private memory, as the worker read it from /proc (RssAnon of its process tree)."""
    said = [
        e for e in events(client, job_id) if e["message"].startswith("Peak private memory of the trainer")
    ]
    assert len(said) == 1, [e["message"] for e in events(client, job_id)]
    return int(said[0]["data"]["peak_bytes"])


def messages(client: Client, job_id: str) -> list[str]:
    return [e["message"] for e in events(client, job_id)]


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_a_large_file_trains_with_memory_flat_in_its_size_and_is_tokenized_once(
    service: Client, tmp_path: Path
) -> None:
    small = service.upload(write_jsonl(tmp_path / "small.jsonl", varied_rows(2_000)))
    large = service.upload(write_jsonl(tmp_path / "large.jsonl", varied_rows(120_000, seed=1)))
    assert large["status"] == "processed" and large["row_count"] == 120_000
    done = {}
    for name, file in (("small", small), ("large", large), ("again", large)):
        job = train_job(service, file["id"])
        done[name] = wait_for(service, job["id"], TERMINAL, timeout=900)
        assert done[name]["status"] == "succeeded", done[name]["error"]
    small_peak, large_peak = peak_of(service, done["small"]["id"]), peak_of(service, done["large"]["id"])
    # 60x the rows, the same private memory: the rows live in the memory-mapped store, not in the trainer
    # (bench/data_scale goes to 2M rows)
    assert large_peak <= 1.25 * small_peak, (small_peak, large_peak)
    first, again = messages(service, done["large"]["id"]), messages(service, done["again"]["id"])
    assert any(m.startswith("Tokenized 120,000 training rows") for m in first)
    assert any(m.startswith("Tokenizing training data: ") and "rows/s" in m for m in first)  # progress
    assert not any(m.startswith("Tokenized 120,000") for m in again)
    assert any(m.startswith("Tokenized data reused from this node's cache: 120,000 rows") for m in again)
    padding = service.get(f"/v1/fine_tuning/jobs/{done['large']['id']}/metrics", name="padding_fraction")
    values = padding["data"]["padding_fraction"]["values"]
    assert values and max(values) < 0.2  # length-bucketed batches; random ones pad about half


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_a_trainer_over_its_memory_limit_fails_with_out_of_memory(settings: Settings, tmp_path: Path) -> None:
    limited = settings.model_copy(update={"trainer_memory_limit": 160 * 2**20})
    with embedded.start(limited, log_dir=tmp_path / "logs"):
        client = Client(limited.api_url)
        train = client.upload(write_jsonl(tmp_path / "train.jsonl", rows(64)))
        job = wait_for(client, train_job(client, train["id"])["id"], TERMINAL)
    assert job["status"] == "failed" and job["error"]["code"] == "out_of_memory", job["error"]
    message = job["error"]["message"]
    assert "memory limit of 160 MiB" in message and "peak" in message
    assert any(f"while {phase}" in message for phase in ("tokenizing", "loading", "training", "starting"))


@pytest.mark.parametrize("config", ["production"], indirect=True)
def test_an_attempt_leaves_no_work_directory(deployment: Deployment, service: Client, tmp_path: Path) -> None:
    work = deployment.settings.job_work_dir
    train = service.upload(write_jsonl(tmp_path / "train.jsonl", rows(64)))
    ok = train_job(service, train["id"])
    failing = train_job(service, train["id"], backend="ort", precision="bf16")  # ORT on CPU is fp32 only
    cancelled = train_job(service, train["id"], hyperparameters={"max_steps": 100_000, "batch_size": 8})
    wait_until("training", lambda: service.job(cancelled["id"])["progress"]["step"] > 0)
    service.post(f"/v1/fine_tuning/jobs/{cancelled['id']}/cancel")
    ends = {job["id"]: wait_for(service, job["id"], TERMINAL)["status"] for job in (ok, failing, cancelled)}
    assert list(ends.values()) == ["succeeded", "failed", "cancelled"]
    for job_id in ends:
        wait_until(
            f"{job_id}'s work directory to go",
            lambda j=job_id: not (work / j).exists() or not any((work / j).iterdir()),
        )


def test_retention_keeps_the_last_checkpoints_and_the_best(
    deployment: Deployment, service: Client, tmp_path: Path
) -> None:
    settings = deployment.settings
    train = service.upload(write_jsonl(tmp_path / "train.jsonl", rows(64)))
    valid = service.upload(write_jsonl(tmp_path / "valid.jsonl", rows(16, "sentiment_valid.jsonl")))
    job = train_job(
        service,
        train["id"],
        validation_file=valid["id"],
        checkpoint_every_steps=2,
        keep_checkpoints=2,
        hyperparameters={"max_steps": 12, "batch_size": 8, "eval_every_steps": 2, "learning_rate": 5e-3},
    )
    done = wait_for(service, job["id"], TERMINAL)
    assert done["status"] == "succeeded", done["error"]
    series = service.get(f"/v1/fine_tuning/jobs/{job['id']}/metrics", name="eval_loss")["data"]["eval_loss"]
    losses = dict(zip(series["steps"], series["values"], strict=True))
    best = min((s for s in range(2, 13, 2)), key=lambda s: losses[s])
    kept = checkpoints(service, job["id"])
    assert sorted(kept) == sorted({10, 12, best})
    deleted = [e for e in events(service, job["id"]) if e["message"].startswith("Deleted the checkpoint")]
    gone = sorted({s for e in deleted for s in e["data"]["deleted_steps"]})
    assert gone == sorted(set(range(2, 13, 2)) - set(kept))
    store = open_store(
        settings.storage_url,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key.get_secret_value(),
    )
    for step in gone:
        with pytest.raises(ObjectNotFound):
            store.stat(f"jobs/{job['id']}/attempt-1/checkpoints/step-{step}.tar")
    for step in kept:
        store.stat(f"jobs/{job['id']}/attempt-1/checkpoints/step-{step}.tar")

"""Hyperparameter search: trials are child jobs through the same queue; the best one becomes the result."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ortune.cli.client import Client
from tests.support import DEMO, TERMINAL, events, rows, wait_for, write_jsonl

SPACE = {"learning_rate": {"type": "float", "low": 1e-4, "high": 3e-2, "log": True}}


def search_body(train: str, valid: str | None, **search: Any) -> dict[str, Any]:
    return {
        "model": "tiny-bert",
        "training_file": train,
        "validation_file": valid,
        "backend": "torch",
        "seed": 5,
        "hyperparameters": {"max_steps": 4, "batch_size": 8, "max_seq_length": 32},
        "hyperparameter_search": {"n_trials": 3, "space": SPACE, "metric": "eval_loss"} | search,
    }


@pytest.mark.parametrize("config", ["embedded"], indirect=True)  # request validation: no store is touched
@pytest.mark.parametrize(
    ("search", "status", "param", "fragment"),
    [
        ({"space": {"dropout": {"type": "float", "low": 0, "high": 1}}}, 422, "space", "not searchable"),
        ({"space": {"learning_rate": {"type": "float", "low": 1e-2, "high": 1e-3}}}, 422, "space", "below"),
        ({"space": {"learning_rate": {"type": "float", "low": 1e-3, "high": 2}}}, 422, "space", "valid"),
        ({"space": {"batch_size": {"type": "float", "low": 4, "high": 8}}}, 422, "space", "whole number"),
        ({"space": {"learning_rate": {"type": "categorical"}}}, 422, "space", "choices"),
        ({"n_trials": 0}, 422, "n_trials", "greater than or equal to 1"),
        ({"n_trials": 2, "parallelism": 3}, 422, "hyperparameter_search", "parallelism"),
        ({"metrik": "eval_loss"}, 422, "metrik", "unknown field"),
    ],
)
def test_a_bad_search_is_refused_by_name(
    client: TestClient,
    train_file: dict[str, Any],
    search: dict[str, Any],
    status: int,
    param: str,
    fragment: str,
) -> None:
    response = client.post("/v1/fine_tuning/jobs", json=search_body(train_file["id"], None, **search))
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert param in (error["param"] or "") and fragment in error["message"]
    assert client.get("/v1/fine_tuning/jobs").json()["data"] == []  # nothing half-created


def test_an_eval_metric_needs_a_validation_file(client: TestClient, train_file: dict[str, Any]) -> None:
    response = client.post("/v1/fine_tuning/jobs", json=search_body(train_file["id"], None))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "hyperparameter_search.metric"


@pytest.mark.e2e
@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_search_runs_trials_as_jobs_and_keeps_the_best(service: Client, tmp_path: Path) -> None:
    train = service.upload(write_jsonl(tmp_path / "train.jsonl", rows(48)))
    valid = service.upload(write_jsonl(tmp_path / "valid.jsonl", rows(16, "sentiment_valid.jsonl")))
    parent = service.create_job(**search_body(train["id"], valid["id"]))
    assert parent["hyperparameter_search"]["n_trials"] == 3
    done = wait_for(service, parent["id"], TERMINAL, timeout=600)
    assert done["status"] == "succeeded", done["error"]

    trials = service.get(f"/v1/fine_tuning/jobs/{parent['id']}/trials")["data"]
    assert len(trials) == 3 and all(t["parent_job_id"] == parent["id"] for t in trials)
    assert all(t["status"] == "succeeded" for t in trials)
    rates = [t["hyperparameters"]["learning_rate_multiplier"] for t in trials]
    assert rates == ["auto"] * 3  # the search varies learning_rate itself, shown in the result
    params = [r["params"]["learning_rate"] for r in done["result"]["trials"]]
    assert params == [t["search_params"]["learning_rate"] for t in trials]
    assert len(set(params)) == 3 and all(1e-4 <= p <= 3e-2 for p in params)
    losses = {t["id"]: t["result"]["metrics"]["eval_loss"] for t in trials}
    best = min(losses, key=lambda k: losses[k])
    assert done["result"]["best_job_id"] == best and done["result"]["best_value"] == losses[best]
    winner = next(t for t in trials if t["id"] == best)
    assert done["fine_tuned_model"] == winner["fine_tuned_model"]
    assert done["progress"] == {"step": 3, "total_steps": 3}

    # The search job downloads as its best trial: the same stored object, checksum verified by the client.
    digest = service.download(parent["id"], "pytorch", tmp_path / "best.tar")
    want = service.get(f"/v1/fine_tuning/jobs/{best}/artifacts")
    assert digest == hashlib.sha256((tmp_path / "best.tar").read_bytes()).hexdigest()
    assert digest == next(a["sha256"] for a in want if a["format"] == "pytorch")
    messages = [e["message"] for e in events(service, parent["id"])]
    assert sum(m.startswith("Started trial") for m in messages) == 3
    # The first trial tokenized the files; the others reused its stores instead of tokenizing again.
    for n, trial in enumerate(trials):
        said = [e["message"] for e in events(service, trial["id"])]
        tokenized = [m for m in said if m.startswith("Tokenized ") and "reused" not in m]
        reused = [m for m in said if m.startswith("Tokenized data reused")]
        assert (len(tokenized), len(reused)) == ((2, 0) if n == 0 else (0, 2)), said
    assert any(m.startswith("The search has completed: best trial " + best) for m in messages)


@pytest.mark.e2e
@pytest.mark.parametrize("config", ["production"], indirect=True)
def test_cancelling_a_search_cancels_its_trials(service: Client, tmp_path: Path) -> None:
    train = service.upload(DEMO / "sentiment_train.jsonl")
    body = search_body(train["id"], None, metric="train_loss", n_trials=4, parallelism=2)
    body["hyperparameters"] |= {"max_steps": 2000}
    parent = service.create_job(**body)
    wait_for(service, parent["id"], {"running"})
    trials: list[dict[str, Any]] = []
    for _ in range(100):
        trials = service.get(f"/v1/fine_tuning/jobs/{parent['id']}/trials")["data"]
        if len(trials) == 2:
            break
        time.sleep(0.2)
    assert len(trials) == 2  # two at a time
    assert service.post(f"/v1/fine_tuning/jobs/{parent['id']}/cancel")["status"] == "cancelled"
    for trial in trials:
        assert wait_for(service, trial["id"], TERMINAL, timeout=60)["status"] == "cancelled"
    assert len(service.get(f"/v1/fine_tuning/jobs/{parent['id']}/trials")["data"]) == 2  # no new trial


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_trials_count_against_the_tenants_concurrent_job_quota(settings: Any) -> None:
    """A search with 3 trials at a time, for a tenant that may hold 2 unfinished jobs: the search itself is
    one, so one trial runs at a time."""
    from api.main import create_app
    from tests.support import upload
    from worker.search import advance

    s = settings.model_copy(update={"max_concurrent_jobs": 2})
    with TestClient(create_app(s)) as client:
        file = upload(client, DEMO / "sentiment_train.jsonl").json()
        body = search_body(file["id"], None, metric="train_loss", parallelism=3)
        parent = client.post("/v1/fine_tuning/jobs", json=body).json()
        assert advance(s, parent["id"]) == "1 trial(s) running, 1/3 started"
        assert advance(s, parent["id"]) == "1 trial(s) running, 1/3 started"  # no room for a second
        trials = client.get(f"/v1/fine_tuning/jobs/{parent['id']}/trials").json()["data"]
    assert len(trials) == 1

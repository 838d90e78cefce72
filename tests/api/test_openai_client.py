"""The official openai package, unchanged, drives a whole job against /v1."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import openai
import pytest

from ortune.cli.client import Client
from tests.support import DEMO, preference_rows, write_jsonl

pytestmark = pytest.mark.e2e


def finished(client: openai.OpenAI, job_id: str, timeout: float = 300) -> Any:
    """The job, polled through the client until it ends."""
    deadline = time.monotonic() + timeout
    while (job := client.fine_tuning.jobs.retrieve(job_id)).status not in (
        "succeeded",
        "failed",
        "cancelled",
    ):
        assert time.monotonic() < deadline
        time.sleep(0.5)
    return job


@pytest.mark.parametrize("config", ["production"], indirect=True)
def test_openai_client_runs_a_job(service: Client, tmp_path: Path) -> None:
    client = openai.OpenAI(base_url=f"{service.http.base_url}/v1", api_key=service.api_key, max_retries=0)
    with (DEMO / "sentiment_valid.jsonl").open("rb") as fh:
        file = client.files.create(file=fh, purpose="fine-tune")
    assert file.status == "processed" and file.bytes == (DEMO / "sentiment_valid.jsonl").stat().st_size
    job = client.fine_tuning.jobs.create(
        model="tiny-bert",
        training_file=file.id,
        suffix="oa",
        hyperparameters={"n_epochs": 1, "batch_size": 16},
        extra_body={"backend": "torch", "checkpoint_every_steps": 4},
    )
    assert job.status == "queued" and job.hyperparameters.n_epochs == 1
    assert [j.id for j in client.fine_tuning.jobs.list(limit=10)] == [job.id]
    job = finished(client, job.id)
    assert job.status == "succeeded" and job.fine_tuned_model == f"ft:tiny-bert:oa:{job.id}"
    events = client.fine_tuning.jobs.list_events(job.id, limit=100).data
    assert events[0].message.startswith("The job has successfully completed")
    assert any(e.type == "metrics" for e in events)
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [c.step_number for c in checkpoints] == [8, 4]
    assert checkpoints[0].fine_tuning_job_id == job.id
    with pytest.raises(openai.NotFoundError) as missing:
        client.fine_tuning.jobs.create(model="gpt-5", training_file=file.id)
    assert missing.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.ConflictError):
        client.fine_tuning.jobs.cancel(job.id)
    assert any(m.id == job.fine_tuned_model for m in client.models.list())
    long = client.fine_tuning.jobs.create(
        model="tiny-bert",
        training_file=file.id,
        extra_body={"backend": "torch"},
        hyperparameters={"n_epochs": 50},
    )
    cancelled = client.fine_tuning.jobs.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.id == long.id
    assert client.fine_tuning.jobs.retrieve(long.id).status == "cancelled"


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_openai_client_creates_a_dpo_job_with_method(service: Client, tmp_path: Path) -> None:
    """A DPO job as OpenAI documents it (`method={"type": "dpo", ...}`, preference rows) through the official
    client: created, shown back in the client's own types, trained."""
    client = openai.OpenAI(base_url=f"{service.http.base_url}/v1", api_key=service.api_key, max_retries=0)
    with write_jsonl(tmp_path / "pairs.jsonl", preference_rows(16)).open("rb") as fh:
        file = client.files.create(file=fh, purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model="tiny-gpt2",
        training_file=file.id,
        method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2, "n_epochs": 1, "batch_size": 8}}},
    )
    assert job.method is not None and job.method.type == "dpo"
    assert job.method.dpo is not None and job.method.dpo.hyperparameters is not None
    assert job.method.dpo.hyperparameters.beta == 0.2
    job = finished(client, job.id)
    assert job.status == "succeeded", job.error
    assert any(
        e.type == "metrics" and "reward_margin" in e.message
        for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data
    )

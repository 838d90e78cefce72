"""/v1/fine_tuning/jobs on both configurations: validation, paging, cancel, events, metrics, artifacts."""

from __future__ import annotations

import hashlib
import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from api.services.artifacts import readahead
from ortune import lifecycle
from ortune.db.models import Artifact
from ortune.db.repositories import (
    ArtifactRepository,
    EventRepository,
    JobRepository,
    MetricRepository,
    TenantRepository,
)
from ortune.db.session import session_scope
from ortune.settings import Settings
from ortune.storage import open_store
from tests.support import DEMO, preference_rows, upload, write_jsonl


def create(client: TestClient, **body: Any) -> Any:
    return client.post("/v1/fine_tuning/jobs", json=body)


def _jobs(client: TestClient) -> list[dict[str, Any]]:
    return client.get("/v1/fine_tuning/jobs", params={"limit": 100}).json()["data"]  # type: ignore[no-any-return]


def test_create_and_retrieve(client: TestClient, train_file: dict[str, Any]) -> None:
    response = create(
        client,
        model="tiny-bert",
        training_file=train_file["id"],
        suffix="mine",
        seed=3,
        metadata={"team": "nlp"},
        hyperparameters={"n_epochs": 2, "batch_size": 4},
        backend="torch",
        checkpoint_every_steps=5,
    )
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["object"] == "fine_tuning.job" and job["id"].startswith("ftjob-")
    assert job["status"] == "queued" and job["task"] == "sequence-classification"
    assert job["hyperparameters"] == {
        "n_epochs": 2,
        "batch_size": 4,
        "learning_rate_multiplier": "auto",
        "max_seq_length": 128,  # the classifier's default
    }
    assert (job["seed"], job["suffix"], job["metadata"], job["backend"]) == (
        3,
        "mine",
        {"team": "nlp"},
        "torch",
    )
    assert client.get(f"/v1/fine_tuning/jobs/{job['id']}").json() == job
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events").json()["data"]
    assert events[0]["message"].startswith("Created fine-tuning job")


def test_openai_method_shape(client: TestClient, train_file: dict[str, Any]) -> None:
    job = create(
        client,
        model="tiny-bert",
        training_file=train_file["id"],
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 4}}},
    ).json()
    assert job["hyperparameters"]["n_epochs"] == 4


def test_the_default_sequence_length_fits_the_task(client: TestClient, tmp_path: Path) -> None:
    """A chat job is cut at 2,048 tokens unless it says otherwise (128 cut most conversations before their
    reply); a classifier keeps 128; an explicit value stands."""
    chat = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(8)
    ]
    lm_file = upload(client, write_jsonl(tmp_path / "chat.jsonl", chat)).json()
    texts = upload(client, DEMO / "sentiment_train.jsonl").json()
    lm = create(client, model="tiny-gpt2", training_file=lm_file["id"]).json()
    clf = create(client, model="tiny-bert", training_file=texts["id"]).json()
    asked = create(
        client, model="tiny-gpt2", training_file=lm_file["id"], hyperparameters={"max_seq_length": 512}
    )
    seq = [j["hyperparameters"]["max_seq_length"] for j in (lm, clf, asked.json())]
    assert seq == [2048, 128, 512]


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"colour": "red"}, "colour", "unknown field 'colour'"),
        (
            {"hyperparameters": {"n_epoch": 3}},
            "hyperparameters.n_epoch",
            "unknown field 'hyperparameters.n_epoch'",
        ),
        ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs", "greater than or equal to 1"),
        ({"backend": "tpu"}, "backend", "backend"),
        ({"suffix": "no spaces"}, "suffix", "suffix"),
        ({"distributed": {"nodes": 2, "strategy": "zero3"}}, "distributed.strategy", "strategy"),
    ],
)
def test_invalid_payload_is_422_naming_the_field(
    client: TestClient, train_file: dict[str, Any], body: dict[str, Any], param: str, fragment: str
) -> None:
    response = create(client, model="tiny-bert", training_file=train_file["id"], **body)
    assert response.status_code == 422
    err = response.json()["error"]
    assert err["param"] == param and fragment in err["message"]
    assert _jobs(client) == []


def test_missing_model_is_422(client: TestClient, train_file: dict[str, Any]) -> None:
    response = create(client, training_file=train_file["id"])
    assert response.status_code == 422 and response.json()["error"]["param"] == "model"


def test_unknown_model_and_file_are_404_with_param(client: TestClient, train_file: dict[str, Any]) -> None:
    response = create(client, model="gpt-99", training_file=train_file["id"])
    assert response.status_code == 404
    assert (response.json()["error"]["param"], response.json()["error"]["code"]) == (
        "model",
        "model_not_found",
    )
    response = create(client, model="tiny-bert", training_file="file-missing")
    assert response.status_code == 404 and response.json()["error"]["param"] == "training_file"
    response = create(client, model="tiny-bert", training_file=train_file["id"], validation_file="file-x")
    assert response.status_code == 404 and response.json()["error"]["param"] == "validation_file"
    assert _jobs(client) == []


def test_files_that_do_not_fit_the_job(
    client: TestClient, tmp_path: Path, train_file: dict[str, Any]
) -> None:
    bad = upload(client, write_jsonl(tmp_path / "bad.jsonl", [{"nope": 1}])).json()
    response = create(client, model="tiny-bert", training_file=bad["id"])
    assert response.status_code == 400
    assert (
        response.json()["error"]["param"] == "training_file"
        and "line 1" in response.json()["error"]["message"]
    )
    text_only = upload(client, write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}] * 4)).json()
    response = create(
        client, model="tiny-bert", training_file=text_only["id"], task="sequence-classification"
    )
    assert response.status_code == 400 and "{label, text}" in response.json()["error"]["message"]
    response = create(client, model="tiny-bert", training_file=text_only["id"])  # infers causal-lm
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"
    one_label = upload(client, write_jsonl(tmp_path / "one.jsonl", [{"text": "a", "label": "x"}] * 3)).json()
    response = create(client, model="tiny-bert", training_file=one_label["id"])
    assert response.status_code == 400 and "two distinct labels" in response.json()["error"]["message"]
    other = upload(client, write_jsonl(tmp_path / "v.jsonl", [{"text": "a", "label": "maybe"}])).json()
    response = create(client, model="tiny-bert", training_file=train_file["id"], validation_file=other["id"])
    assert response.status_code == 400 and "maybe" in response.json()["error"]["message"]
    response = create(
        client,
        model="tiny-bert",
        training_file=train_file["id"],
        distributed={"nodes": 2, "procs_per_node": 1},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "distributed"
    assert _jobs(client) == []


def test_max_steps_limit(settings: Settings, train_file: dict[str, Any]) -> None:
    from api.main import create_app

    with TestClient(create_app(settings.model_copy(update={"max_steps": 10}))) as client:
        response = create(
            client, model="tiny-bert", training_file=train_file["id"], hyperparameters={"max_steps": 11}
        )
        # without max_steps, the steps the epochs imply are held to the same limit (360 rows / 8 x 3 = 135)
        implied = create(
            client,
            model="tiny-bert",
            training_file=train_file["id"],
            hyperparameters={"n_epochs": 3, "batch_size": 8},
        )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "hyperparameters.max_steps"
    assert implied.status_code == 400, implied.text
    error = implied.json()["error"]
    assert error["code"] == "limit_exceeded" and "would train 135 steps" in error["message"]


def test_cursor_pages(client: TestClient, train_file: dict[str, Any]) -> None:
    ids = [create(client, model="tiny-bert", training_file=train_file["id"]).json()["id"] for _ in range(5)]
    seen, after = [], None
    while True:
        page = client.get(
            "/v1/fine_tuning/jobs", params={"limit": 2, **({"after": after} if after else {})}
        ).json()
        seen += [j["id"] for j in page["data"]]
        if not page["has_more"]:
            break
        after = page["data"][-1]["id"]
    assert seen == list(reversed(ids))
    assert client.get("/v1/fine_tuning/jobs", params={"limit": 0}).status_code == 422


def test_cancel_queued_then_conflict(client: TestClient, train_file: dict[str, Any]) -> None:
    job = create(client, model="tiny-bert", training_file=train_file["id"]).json()
    cancelled = client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel").json()
    assert cancelled["status"] == "cancelled" and cancelled["finished_at"] is not None
    again = client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel")
    assert again.status_code == 409 and again.json()["error"]["code"] == "job_not_cancellable"
    assert client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"] == "cancelled"
    assert client.post("/v1/fine_tuning/jobs/ftjob-nope/cancel").status_code == 404


def test_events_page_newest_first(client: TestClient, settings: Settings, train_file: dict[str, Any]) -> None:
    job = create(client, model="tiny-bert", training_file=train_file["id"]).json()
    with session_scope(settings.database_url) as session:
        events = EventRepository(session)
        for i in range(5):
            events.add(job["id"], f"message {i}")
        events.add(job["id"], "Step 3", type="metrics", data={"step": 3, "train_loss": 0.5})
    page = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"limit": 3}).json()
    assert [e["message"] for e in page["data"]] == ["Step 3", "message 4", "message 3"]
    assert page["data"][0]["type"] == "metrics" and page["data"][0]["data"]["train_loss"] == 0.5
    assert page["has_more"]
    rest = client.get(
        f"/v1/fine_tuning/jobs/{job['id']}/events", params={"after": page["data"][-1]["id"]}
    ).json()
    assert [e["message"] for e in rest["data"]][:3] == ["message 2", "message 1", "message 0"]
    bad = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"after": "yesterday"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"


def test_metrics_are_downsampled_on_the_server(
    client: TestClient, settings: Settings, train_file: dict[str, Any]
) -> None:
    job = create(client, model="tiny-bert", training_file=train_file["id"]).json()
    with session_scope(settings.database_url) as session:
        MetricRepository(session).add_many(job["id"], [("train_loss", s, 1.0 / (s + 1)) for s in range(3000)])
        MetricRepository(session).add_many(job["id"], [("train_loss", 0, 7.0)])  # a re-run step replaces
    full = client.get(f"/v1/fine_tuning/jobs/{job['id']}/metrics", params={"max_points": 5000}).json()
    assert full["downsampled"] is False and len(full["data"]["train_loss"]["steps"]) == 3000
    assert full["data"]["train_loss"]["values"][0] == 7.0
    small = client.get(f"/v1/fine_tuning/jobs/{job['id']}/metrics", params={"max_points": 100}).json()
    series = small["data"]["train_loss"]
    assert small["downsampled"] is True and len(series["steps"]) <= 100
    assert (
        series["steps"][0] == 0 and series["steps"][-1] == 2999 and series["steps"] == sorted(series["steps"])
    )


def test_artifact_download_with_range(
    client: TestClient, settings: Settings, train_file: dict[str, Any]
) -> None:
    job = create(client, model="tiny-bert", training_file=train_file["id"]).json()
    no_adapter = client.get(f"/v1/fine_tuning/jobs/{job['id']}/artifacts/merged")
    assert no_adapter.status_code == 404 and "trained no adapter" in no_adapter.json()["error"]["message"]
    missing = client.get(f"/v1/fine_tuning/jobs/{job['id']}/artifacts/onnx")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "artifact_not_found"
    assert client.get(f"/v1/fine_tuning/jobs/{job['id']}/artifacts/safetensors").status_code == 422
    payload = bytes(range(256)) * 8192  # 2 MiB, several chunks
    key = f"jobs/{job['id']}/artifacts/onnx.tar"
    store = open_store(
        settings.storage_url,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key.get_secret_value(),
    )
    store.put_fileobj(key, io.BytesIO(payload))
    digest = hashlib.sha256(payload).hexdigest()
    with session_scope(settings.database_url) as session:
        ArtifactRepository(session).put(
            Artifact(
                job_id=job["id"],
                format="onnx",
                object_key=key,
                bytes=len(payload),
                sha256=digest,
                manifest={"format": "onnx"},
            )
        )
    url = f"/v1/fine_tuning/jobs/{job['id']}/artifacts/onnx"
    whole = client.get(url)
    assert whole.status_code == 200 and whole.content == payload
    assert whole.headers["x-ortune-sha256"] == digest and whole.headers["accept-ranges"] == "bytes"
    part = client.get(url, headers={"Range": "bytes=1000-1999999"})
    assert part.status_code == 206 and part.content == payload[1000:2000000]
    assert part.headers["content-range"] == f"bytes 1000-1999999/{len(payload)}"
    tail = client.get(url, headers={"Range": "bytes=-10"})
    assert tail.status_code == 206 and tail.content == payload[-10:]
    beyond = client.get(url, headers={"Range": f"bytes={len(payload)}-"})
    assert beyond.status_code == 416 and beyond.headers["content-range"] == f"bytes */{len(payload)}"
    assert client.get(url, headers={"Range": "bytes=5-1,7-9"}).status_code == 416
    listed = client.get(f"/v1/fine_tuning/jobs/{job['id']}/artifacts").json()
    assert listed[0]["sha256"] == digest and listed[0]["url"] == url


def test_models_list_base_and_fine_tuned(
    client: TestClient, settings: Settings, train_file: dict[str, Any]
) -> None:
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert {"tiny-bert", "tiny-gpt2", "sentence-transformers/all-MiniLM-L6-v2"} <= set(ids)
    job = create(client, model="tiny-bert", training_file=train_file["id"]).json()
    with session_scope(settings.database_url) as session:
        JobRepository(session).update(
            job["id"], status="succeeded", fine_tuned_model=f"ft:tiny-bert:x:{job['id']}"
        )
        # a model is listed while its files are stored (DELETE /v1/models removes them)
        ArtifactRepository(session).put(
            Artifact(
                job_id=job["id"], format="pytorch", object_key="k", bytes=1, sha256="0" * 64, manifest={}
            )
        )
    assert client.get(f"/v1/models/ft:tiny-bert:x:{job['id']}").json()["owned_by"] == "ortune:fine-tuned"
    assert client.get("/v1/models/sentence-transformers/all-MiniLM-L6-v2").status_code == 200
    assert client.get("/v1/models/nope").status_code == 404


def test_health_and_readiness(client: TestClient) -> None:
    assert client.get("/healthz").json()["status"] == "ok"
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["checks"] == {"database": "ok", "broker": "ok", "storage": "ok"}


def test_readiness_reports_a_dead_broker(settings: Settings) -> None:
    from api.main import create_app

    admin = "ortune-admin-readyz"
    broken = settings.model_copy(
        update={"broker_url": "redis://127.0.0.1:1/0", "admin_api_key": SecretStr(admin)}
    )
    with TestClient(create_app(broken)) as client:
        ready = client.get("/readyz")
        detailed = client.get("/readyz", headers={"Authorization": f"Bearer {admin}"})
    assert ready.status_code == 503 and ready.headers["retry-after"] == "5"
    # anyone may ask; only an admin key learns why (the exception names hosts and ports)
    assert ready.json()["checks"] == {"database": "ok", "broker": "error", "storage": "ok"}
    assert detailed.json()["checks"]["broker"].startswith("error: ") and "127.0.0.1" in detailed.text


def test_unknown_route_is_openai_shaped(client: TestClient) -> None:
    response = client.get("/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


class Chunks:
    """A storage stream that records how far it was read and whether it was closed."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.fail_at, self.read = n, fail_at, 0
        self.closed = threading.Event()

    def __iter__(self) -> Iterator[bytes]:
        try:
            for i in range(self.n):
                if i == self.fail_at:
                    raise OSError("the storage connection dropped")
                self.read += 1
                yield bytes([i]) * 4
        finally:
            self.closed.set()


def test_readahead_streams_in_order_and_stays_bounded() -> None:
    chunks = Chunks(50)

    async def main() -> list[bytes]:
        got = []
        async for chunk in readahead(iter(chunks), depth=2):
            assert chunks.read <= len(got) + 4  # queued (2), in the reader's hand (1), just yielded (1)
            got.append(chunk)
        return got

    assert anyio.run(main) == [bytes([i]) * 4 for i in range(50)]
    assert chunks.closed.wait(5)


def test_readahead_stops_reading_when_the_client_goes_away() -> None:
    chunks = Chunks(10_000)

    async def main() -> None:
        stream = readahead(iter(chunks), depth=2)
        assert await stream.__anext__() == bytes([0]) * 4
        await stream.aclose()  # what Starlette does when the client disconnects

    anyio.run(main)
    assert chunks.closed.wait(5)  # the storage stream is closed, not read to its end
    assert chunks.read < 10


def test_readahead_raises_what_storage_raised() -> None:
    chunks = Chunks(10, fail_at=3)

    async def main() -> int:
        got = 0
        async for _ in readahead(iter(chunks)):
            got += 1
        return got

    with pytest.raises(OSError, match="storage connection dropped"):
        anyio.run(main)
    assert chunks.closed.wait(5)


def test_an_app_stopped_and_started_again_still_reads(settings: Settings) -> None:
    """Stopping the app closes the hot reads' connections (ortune.db.reads); a later start opens new ones,
    as a test client or schemathesis starts one app many times."""
    from api.main import create_app

    app = create_app(settings)
    with TestClient(app) as client:
        file = upload(client, DEMO / "sentiment_train.jsonl")
        job = create(client, model="tiny-bert", training_file=file.json()["id"]).json()
        assert client.get(f"/v1/fine_tuning/jobs/{job['id']}").status_code == 200
    for _ in range(2):
        with TestClient(app) as client:
            again = client.get(f"/v1/fine_tuning/jobs/{job['id']}")
            assert again.status_code == 200, again.text
            assert again.json()["status"] == job["status"]
            events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events")
            assert events.status_code == 200, events.text


def test_a_job_whose_onnx_export_failed_succeeds_with_its_pytorch_model(
    client: TestClient, settings: Settings, train_file: dict[str, Any]
) -> None:
    """The worker stored the PyTorch model and the trainer reported the ONNX export's failure: the job
    succeeds, its completion says what is missing, and the ONNX download's 404 says why."""
    job = create(client, model="tiny-bert", training_file=train_file["id"]).json()
    reason = "ONNX export failed: UnsupportedOperatorError: aten::foo"
    with session_scope(settings.database_url) as session:
        jobs = JobRepository(session)
        jobs.update(job["id"], status="running", result={"failed_artifacts": {"onnx": reason}})
        ArtifactRepository(session).put(
            Artifact(
                job_id=job["id"], format="pytorch", object_key="k", bytes=1, sha256="0" * 64, manifest={}
            )
        )
        stored = jobs.get(job["id"])
        assert stored is not None and lifecycle.succeed(session, stored, stored.attempt)
    done = client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()
    assert done["status"] == "succeeded" and done["result"]["failed_artifacts"] == {"onnx": reason}
    said = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events").json()["data"][0]["message"]
    assert said.endswith("(without its onnx model, whose export failed: see above)")
    no_adapter = client.get(f"/v1/fine_tuning/jobs/{job['id']}/artifacts/merged")
    assert no_adapter.status_code == 404 and "trained no adapter" in no_adapter.json()["error"]["message"]
    missing = client.get(f"/v1/fine_tuning/jobs/{job['id']}/artifacts/onnx")
    assert (
        missing.status_code == 404
        and f"its onnx export failed: {reason}" in missing.json()["error"]["message"]
    )


def test_a_lora_job_is_recorded_with_its_adapter_options(client: TestClient, tmp_path: Path) -> None:
    chat = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(8)
    ]
    file = upload(client, write_jsonl(tmp_path / "chat.jsonl", chat)).json()
    lora = {"type": "supervised", "supervised": {"lora": {"r": 4, "target_modules": ["c_attn"]}}}
    job = create(client, model="tiny-gpt2", training_file=file["id"], method=lora)
    assert job.status_code == 200, job.text
    shown = job.json()["method"]["supervised"]["lora"]
    assert shown == {"r": 4, "alpha": 16, "dropout": 0.05, "target_modules": ["c_attn"]}
    ort = create(client, model="tiny-gpt2", training_file=file["id"], method=lora, backend="ort")
    assert ort.status_code == 200, ort.text  # ORTModule trains over the PEFT model
    bad = create(
        client, model="tiny-gpt2", training_file=file["id"], method={"supervised": {"lora": {"r": 0}}}
    )
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "method.supervised.lora.r"


def test_a_dpo_job_is_recorded_and_its_rows_and_backend_are_checked(
    client: TestClient, tmp_path: Path
) -> None:
    """method.type dpo in OpenAI's shape (beta among its hyperparameters) is stored and shown back; DPO
    needs preference rows, preference rows need DPO, and backend ort is refused for it, each naming the
    field."""
    pairs = upload(client, write_jsonl(tmp_path / "pairs.jsonl", preference_rows(8))).json()
    assert pairs["status"] == "processed" and pairs["row_kind"] == "preference", pairs
    chat = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(8)
    ]
    chat_file = upload(client, write_jsonl(tmp_path / "chat.jsonl", chat)).json()
    method = {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.25, "n_epochs": 2}, "lora": {"r": 4}}}
    job = create(client, model="tiny-gpt2", training_file=pairs["id"], method=method)
    assert job.status_code == 200, job.text
    shown = job.json()["method"]
    assert shown["type"] == "dpo" and shown["dpo"]["hyperparameters"]["beta"] == 0.25
    assert shown["dpo"]["hyperparameters"]["n_epochs"] == 2 and shown["dpo"]["lora"]["r"] == 4
    auto_beta = create(client, model="tiny-gpt2", training_file=pairs["id"], method={"type": "dpo"})
    assert auto_beta.json()["method"]["dpo"]["hyperparameters"]["beta"] == 0.1

    wrong_rows = create(client, model="tiny-gpt2", training_file=chat_file["id"], method=method)
    assert wrong_rows.status_code == 400 and wrong_rows.json()["error"]["param"] == "training_file"
    assert "method dpo trains on preference rows" in wrong_rows.json()["error"]["message"]
    no_method = create(client, model="tiny-gpt2", training_file=pairs["id"])
    assert no_method.status_code == 400 and "train with method dpo" in no_method.json()["error"]["message"]
    ort = create(client, model="tiny-gpt2", training_file=pairs["id"], method=method, backend="ort")
    assert ort.status_code == 400 and ort.json()["error"]["param"] == "backend"
    mixed = create(
        client, model="tiny-gpt2", training_file=pairs["id"], method={"type": "dpo", "supervised": {}}
    )
    assert mixed.status_code == 422 and "method.supervised given with method.type dpo" in mixed.text
    beta = create(
        client,
        model="tiny-gpt2",
        training_file=pairs["id"],
        method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0}}},
    )
    assert beta.status_code == 422 and beta.json()["error"]["param"] == "method.dpo.hyperparameters.beta"
    classifier = create(client, model="tiny-bert", training_file=pairs["id"], method=method)
    assert classifier.status_code == 400 and classifier.json()["error"]["param"] == "model"


def test_the_readmes_job_files_are_valid_requests() -> None:
    """Every YAML job file the README shows is a request the API accepts as written (files and models
    aside, which depend on the reader's own)."""
    import re

    import yaml

    from api.schemas import JobCreate
    from tests.support import ROOT

    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) >= 3
    for block in blocks:
        JobCreate.model_validate(yaml.safe_load(block))


def test_packing_is_shown_back_and_refused_where_there_is_nothing_to_pack(
    client: TestClient, tmp_path: Path
) -> None:
    texts = upload(
        client, write_jsonl(tmp_path / "lm.jsonl", [{"text": f"row {i}"} for i in range(8)])
    ).json()
    method = {"type": "supervised", "supervised": {"packing": True}}
    job = create(client, model="tiny-gpt2", training_file=texts["id"], method=method)
    assert job.status_code == 200 and job.json()["method"]["supervised"]["packing"] is True
    labelled = upload(client, DEMO / "sentiment_valid.jsonl").json()
    classifier = create(client, model="tiny-bert", training_file=labelled["id"], method=method)
    assert classifier.status_code == 400
    assert classifier.json()["error"]["param"] == "method.supervised.packing"
    ort = create(client, model="tiny-gpt2", training_file=texts["id"], method=method, backend="ort")
    assert ort.status_code == 400 and ort.json()["error"]["param"] == "backend"


def test_a_checkpoint_is_a_base_by_its_listed_name_within_the_tenant(
    client: TestClient, settings: Settings, train_file: dict[str, Any]
) -> None:
    """`model: ft:...:ckpt-step-N` names a stored checkpoint: accepted while it exists, 404 for a step that
    was never stored or another tenant's job, 400 for a LoRA job's (its checkpoints hold the adapter only)."""
    from ortune.db.models import Checkpoint
    from ortune.db.repositories import CheckpointRepository
    from trainer_core.spec import Lora

    job = create(client, model="tiny-bert", training_file=train_file["id"]).json()
    with session_scope(settings.database_url) as session:
        CheckpointRepository(session).add(
            Checkpoint(id="ckpt-t", job_id=job["id"], step=4, object_key="k", bytes=1, sha256="1" * 64)
        )
    name = client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"][0]
    name = name["fine_tuned_model_checkpoint"]
    assert name.endswith(f":{job['id']}:ckpt-step-4")
    again = create(client, model=name, training_file=train_file["id"])
    assert again.status_code == 200, again.text
    assert again.json()["model"] == name
    missing = create(client, model=name.replace("ckpt-step-4", "ckpt-step-5"), training_file=train_file["id"])
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    with session_scope(settings.database_url) as session:
        lora = JobRepository(session).get(again.json()["id"])
        assert lora is not None
        lora.spec = lora.spec.model_copy(update={"lora": Lora()})
        CheckpointRepository(session).add(
            Checkpoint(id="ckpt-l", job_id=lora.id, step=2, object_key="k2", bytes=1, sha256="2" * 64)
        )
    adapter_only = create(client, model=f"ft:x:{lora.id}:ckpt-step-2", training_file=train_file["id"])
    assert (
        adapter_only.status_code == 400
        and "holds the adapter alone" in adapter_only.json()["error"]["message"]
    )
    with session_scope(settings.database_url) as session:
        elsewhere = TenantRepository(session).create("elsewhere")
        stored = JobRepository(session).get(job["id"])
        assert stored is not None
        stored.tenant_id = elsewhere.id
    theirs = create(client, model=name, training_file=train_file["id"])
    assert theirs.status_code == 404 and "no fine-tuned model checkpoint" in theirs.json()["error"]["message"]


def test_the_job_list_filters_by_status_and_metadata(client: TestClient, train_file: dict[str, Any]) -> None:
    """`status=` and OpenAI's `metadata[key]=value` (every pair must match) narrow the list, with the
    cursor pages still working; a malformed metadata filter is a 400 naming it."""
    made = [
        create(
            client,
            model="tiny-bert",
            training_file=train_file["id"],
            metadata={"team": team, "run": str(i)},
        ).json()
        for i, team in enumerate(["search", "ads", "search", "search"])
    ]
    client.post(f"/v1/fine_tuning/jobs/{made[3]['id']}/cancel")

    def ids(query: str) -> list[str]:
        response = client.get(f"/v1/fine_tuning/jobs?{query}")
        assert response.status_code == 200, response.text
        return [j["id"] for j in response.json()["data"]]

    assert ids("metadata[team]=search") == [made[3]["id"], made[2]["id"], made[0]["id"]]
    assert ids("metadata[team]=search&metadata[run]=2") == [made[2]["id"]]
    assert ids("metadata[team]=search&status=queued") == [made[2]["id"], made[0]["id"]]
    assert ids("status=cancelled") == [made[3]["id"]]
    assert ids("metadata[team]=nobody") == []
    first = client.get("/v1/fine_tuning/jobs?metadata[team]=search&limit=2").json()
    assert first["has_more"] and len(first["data"]) == 2
    rest = ids(f"metadata[team]=search&limit=2&after={first['last_id']}")
    assert rest == [made[0]["id"]]
    bad = client.get("/v1/fine_tuning/jobs?metadata[]=x")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "metadata[]"
    unknown = client.get("/v1/fine_tuning/jobs?status=sleeping")
    assert unknown.status_code == 422 and unknown.json()["error"]["param"] == "status"

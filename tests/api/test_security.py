"""Tenants and API keys, quotas, and Idempotency-Key, on both configurations."""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy import update

from api.main import create_app
from ortune.db.models import Artifact, Checkpoint, Job, JobStatus
from ortune.db.repositories import ArtifactRepository, CheckpointRepository
from ortune.db.session import session_scope
from ortune.settings import Settings
from ortune.storage import ObjectNotFound
from tests.support import ADMIN_KEY, DEMO

ADMIN = "ortune-admin-test-key"
# Paths every tenant may call without an id of another tenant's in them, and paths for admins only.
PUBLIC = {"/healthz", "/readyz", "/dashboard", "/dashboard/jobs/{job_id}"}
ADMIN_ONLY = {
    "/metrics",
    "/v1/admin/tenants",
    "/v1/admin/tenants/{tenant_id}/api_keys",
    "/v1/admin/api_keys/{key_id}",
    "/v1/nodes",
}
LISTS = {"/v1/files", "/v1/fine_tuning/jobs", "/v1/models"}
# Paths that name a model in their body: another tenant's model does not exist for you there either.
INFERENCE = {"/v1/chat/completions", "/v1/completions", "/v1/predict"}


@pytest.fixture
def secured(settings: Settings) -> Iterator[TestClient]:
    s = settings.model_copy(update={"require_api_key": True, "admin_api_key": SecretStr(ADMIN)})
    with TestClient(create_app(s)) as client:
        yield client


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def tenant_key(client: TestClient, name: str, **fields: Any) -> str:
    tenant = client.post("/v1/admin/tenants", json={"name": name, **fields}, headers=bearer(ADMIN))
    assert tenant.status_code == 200, tenant.text
    key = client.post(
        f"/v1/admin/tenants/{tenant.json()['id']}/api_keys", json={"name": "test"}, headers=bearer(ADMIN)
    )
    assert key.status_code == 200, key.text
    assert key.json()["key"].startswith("ortune-sk-")
    return str(key.json()["key"])


def upload(client: TestClient, key: str, **headers: str) -> Any:
    with (DEMO / "sentiment_train.jsonl").open("rb") as fh:
        return client.post(
            "/v1/files",
            files={"file": ("train.jsonl", fh)},
            data={"purpose": "fine-tune"},
            headers=bearer(key) | headers,
        )


def create_job(client: TestClient, key: str, file_id: str, **headers: str) -> Any:
    return client.post(
        "/v1/fine_tuning/jobs",
        json={"model": "tiny-bert", "training_file": file_id},
        headers=bearer(key) | headers,
    )


def test_every_path_is_scoped_to_its_tenant(secured: TestClient, settings: Settings) -> None:
    alice, bob = tenant_key(secured, "alice"), tenant_key(secured, "bob")
    file = upload(secured, alice).json()
    job = create_job(secured, alice, file["id"]).json()
    model = f"ft:tiny-bert:ortune:{job['id']}"
    with session_scope(settings.database_url) as session:  # as if it had trained
        session.execute(
            update(Job).where(Job.id == job["id"]).values(status=JobStatus.succeeded, fine_tuned_model=model)
        )
        for fmt in ("pytorch", "onnx"):
            ArtifactRepository(session).put(
                Artifact(job_id=job["id"], format=fmt, object_key="k", bytes=1, sha256="0" * 64, manifest={})
            )
    ids = {"job_id": job["id"], "file_id": file["id"], "model_id": model, "fmt": "pytorch"}

    paths = secured.app.openapi()["paths"]  # type: ignore[attr-defined]
    checked = 0
    for path, operations in paths.items():
        if path in PUBLIC | ADMIN_ONLY | LISTS | INFERENCE:
            continue
        params = set(re.findall(r"{(\w+)(?::path)?}", path))
        assert params and params <= set(ids), (
            f"{path}: classify it in this test (scoped, list, public, admin)"
        )
        url = re.sub(r"{(\w+)(?::path)?}", lambda m: ids[m.group(1)], path)
        for method in operations:
            for_bob = secured.request(method.upper(), url, headers=bearer(bob))
            assert for_bob.status_code == 404, (method, path, for_bob.text)  # never 403: it does not exist
            checked += 1
    assert checked >= 14

    bodies = {
        "/v1/chat/completions": {"model": model, "messages": [{"role": "user", "content": "hi"}]},
        "/v1/completions": {"model": model, "prompt": "hi"},
        "/v1/predict": {"model": model, "inputs": "hi"},
    }
    assert set(bodies) == INFERENCE
    for path, body in bodies.items():
        for_bob = secured.post(path, json=body, headers=bearer(bob))
        assert for_bob.status_code == 404 and for_bob.json()["error"]["code"] == "model_not_found", path
    # alice's own model passes the check and is forwarded (nothing serves it here: 503)
    assert secured.post("/v1/predict", json=bodies["/v1/predict"], headers=bearer(alice)).status_code == 503

    for path in LISTS:
        listed = secured.get(path, headers=bearer(bob)).json()["data"]
        assert not {job["id"], file["id"], model} & {item["id"] for item in listed}, path
        mine = {item["id"] for item in secured.get(path, headers=bearer(alice)).json()["data"]}
        assert {job["id"], file["id"], model} & mine, path
    # bob's attempts changed nothing of alice's
    assert secured.get(f"/v1/files/{file['id']}", headers=bearer(alice)).status_code == 200
    assert (
        secured.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=bearer(alice)).json()["status"]
        == "succeeded"
    )
    # nor can bob train on alice's file
    stolen = create_job(secured, bob, file["id"])
    assert stolen.status_code == 404 and stolen.json()["error"]["param"] == "training_file"


def test_keys_are_checked_and_admin_paths_need_an_admin(secured: TestClient) -> None:
    none = secured.get("/v1/fine_tuning/jobs")
    assert none.status_code == 401 and none.headers["www-authenticate"] == "Bearer"
    assert "API key is required" in none.json()["error"]["message"]
    wrong = secured.get("/v1/files", headers=bearer("ortune-sk-made-up"))
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    garbled = secured.get("/v1/files", headers={"Authorization": "Basic abc"})
    assert garbled.status_code == 401 and garbled.json()["error"]["param"] == "Authorization"
    assert secured.get("/healthz").status_code == 200

    key = tenant_key(secured, "carol")
    for method, path in (("GET", "/metrics"), ("GET", "/v1/admin/tenants"), ("POST", "/v1/admin/tenants")):
        response = secured.request(method, path, headers=bearer(key), json={"name": "x"})
        assert response.status_code == 403 and response.json()["error"]["code"] == "platform_key_required"
    assert secured.get("/metrics", headers=bearer(ADMIN)).status_code == 200

    dup = secured.post("/v1/admin/tenants", json={"name": "carol"}, headers=bearer(ADMIN))
    assert dup.status_code == 409 and dup.json()["error"]["param"] == "name"
    bad = secured.post("/v1/admin/tenants", json={"name": "../etc"}, headers=bearer(ADMIN))
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "name"

    tenants = secured.get("/v1/admin/tenants", headers=bearer(ADMIN)).json()["data"]
    carol = next(t for t in tenants if t["name"] == "carol")
    keys = secured.get(f"/v1/admin/tenants/{carol['id']}/api_keys", headers=bearer(ADMIN)).json()["data"]
    assert len(keys) == 1 and "key" not in keys[0] and key.startswith(keys[0]["prefix"])
    assert secured.get("/v1/files", headers=bearer(key)).status_code == 200
    revoked = secured.delete(f"/v1/admin/api_keys/{keys[0]['id']}", headers=bearer(ADMIN))
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert secured.get("/v1/files", headers=bearer(key)).status_code == 401  # at once, in this process


def test_a_tenant_admin_key_manages_its_own_tenant_only(secured: TestClient) -> None:
    """Before platform keys, any tenant's admin key could mint keys for every tenant and read /metrics."""
    tenants = {name: tenant_key(secured, name) for name in ("frank", "grace")}
    ids = {t["name"]: t["id"] for t in secured.get("/v1/admin/tenants", headers=bearer(ADMIN)).json()["data"]}
    frank_admin = secured.post(
        f"/v1/admin/tenants/{ids['frank']}/api_keys",
        json={"name": "ops", "admin": True},
        headers=bearer(ADMIN),
    ).json()
    assert (frank_admin["admin"], frank_admin["platform"]) == (True, False)
    own = bearer(frank_admin["key"])

    minted = secured.post(f"/v1/admin/tenants/{ids['frank']}/api_keys", json={"name": "ci"}, headers=own)
    assert (
        minted.status_code == 200
        and secured.get("/v1/files", headers=bearer(minted.json()["key"])).is_success
    )
    listed = secured.get(f"/v1/admin/tenants/{ids['frank']}/api_keys", headers=own).json()["data"]
    assert {k["name"] for k in listed} == {"test", "ops", "ci"}

    graces = secured.get(f"/v1/admin/tenants/{ids['grace']}/api_keys", headers=bearer(ADMIN)).json()["data"]
    for method, path in (
        ("POST", f"/v1/admin/tenants/{ids['grace']}/api_keys"),
        ("GET", f"/v1/admin/tenants/{ids['grace']}/api_keys"),
        ("DELETE", f"/v1/admin/api_keys/{graces[0]['id']}"),
    ):
        response = secured.request(
            method, path, headers=own, json={"name": "x"} if method == "POST" else None
        )
        assert response.status_code == 404, (method, path, response.text)  # another tenant is invisible
    assert secured.get("/v1/files", headers=bearer(tenants["grace"])).status_code == 200  # not revoked

    for path in ("/metrics", "/v1/nodes", "/v1/admin/tenants"):
        response = secured.get(path, headers=own)
        assert response.status_code == 403 and response.json()["error"]["code"] == "platform_key_required"
    escalate = secured.post(
        f"/v1/admin/tenants/{ids['frank']}/api_keys", json={"name": "up", "platform": True}, headers=own
    )
    assert escalate.status_code == 403 and escalate.json()["error"]["param"] == "platform"

    platform = secured.post(
        f"/v1/admin/tenants/{ids['frank']}/api_keys",
        json={"name": "p", "platform": True},
        headers=bearer(ADMIN),
    ).json()
    assert (platform["admin"], platform["platform"]) == (True, True)
    assert secured.get("/v1/admin/tenants", headers=bearer(platform["key"])).status_code == 200
    revoked = secured.delete(f"/v1/admin/api_keys/{minted.json()['id']}", headers=own)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None


def test_a_caller_without_a_key_is_never_an_admin(client: TestClient) -> None:
    """In an open deployment the caller without a key used to be an admin: it could mint keys and tenants."""
    for method, path in (
        ("GET", "/metrics"),
        ("GET", "/v1/nodes"),
        ("GET", "/v1/admin/tenants"),
        ("POST", "/v1/admin/tenants"),
        ("POST", "/v1/admin/tenants/default/api_keys"),
    ):
        response = client.request(method, path, json={"name": "x"} if method == "POST" else None)
        assert response.status_code == 403, (method, path, response.text)
    assert client.get("/v1/nodes", headers=bearer(ADMIN_KEY)).status_code == 200  # the admin key still works


def test_open_deployment_takes_callers_without_keys(client: TestClient) -> None:
    # development default: no key needed, a placeholder key (the openai SDK always sends one) is ignored
    assert client.get("/v1/files").status_code == 200
    assert client.get("/v1/files", headers=bearer("unused")).status_code == 200
    made_up = client.get("/v1/files", headers=bearer("ortune-sk-made-up"))
    assert made_up.status_code == 401  # but an ortune key is always checked


def test_quota_of_unfinished_jobs_per_tenant(secured: TestClient) -> None:
    key = tenant_key(secured, "dave", max_concurrent_jobs=2)
    file = upload(secured, key).json()
    first, second = (create_job(secured, key, file["id"]).json() for _ in range(2))
    refused = create_job(secured, key, file["id"])
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "quota_exceeded" and "2 unfinished jobs and may hold 2" in error["message"]
    secured.post(f"/v1/fine_tuning/jobs/{first['id']}/cancel", headers=bearer(key))
    assert create_job(secured, key, file["id"]).status_code == 200
    assert second["status"] == "queued"


def test_priority_is_clamped_to_the_tenants_maximum(secured: TestClient) -> None:
    key = tenant_key(secured, "erin", max_priority=10)
    file = upload(secured, key).json()
    body = {"model": "tiny-bert", "training_file": file["id"]}
    high = secured.post("/v1/fine_tuning/jobs", json=body | {"priority": 90}, headers=bearer(key)).json()
    low = secured.post("/v1/fine_tuning/jobs", json=body | {"priority": -5}, headers=bearer(key)).json()
    assert (high["priority"], low["priority"]) == (10, -5)
    said = secured.get(f"/v1/fine_tuning/jobs/{high['id']}/events", headers=bearer(key)).json()["data"]
    assert any("Priority 90 was lowered to 10, this tenant's maximum" in e["message"] for e in said)
    tenants = secured.get("/v1/admin/tenants", headers=bearer(ADMIN)).json()["data"]
    assert next(t for t in tenants if t["name"] == "erin")["max_priority"] == 10


def test_idempotency_key_replays_the_first_result(client: TestClient) -> None:
    key = {"Idempotency-Key": "upload-1"}
    with (DEMO / "sentiment_train.jsonl").open("rb") as fh:
        body = fh.read()

    def send(content: bytes, idem: dict[str, str]) -> Any:
        return client.post(
            "/v1/files", files={"file": ("train.jsonl", content)}, data={"purpose": "fine-tune"}, headers=idem
        )

    first, again = send(body, key), send(body, key)
    assert first.status_code == again.status_code == 200
    assert first.json()["id"] == again.json()["id"] and again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    other = send(body + b'{"text": "one more", "label": "positive"}\n', key)
    assert other.status_code == 400 and other.json()["error"]["code"] == "idempotency_key_reused"
    assert len(client.get("/v1/files").json()["data"]) == 1

    file_id = first.json()["id"]
    job_key = {"Idempotency-Key": "job-1"}
    jobs = [create_job(client, "unused", file_id, **job_key) for _ in range(2)]
    assert jobs[0].json()["id"] == jobs[1].json()["id"]
    changed = client.post(
        "/v1/fine_tuning/jobs",
        json={"model": "tiny-bert", "training_file": file_id, "seed": 3},
        headers=job_key,
    )
    assert changed.status_code == 400 and changed.json()["error"]["param"] == "Idempotency-Key"
    # a key used for a file is not one for a job
    crossed = create_job(client, "unused", file_id, **key)
    assert crossed.status_code == 400 and "POST /v1/files" in crossed.json()["error"]["message"]
    too_long = create_job(client, "unused", file_id, **{"Idempotency-Key": "k" * 300})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "invalid_idempotency_key"
    assert len(client.get("/v1/fine_tuning/jobs").json()["data"]) == 1


def test_concurrent_retries_with_one_key_make_one_job(client: TestClient) -> None:
    with (DEMO / "sentiment_train.jsonl").open("rb") as fh:
        file_id = client.post(
            "/v1/files", files={"file": ("t.jsonl", fh)}, data={"purpose": "fine-tune"}
        ).json()["id"]
    with ThreadPoolExecutor(6) as pool:
        answers = list(
            pool.map(lambda _: create_job(client, "unused", file_id, **{"Idempotency-Key": "race"}), range(6))
        )
    ok = [a for a in answers if a.status_code == 200]
    assert ok and all(a.status_code in (200, 409) for a in answers), [a.text for a in answers]
    assert len({a.json()["id"] for a in ok}) == 1
    assert len(client.get("/v1/fine_tuning/jobs").json()["data"]) == 1


def test_the_api_refuses_to_run_open_over_a_database_with_keys(settings: Settings) -> None:
    from api.auth import OpenWithKeys
    from ortune.db.repositories import KeyRepository, TenantRepository

    with session_scope(settings.database_url) as session:
        KeyRepository(session).issue(TenantRepository(session).create("frank").id, "k")
    with pytest.raises(OpenWithKeys, match="ORTUNE_REQUIRE_API_KEY"), TestClient(create_app(settings)):
        pass
    # told explicitly, it runs open; required, it starts as usual
    for choice in (False, True):
        told = settings.model_copy(update={"require_api_key": choice})
        with TestClient(create_app(told)) as client:
            assert client.get("/healthz").status_code == 200


def test_a_tenants_storage_quota_counts_uploads_and_models(secured: TestClient) -> None:
    size = (DEMO / "sentiment_train.jsonl").stat().st_size
    key = tenant_key(secured, "hank", max_storage_bytes=2 * size - 1)  # room for one upload, not two
    first = upload(secured, key)
    assert first.status_code == 200, first.text
    refused = upload(secured, key)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "storage_quota_exceeded" and error["param"] == "max_storage_bytes"
    assert f"keeps {size:,} bytes in storage and may keep {2 * size - 1:,}" in error["message"]
    assert [f["id"] for f in secured.get("/v1/files", headers=bearer(key)).json()["data"]] == [
        first.json()["id"]
    ]
    tenants = secured.get("/v1/admin/tenants", headers=bearer(ADMIN)).json()["data"]
    assert next(t for t in tenants if t["name"] == "hank")["storage_bytes"] == size  # nothing of the refused

    full = tenant_key(secured, "ivy", max_storage_bytes=size)  # exactly one upload: then no room for a job
    file = upload(secured, full).json()
    job = create_job(secured, full, file["id"])
    assert job.status_code == 429 and job.json()["error"]["code"] == "storage_quota_exceeded"

    assert secured.delete(f"/v1/files/{first.json()['id']}", headers=bearer(key)).status_code == 200
    assert upload(secured, key).status_code == 200  # deleting made room


def test_deleting_a_fine_tuned_model_frees_its_storage(secured: TestClient, settings: Settings) -> None:
    key = tenant_key(secured, "judy")
    other = tenant_key(secured, "ken")
    file = upload(secured, key).json()
    job = create_job(secured, key, file["id"]).json()
    store = secured.app.state.store  # type: ignore[attr-defined]
    model = f"ft:tiny-bert:judy:{job['id']}"
    stored = {
        f"jobs/{job['id']}/attempt-1/artifacts/pytorch.tar": 3000,
        f"jobs/{job['id']}/attempt-1/checkpoints/step-5.tar": 2000,
    }
    for object_key, n in stored.items():
        store.put_fileobj(object_key, io.BytesIO(b"x" * n))
    with session_scope(settings.database_url) as session:
        session.execute(
            update(Job).where(Job.id == job["id"]).values(status=JobStatus.succeeded, fine_tuned_model=model)
        )
        keys = list(stored)
        ArtifactRepository(session).put(
            Artifact(
                job_id=job["id"],
                format="pytorch",
                object_key=keys[0],
                bytes=3000,
                sha256="0" * 64,
                manifest={},
            )
        )
        CheckpointRepository(session).add(
            Checkpoint(
                id="ftckpt-t",
                job_id=job["id"],
                step=5,
                object_key=keys[1],
                bytes=2000,
                sha256="0" * 64,
                metrics={},
            )
        )
    usage = lambda: next(  # noqa: E731
        t
        for t in secured.get("/v1/admin/tenants", headers=bearer(ADMIN)).json()["data"]
        if t["name"] == "judy"
    )["storage_bytes"]
    assert usage() == file["bytes"] + 5000
    assert model in [m["id"] for m in secured.get("/v1/models", headers=bearer(key)).json()["data"]]
    assert secured.delete(f"/v1/models/{model}", headers=bearer(other)).status_code == 404  # not ken's
    assert secured.delete("/v1/models/tiny-bert", headers=bearer(key)).status_code == 400  # a base model

    deleted = secured.delete(f"/v1/models/{model}", headers=bearer(key))
    assert deleted.status_code == 200 and deleted.json() == {"id": model, "object": "model", "deleted": True}
    assert usage() == file["bytes"]
    for object_key in stored:
        with pytest.raises(ObjectNotFound):
            store.stat(object_key)
    assert model not in [m["id"] for m in secured.get("/v1/models", headers=bearer(key)).json()["data"]]
    assert secured.delete(f"/v1/models/{model}", headers=bearer(key)).status_code == 404  # once
    assert (
        secured.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=bearer(key)).json()["status"] == "succeeded"
    )


def test_a_fine_tuned_base_is_the_tenants_own_with_its_labels(
    secured: TestClient, settings: Settings
) -> None:
    """`model: ft:...` continues only from this tenant's succeeded job whose model is stored, with the labels
    it was trained on; another tenant's, a deleted one, or other labels are refused by name."""
    lena, max_ = tenant_key(secured, "lena"), tenant_key(secured, "max")
    file = upload(secured, lena).json()
    job = create_job(secured, lena, file["id"]).json()
    model = f"ft:tiny-bert:lena:{job['id']}"
    with session_scope(settings.database_url) as session:
        session.execute(
            update(Job).where(Job.id == job["id"]).values(status=JobStatus.succeeded, fine_tuned_model=model)
        )
        ArtifactRepository(session).put(
            Artifact(
                job_id=job["id"], format="pytorch", object_key="k", bytes=1, sha256="ab" * 32, manifest={}
            )
        )
    body = {"model": model, "training_file": file["id"]}
    ok = secured.post("/v1/fine_tuning/jobs", json=body, headers=bearer(lena))
    assert ok.status_code == 200, ok.text
    theirs = upload(secured, max_).json()
    stolen = secured.post(
        "/v1/fine_tuning/jobs", json=body | {"training_file": theirs["id"]}, headers=bearer(max_)
    )
    assert stolen.status_code == 404 and stolen.json()["error"]["param"] == "model"

    other = io.BytesIO(b'{"text": "x", "label": "a"}\n{"text": "y", "label": "b"}\n')
    relabelled = secured.post(
        "/v1/files", files={"file": ("o.jsonl", other)}, data={"purpose": "fine-tune"}, headers=bearer(lena)
    ).json()
    refused = secured.post(
        "/v1/fine_tuning/jobs", json=body | {"training_file": relabelled["id"]}, headers=bearer(lena)
    )
    assert refused.status_code == 400 and "are not those" in refused.json()["error"]["message"]

    secured.post(f"/v1/fine_tuning/jobs/{ok.json()['id']}/cancel", headers=bearer(lena))
    assert secured.delete(f"/v1/models/{model}", headers=bearer(lena)).status_code == 200
    gone = secured.post("/v1/fine_tuning/jobs", json=body, headers=bearer(lena))
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"

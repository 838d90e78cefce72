"""What the API decides before it forwards an inference request: whose model it is, whether it has an ONNX
model to serve, and what a caller is told when the inference process does not answer."""

from __future__ import annotations

import time
from typing import Any

from fastapi.testclient import TestClient

from ortune import lifecycle
from ortune.db.models import Artifact
from ortune.db.repositories import ArtifactRepository, JobRepository, TenantRepository
from ortune.db.session import session_scope
from ortune.settings import Settings

CHAT = [{"role": "user", "content": "hi"}]


def succeeded(
    client: TestClient, settings: Settings, train_file: dict[str, Any], *formats: str
) -> tuple[str, str]:
    """A job made succeeded with the artifact rows `formats`: its model name and id."""
    job = client.post(
        "/v1/fine_tuning/jobs", json={"model": "tiny-bert", "training_file": train_file["id"]}
    ).json()
    with session_scope(settings.database_url) as session:
        jobs = JobRepository(session)
        jobs.update(job["id"], status="running", result={"failed_artifacts": {"onnx": "simulated"}})
        for fmt in formats:
            ArtifactRepository(session).put(
                Artifact(
                    job_id=job["id"], format=fmt, object_key=f"k/{fmt}", bytes=1, sha256="0" * 64, manifest={}
                )
            )
        stored = jobs.get(job["id"])
        assert stored is not None and lifecycle.succeed(session, stored, stored.attempt)
        session.refresh(stored)
        assert stored.fine_tuned_model is not None
        return stored.fine_tuned_model, stored.id


def test_inference_answers_for_the_callers_own_served_models_only(
    client: TestClient, settings: Settings, train_file: dict[str, Any]
) -> None:
    name, job_id = succeeded(client, settings, train_file, "pytorch", "onnx")
    # nothing listens at ORTUNE_SERVE_URL here: a 503 that says what to start, with Retry-After
    down = client.post("/v1/predict", json={"model": name, "inputs": "good"})
    assert down.status_code == 503 and down.json()["error"]["code"] == "inference_unavailable"
    assert "ortune serve" in down.json()["error"]["message"] and down.headers["retry-after"] == "5"
    wrong_kind = client.post("/v1/chat/completions", json={"model": name, "messages": CHAT})
    assert wrong_kind.status_code == 400 and "use /v1/predict" in wrong_kind.json()["error"]["message"]
    base = client.post("/v1/chat/completions", json={"model": "tiny-gpt2", "messages": CHAT})
    assert base.status_code == 404 and base.json()["error"]["param"] == "model"

    no_onnx, _ = succeeded(client, settings, train_file, "pytorch")
    missing = client.post("/v1/predict", json={"model": no_onnx, "inputs": "good"})
    assert (
        missing.status_code == 404
        and "has no ONNX model to serve: simulated" in missing.json()["error"]["message"]
    )

    with session_scope(settings.database_url) as session:
        elsewhere = TenantRepository(session).create("elsewhere")
        stored = JobRepository(session).get(job_id)
        assert stored is not None
        stored.tenant_id = elsewhere.id
    theirs = client.post("/v1/predict", json={"model": name, "inputs": "good"})
    assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "model_not_found"


def test_inference_requests_are_checked_before_they_are_forwarded(client: TestClient) -> None:
    for body, param in [
        ({"model": "m", "messages": CHAT, "temperature": 3}, "temperature"),
        ({"model": "m", "messages": CHAT, "n": 2}, "n"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "m", "messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ]:
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 422 and response.json()["error"]["param"] == param, response.text


def test_a_stalled_reader_is_cut_and_its_upstream_reply_ended() -> None:
    """A client whose socket stops taking bytes (send never returns) is cut after the send timeout, and the
    inference process's reply is closed with it, so its row leaves the batch and its slot is freed. (Loopback
    absorbs about 3 MB before a send blocks, more than a test model writes, so the stall is made at the ASGI
    send, the point where a full socket shows.)"""
    import anyio

    from api.routes.inference import Relay

    ended: list[str] = []
    sent: list[dict[str, Any]] = []

    async def upstream() -> Any:
        try:
            while True:
                yield b"data: {}\n\n"
                await anyio.sleep(0.01)
        finally:
            ended.append("chunks")

    async def close_upstream() -> None:
        ended.append("upstream")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if len(sent) > 3:
            await anyio.sleep_forever()  # the client's socket is full and stays full

    async def receive() -> dict[str, Any]:
        await anyio.sleep_forever()
        raise AssertionError

    async def run() -> float:
        from starlette.background import BackgroundTask

        relay = Relay(
            upstream(), 0.5, media_type="text/event-stream", background=BackgroundTask(close_upstream)
        )
        started = time.monotonic()
        with anyio.fail_after(10):
            await relay(
                {"type": "http", "asgi": {"spec_version": "2.4"}, "client": ("1.2.3.4", 5)}, receive, send
            )
        return time.monotonic() - started

    took = anyio.run(run)
    assert 0.5 <= took < 5 and "upstream" in ended
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 3


def test_an_inference_process_gone_midway_ends_the_stream_with_an_error_event() -> None:
    """The upstream dies after one whole event and half of the next (a real socket, closed mid-body): the
    caller gets the whole event, then an error event, never the half one or a cut without a word."""
    import socket
    import threading

    import anyio
    import httpx

    from api.routes.inference import _passed_on

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def dies_midway() -> None:
        conn, _ = server.accept()
        conn.recv(65536)
        whole, half = b'data: {"n": 1}\n\n', b'data: {"n": '
        body = whole + half
        conn.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            + f"{len(body) + 100:x}\r\n".encode()  # promises more than it sends
            + body
        )
        conn.close()

    threading.Thread(target=dies_midway, daemon=True).start()

    async def relayed() -> bytes:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            upstream = await client.send(client.build_request("POST", "/v1/chat/completions"), stream=True)
            return b"".join([chunk async for chunk in _passed_on(upstream, client)])

    out = anyio.run(relayed).decode()
    server.close()
    first, second = out.strip().split("\n\n")
    assert first == 'data: {"n": 1}'
    assert '"code": "inference_unavailable"' in second and "went away during the reply" in second

"""Inference in OpenAI's shapes, for fine-tuned models by their `fine_tuned_model` name: the API checks the
caller and finds the model's ONNX artifact exactly as a download does (another tenant's model is a 404),
then forwards the request to the inference process (serve/, `ORTUNE_SERVE_URL`), streaming its events back.
The API itself never runs a model."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from sqlalchemy.orm import Session
from starlette.background import BackgroundTask

from api.auth import CallerDep
from api.caller import Caller
from api.deps import ReadDep
from api.errors import ERRORS, APIError, NotFound, Unavailable, body
from ortune.db.models import JobStatus
from ortune.db.repositories import ArtifactRepository, JobRepository
from ortune.inference import ChatCompletionRequest, CompletionRequest, PredictRequest, StoredModel
from trainer_core import tasks

router = APIRouter(prefix="/v1", tags=["inference"], responses=ERRORS)
log = logging.getLogger("ortune.inference")


def stored_model(session: Session, caller: Caller, name: str) -> StoredModel:
    job = JobRepository(session).by_fine_tuned_model(caller.tenant_id, name)
    if job is None or job.status != JobStatus.succeeded:
        raise NotFound(
            f"no fine-tuned model with id {name!r} (inference serves this tenant's fine-tuned models)",
            param="model",
            code="model_not_found",
        )
    artifact = ArtifactRepository(session).get(job.id, "onnx")
    if artifact is None:
        reason = ((job.result or {}).get("failed_artifacts") or {}).get("onnx") or "it was deleted"
        raise NotFound(f"{name} has no ONNX model to serve: {reason}", param="model", code="model_not_found")
    return StoredModel(name=name, object_key=artifact.object_key, sha256=artifact.sha256, task=job.task)


# what a caller is told beside an upstream refusal: when to try again
PASSED_ON = ("retry-after",)


async def forward(request: Request, path: str, body: dict[str, Any], stream: bool) -> Response:
    settings = request.app.state.settings
    client: httpx.AsyncClient | None = getattr(request.app.state, "serve_client", None)
    if client is None:
        # no pool bound: each tenant's streams are bounded by the inference process (429 past its limit),
        # and a stalled reader is cut, so connections are never held for long
        client = request.app.state.serve_client = httpx.AsyncClient(
            base_url=settings.serve_url,
            timeout=httpx.Timeout(600, connect=5),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
    try:
        upstream = await client.send(client.build_request("POST", path, json=body), stream=True)
    except httpx.TransportError as exc:
        raise Unavailable(
            f"the inference server at {client.base_url} does not answer ({type(exc).__name__}); start it "
            "with `ortune serve` (`ortune up` starts it beside the API)",
            code="inference_unavailable",
            headers={"Retry-After": "5"},
        ) from exc
    if stream and upstream.status_code == 200:
        return Relay(
            _passed_on(upstream, client),
            settings.inference_send_timeout_seconds,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(upstream.aclose),
        )
    content = await upstream.aread()
    await upstream.aclose()
    headers = {h: upstream.headers[h] for h in PASSED_ON if h in upstream.headers}
    return Response(content, status_code=upstream.status_code, media_type="application/json", headers=headers)


async def _passed_on(upstream: httpx.Response, client: httpx.AsyncClient) -> AsyncIterator[bytes]:
    """The upstream's events as they come; if the inference process goes away midway (killed, restarted),
    the stream ends with an error event, as one that failed inside it does, not a cut connection."""
    held = b""  # passed on by whole events, so that an error event never follows half of one
    try:
        async for chunk in upstream.aiter_raw():
            held += chunk
            if (end := held.rfind(b"\n\n")) >= 0:
                yield held[: end + 2]
                held = held[end + 2 :]
    except httpx.TransportError as exc:
        message = (
            f"the inference server at {client.base_url} went away during the reply ({type(exc).__name__}); "
            "try again"
        )
        yield f"data: {json.dumps(body(message, code='inference_unavailable'))}\n\n".encode()
        return
    if held:
        yield held


class StalledReader(Exception):
    """A client that took nothing of its stream for the send timeout."""


class Relay(StreamingResponse):
    """The inference process's events passed on as they come; a client that takes nothing for
    `send_timeout` seconds (its socket and buffers full) is cut, and the upstream reply with it, so a stalled
    reader holds no connection, row of the batch or tenant slot for longer than that."""

    def __init__(self, content: Any, send_timeout: float, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.send_timeout = send_timeout

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def timed(message: Any) -> None:
            try:
                with anyio.fail_after(self.send_timeout):
                    await send(message)
            except TimeoutError:
                raise StalledReader(f"took nothing for {self.send_timeout:g} s") from None

        # Starlette runs the background task only after a complete reply: the upstream must end on every
        # path (a client gone, a stalled one cut), so that its row leaves the batch at once
        background, self.background = self.background, None
        try:
            await super().__call__(scope, receive, timed)
        except StalledReader as exc:
            log.warning("cut a stalled inference stream to %s: %s", _peer(scope), exc)
        finally:
            if background is not None:
                await background()


def _peer(scope: Any) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "a client"


ENDPOINTS = {"chat": "/v1/chat/completions", "predict": "/v1/predict"}  # by TaskInfo.serving


async def _checked(read: ReadDep, caller: Caller, name: str, serving: tasks.Serving) -> StoredModel:
    model = await read(lambda session: stored_model(session, caller, name))
    served_as = tasks.get(model.task).serving
    if served_as is None:
        raise APIError(
            f"{name} is a {model.task} model, which this server does not serve yet: download its ONNX "
            "artifact (GET /v1/fine_tuning/jobs/{id}/artifacts/onnx) and run it with onnxruntime",
            param="model",
            code="model_not_served",
        )
    if served_as != serving:
        raise APIError(f"{name} is a {model.task} model: use {ENDPOINTS[served_as]}", param="model")
    return model


@router.post("/chat/completions")
async def chat_completions(
    req: ChatCompletionRequest, request: Request, read: ReadDep, caller: CallerDep
) -> Response:
    """Chat with a fine-tuned causal LM (OpenAI's shape; `stream: true` for server-sent events)."""
    model = await _checked(read, caller, req.model, "chat")
    body = _upstream(req, caller, model)
    return await forward(request, "/v1/chat/completions", body, req.stream)


@router.post("/completions")
async def completions(req: CompletionRequest, request: Request, read: ReadDep, caller: CallerDep) -> Response:
    """Continue a prompt with a fine-tuned causal LM (OpenAI's legacy completions shape)."""
    model = await _checked(read, caller, req.model, "chat")
    body = _upstream(req, caller, model)
    return await forward(request, "/v1/completions", body, req.stream)


@router.post("/predict")
async def predict(req: PredictRequest, request: Request, read: ReadDep, caller: CallerDep) -> Response:
    """Label scores from a fine-tuned classifier: `{"model", "inputs": text or [texts]}` in, `{"data":
    [[{label, score}, ...], ...]}` out, a list per text, best first (text-embeddings-inference's shape)."""
    model = await _checked(read, caller, req.model, "predict")
    body = _upstream(req, caller, model)
    return await forward(request, "/v1/predict", body, False)


def _upstream(req: Any, caller: Caller, model: StoredModel) -> dict[str, Any]:
    """The request as the inference process reads it: the stored model and whose limits it counts against
    (set here, whatever the caller sent)."""
    return req.model_dump(exclude_none=True) | {
        "ortune_model": model.model_dump(),
        "ortune_tenant": caller.tenant_id,
    }

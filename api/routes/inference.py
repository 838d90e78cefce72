"""Inference in OpenAI's shapes, for fine-tuned models by their `fine_tuned_model` name: the API checks the
caller and finds the model's ONNX artifact exactly as a download does (another tenant's model is a 404),
then forwards the request to the inference process (serve/, `ORTUNE_SERVE_URL`), streaming its events back.
The API itself never runs a model."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from sqlalchemy.orm import Session
from starlette.background import BackgroundTask

from api.auth import CallerDep
from api.caller import Caller
from api.deps import ReadDep
from api.errors import ERRORS, APIError, NotFound, Unavailable
from ortune.db.models import JobStatus
from ortune.db.repositories import ArtifactRepository, JobRepository
from ortune.inference import ChatCompletionRequest, CompletionRequest, PredictRequest, StoredModel
from trainer_core import tasks

router = APIRouter(prefix="/v1", tags=["inference"], responses=ERRORS)


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


async def forward(request: Request, path: str, body: dict[str, Any], stream: bool) -> Response:
    client: httpx.AsyncClient | None = getattr(request.app.state, "serve_client", None)
    if client is None:
        settings = request.app.state.settings
        client = request.app.state.serve_client = httpx.AsyncClient(
            base_url=settings.serve_url, timeout=httpx.Timeout(600, connect=5)
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
        return StreamingResponse(
            upstream.aiter_raw(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(upstream.aclose),
        )
    content = await upstream.aread()
    await upstream.aclose()
    return Response(content, status_code=upstream.status_code, media_type="application/json")


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
    body = req.model_dump(exclude_none=True) | {"ortune_model": model.model_dump()}
    return await forward(request, "/v1/chat/completions", body, req.stream)


@router.post("/completions")
async def completions(req: CompletionRequest, request: Request, read: ReadDep, caller: CallerDep) -> Response:
    """Continue a prompt with a fine-tuned causal LM (OpenAI's legacy completions shape)."""
    model = await _checked(read, caller, req.model, "chat")
    body = req.model_dump(exclude_none=True) | {"ortune_model": model.model_dump()}
    return await forward(request, "/v1/completions", body, req.stream)


@router.post("/predict")
async def predict(req: PredictRequest, request: Request, read: ReadDep, caller: CallerDep) -> Response:
    """Label scores from a fine-tuned classifier: `{"model", "inputs": text or [texts]}` in, `{"data":
    [[{label, score}, ...], ...]}` out, a list per text, best first (text-embeddings-inference's shape)."""
    model = await _checked(read, caller, req.model, "predict")
    body = req.model_dump(exclude_none=True) | {"ortune_model": model.model_dump()}
    return await forward(request, "/v1/predict", body, False)

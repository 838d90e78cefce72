"""The inference process's HTTP face (`ortune serve`; the API forwards to it, having checked the caller and
resolved the model): OpenAI's chat and text completions, streamed as server-sent events when asked, and
label scores for classifiers. It runs on the same machine as the API or beside it; it trusts the API's
`ortune_model` and must not be exposed on its own."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from ortune.inference import ChatCompletionRequest, CompletionRequest, Generation, PredictRequest, error
from ortune.settings import Settings, get_settings
from ortune.storage import ArchiveUnusable, open_store
from serve.models import Classifier, Decoder, ModelCache, NotServed, Ref, Sampling, TooLarge


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(title="ortune inference", docs_url=None, redoc_url=None)
    store = open_store(
        settings.storage_url,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key.get_secret_value(),
        region=settings.s3_region,
    )
    cache = ModelCache(store, settings.job_work_dir / "serve", settings.serve_cache_bytes)
    app.state.cache = cache

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"status": "ok", "pid": os.getpid(), "models": len(cache.entries), "cache_bytes": cache.used}

    @app.post("/v1/chat/completions")
    def chat_completions(req: ChatCompletionRequest) -> Any:
        return _generate(cache, req, chat=True)

    @app.post("/v1/completions")
    def completions(req: CompletionRequest) -> Any:
        return _generate(cache, req, chat=False)

    @app.post("/v1/predict")
    def predict(req: PredictRequest) -> Any:
        model = _model(cache, req.ortune_model)
        if isinstance(model, JSONResponse):
            return model
        if not isinstance(model, Classifier):
            return _refuse(
                f"{req.model} is a causal LM: use /v1/chat/completions or /v1/completions", "model"
            )
        texts = [req.inputs] if isinstance(req.inputs, str) else req.inputs
        return {"object": "list", "model": req.model, "data": model.predict(texts)}

    return app


def app() -> FastAPI:
    return create_app()


def _refuse(
    message: str, param: str | None = None, status: int = 400, code: str = "invalid_request_error"
) -> JSONResponse:
    return JSONResponse(error(message, param=param, code=code), status_code=status)


def _model(cache: ModelCache, stored: Any) -> Decoder | Classifier | JSONResponse:
    if stored is None:
        return _refuse("no ortune_model: requests come through the API", "model")
    try:
        return cache.get(Ref(stored.name, stored.object_key, stored.sha256))
    except TooLarge as exc:
        return _refuse(str(exc), "model", code="model_too_large")
    except NotServed as exc:
        return _refuse(f"{stored.name}: {exc}", "model", code="model_not_served")
    except ArchiveUnusable as exc:
        return _refuse(str(exc), "model", status=404, code="model_not_found")


def _generate(cache: ModelCache, req: Generation, *, chat: bool) -> Any:
    model = _model(cache, req.ortune_model)
    if isinstance(model, JSONResponse):
        return model
    if not isinstance(model, Decoder):
        return _refuse(f"{req.model} is a classifier: use /v1/predict", "model")
    stops = list(req.stops)
    if isinstance(req, ChatCompletionRequest):
        prompt, end_of_turn = model.chat_prompt([m.model_dump() for m in req.messages])
        stops += end_of_turn
    else:
        assert isinstance(req, CompletionRequest)
        prompt = model.encode(req.prompt)
    if len(prompt) + req.limit > model.context:
        return _refuse(
            f"this model's context is {model.context} tokens; the prompt has {len(prompt)} and max_tokens "
            f"asks for {req.limit} more",
            "messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    sampling = Sampling(req.limit, req.temperature, req.top_p, req.seed, stops)
    steps = model.generate(prompt, sampling)
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    head = {"id": ident, "created": created, "model": req.model, "system_fingerprint": _fingerprint(model)}
    if req.stream:
        return StreamingResponse(_events(steps, head, chat, len(prompt)), media_type="text/event-stream")
    text, finish, count = "", "length", 0
    for piece, reason, so_far in steps:
        text += piece
        finish, count = reason or finish, so_far
    usage = {"prompt_tokens": len(prompt), "completion_tokens": count, "total_tokens": len(prompt) + count}
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish,
            "logprobs": None,
        }
        return head | {"object": "chat.completion", "choices": [choice], "usage": usage}
    return head | {
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        "usage": usage,
    }


def _events(
    steps: Iterator[tuple[str, str | None, int]], head: dict[str, Any], chat: bool, prompt: int
) -> Iterator[bytes]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    count = 0

    def event(delta: str | None, reason: str | None, first: bool = False) -> bytes:
        if chat:
            part: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if delta:
                part["content"] = delta
            choice: dict[str, Any] = {"index": 0, "delta": part, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
        return f"data: {json.dumps(head | {'object': kind, 'choices': [choice]})}\n\n".encode()

    if chat:
        yield event(None, None, first=True)
    for piece, reason, so_far in steps:
        count = so_far
        if piece or reason:
            yield event(piece, reason)
    usage = {"prompt_tokens": prompt, "completion_tokens": count, "total_tokens": prompt + count}
    yield f"data: {json.dumps(head | {'object': kind, 'choices': [], 'usage': usage})}\n\n".encode()
    yield b"data: [DONE]\n\n"


def _fingerprint(model: Decoder) -> str:
    # says how the answer was made: with the export's KV cache, or the slower whole-sequence path
    return "ortune-onnx-kv" if model.kv_cache else "ortune-onnx-nocache"

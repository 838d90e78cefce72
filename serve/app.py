"""The inference process's HTTP face (`ortune serve`; the API forwards to it, having checked the caller and
resolved the model): OpenAI's chat and text completions, streamed as server-sent events when asked, and
label scores for classifiers. It runs on the same machine as the API or beside it; it trusts the API's
`ortune_model` and must not be exposed on its own."""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ortune.inference import ChatCompletionRequest, CompletionRequest, Generation, PredictRequest, error
from ortune.settings import Settings, get_settings
from ortune.storage import ArchiveUnusable, open_store
from serve.cache import CacheBusy, Lease, ModelCache, NotServed, Ref, TooLarge
from serve.limits import Limited, NeverFits, TenantLimits, Ticket
from serve.models import Classifier, Decoder, PromptTooLong, Sampling


class Refused(ValueError):
    """A request this server will not answer as sent (400, or the status given), naming the field."""

    def __init__(self, message: str, param: str | None, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param, self.code = param, code


# what each refusal is answered with: status, code, and Retry-After where trying again later helps
REFUSALS: dict[type[Exception], tuple[int, str, str | None]] = {
    TooLarge: (400, "model_too_large", "model"),
    NotServed: (400, "model_not_served", "model"),
    ArchiveUnusable: (404, "model_not_found", "model"),
    NeverFits: (400, "request_too_large", "max_tokens"),
    CacheBusy: (503, "model_cache_busy", "model"),
}


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(title="ortune inference", docs_url=None, redoc_url=None)
    store = open_store(
        settings.storage_url,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key.get_secret_value(),
        region=settings.s3_region,
    )
    serving = Serving(
        settings,
        ModelCache(store, settings.job_work_dir / "serve", settings.serve_cache_bytes),
        TenantLimits(settings.serve_max_streams_per_tenant, settings.serve_tokens_per_minute_per_tenant),
    )
    app.state.serving = serving

    @app.exception_handler(Refused)
    def refused(_: Request, exc: Refused) -> JSONResponse:
        return JSONResponse(error(str(exc), param=exc.param, code=exc.code), status_code=400)

    @app.exception_handler(Limited)
    def limited(_: Request, exc: Limited) -> JSONResponse:
        return JSONResponse(
            error(str(exc), code=exc.code), status_code=429, headers={"Retry-After": str(exc.retry_after)}
        )

    for kind, (status, code, param) in REFUSALS.items():

        def answer(
            _: Request, exc: Exception, status: int = status, code: str = code, param: Any = param
        ) -> Any:
            headers = {"Retry-After": "1"} if status == 503 else None
            return JSONResponse(error(str(exc), param=param, code=code), status_code=status, headers=headers)

        app.add_exception_handler(kind, answer)

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        cache = serving.cache
        return {
            "status": "ok",
            "pid": os.getpid(),
            "models": len(cache.entries),
            "cache_bytes": cache.used,
            "models_in_use": sum(1 for e in cache.entries.values() if e.users),
            "requests_under_way": serving.limits.under_way(),
        }

    @app.post("/v1/chat/completions")
    def chat_completions(req: ChatCompletionRequest) -> Any:
        return serving.generate(req, chat=True)

    @app.post("/v1/completions")
    def completions(req: CompletionRequest) -> Any:
        return serving.generate(req, chat=False)

    @app.post("/v1/predict")
    def predict(req: PredictRequest) -> Any:
        with serving.admitted(req.ortune_tenant, req.ortune_model) as (_, lease):
            model = lease.model
            if not isinstance(model, Classifier):
                raise Refused(
                    f"{req.model} is a causal LM: use /v1/chat/completions or /v1/completions", "model"
                )
            texts = [req.inputs] if isinstance(req.inputs, str) else req.inputs
            return {"object": "list", "model": req.model, "data": model.predict(texts)}

    return app


def app() -> FastAPI:
    return create_app()


class Serving:
    """What every request goes through: the tenant's slot and tokens, then the model, held while in use."""

    def __init__(self, settings: Settings, cache: ModelCache, limits: TenantLimits) -> None:
        self.settings, self.cache, self.limits = settings, cache, limits

    @contextlib.contextmanager
    def admitted(self, tenant: str | None, stored: Any) -> Iterator[tuple[Ticket, Lease]]:
        """A slot of the tenant's and the model held, both given back when the block ends."""
        ticket, lease = self._admit(tenant, stored)
        try:
            yield ticket, lease
        finally:
            ticket.close()
            lease.close()

    def _admit(self, tenant: str | None, stored: Any) -> tuple[Ticket, Lease]:
        if stored is None or tenant is None:
            raise Refused("no ortune_model or ortune_tenant: requests come through the API", "model")
        ticket = self.limits.admit(tenant)
        try:
            return ticket, self.cache.use(Ref(stored.name, stored.object_key, stored.sha256))
        except BaseException:
            ticket.close()
            raise

    def generate(self, req: Generation, *, chat: bool) -> Any:
        ticket, lease = self._admit(req.ortune_tenant, req.ortune_model)
        try:
            model, prompt, sampling = self._read(lease.model, req, chat)
            ticket.reserve(len(prompt) + sampling.max_tokens)
            steps = model.generate(prompt, sampling)
        except BaseException:
            ticket.close()
            lease.close()
            raise

        def done(count: int = 0) -> None:
            ticket.close(len(prompt) + count)
            lease.close()

        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        head = {
            "id": ident,
            "created": created,
            "model": req.model,
            "system_fingerprint": _fingerprint(model),
        }
        if req.stream:
            body = _events(steps, head, chat, len(prompt), done)
            weakref.finalize(body, done)  # a reply never started (its client gone first) frees its slot too
            return StreamingResponse(body, media_type="text/event-stream")
        text, finish, count = "", "length", 0
        try:
            for piece, reason, so_far in steps:
                text += piece
                finish, count = reason or finish, so_far
        finally:
            done(count)
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": count,
            "total_tokens": len(prompt) + count,
        }
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

    def _read(self, model: Any, req: Generation, chat: bool) -> tuple[Decoder, list[int], Sampling]:
        """The decoder, the prompt's tokens and how to sample the reply, or Refused naming the field."""
        field = "messages" if chat else "prompt"
        if not isinstance(model, Decoder):
            raise Refused(f"{req.model} is a classifier: use /v1/predict", "model")
        stops = list(req.stops)
        if isinstance(req, ChatCompletionRequest):
            text, end_of_turn = model.chat_prompt([m.model_dump() for m in req.messages])
            stops += end_of_turn
        else:
            assert isinstance(req, CompletionRequest)
            text = req.prompt
        try:
            prompt = model.encode(text)
        except PromptTooLong as exc:
            raise Refused(str(exc), field, code="context_length_exceeded") from exc
        asked, most = req.asked, self.settings.serve_max_tokens
        length_field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        room = model.context - len(prompt)
        if asked is None:  # as much as fits, up to the default
            limit = min(self.settings.serve_default_max_tokens, most, room)
            wants = "leaves no room for a reply"
        else:
            limit, wants = asked, f"{length_field} asks for {asked} more"
        if limit > room or limit < 1:
            raise Refused(
                f"this model's context is {model.context} tokens; the prompt has {len(prompt)} and {wants}",
                field,
                code="context_length_exceeded",
            )
        if limit > most:
            raise Refused(
                f"{length_field} is {asked}: this server's most for one reply is {most} "
                "(ORTUNE_SERVE_MAX_TOKENS)",
                length_field,
            )
        return model, prompt, Sampling(limit, req.temperature, req.top_p, req.seed, stops)


def _events(
    steps: Iterator[tuple[str, str | None, int]],
    head: dict[str, Any],
    chat: bool,
    prompt: int,
    done: Callable[..., None],
) -> Iterator[bytes]:
    """The reply as server-sent events; one that fails midway ends with an error event (what OpenAI's client
    raises as an APIError), never a cut connection."""
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

    try:
        if chat:
            yield event(None, None, first=True)
        for piece, reason, so_far in steps:
            count = so_far
            if piece or reason:
                yield event(piece, reason)
    except Exception as exc:  # the model failed midway: the client hears why, and the stream ends
        failed = error(
            f"the reply failed after {count} tokens: {type(exc).__name__}: {exc}", code="server_error"
        )
        yield f"data: {json.dumps(failed)}\n\n".encode()
        return
    finally:
        done(count)
    usage = {"prompt_tokens": prompt, "completion_tokens": count, "total_tokens": prompt + count}
    yield f"data: {json.dumps(head | {'object': kind, 'choices': [], 'usage': usage})}\n\n".encode()
    yield b"data: [DONE]\n\n"


def _fingerprint(model: Decoder) -> str:
    # says how the answer was made: with the export's KV cache, or the slower whole-sequence path
    return "ortune-onnx-kv" if model.kv_cache else "ortune-onnx-nocache"

"""Request bodies are capped before anything parses them: a JSON body over `max_request_bytes` is refused
with 413, whether it declares its length or arrives chunked. Uploads (POST /v1/files) have their own, larger
limit, counted as they stream to disk (api/services/uploads.py)."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import body

UPLOAD = ("POST", "/v1/files")


class BodyTooLarge(HTTPException):
    """Raised while the handler reads a chunked body: an HTTPException, so FastAPI passes it on as it is
    (any other exception while parsing a body becomes its generic 400) and api/errors renders it."""


class BodyLimit:
    """Pure ASGI middleware, so that it sees the body before FastAPI reads it whole."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) == UPLOAD:
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send, f"the request body of {int(declared):,} bytes")
            return
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(413, self._message("the chunked request body"))
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except BodyTooLarge:
            if not started:  # a chunked body that ran past the limit while the handler read it
                await self._refuse(send, "the chunked request body")

    def _message(self, what: str) -> str:
        return f"{what} is over this API's limit of {self.limit:,} bytes (ORTUNE_MAX_REQUEST_BYTES)"

    async def _refuse(self, send: Send, what: str) -> None:
        payload = body(self._message(what), code="payload_too_large")
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(payload).encode()})

"""A small error hierarchy with status codes, rendered in OpenAI's error shape by one handler."""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    status_code = 400
    code = "invalid_request_error"
    type = "invalid_request_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers
        if code:
            self.code = code


class NotFound(APIError):
    status_code = 404
    code = "not_found"


class Conflict(APIError):
    status_code = 409
    code = "conflict"


class PayloadTooLarge(APIError):
    status_code = 413
    code = "payload_too_large"


class RangeNotSatisfiable(APIError):
    status_code = 416
    code = "range_not_satisfiable"


class Unavailable(APIError):
    status_code = 503
    code = "service_unavailable"
    type = "server_error"


def body(
    message: str, *, code: str, type: str = "invalid_request_error", param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_UNION_MEMBER = re.compile(
    r"^(constrained-|literal\[|function-|is-instance\[|list\[|dict\[|"
    r"(int|float|str|bool|none|tagged-union)$)"
)


def _loc(loc: tuple[Any, ...]) -> str:
    """`hyperparameters.n_epochs`, without pydantic's union-member tags or the request-part prefix."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header", "form")]
    return ".".join(p for p in parts if not _UNION_MEMBER.match(p))


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(
            body(exc.message, code=exc.code, type=exc.type, param=exc.param),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors, seen = [], set()
        for err in exc.errors():  # a union reports once per member; the first says it best
            where = _loc(tuple(err.get("loc", ())))
            if where not in seen:
                seen.add(where)
                errors.append(err)
        messages = []
        for err in errors:
            where = _loc(tuple(err.get("loc", ())))
            if err.get("type") == "extra_forbidden":
                messages.append(f"unknown field '{where}'")
            elif err.get("type") == "missing":
                messages.append(f"missing required field '{where}'")
            else:
                messages.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        param = _loc(tuple(errors[0].get("loc", ()))) if errors else None
        return JSONResponse(
            body("; ".join(messages), code="invalid_request", param=param or None), status_code=422
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(
            body(str(exc.detail), code=code),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(OperationalError)
    async def _db_down(_: Request, exc: OperationalError) -> JSONResponse:
        return JSONResponse(
            body(
                "the database is unavailable; retry shortly", code="database_unavailable", type="server_error"
            ),
            status_code=503,
            headers={"Retry-After": "5"},
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            body(f"internal error: {type(exc).__name__}", code="internal_error", type="server_error"),
            status_code=500,
        )

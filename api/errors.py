"""A small error hierarchy with status codes, rendered in OpenAI's error shape by one handler."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from ortune.storage import StorageUnavailable


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


class Unauthorized(APIError):
    status_code = 401
    code = "invalid_api_key"

    def __init__(self, message: str, **kw: object) -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"}, **kw)  # type: ignore[arg-type]


class Forbidden(APIError):
    status_code = 403
    code = "forbidden"


class TooManyRequests(APIError):
    status_code = 429
    code = "rate_limit_exceeded"


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


log = logging.getLogger(__name__)

# Postgres: lock_timeout (lock_not_available) and statement_timeout (query_canceled) ran out
BUSY = ("55P03", "57014")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class ErrorResponse(BaseModel):
    """OpenAI's error shape; every 4xx and 5xx of this API has it."""

    error: ErrorDetail


_WHY = {
    400: "The request is invalid (the error names the field)",
    401: "No API key, or one that is not valid",
    403: "An admin key is needed",
    404: "No such resource (for this tenant)",
    409: "The resource is in a state that does not allow this",
    413: "The upload is over the size limit",
    416: "The range cannot be satisfied",
    422: "The body or a parameter does not match the schema (the error names the field)",
    429: "Over a quota",
    503: "The database is unavailable; retry after Retry-After",
}
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": why} for code, why in _WHY.items()
}


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


def _allowed_methods(request: Request) -> list[str]:
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        if match != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


def _unavailable(exc: DBAPIError) -> bool:
    """The database went away or is going (a connection dropped, a shutdown, a restart), whatever class
    the driver's dialect gave it: SQLAlchemy's asyncpg dialect raises a dropped connection as a bare
    DBAPIError or an InterfaceError, which the two-host soak saw as a 500 during a Postgres restart."""
    sqlstate = str(getattr(exc.orig, "sqlstate", None) or "")
    return (
        isinstance(exc, OperationalError | InterfaceError)
        or exc.connection_invalidated
        or sqlstate.startswith(
            ("08", "57P")
        )  # connection exceptions; admin/crash shutdown, cannot connect now
    )


def _internal(exc: Exception) -> JSONResponse:
    return JSONResponse(
        body(f"internal error: {type(exc).__name__}", code="internal_error", type="server_error"),
        status_code=500,
    )


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(
        body(exc.message, code=exc.code, type=exc.type, param=exc.param),
        status_code=exc.status_code,
        headers=exc.headers,
    )


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


async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(
        exc.status_code, "http_error"
    )
    headers = dict(getattr(exc, "headers", None) or {})
    message = str(exc.detail)
    if exc.status_code == 405:
        # Starlette's Allow names the methods of the first route on the path only; name them all.
        allowed = _allowed_methods(request)
        headers["Allow"] = ", ".join(allowed)
        message = f"{request.method} is not allowed on {request.url.path}; use {', '.join(allowed)}"
    return JSONResponse(body(message, code=code), status_code=exc.status_code, headers=headers)


async def _db_down(_: Request, exc: DBAPIError) -> JSONResponse:
    # SQLAlchemy's asyncpg dialect raises a timeout as a bare DBAPIError; the sqlstate says what it was
    if getattr(exc.orig, "sqlstate", None) in BUSY:
        return JSONResponse(
            body(
                "the database is busy: this request waited longer than the API's lock or statement "
                "timeout; retry shortly",
                code="database_busy",
                type="server_error",
            ),
            status_code=503,
            headers={"Retry-After": "1"},
        )
    if not _unavailable(exc):
        log.error("database error in a request", exc_info=exc)  # Starlette logs no 500 handled here
        return _internal(exc)
    return JSONResponse(
        body("the database is unavailable; retry shortly", code="database_unavailable", type="server_error"),
        status_code=503,
        headers={"Retry-After": "5"},
    )


async def _storage_down(_: Request, exc: StorageUnavailable) -> JSONResponse:
    return JSONResponse(
        body(
            "object storage is unavailable; nothing was stored, retry shortly",
            code="storage_unavailable",
            type="server_error",
        ),
        status_code=503,
        headers={"Retry-After": "5"},
    )


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    return _internal(exc)


def install(app: FastAPI) -> None:
    for exc_type, handler in (
        (APIError, _api_error),
        (RequestValidationError, _validation),
        (StarletteHTTPException, _http),
        (DBAPIError, _db_down),
        (StorageUnavailable, _storage_down),
        (Exception, _unexpected),
    ):
        app.add_exception_handler(exc_type, handler)  # type: ignore[arg-type]

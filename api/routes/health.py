from __future__ import annotations

import asyncio
import os
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from api.auth import PlatformDep, authenticate
from api.deps import SettingsDep
from api.errors import ERRORS, APIError
from ortune.db.session import make_engine
from ortune.queue import ping_broker

router = APIRouter(tags=["health"], responses=ERRORS)


@router.get("/healthz")
def healthz() -> dict[str, str | int]:
    """The process is up (its pid lets a launcher tell its own server from another on the port)."""
    return {"status": "ok", "pid": os.getpid()}


def _check_db(url: str) -> None:
    with make_engine(url).connect() as conn:
        conn.execute(text("SELECT 1"))


@router.get("/readyz", responses={503: {"description": "a dependency is down"}})
async def readyz(request: Request, settings: SettingsDep) -> JSONResponse:
    """Database, broker and storage all answer. Only a platform key sees why a check failed: the exception
    text names hosts, ports and users."""
    try:
        caller = await authenticate(request)
        detailed = caller.platform  # hosts and users in exception text are the operator's business
    except APIError:
        detailed = False
    checks: dict[str, Any] = {}
    probes = {
        "database": lambda: _check_db(settings.database_url),
        "broker": lambda: ping_broker(settings),
        "storage": request.app.state.store.ping,
    }
    for name, probe in probes.items():
        try:
            await asyncio.wait_for(asyncio.to_thread(probe), timeout=5)
            checks[name] = "ok"
        except Exception as exc:
            checks[name] = f"error: {type(exc).__name__}: {exc}"[:300] if detailed else "error"
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse(
        {"status": "ok" if ok else "unavailable", "checks": checks},
        status_code=200 if ok else 503,
        headers=None if ok else {"Retry-After": "5"},
    )


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
def metrics(request: Request, _: PlatformDep) -> Response:
    """Prometheus exposition: request rates and latencies, queue depth, jobs by status, samples/s (a platform
    key, in every mode: it names every tenant's running jobs)."""
    return Response(generate_latest(request.app.state.metrics), media_type=CONTENT_TYPE_LATEST)

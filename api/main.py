"""The FastAPI app: routers per resource, one error handler, settings and the store on app.state."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio.to_thread
from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry

from api import errors
from api.auth import KeyCache, refuse_open_with_keys
from api.deps import Reader
from api.limits import BodyLimit
from api.observability import JobCollector, RequestMetrics
from api.routes import admin, dashboard, files, health, inference, jobs, models, nodes
from ortune import __version__
from ortune.db.session import limit_postgres_sessions
from ortune.settings import Settings, get_settings
from ortune.storage import open_store


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.api_threads
        await anyio.to_thread.run_sync(refuse_open_with_keys, settings)
        # What start-up built (modules, routes, schemas) lives as long as the process: frozen, it is out of
        # the collector's sight, and a full collection no longer walks its ~100k objects (70 ms on this
        # machine, a tail-latency spike each time; bench/api_load).
        gc.freeze()
        yield
        await app.state.reader.close()
        if (serve := getattr(app.state, "serve_client", None)) is not None:
            await serve.aclose()

    app = FastAPI(
        lifespan=lifespan,
        title="ortune",
        version=__version__,
        description="Managed fine-tuning jobs in OpenAI's REST shapes, trained with ONNX Runtime.",
    )
    app.state.settings = settings
    limits = settings.session_limits("api")
    limit_postgres_sessions(settings.database_url, limits, application_name="ortune-api")
    app.state.store = open_store(
        settings.storage_url,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key.get_secret_value(),
        region=settings.s3_region,
    )
    app.state.key_cache = KeyCache(settings.api_key_cache_seconds)
    app.state.reader = Reader(settings.database_url, limits)
    app.state.metrics = CollectorRegistry()
    app.state.metrics.register(JobCollector(settings.database_url))
    app.add_middleware(BodyLimit, limit=settings.max_request_bytes)
    app.add_middleware(RequestMetrics, registry=app.state.metrics)
    errors.install(app)
    for module in (files, jobs, models, inference, admin, nodes, health, dashboard):
        app.include_router(module.router)
    app.mount("/dashboard/static", StaticFiles(directory=dashboard.STATIC), name="dashboard-static")
    return app


def app() -> FastAPI:
    """Factory for `uvicorn --factory api.main:app`."""
    return create_app()

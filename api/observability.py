"""Prometheus metrics: request rates and latencies from a middleware, job figures read at scrape time.

Job gauges are read from the database when Prometheus scrapes, not kept in the process: the database is the
source of truth, and any API replica answers the same. Each app has its own registry, so tests that build
many apps never collide.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ortune.db.models import JobStatus
from ortune.db.repositories import JobRepository, MetricRepository
from ortune.db.session import session_scope

# Latency buckets around the API's own targets (p99 under 50 ms for polls), in seconds.
BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class JobCollector(Collector):
    def __init__(self, database_url: str) -> None:
        self.database_url = database_url

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = GaugeMetricFamily("ortune_jobs", "Jobs by status.", labels=["status"])
        queue = GaugeMetricFamily("ortune_queue_depth", "Jobs waiting for a worker (status queued).")
        speed = GaugeMetricFamily(
            "ortune_training_samples_per_second", "Last reported training speed.", labels=["job_id"]
        )
        up = GaugeMetricFamily("ortune_database_up", "1 when the database answered this scrape.")
        try:
            with session_scope(self.database_url) as session:
                counts = JobRepository(session).count_by_status()
                rates = MetricRepository(session).latest_of_running("samples_per_second")
        except Exception:  # a scrape while the database is down still answers, and says so
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        for status in JobStatus:
            jobs.add_metric([status.value], counts.get(status, 0))
        queue.add_metric([], counts.get(JobStatus.queued, 0))
        for job_id, rate in sorted(rates.items()):
            speed.add_metric([job_id], rate)
        yield from (up, jobs, queue, speed)


class RequestMetrics:
    """Pure ASGI middleware (a BaseHTTPMiddleware would wrap every streamed download in a second stream)."""

    def __init__(self, app: ASGIApp, registry: CollectorRegistry) -> None:
        self.app = app
        self.requests = Counter(
            "ortune_http_requests", "HTTP requests.", ["method", "route", "status"], registry=registry
        )
        self.latency = Histogram(
            "ortune_http_request_duration_seconds",
            "Time to the response's first byte.",
            ["method", "route"],
            buckets=BUCKETS,
            registry=registry,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                self._observe(scope, status, time.perf_counter() - start)
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception:
            self._observe(scope, 500, time.perf_counter() - start)
            raise

    def _observe(self, scope: Scope, status: int, seconds: float) -> None:
        # The route template, never the raw path: ids in paths would make one series per job.
        route = getattr(scope.get("route"), "path", None) or "unmatched"
        self.requests.labels(scope["method"], route, str(status)).inc()
        self.latency.labels(scope["method"], route).observe(seconds)

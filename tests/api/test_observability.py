"""/metrics for Prometheus, parsed with prometheus_client's own parser, on both configurations."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from ortune.db.models import JobStatus
from ortune.db.repositories import JobRepository, MetricRepository
from ortune.db.session import session_scope
from ortune.settings import Settings
from tests.support import ADMIN_KEY


def scrape(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def test_metrics_count_requests_jobs_and_training_speed(
    client: TestClient, settings: Settings, train_file: dict[str, Any]
) -> None:
    body = {"model": "tiny-bert", "training_file": train_file["id"], "backend": "torch"}
    jobs = [client.post("/v1/fine_tuning/jobs", json=body).json()["id"] for _ in range(3)]
    with session_scope(settings.database_url) as session:
        JobRepository(session).update(jobs[0], status=JobStatus.running)
        MetricRepository(session).add_many(
            jobs[0],
            [("samples_per_second", 1, 100.0), ("samples_per_second", 2, 120.5), ("train_loss", 2, 0.5)],
        )
    for _ in range(4):
        assert client.get(f"/v1/fine_tuning/jobs/{jobs[1]}").status_code == 200
    assert client.get("/v1/fine_tuning/jobs/ftjob-nope").status_code == 404

    samples = scrape(client)
    assert samples[("ortune_database_up", ())] == 1
    assert samples[("ortune_jobs", (("status", "running"),))] == 1
    assert samples[("ortune_jobs", (("status", "queued"),))] == 2
    assert samples[("ortune_queue_depth", ())] == 2
    assert samples[("ortune_training_samples_per_second", (("job_id", jobs[0]),))] == 120.5
    # The route template, not the path: one series for every job id.
    polled = (("method", "GET"), ("route", "/v1/fine_tuning/jobs/{job_id}"), ("status", "200"))
    assert samples[("ortune_http_requests_total", polled)] == 4
    missing = (("method", "GET"), ("route", "/v1/fine_tuning/jobs/{job_id}"), ("status", "404"))
    assert samples[("ortune_http_requests_total", missing)] == 1
    latency = (("method", "GET"), ("route", "/v1/fine_tuning/jobs/{job_id}"))
    assert samples[("ortune_http_request_duration_seconds_count", latency)] == 5
    assert samples[("ortune_http_request_duration_seconds_sum", latency)] > 0

"""The API under load: what a dashboard polls, beside /healthz on the same server, with a full database.

The database holds 1,000 jobs, 100,000 metric points and 20,000 events. wrk (Debian's package) drives 20
concurrent connections at each endpoint in turn, each request on a random job, after a 2 s warm-up that is not
counted (it opens the pools' connections); the figures are requests/s as a ratio to /healthz measured in the
same run and wrk's p99 latency. The targets (>= 0.5x, p99 < 50 ms) are the issue's, for the two reads a
dashboard polls: the job and its events. Chart series and the job list are measured beside them, without one.

    python -m bench.api_load [--seconds 10] [--connections 20] [--out bench/results]
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import subprocess
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.common import configuration, verdict, write
from ortune.cli import embedded
from ortune.cli.client import Client
from ortune.db.base import new_id, utcnow
from ortune.db.models import Job, JobStatus
from ortune.db.repositories import EventRepository, JobRepository, MetricRepository
from ortune.db.session import session_scope
from ortune.settings import Settings
from tests.support import DEMO

DATA = DEMO / "sentiment_train.jsonl"
TARGETED = ("job poll", "events")
ENDPOINTS = {
    "healthz": None,
    "job poll": "",
    "events": "/events?limit=20",
    "metrics (chart)": "/metrics?max_points=500",
    "job list": None,
}
SCRIPT = """
local ids = {%s}
local suffix = "%s"
request = function()
  return wrk.format("GET", "/v1/fine_tuning/jobs/" .. ids[math.random(#ids)] .. suffix)
end
"""


def seed(settings: Settings, jobs: int, points_per_job: int, events_per_job: int) -> list[str]:
    """Jobs copied from one created through the API, with metric series and events of their own."""
    client = Client(settings.api_url)
    train = client.upload(DATA)
    template = client.create_job(model="tiny-bert", training_file=train["id"], backend="torch")
    with session_scope(settings.database_url) as session:
        source = JobRepository(session).get(template["id"])
        assert source is not None
        JobRepository(session).update(source.id, status=JobStatus.cancelled)
        ids, start = [], utcnow() - timedelta(days=1)
        for i in range(jobs):
            job = Job(
                id=new_id("ftjob"),
                model=source.model,
                task=source.task,
                training_file_id=source.training_file_id,
                status=random.choice([JobStatus.succeeded, JobStatus.running, JobStatus.failed]),
                spec=source.spec,
                seed=i,
                backend_requested="torch",
                backend_used="torch",
                step=points_per_job,
                total_steps=points_per_job,
                created_at=start + timedelta(seconds=i),
            )
            session.add(job)
            ids.append(job.id)
        session.flush()
        metrics, events = MetricRepository(session), EventRepository(session)
        for n, job_id in enumerate(ids):
            metrics.add_many(job_id, [("train_loss", s, 1.0 / (s + 1)) for s in range(1, points_per_job + 1)])
            events.add_many(
                [
                    {
                        "job_id": job_id,
                        "message": f"Step {s}: train_loss={1.0 / (s + 1):.4g}",
                        "level": "info",
                        "type": "metrics",
                        "data": {"step": s, "train_loss": 1.0 / (s + 1)},
                        "created_at": start + timedelta(seconds=n, milliseconds=s),
                    }
                    for s in range(events_per_job)
                ]
            )
    return ids


def wrk(url: str, seconds: int, connections: int, script: Path | None) -> dict[str, float]:
    cmd = ["wrk", "-t2", f"-c{connections}", f"-d{seconds}s", "--latency"]
    out = subprocess.run(
        [*cmd, *(["-s", str(script)] if script else []), url], capture_output=True, text=True
    )
    text = out.stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))  # type: ignore[union-attr]
    p99 = re.search(r"99%\s+([\d.]+)(us|ms|s)\b", text)
    assert p99 is not None, text
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[p99.group(2)]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    errors = re.search(r"Socket errors: (.*)", text)
    return {
        "requests_per_s": rps,
        "p99_ms": float(p99.group(1)) * scale,
        "non_2xx": float(non2xx.group(1)) if non2xx else 0.0,
        "socket_errors": errors.group(1) if errors else "",  # type: ignore[dict-item]
    }


def run(config: str, seconds: int, connections: int, tmp: Path) -> dict[str, Any]:
    with configuration(config, tmp / config) as settings, embedded.start(settings, worker=False):
        t0 = time.perf_counter()
        ids = seed(settings, jobs=1000, points_per_job=100, events_per_job=20)
        seeded_s = time.perf_counter() - t0
        results: dict[str, dict[str, float]] = {}
        for name, suffix in ENDPOINTS.items():
            script = None
            url = settings.api_url + ("/healthz" if name == "healthz" else "")
            if name == "job list":
                url = settings.api_url + "/v1/fine_tuning/jobs?limit=20"
            elif suffix is not None:
                script = tmp / f"{config}-{len(results)}.lua"
                sample = random.sample(ids, 200)
                script.write_text(SCRIPT % (", ".join(f'"{i}"' for i in sample), suffix))
            wrk(url, 2, connections, script)  # warm-up
            results[name] = wrk(url, seconds, connections, script)
    health = results["healthz"]["requests_per_s"]
    for r in results.values():
        r["ratio_to_healthz"] = r["requests_per_s"] / health
    return {
        "config": config,
        "seconds": seconds,
        "connections": connections,
        "seed_s": seeded_s,
        "results": results,
    }


def markdown(reports: list[dict[str, Any]]) -> str:
    r0 = reports[0]
    lines = [
        f"### api_load (wrk, {r0['connections']} connections, {r0['seconds']} s per endpoint; 1,000 jobs, "
        "100k metric points, 20k events)",
        "",
        "| configuration | endpoint | requests/s | ratio to /healthz (target >= 0.5x for job poll and "
        "events) | p99 (target < 50 ms for the same) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in reports:
        for name, f in r["results"].items():
            bad = f" ({f['non_2xx']:.0f} non-2xx)" if f["non_2xx"] else ""
            ratio, p99 = f["ratio_to_healthz"], f["p99_ms"]
            targeted = name in TARGETED
            lines.append(
                f"| {r['config']} | {name} | {f['requests_per_s']:.0f}{bad} | {ratio:.2f}x"
                f"{f' ({verdict(ratio >= 0.5)})' if targeted else ''} | {p99:.1f} ms"
                f"{f' ({verdict(p99 < 50)})' if targeted else ''} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--connections", type=int, default=20)
    parser.add_argument("--configs", nargs="+", default=["production", "embedded"])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("api_load needs wrk: `make system-deps` (Debian package wrk)")
    with tempfile.TemporaryDirectory(prefix="ortune-bench-") as tmp:
        reports = [run(c, args.seconds, args.connections, Path(tmp)) for c in args.configs]
    write(args.out, "api_load", {"runs": reports}, markdown(reports))


if __name__ == "__main__":
    main()

"""How many metric points per second the worker's relay persists, by batch size, on SQLite and Postgres.

A synthetic trainer stream (one metrics event a step with five series, as the Trainer callback emits) goes
through the worker's own `Relay` into the database, flushed every N events; each flush is one transaction that
writes the events, upserts the points and beats the heartbeat, as during a real job. The figure to compare
with is what training produces: a step every few milliseconds at most for the small models here (5 points a
step), so the headroom column is points/s over 500 points/s (100 logged steps a second).

    python -m bench.metrics_ingest [--events 5000] [--out bench/results]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import configuration, write
from ortune.cli import embedded
from ortune.cli.client import Client
from ortune.db.repositories import MetricRepository
from ortune.db.session import session_scope
from tests.support import DEMO
from worker.relay import Relay

BATCHES = [1, 20, 200, 1000]
TRAINING_POINTS_PER_S = 500.0
DATA = DEMO / "sentiment_valid.jsonl"


def ingest(database_url: str, job_id: str, events: int, batch: int, step0: int) -> float:
    relay = Relay(database_url, job_id)
    t0 = time.perf_counter()
    for i in range(events):
        step = step0 + i
        relay.add(
            {
                "type": "metrics",
                "time": time.time(),
                "step": step,
                "total_steps": step0 + events,
                "train_loss": 1.0 / (step + 1),
                "learning_rate": 1e-4,
                "grad_norm": 0.5,
                "samples_per_second": 400.0,
                "eval_loss": 0.7,
            }
        )
        if (i + 1) % batch == 0:
            relay.flush()
    relay.flush()
    return time.perf_counter() - t0


def run(config: str, events: int, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"config": config, "events": events, "batches": {}}
    with configuration(config, tmp / config) as settings, embedded.start(settings, worker=False):
        client = Client(settings.api_url)
        train = client.upload(DATA)
        job = client.create_job(model="tiny-bert", training_file=train["id"], backend="torch")
        for n, batch in enumerate(BATCHES):
            count = events if batch > 1 else events // 10  # one transaction per event is slow: fewer of them
            seconds = ingest(settings.database_url, job["id"], count, batch, step0=n * 10 * events)
            points = count * 5
            out["batches"][batch] = {"points_per_s": points / seconds, "events_per_s": count / seconds}
        with session_scope(settings.database_url) as session:
            stored = len(MetricRepository(session).series(job["id"], ["train_loss"])["train_loss"])
        expected = events // 10 + events * (len(BATCHES) - 1)
        assert stored == expected, (stored, expected)  # every point arrived once
    return out


def markdown(reports: list[dict[str, Any]]) -> str:
    lines = [
        "### metrics_ingest (worker Relay -> database; 5 points and 1 event a step, a transaction a flush)",
        "",
        "| configuration | events per flush | points/s | events/s | headroom over 500 points/s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in reports:
        for batch, f in r["batches"].items():
            lines.append(
                f"| {r['config']} | {batch} | {f['points_per_s']:.0f} | {f['events_per_s']:.0f} | "
                f"{f['points_per_s'] / TRAINING_POINTS_PER_S:.1f}x |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--configs", nargs="+", default=["embedded", "production"])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ortune-bench-") as tmp:
        reports = [run(c, args.events, Path(tmp)) for c in args.configs]
    write(args.out, "metrics_ingest", {"runs": reports}, markdown(reports))


if __name__ == "__main__":
    main()

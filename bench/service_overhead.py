"""What the service costs on top of training: a job through API -> Celery -> worker vs the same spec by hand.

For each configuration the job is first run through the service; the spec.json the worker staged is then run
by hand with `python -m trainer_core.engine.launch`, so both runs train exactly the same thing. Rounds
alternate
(service, hand, service, hand) and medians are reported. Figures:

- end to end: hand wall time / service wall time (submit until the API says succeeded); target >= 0.97x;
- training speed: samples/s the trainer reported in each run (the relay must not slow training);
- submit -> first step: from the POST to the trainer's first logged step, minus the model load the trainer
  reported; the part the service adds is that minus the same interval by hand (process start to first step,
  minus model load). Targets: <= 1 s on Redis, <= 2 s on the embedded default.

    python -m bench.service_overhead [--steps 300] [--rounds 2] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select

from bench.common import configuration, median, verdict, write
from ortune.cli import embedded
from ortune.cli.client import Client
from ortune.db.models import Job, JobEvent
from ortune.db.session import session_scope
from ortune.settings import Settings
from tests.support import DEMO
from worker.staging import store_of

DATA = DEMO / "sentiment_train.jsonl"
TARGET_LATENCY = {"embedded": 2.0, "production": 1.0}


def _figures(events: list[dict[str, Any]]) -> dict[str, float]:
    """From trainer events (each with its own `time`): model load, first step time, training speed."""
    load_s = next(e["data"]["load_s"] for e in events if (e.get("data") or {}).get("load_s") is not None)
    metrics = [e for e in events if e["type"] == "metrics" and e.get("train_loss") is not None]
    return {
        "load_s": float(load_s),
        "first_step_at": float(metrics[0]["time"]),
        "samples_per_s": float(metrics[-1]["samples_per_second"]),
    }


def by_hand(spec_path: Path, workdir: Path) -> dict[str, float]:
    spec = json.loads(spec_path.read_text()) | {"output_dir": str(workdir / "out")}
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "spec.json").write_text(json.dumps(spec))
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "trainer_core.engine.launch", str(workdir / "spec.json")],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    wall = time.time() - t0
    f = _figures([json.loads(line) for line in proc.stdout.splitlines()])
    return {
        "wall_s": wall,
        "samples_per_s": f["samples_per_s"],
        "to_first_step_s": f["first_step_at"] - t0 - f["load_s"],
    }


def _ts(dt: datetime) -> float:
    return dt.timestamp()


def through_service(
    settings: Settings, client: Client, train_id: str, steps: int
) -> tuple[dict[str, float], Path]:
    t0 = time.time()
    job = client.create_job(
        model="tiny-bert",
        training_file=train_id,
        backend="torch",
        seed=1,
        hyperparameters={"max_steps": steps, "batch_size": 16, "max_seq_length": 64, "learning_rate": 1e-3},
    )
    # Poll as a dashboard would (every 2 s would do; 0.5 s here): a tight poll loop would itself take CPU
    # from training on a small machine. The end is the worker's own finished_at, not the poll that saw it.
    while (status := client.job(job["id"])["status"]) not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.5)
    assert status == "succeeded", client.job(job["id"])["error"]
    with session_scope(settings.database_url) as session:
        row = session.get(Job, job["id"])
        assert row is not None and row.started_at is not None and row.finished_at is not None
        wall = _ts(row.finished_at) - t0
        stored = list(
            session.scalars(select(JobEvent).where(JobEvent.job_id == job["id"]).order_by(JobEvent.id))
        )
        events = [
            {"type": e.type, "time": _ts(e.created_at), "data": e.data, **(e.data or {})} for e in stored
        ]
        pickup = _ts(row.started_at) - _ts(row.created_at)
    f = _figures(events)
    # the spec the worker staged (its attempt folder is gone; the stores it names stay in the node's cache)
    spec = settings.data_dir / "specs" / f"{job['id']}.json"
    store_of(settings).get_to_path(f"jobs/{job['id']}/spec.json", spec)
    return {
        "wall_s": wall,
        "samples_per_s": f["samples_per_s"],
        "to_first_step_s": f["first_step_at"] - t0 - f["load_s"],
        "pickup_s": pickup,
    }, spec


def run(config: str, steps: int, rounds: int, tmp: Path) -> dict[str, Any]:
    service: list[dict[str, float]] = []
    hand: list[dict[str, float]] = []
    with (
        configuration(config, tmp / config) as settings,
        embedded.start(settings, log_dir=tmp / config / "logs"),
    ):
        client = Client(settings.api_url)
        train = client.upload(DATA)
        through_service(settings, client, train["id"], 5)  # warm: worker imports, page cache
        for i in range(rounds):
            figures, spec = through_service(settings, client, train["id"], steps)
            service.append(figures)
            hand.append(by_hand(spec, tmp / config / f"hand-{i}"))
    s_wall, h_wall = median([r["wall_s"] for r in service]), median([r["wall_s"] for r in hand])
    s_first, h_first = (
        median([r["to_first_step_s"] for r in service]),
        median([r["to_first_step_s"] for r in hand]),
    )
    return {
        "config": config,
        "steps": steps,
        "service": service,
        "by_hand": hand,
        "end_to_end_ratio": h_wall / s_wall,
        "samples_per_s_ratio": median([r["samples_per_s"] for r in service])
        / median([r["samples_per_s"] for r in hand]),
        "submit_to_first_step_s": s_first,
        "hand_to_first_step_s": h_first,
        "service_added_latency_s": s_first - h_first,
        "pickup_s": median([r["pickup_s"] for r in service]),
        "latency_target_s": TARGET_LATENCY[config],
    }


def markdown(reports: list[dict[str, Any]]) -> str:
    lines = [
        "### service_overhead (tiny-bert, batch 16, seq 64; medians of alternating rounds)",
        "",
        "| configuration | end to end (hand/service), target >= 0.97x | training samples/s (service/hand) "
        "| submit -> first step, minus model load | of which the service adds | queue pickup |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in reports:
        lines.append(
            f"| {r['config']} ({r['steps']} steps) | {r['end_to_end_ratio']:.3f}x "
            f"({verdict(r['end_to_end_ratio'] >= 0.97)}) | {r['samples_per_s_ratio']:.3f}x | "
            f"{r['submit_to_first_step_s']:.2f} s (by hand {r['hand_to_first_step_s']:.2f} s) | "
            f"{r['service_added_latency_s']:.2f} s, target <= {r['latency_target_s']:.0f} s "
            f"({verdict(r['service_added_latency_s'] <= r['latency_target_s'])}) | {r['pickup_s']:.2f} s |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=["embedded", "production"])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ortune-bench-") as tmp:
        reports = [run(c, args.steps, args.rounds, Path(tmp)) for c in args.configs]
    write(args.out, "service_overhead", {"runs": reports}, markdown(reports))


if __name__ == "__main__":
    main()

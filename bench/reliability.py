"""How fast the service lets go and picks up again: cancel -> trainer gone, pause -> checkpoint stored and
worker free, and a SIGKILLed worker -> its job training again on another worker, each beside the limit it
is held to (cancel within 10 s; recovery within the heartbeat timeout plus one sweep and a model load).

    python -m bench.reliability [--configs embedded production] [--out bench/results]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import configuration, verdict, write
from ortune.cli import embedded
from ortune.cli.client import Client
from ortune.settings import Settings
from tests.support import submit

CANCEL_LIMIT_S = 10.0
TIMING = {"heartbeat_seconds": 1.0, "heartbeat_timeout_seconds": 10.0, "sweep_seconds": 1.0}


def _until(check: Any, timeout: float = 300) -> float:
    """Seconds until check() is true."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("the service did not get there in time")
        time.sleep(0.05)
    return time.monotonic() - t0


def _messages(client: Client, job_id: str) -> list[str]:
    return [e["message"] for e in client.get(f"/v1/fine_tuning/jobs/{job_id}/events", limit=100)["data"]]


def _step(client: Client, job_id: str) -> int:
    return int(client.job(job_id)["progress"]["step"])


def measure(settings: Settings, tmp: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    with embedded.start(settings, log_dir=tmp / "logs") as running:
        client = Client(settings.api_url)
        job = str(submit(client, tmp, 100_000, 100_000)["id"])
        _until(lambda: _step(client, job) >= 10)
        client.post(f"/v1/fine_tuning/jobs/{job}/cancel")
        out["cancel_s"] = _until(
            lambda: any(m.startswith("Training stopped") for m in _messages(client, job))
        )

        job = str(submit(client, tmp, 100_000, 100_000)["id"])
        _until(lambda: _step(client, job) >= 10)
        client.post(f"/v1/fine_tuning/jobs/{job}/pause")
        out["pause_s"] = _until(lambda: any(m.startswith("Paused;") for m in _messages(client, job)))
        client.post(f"/v1/fine_tuning/jobs/{job}/cancel")

        job = str(submit(client, tmp, 100_000, 50)["id"])
        _until(lambda: _step(client, job) >= 120)
        running.procs[0].kill()
        killed_at = time.monotonic()
        with (tmp / "logs" / "worker2.log").open("ab") as log:
            second = subprocess.Popen(
                embedded.worker_command(settings, name="second@%h"),
                env=embedded.child_env(settings),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            _until(lambda: client.job(job)["attempt"] == 2 and _step(client, job) > 100)
            out["recovery_s"] = time.monotonic() - killed_at
            client.post(f"/v1/fine_tuning/jobs/{job}/cancel")
        finally:
            second.terminate()
            second.wait(60)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", nargs="+", default=["embedded", "production"])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    report: dict[str, Any] = {"timing": TIMING, "configs": {}}
    lines = [
        "## reliability",
        "",
        f"heartbeat every {TIMING['heartbeat_seconds']:g} s, lost after "
        f"{TIMING['heartbeat_timeout_seconds']:g} s, sweep every {TIMING['sweep_seconds']:g} s",
        "",
        "| config | cancel -> trainer stopped | pause -> checkpoint stored, worker free "
        "| SIGKILLed worker -> training again elsewhere | cancel target |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in args.configs:
        with (
            tempfile.TemporaryDirectory(prefix=f"bench-rel-{name}-") as tmp,
            configuration(name, Path(tmp)) as s,
        ):
            figures = measure(s.model_copy(update=TIMING), Path(tmp))
        report["configs"][name] = figures
        lines.append(
            f"| {name} | {figures['cancel_s']:.2f} s | {figures['pause_s']:.2f} s "
            f"| {figures['recovery_s']:.1f} s "
            f"| <= {CANCEL_LIMIT_S:g} s: {verdict(figures['cancel_s'] <= CANCEL_LIMIT_S)} |"
        )
    write(args.out, "reliability", report, "\n".join(lines))


if __name__ == "__main__":
    main()

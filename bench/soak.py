"""The fault soak of tests/e2e/test_hosts.py, longer: two hosts as network namespaces, many small jobs from
two tenants and a third tenant streaming chat replies all along, rounds of faults (a worker SIGKILLed, a
host partitioned, Redis and Postgres restarted, the inference process SIGKILLed), then jobs run, faults
injected, jobs lost (target 0), how the streams ended (none cut without a word) and, per fault, the seconds
until training took a step again (or, for the inference process, a stream completed again). Needs root.

    python -m bench.soak [--jobs 16] [--rounds 3] [--out bench/results]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.common import verdict, write
from tests.hosts import Network, running, soak, tenant, tenant_key, trainer_attempts


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    if reason := Network.skip_reason():
        print(f"bench.soak: skipped: {reason}")
        return 0
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        with running(tmp) as (d, workers, admin):
            keys = [tenant_key(admin, name) for name in ("north", "south")]
            streamer = tenant(admin, "streams")
            report = soak(d, workers, tmp, keys, n_jobs=args.jobs, rounds=args.rounds, streamer=streamer)
    lost = [j for j, job in report.jobs.items() if job["status"] != "succeeded"]
    streams = report.streams
    assert streams is not None
    other_5xx = [e for e in report.watch.server_errors if e[0] != 503 or not e[2]]
    rows = [
        ("jobs run", str(len(report.jobs)), ""),
        ("faults injected", str(len(report.faults)), ""),
        ("jobs lost (not succeeded)", str(len(lost)), verdict(not lost)),
        ("artifacts whose sha256 was checked", str(report.artifacts_checked), ""),
        (
            "moments with two live attempts of a job",
            str(len(report.watch.overlaps)),
            verdict(not report.watch.overlaps),
        ),
        (
            "requests polled / 503 with Retry-After",
            f"{report.watch.responses} / {len(report.watch.server_errors) - len(other_5xx)}",
            "",
        ),
        ("other 5xx", str(len(other_5xx)), verdict(not other_5xx)),
        ("trainers left behind", str(len(trainer_attempts())), ""),
        *((f"streams: {end}", str(n), "") for end, n in sorted(streams.ends.items())),
        (
            "streams cut without [DONE] or an error event, or 5xx without Retry-After",
            str(len(streams.broken)),
            verdict(not streams.broken),
        ),
        ("wall time", f"{report.wall_s} s", ""),
    ]
    rows += [
        (
            f"fault at {f.at} s: {f.name}: next training step after",
            f"{f.recovered_s} s",
            verdict(f.recovered_s is not None),
        )
        for f in report.faults
    ]
    md = "### soak: two hosts, faults while jobs run\n\n| measure | value | target |\n| --- | --- | --- |\n"
    md += "\n".join(f"| {a} | {b} | {c} |" for a, b, c in rows)
    write(
        args.out, "soak", {"rows": rows, "lost": lost, "other_5xx": other_5xx, "broken": streams.broken}, md
    )
    return 0 if not lost and not other_5xx and not report.watch.overlaps and not streams.broken else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""The fault soak of tests/e2e/test_hosts.py, longer: two hosts as network namespaces, many small jobs from
two tenants, rounds of faults (a worker SIGKILLed, a host partitioned, Redis and Postgres restarted), then
jobs run, faults injected, jobs lost (target 0) and, per fault, the seconds until training took a step
again. Needs root (`ip netns`).

    python -m bench.soak [--jobs 16] [--rounds 3] [--out bench/results]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.common import verdict, write
from tests.hosts import Network, running, soak, tenant_key, trainer_attempts


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
            keys = [tenant_key(admin, tenant) for tenant in ("north", "south")]
            report = soak(d, workers, tmp, keys, n_jobs=args.jobs, rounds=args.rounds)
    lost = [j for j, job in report.jobs.items() if job["status"] != "succeeded"]
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
    write(args.out, "soak", {"rows": rows, "lost": lost, "other_5xx": other_5xx}, md)
    return 0 if not lost and not other_5xx and not report.watch.overlaps else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""`make bench`: every benchmark in one run, each printing ratios measured side by side."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = [
    "bench.train_backends",
    "bench.demo_precision",
    "bench.llm_methods",
    "bench.media_tasks",
    "bench.serve",
    "bench.service_overhead",
    "bench.api_load",
    "bench.artifact_io",
    "bench.metrics_ingest",
    "bench.reliability",
    "bench.data_scale",
    "bench.soak",
]


def main() -> int:
    out = Path("bench/results")
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for module in BENCHMARKS:
        print(f"== {module}", flush=True)
        failed |= subprocess.call([sys.executable, "-m", module, "--out", str(out)])
    parts = sorted(out.glob("*.md"))
    (out / "summary.md").write_text("\n\n".join(p.read_text() for p in parts if p.name != "summary.md"))
    return failed


if __name__ == "__main__":
    sys.exit(main())

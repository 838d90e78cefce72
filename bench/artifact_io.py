"""Artifact downloads through the API vs a raw S3 GET of the same object from the same SeaweedFS.

Both transfers use the same HTTP client (httpx, streamed, bytes discarded), the raw one through a presigned
URL. Rounds alternate and the median is reported; target >= 0.8x of the raw throughput. The API process's
resident memory is sampled every 10 ms during each download: its peak over the idle baseline must stay flat
as the file grows (an artifact is streamed, never read whole), so two sizes are measured.

    python -m bench.artifact_io [--sizes-mb 100 500] [--rounds 2] [--out bench/results]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.common import configuration, median, verdict, write
from ortune.cli import embedded
from ortune.cli.client import Client
from ortune.db.models import Artifact
from ortune.db.session import session_scope
from ortune.storage import S3Store, open_store
from tests.support import DEMO

DATA = DEMO / "sentiment_valid.jsonl"
MB = 1024 * 1024


def make_file(path: Path, size_mb: int) -> str:
    block, digest = os.urandom(MB), hashlib.sha256()
    with path.open("wb") as fh:
        for _ in range(size_mb):
            fh.write(block)
            digest.update(block)
    return digest.hexdigest()


def fetch(url: str) -> tuple[float, int]:
    done = 0
    t0 = time.perf_counter()
    with httpx.stream("GET", url, timeout=120) as response:
        response.raise_for_status()
        for chunk in response.iter_raw(1 * MB):
            done += len(chunk)
    return time.perf_counter() - t0, done


class PeakRSS:
    """Samples a process's RSS in a thread; `peak` is the highest reading since start."""

    def __init__(self, pid: int) -> None:
        self.proc, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.01)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run(sizes_mb: list[int], rounds: int, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"sizes": {}}
    with configuration("production", tmp / "production") as settings:
        services = embedded.start(settings, worker=False, log_dir=tmp / "logs")
        try:
            client = Client(settings.api_url)
            train = client.upload(DATA)
            job = client.create_job(model="tiny-bert", training_file=train["id"], backend="torch")
            client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel")
            store = open_store(
                settings.storage_url,
                access_key=settings.s3_access_key,
                secret_key=settings.s3_secret_key.get_secret_value(),
                region=settings.s3_region,
            )
            assert isinstance(store, S3Store)
            api_pid = services.procs[-1].pid
            for size in sizes_mb:
                path = tmp / f"artifact-{size}.bin"
                sha = make_file(path, size)
                key = f"bench/{job['id']}/{size}.tar"
                store.put_path(key, path)
                path.unlink()
                fmt = "pytorch" if size == sizes_mb[0] else "onnx"
                with session_scope(settings.database_url) as session:
                    session.add(
                        Artifact(
                            job_id=job["id"],
                            format=fmt,
                            object_key=key,
                            bytes=size * MB,
                            sha256=sha,
                            manifest={},
                        )
                    )
                api_url = f"{settings.api_url}/v1/fine_tuning/jobs/{job['id']}/artifacts/{fmt}"
                raw_url = store.client.generate_presigned_url(
                    "get_object", Params={"Bucket": store.bucket, "Key": key}, ExpiresIn=3600
                )
                fetch(raw_url)  # warm SeaweedFS's caches for both
                api_s, raw_s, peaks = [], [], []
                for _ in range(rounds):
                    baseline = psutil.Process(api_pid).memory_info().rss
                    with PeakRSS(api_pid) as rss:
                        seconds, got = fetch(api_url)
                    assert got == size * MB, got
                    api_s.append(seconds)
                    peaks.append(rss.peak - baseline)
                    seconds, got = fetch(raw_url)
                    assert got == size * MB, got
                    raw_s.append(seconds)
                out["sizes"][size] = {
                    "api_mb_per_s": size / median(api_s),
                    "raw_s3_mb_per_s": size / median(raw_s),
                    "ratio": median(raw_s) / median(api_s),
                    "api_peak_rss_over_baseline_mb": max(peaks) / MB,
                    "api_rounds_s": api_s,
                    "raw_rounds_s": raw_s,
                }
        finally:
            services.stop()
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "### artifact_io (SeaweedFS S3; API stream vs presigned raw GET, same httpx client)",
        "",
        "| size | through the API | raw S3 GET | ratio (target >= 0.8x) | API peak RSS over idle |",
        "| --- | --- | --- | --- | --- |",
    ]
    for size, r in report["sizes"].items():
        api, raw, ratio = r["api_mb_per_s"], r["raw_s3_mb_per_s"], r["ratio"]
        lines.append(
            f"| {size} MB | {api:.0f} MB/s | {raw:.0f} MB/s | {ratio:.2f}x ({verdict(ratio >= 0.8)}) "
            f"| {r['api_peak_rss_over_baseline_mb']:.1f} MB |"
        )
    peaks = [r["api_peak_rss_over_baseline_mb"] for r in report["sizes"].values()]
    sizes = list(report["sizes"])
    if len(peaks) > 1:
        flat = max(peaks) - min(peaks) < 0.05 * (int(sizes[-1]) - int(sizes[0]))
        shown = ", ".join(f"{p:.1f}" for p in peaks)
        lines.append(f"\nmemory flat in the file's size: {verdict(flat)} (peaks {shown} MB)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes-mb", nargs="+", type=int, default=[100, 500])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ortune-bench-") as tmp:
        report = run(args.sizes_mb, args.rounds, Path(tmp))
    write(args.out, "artifact_io", report, markdown(report))


if __name__ == "__main__":
    main()

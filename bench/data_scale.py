"""Real datasets at the limits: how a job's cost grows with its file, on the embedded default.

For each size (rows) and kind of row (text classification on all-MiniLM-L6-v2, chat on tiny-gpt2), in one
run: the upload's time; submit -> first training step, cold (tokenizing) and again on the same file (the
cached store); tokenization rows/s and the cores it kept busy; the trainer's peak private memory (RssAnon of
its process tree, read from /proc by the worker); the padding fraction of the training batches.

Targets: peak at 1M rows <= 1.5x the peak at 10k; the second job reaches its first step >= 10x sooner than
the first; tokenization keeps both cores busy.

    python -m bench.data_scale [--sizes 10000,100000,1000000,2000000] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import select

from bench.common import configuration, median, verdict, write
from ortune.cli import embedded
from ortune.cli.client import Client
from ortune.db.models import JobEvent
from ortune.db.session import session_scope

SENTENCE = (
    "the a this that good bad great terrible movie phone service delivery staff food was is were not very "
    "really quite slow fast kind rude cheap expensive again never always would recommend buy love hate"
)
WORDS = SENTENCE.split()
KINDS = {
    "text_label": ("sentence-transformers/all-MiniLM-L6-v2", 128),
    "chat": ("tiny-gpt2", 256),
}


def make_file(path: Path, kind: str, n: int, seed: int = 0) -> Path:
    """`n` rows of 5 to 80 words: lengths vary, as in real data."""
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(n):
            text = " ".join(rng.choices(WORDS, k=rng.randint(5, 80)))
            if kind == "text_label":
                row: dict[str, Any] = {"text": text, "label": rng.choice(["negative", "positive"])}
            else:
                reply = " ".join(rng.choices(WORDS, k=rng.randint(3, 40)))
                row = {
                    "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
                }
            out.write(json.dumps(row) + "\n")
    return path


def _events(settings: Any, job_id: str) -> list[tuple[float, str, dict[str, Any]]]:
    with session_scope(settings.database_url) as session:
        stored = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id))
        return [(e.created_at.timestamp(), e.message, e.data or {}) for e in stored]


def one_job(client: Client, settings: Any, file_id: str, kind: str) -> dict[str, float]:
    model, seq = KINDS[kind]
    t0 = time.time()
    job = client.create_job(
        model=model,
        training_file=file_id,
        backend="torch",
        seed=1,
        hyperparameters={"max_steps": 10, "batch_size": 16, "max_seq_length": seq},
    )
    while (done := client.job(job["id"]))["status"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.5)
    assert done["status"] == "succeeded", done["error"]
    said = _events(settings, job["id"])
    first = next(t for t, _, d in said if d.get("step", 0) >= 1 and "train_loss" in d)
    peak = next(d["peak_bytes"] for _, m, d in said if m.startswith("Peak private memory of the trainer"))
    tok_peak = next(
        (d["peak_bytes"] for _, m, d in said if m.startswith("Peak private memory of the tok")), 0
    )
    tok = next((d for _, m, d in said if m.startswith("Tokenized ") and "cpu_seconds" in d), None)
    pads = [d["padding_fraction"] for _, _, d in said if "padding_fraction" in d]
    return {
        "to_first_step_s": first - t0,
        "peak_mib": peak / 2**20,
        "tokenizer_peak_mib": tok_peak / 2**20,
        "rows_per_s": tok["rows"] / tok["seconds"] if tok else float("nan"),
        "cores": tok["cpu_seconds"] / tok["seconds"] if tok else float("nan"),
        "padding": median(pads),
    }


def run(sizes: list[int], kinds: list[str], tmp: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with configuration("embedded", tmp / "embedded") as settings:
        settings = settings.model_copy(update={"max_upload_bytes": 1024 * 2**20})
        with embedded.start(settings, log_dir=tmp / "logs"):
            client = Client(settings.api_url, timeout=900)
            for kind in kinds:
                for n in sizes:
                    path = make_file(tmp / f"{kind}-{n}.jsonl", kind, n)
                    t0 = time.perf_counter()
                    file = client.upload(path)
                    upload_s = time.perf_counter() - t0
                    assert file["status"] == "processed", file["status_details"]
                    cold = one_job(client, settings, file["id"], kind)
                    warm = one_job(client, settings, file["id"], kind)
                    results[f"{kind}/{n}"] = {
                        "rows": n,
                        "mb": path.stat().st_size / 1e6,
                        "upload_s": upload_s,
                        "cold": cold,
                        "cached": warm,
                    }
                    path.unlink()
                    print(kind, n, json.dumps(results[f"{kind}/{n}"]), flush=True)
    return results


def markdown(results: dict[str, Any], sizes: list[int]) -> str:
    lines = [
        "### data_scale (embedded default, 10 training steps, batch 16)",
        "",
        "| rows | kind | MB | upload s | first step cold s | first step cached s | cold/cached "
        "| tokenize rows/s | cores busy | tokenizer peak MiB | trainer peak MiB | peak / smallest "
        "| padding |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind in KINDS:
        base = results.get(f"{kind}/{sizes[0]}", {}).get("cold", {}).get("peak_mib")
        for n in sizes:
            r = results.get(f"{kind}/{n}")
            if r is None:
                continue
            c, w = r["cold"], r["cached"]
            lines.append(
                f"| {n:,} | {kind} | {r['mb']:.0f} | {r['upload_s']:.1f} | {c['to_first_step_s']:.1f} | "
                f"{w['to_first_step_s']:.1f} | {c['to_first_step_s'] / w['to_first_step_s']:.1f}x | "
                f"{c['rows_per_s']:,.0f} | {c['cores']:.2f} | {c['tokenizer_peak_mib']:.0f} | "
                f"{c['peak_mib']:.0f} | {c['peak_mib'] / base:.2f}x | {c['padding']:.3f} |"
            )
    lines.append("")
    for kind in KINDS:
        base = results.get(f"{kind}/{sizes[0]}")
        big = results.get(f"{kind}/1000000")
        if base and big:
            ratio = big["cold"]["peak_mib"] / base["cold"]["peak_mib"]
            ok = verdict(ratio <= 1.5)
            lines.append(f"- {kind}: peak at 1M rows / at {sizes[0]:,} = {ratio:.2f}x (target <= 1.5x: {ok})")
        for n in sizes:
            r = results.get(f"{kind}/{n}")
            if r and n >= 100_000:
                speed = r["cold"]["to_first_step_s"] / r["cached"]["to_first_step_s"]
                ok = verdict(speed >= 10)
                lines.append(
                    f"- {kind} {n:,} rows: cached job first step {speed:.1f}x sooner (target >= 10x: {ok})"
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="10000,100000,1000000,2000000")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        results = run(sizes, args.kinds.split(","), Path(tmp))
    write(args.out, "data_scale", {"sizes": sizes, "results": results}, markdown(results, sizes))


if __name__ == "__main__":
    main()

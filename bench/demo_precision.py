"""The demo's job trained in fp32 and in `precision: auto` (bf16 mixed precision where the CPU has it), side
by side: validation accuracy after training (target: auto within 0.01 of fp32), final loss and wall time.

Each run is `python -m trainer_core.engine.launch` on the demo's own data and hyperparameters
(ortune/cli/demo.py JOB), as the worker would start it.

    python -m bench.demo_precision [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import verdict, write
from ortune.cli.demo import DATA, JOB
from tests.support import launch_trainer
from trainer_core.models import registry
from trainer_core.spec import Hyperparameters, TrainingSpec


def train(tmp: Path, precision: str) -> dict[str, Any]:
    rows = DATA / "sentiment_train.jsonl"
    labels = sorted({json.loads(line)["label"] for line in rows.read_text().splitlines() if line.strip()})
    n_rows = sum(1 for line in rows.read_text().splitlines() if line.strip())
    model = registry.resolve(JOB["model"])
    spec = TrainingSpec(
        job_id=f"demo-{precision}",
        task="sequence-classification",
        model=model.id,
        model_path=str(model.path),
        train_file=str(rows),
        validation_file=str(DATA / "sentiment_valid.jsonl"),
        labels=labels,
        output_dir=str(tmp / precision / "out"),
        seed=JOB["seed"],
        precision=precision,  # type: ignore[arg-type]
        hyperparameters=Hyperparameters(**JOB["hyperparameters"]).resolved(n_rows),
    )
    (tmp / precision).mkdir()
    t0 = time.perf_counter()
    code, events, err = launch_trainer(spec, tmp / precision / "spec.json")
    wall = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"{precision}: trainer exited {code}: {err}")
    backend = next(e for e in events if e["type"] == "backend")
    evals = [e for e in events if e["type"] == "metrics" and "eval_accuracy" in e]
    result = events[-1]
    return {
        "precision_used": backend["precision"],
        "reason": backend["precision_reason"],
        "backend_used": backend["used"],
        "accuracy_before": evals[0]["eval_accuracy"],
        "accuracy_after": result["metrics"]["eval_accuracy"],
        "train_loss": result["metrics"]["train_loss"],
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {p: train(Path(tmp), p) for p in ("fp32", "auto")}
    gap = runs["auto"]["accuracy_after"] - runs["fp32"]["accuracy_after"]
    speed = runs["fp32"]["wall_s"] / runs["auto"]["wall_s"]
    lines = [
        "### demo_precision (the demo's job: all-MiniLM-L6-v2, 360 rows, 3 epochs)",
        "",
        "| precision asked | used | accuracy before | accuracy after | final train loss | wall time |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for asked, r in runs.items():
        lines.append(
            f"| {asked} | {r['precision_used']} | {r['accuracy_before']:.3f} | {r['accuracy_after']:.3f} | "
            f"{r['train_loss']:.4f} | {r['wall_s']:.0f}s |"
        )
    lines += [
        "",
        f"auto's accuracy minus fp32's: {gap:+.3f} (target within 0.01: {verdict(abs(gap) <= 0.01)}); "
        f"auto chose: {runs['auto']['reason']}; wall time fp32/auto {speed:.2f}x",
    ]
    write(args.out, "demo_precision", {"runs": runs, "accuracy_gap": gap}, "\n".join(lines))


if __name__ == "__main__":
    main()

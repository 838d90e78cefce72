"""Image classification, audio classification and speech recognition, side by side in one run: held-out
accuracy (or word error rate) before and after training, the engine each ran on and why, samples/s, and
the ONNX export's check, for `auto` (bf16 under PyTorch on this CPU), PyTorch fp32 and ORT fp32.

Data: ortune.media_demo's shapes (240 training, 60 held out), tones (240/60) and melodies (480/48), as the
e2e tests use them; each run goes through the trainer as a job does (`python -m trainer_core.engine.launch`),
stores, export and all.

    python -m bench.media_tasks [--out bench/results]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import write
from ortune import media_demo
from tests.support import launch_trainer
from trainer_core.spec import Hyperparameters, TrainingSpec

TASKS: dict[str, dict[str, Any]] = {
    "image-classification": {
        "model": "tiny-vit",
        "rows": media_demo.image_rows,
        "sizes": (240, 60),
        "hp": {"n_epochs": 8, "learning_rate_multiplier": 40},
        "labels": sorted(media_demo.SHAPES),
        "metric": "eval_accuracy",
    },
    "audio-classification": {
        "model": "tiny-audio",
        "rows": media_demo.audio_rows,
        "sizes": (240, 60),
        "hp": {"n_epochs": 4, "learning_rate_multiplier": 40},
        "labels": sorted(media_demo.PITCHES),
        "metric": "eval_accuracy",
    },
    "automatic-speech-recognition": {
        "model": "tiny-whisper",
        "rows": media_demo.melody_rows,
        "sizes": (480, 48),
        "hp": {"n_epochs": 15, "learning_rate_multiplier": 20},
        "labels": [],
        "metric": "eval_wer",
    },
}
ENGINES = {"auto": {}, "torch fp32": {"backend": "torch", "precision": "fp32"}}
ENGINES["ort fp32"] = {"backend": "ort", "precision": "fp32"}


def run(root: Path, task: str, engine: str) -> dict[str, Any]:
    case = TASKS[task]
    home = root / f"{task}-{engine.replace(' ', '-')}"
    home.mkdir()
    column = "transcription" if task == "automatic-speech-recognition" else "label"
    files = []
    for name, n, seed in (("train.zip", case["sizes"][0], 1), ("valid.zip", case["sizes"][1], 2)):
        rows = case["rows"](n, seed)
        files.append(media_demo.write_archive(home / name, rows, layout="metadata", column=column))
    spec = TrainingSpec(
        job_id=f"bench-{task}",
        task=task,  # type: ignore[arg-type]
        model=case["model"],
        train_file=str(files[0]),
        train_format="zip",
        validation_file=str(files[1]),
        validation_format="zip",
        labels=case["labels"],
        output_dir=str(home / "out"),
        seed=7,
        hyperparameters=Hyperparameters(batch_size=16, **case["hp"]).resolved(case["sizes"][0]),
        **ENGINES[engine],
    )
    t0 = time.perf_counter()
    code, events, err = launch_trainer(spec, home / "spec.json")
    wall = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"{task} {engine}: trainer exited {code}: {err}")
    backend = next(e for e in events if e["type"] == "backend")
    metrics = [e for e in events if e["type"] == "metrics"]
    evaluated = [m for m in metrics if case["metric"] in m]
    rates = [m["samples_per_second"] for m in metrics if "samples_per_second" in m]
    onnx = next((e["manifest"] for e in events if e["type"] == "artifact" and e["format"] == "onnx"), None)
    result = events[-1]
    return {
        "engine": backend["used"],
        "precision": backend["precision"],
        "reason": backend["reason"] or "asked",
        "before": evaluated[0][case["metric"]],
        "after": evaluated[-1][case["metric"]],
        "metric": case["metric"],
        "steps": result["steps"],
        "samples_per_second": rates[-1] if rates else None,
        "ort_graph_nodes": result["metrics"].get("ort_training_graph_nodes"),
        "wall_s": wall,
        "onnx_check": (onnx or {}).get("greedy_parity") or (onnx or {}).get("parity"),
        "failed": result.get("failed_artifacts"),
    }


def _check(r: dict[str, Any]) -> str:
    c = r["onnx_check"]
    if c is None:
        return f"failed: {r['failed']}"
    if "identical" in c:
        return f"{c['identical']}/{c['clips']} transcripts identical"
    return f"logits max diff {c['max_abs_diff']:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for task in TASKS:
            for engine in ENGINES:
                runs[f"{task} ({engine})"] = run(Path(tmp), task, engine)
    lines = [
        "### media_tasks (tiny-vit, tiny-audio, tiny-whisper on ortune.media_demo's data; batch 16)",
        "",
        "| task (asked) | engine | precision | held-out before -> after | steps | samples/s | ORT graph "
        "| wall | ONNX check |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in runs.items():
        rate = f"{r['samples_per_second']:.1f}" if r["samples_per_second"] else "-"
        metric = "accuracy" if r["metric"] == "eval_accuracy" else "WER"
        lines.append(
            f"| {name} | {r['engine']} | {r['precision']} | {metric} {r['before']:.2f} -> {r['after']:.2f} | "
            f"{r['steps']} | {rate} | {r['ort_graph_nodes'] or '-'} | {r['wall_s']:.0f}s | {_check(r)} |"
        )
    lines += ["", "Why each engine:"]
    lines += [f"- {name}: {r['reason']}" for name, r in runs.items()]
    write(args.out, "media_tasks", {"runs": runs}, "\n".join(lines))


if __name__ == "__main__":
    main()

"""`ortune demo`: the main job end to end on the embedded default.

Starts the service unless one already answers, uploads the shipped sentiment data, fine-tunes
all-MiniLM-L6-v2, follows it, downloads both formats, loads each back and prints accuracy before and after.
"""

from __future__ import annotations

import json
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from ortune.cli.client import Client
from ortune.cli.follow import follow_with_progress
from ortune.settings import get_settings

DATA = Path(__file__).parents[1] / "demo_data"
MODEL = "sentence-transformers/all-MiniLM-L6-v2"
# The demo's job, also trained by bench/demo_precision in each precision.
JOB: dict[str, Any] = {
    "model": MODEL,
    "suffix": "sentiment",
    "seed": 7,
    "hyperparameters": {"n_epochs": 3, "batch_size": 16, "learning_rate": 1e-4, "max_seq_length": 64},
}


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _extract(archive: Path, into: Path) -> Path:
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / archive.stem.rsplit("-", 1)[-1]


def pytorch_accuracy(model_dir: Path, rows: list[dict[str, Any]]) -> float:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, local_files_only=True).eval()
    enc = tok([r["text"] for r in rows], padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        pred = model(**enc).logits.argmax(-1).tolist()
    names = model.config.id2label
    return sum(names[p] == str(r["label"]) for p, r in zip(pred, rows, strict=True)) / len(rows)


def onnx_accuracy(model_dir: Path, rows: list[dict[str, Any]]) -> float:
    import onnxruntime as ort
    from transformers import AutoTokenizer

    manifest = json.loads((model_dir / "ortune_manifest.json").read_text())
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    session = ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    enc = tok([r["text"] for r in rows], padding=True, truncation=True, max_length=128, return_tensors="np")
    logits = session.run(["logits"], {n: enc[n] for n in manifest["inputs"]})[0]
    labels = manifest["labels"]
    return sum(str(labels[p]) == str(r["label"]) for p, r in zip(logits.argmax(-1), rows, strict=True)) / len(
        rows
    )


def _try_it(client: Client, console: Console, model: str, texts: list[str]) -> None:
    """The fine-tuned model answering through the service (/v1/predict, the inference process)."""
    response = client.http.post("/v1/predict", json={"model": model, "inputs": texts})
    if response.status_code != 200:
        console.print(f"[yellow]/v1/predict did not answer: {response.text[:200]}[/]")
        return
    for text, scores in zip(texts, response.json()["data"], strict=True):
        best = scores[0]
        console.print(f"served by /v1/predict: {best['label']} ({best['score']:.2f}) for {text[:60]!r}")


def run_demo(console: Console, *, keep: bool = False) -> int:
    from ortune.cli.embedded import start

    settings = get_settings()
    services = None
    try:
        httpx.get(f"{settings.api_url}/healthz", timeout=2).raise_for_status()
        console.print(f"using the service already at {settings.api_url}")
    except httpx.HTTPError:
        console.print(f"starting the embedded service at {settings.api_url} (state in {settings.data_dir}/)")
        services = start(settings)
    try:
        client = Client(settings.api_url)
        train = client.upload(DATA / "sentiment_train.jsonl")
        valid = client.upload(DATA / "sentiment_valid.jsonl")
        console.print(f"uploaded {train['row_count']} training and {valid['row_count']} validation rows")
        job = client.create_job(training_file=train["id"], validation_file=valid["id"], **JOB)
        console.print(f"submitted {job['id']}")
        done = follow_with_progress(client, job["id"], console, interval=0.5)
        if done["status"] != "succeeded":
            console.print(f"[red]job {done['status']}[/] {(done.get('error') or {}).get('message', '')}")
            return 1
        series = client.get(f"/v1/fine_tuning/jobs/{job['id']}/metrics", name="eval_accuracy")["data"]
        before = series["eval_accuracy"]["values"][0]
        rows = _rows(DATA / "sentiment_valid.jsonl")
        results = {}
        with tempfile.TemporaryDirectory() as tmp:
            for fmt in ("pytorch", "onnx"):
                archive = Path(tmp) / f"{job['id']}-{fmt}.tar"
                digest = client.download(job["id"], fmt, archive)
                console.print(
                    f"downloaded {fmt}: {archive.stat().st_size:,} bytes, sha256 {digest[:16]}… verified"
                )
                model_dir = _extract(archive, Path(tmp))
                results[fmt] = (pytorch_accuracy if fmt == "pytorch" else onnx_accuracy)(model_dir, rows)
        table = Table("validation accuracy", "value", title=f"{MODEL} on {len(rows)} held-out sentences")
        table.add_row("before training (job's step-0 evaluation)", f"{before:.3f}")
        table.add_row("after, PyTorch artifact loaded back", f"{results['pytorch']:.3f}")
        table.add_row("after, ONNX artifact in onnxruntime", f"{results['onnx']:.3f}")
        console.print(table)
        final = client.job(job["id"])
        console.print(
            f"backend used: {final['backend_used']} ({final['backend_reason'] or 'as requested'}); "
            f"ONNX parity max |Δlogit| {final['result']['onnx_max_abs_diff'] or float('nan'):.2e}"
        )
        console.print(f"precision: {final['precision_used']} ({final['precision_reason']})")
        _try_it(client, console, final["fine_tuned_model"], [r["text"] for r in rows[:2]])
        if min(results.values()) <= before:
            console.print("[red]accuracy after training did not beat accuracy before[/]")
            return 1
        return 0
    finally:
        if services is not None and not keep:
            services.stop()

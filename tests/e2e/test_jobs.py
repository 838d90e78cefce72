"""Whole jobs through real processes: the API under uvicorn, a Celery worker, the trainer subprocess,
on the embedded default and on Postgres + Redis + SeaweedFS."""

from __future__ import annotations

import json
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from ortune.cli import embedded
from ortune.cli.client import Client
from ortune.settings import Settings
from tests.deployments import Deployment
from tests.support import DEMO, TERMINAL, events, preference_rows, rows, wait_for, write_jsonl
from trainer_core.engine import precision
from worker.staging import store_of

pytestmark = pytest.mark.e2e


def extract(archive: Path, into: Path, fmt: str) -> Path:
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / fmt


def test_classification_job_end_to_end(service: Client, tmp_path: Path) -> None:
    train = service.upload(write_jsonl(tmp_path / "train.jsonl", rows(64)))
    valid = service.upload(write_jsonl(tmp_path / "valid.jsonl", rows(16, "sentiment_valid.jsonl")))
    job = service.create_job(
        model="tiny-bert",
        training_file=train["id"],
        validation_file=valid["id"],
        backend="torch",
        seed=11,
        checkpoint_every_steps=3,
        hyperparameters={"max_steps": 6, "batch_size": 8, "learning_rate": 1e-3, "max_seq_length": 32},
    )
    done = wait_for(service, job["id"], TERMINAL)
    assert done["status"] == "succeeded", done["error"]
    assert done["backend_used"] == "torch" and done["progress"] == {"step": 6, "total_steps": 6}
    # precision auto: bf16 mixed precision where this CPU computes bf16 natively, and the job says why
    native = precision.native_bf16(cuda=False)
    assert (done["precision"], done["precision_used"]) == ("auto", "bf16" if native else "fp32")
    assert done["precision_reason"] and (native is None or native in done["precision_reason"])
    assert done["fine_tuned_model"] == f"ft:tiny-bert:ortune:{job['id']}"
    assert done["result"]["onnx_max_abs_diff"] <= 1e-3 and done["trained_tokens"] > 0

    log = events(service, job["id"])
    metrics = [e for e in log if e["type"] == "metrics"]
    assert any(e["data"].get("train_loss") is not None for e in metrics)
    assert any("Backend: torch" in e["message"] for e in log)
    steps = [c["step_number"] for c in service.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints")["data"]]
    assert steps == [6, 3]
    series = service.get(f"/v1/fine_tuning/jobs/{job['id']}/metrics")["data"]
    assert series["train_loss"]["steps"] == [1, 2, 3, 4, 5, 6]
    assert series["eval_accuracy"]["steps"][0] == 0  # the evaluation before training

    # OpenAI's result file: the step metrics as CSV, a file of the job's own
    (result_file,) = done["result_files"]
    described = service.get(f"/v1/files/{result_file}")
    assert described["purpose"] == "fine-tune-results" and described["filename"] == "step_metrics.csv"
    table = service.http.get(f"/v1/files/{result_file}/content").text.splitlines()
    assert table[0].startswith("step,train_loss,valid_loss,valid_accuracy"), table[0]
    by_step = {int(line.split(",")[0]): line.split(",") for line in table[1:]}
    assert sorted(by_step) == [0, 1, 2, 3, 4, 5, 6] and described["bytes"] == len("\n".join(table)) + 1
    assert float(by_step[6][1]) == pytest.approx(series["train_loss"]["values"][-1])

    texts = [r["text"] for r in rows(16, "sentiment_valid.jsonl")]
    pt_dir = (
        extract(tmp_path / "pt.tar", tmp_path, "pytorch")
        if service.download(job["id"], "pytorch", tmp_path / "pt.tar")
        else None
    )
    onnx_dir = (
        extract(tmp_path / "onnx.tar", tmp_path, "onnx")
        if service.download(job["id"], "onnx", tmp_path / "onnx.tar")
        else None
    )
    assert (
        pt_dir
        and onnx_dir
        and (pt_dir / "model.safetensors").is_file()
        and (onnx_dir / "model.onnx").is_file()
    )

    import onnxruntime as ort
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pt_dir)
    model = AutoModelForSequenceClassification.from_pretrained(pt_dir).eval()
    assert model.config.id2label == {0: "negative", 1: "positive"}
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        pt_logits = model(**enc).logits.numpy()
    manifest = json.loads((onnx_dir / "ortune_manifest.json").read_text())
    assert manifest["parity"]["max_abs_diff"] == done["result"]["onnx_max_abs_diff"]
    session = ort.InferenceSession(str(onnx_dir / "model.onnx"))
    onnx_enc = AutoTokenizer.from_pretrained(onnx_dir)(texts, padding=True, return_tensors="np")
    onnx_logits = session.run(["logits"], {n: onnx_enc[n] for n in manifest["inputs"]})[0]
    assert np.abs(onnx_logits - pt_logits).max() < 1e-3
    assert (onnx_logits.argmax(-1) == pt_logits.argmax(-1)).all()


@pytest.mark.parametrize("config", ["production"], indirect=True)
def test_causal_lm_job_end_to_end(service: Client, tmp_path: Path) -> None:
    rows = [
        {"prompt": f"Q: what is {a} plus {b}? A:", "completion": f" {a + b}"}
        for a in range(8)
        for b in range(4)
    ]
    train = service.upload(write_jsonl(tmp_path / "lm.jsonl", rows))
    job = service.create_job(
        model="tiny-gpt2",
        training_file=train["id"],
        seed=5,
        hyperparameters={"max_steps": 4, "batch_size": 8, "learning_rate": 1e-3},
    )
    done = wait_for(service, job["id"], TERMINAL)
    assert done["status"] == "succeeded", done["error"]
    assert done["task"] == "causal-lm"
    service.download(job["id"], "pytorch", tmp_path / "pt.tar")
    service.download(job["id"], "onnx", tmp_path / "onnx.tar")
    pt_dir, onnx_dir = (
        extract(tmp_path / "pt.tar", tmp_path, "pytorch"),
        extract(tmp_path / "onnx.tar", tmp_path, "onnx"),
    )

    import onnxruntime as ort
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pt_dir)
    model = AutoModelForCausalLM.from_pretrained(pt_dir).eval()
    ids = tok("Q: what is 3 plus 1? A:", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.eos_token_id)
    assert out.shape[1] > ids["input_ids"].shape[1]
    # the downloaded ONNX decoder, fed its own KV cache step by step, writes PyTorch's greedy tokens
    manifest = json.loads((onnx_dir / "ortune_manifest.json").read_text())
    assert manifest["kv_cache"] and manifest["greedy_parity"]["diverged"] == []
    session = ort.InferenceSession(str(onnx_dir / "model.onnx"))
    pasts = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in pasts}
    step, seen, tokens = ids["input_ids"].numpy(), 0, []
    for _ in range(3):
        total = seen + step.shape[1]
        feed = {
            "input_ids": step,
            "attention_mask": np.ones((1, total), np.int64),
            "position_ids": np.arange(seen, total)[None],
        }
        logits, *present = session.run(None, feed | past)
        past = dict(zip(past, present, strict=True))
        tokens.append(int(logits[0, -1].argmax()))
        seen, step = total, np.array([[tokens[-1]]])
    want = out[0, ids["input_ids"].shape[1] :].tolist()  # up to 3 tokens, or to the end token
    assert tokens[: len(want)] == want


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_cancel_a_running_job_stops_training(service: Client, tmp_path: Path) -> None:
    train = service.upload(write_jsonl(tmp_path / "train.jsonl", rows(64)))
    job = service.create_job(
        model="tiny-bert",
        training_file=train["id"],
        backend="torch",
        hyperparameters={"max_steps": 100000, "batch_size": 8, "max_seq_length": 32},
    )
    deadline = time.monotonic() + 120
    while service.job(job["id"])["progress"]["step"] < 3:
        assert time.monotonic() < deadline, "training never started"
        time.sleep(0.3)
    cancelled_at = time.monotonic()
    assert service.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel")["status"] == "cancelled"
    while not any("stopped after the job was cancelled" in e["message"] for e in events(service, job["id"])):
        assert time.monotonic() - cancelled_at < 10, "training did not stop within 10 s of cancel"
        time.sleep(0.2)
    step = service.job(job["id"])["progress"]["step"]
    time.sleep(1.5)
    final = service.job(job["id"])
    assert final["status"] == "cancelled" and final["progress"]["step"] == step


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_backend_ort_job_reports_ort(service: Client, tmp_path: Path) -> None:
    train = service.upload(write_jsonl(tmp_path / "train.jsonl", rows(32)))
    job = service.create_job(
        model="tiny-bert",
        training_file=train["id"],
        backend="ort",
        hyperparameters={"max_steps": 3, "batch_size": 8},
    )
    done = wait_for(service, job["id"], TERMINAL)
    assert done["status"] == "succeeded", done["error"]
    assert (done["backend"], done["backend_used"], done["backend_reason"]) == ("ort", "ort", None)
    assert done["result"]["metrics"]["ort_training_graph_nodes"] > 50
    assert any("ONNX Runtime trained this job" in e["message"] for e in events(service, job["id"]))


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_broken_ort_install_fails_backend_ort_with_the_reason(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.trainer_core.test_ort import BROKEN_ORT

    shadow = tmp_path / "broken"
    shadow.mkdir()
    (shadow / "sitecustomize.py").write_text(BROKEN_ORT)
    monkeypatch.setenv("PYTHONPATH", str(shadow))  # the worker and its trainer start with a broken ORT
    with embedded.start(settings, log_dir=tmp_path / "logs"):
        client = Client(settings.api_url)
        train = client.upload(write_jsonl(tmp_path / "train.jsonl", rows(32)))
        job = client.create_job(
            model="tiny-bert", training_file=train["id"], backend="ort", hyperparameters={"max_steps": 2}
        )
        done = wait_for(client, job["id"], TERMINAL)
        assert done["status"] == "failed"
        assert done["error"]["code"] == "BackendUnavailable"
        assert "simulated broken onnxruntime-training build" in done["error"]["message"]
        auto = client.create_job(
            model="tiny-bert",
            training_file=train["id"],
            backend="auto",
            precision="fp32",  # the precision ORT can run on CPU, so that only the broken install is left
            hyperparameters={"max_steps": 2},
        )
        done = wait_for(client, auto["id"], TERMINAL)
        assert done["status"] == "succeeded", done["error"]
        assert done["backend_used"] == "torch" and "fell back to PyTorch" in done["backend_reason"]
        assert any(
            e["level"] == "warn" and "simulated broken" in e["message"] for e in events(client, auto["id"])
        )


@pytest.mark.parametrize("config", ["production"], indirect=True)
def test_a_lora_chat_job_end_to_end(service: Client, tmp_path: Path) -> None:
    """method.supervised.lora through the API on chat rows: the job succeeds with an adapter beside the
    merged model and its ONNX, each downloadable with its sha256; the backend says why PyTorch ran."""
    rows = [
        {"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": f"{w} {w}"}]}
        for w in ("hello", "goodbye", "thanks", "please") * 8
    ]
    train = service.upload(write_jsonl(tmp_path / "chat.jsonl", rows))
    job = service.create_job(
        model="tiny-gpt2",
        training_file=train["id"],
        method={
            "type": "supervised",
            "supervised": {
                "hyperparameters": {"max_steps": 6, "batch_size": 8, "learning_rate": 1e-3},
                "lora": {"r": 4, "alpha": 8, "target_modules": ["c_attn"]},
            },
        },
    )
    done = wait_for(service, job["id"], TERMINAL)
    assert done["status"] == "succeeded", done["error"]
    assert done["backend_used"] == "torch"
    artifacts = {a["format"]: a for a in service.get(f"/v1/fine_tuning/jobs/{job['id']}/artifacts")}
    assert set(artifacts) == {"adapter", "pytorch", "onnx"}
    assert artifacts["adapter"]["manifest"]["lora"]["r"] == 4
    digest = service.download(job["id"], "adapter", tmp_path / "adapter.tar")
    assert digest == artifacts["adapter"]["sha256"]
    merged = service.download(job["id"], "merged", tmp_path / "merged.tar")
    assert merged == artifacts["pytorch"]["sha256"]  # the adapter merged into its base
    with tarfile.open(tmp_path / "adapter.tar") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_a_dpo_job_end_to_end(service: Client, tmp_path: Path) -> None:
    """method dpo through the API on preference pairs: the job succeeds, its events and charts carry the
    reward margins and accuracies, the held-out pairs' preference accuracy rises, and the model downloads."""
    train = service.upload(write_jsonl(tmp_path / "pairs.jsonl", preference_rows(48)))
    held_out = service.upload(write_jsonl(tmp_path / "held-out.jsonl", preference_rows(12, held_out=True)))
    job = service.create_job(
        model="tiny-gpt2",
        training_file=train["id"],
        validation_file=held_out["id"],
        seed=5,  # else a random one: the figures below would move run to run
        method={
            "type": "dpo",
            "dpo": {"hyperparameters": {"beta": 0.1, "n_epochs": 3, "batch_size": 8, "learning_rate": 1e-2}},
        },
    )
    done = wait_for(service, job["id"], TERMINAL)
    assert done["status"] == "succeeded", done["error"]
    assert done["backend_used"] == "torch" and "DPO trains under PyTorch" in done["backend_reason"]
    assert done["method"]["type"] == "dpo"
    charts = service.get(f"/v1/fine_tuning/jobs/{job['id']}/metrics")["data"]
    assert {"reward_margin", "reward_accuracy", "eval_reward_accuracy", "eval_preference_accuracy"} <= set(
        charts
    )
    preference = charts["eval_preference_accuracy"]["values"]
    assert preference[-1] >= preference[0] + 0.3, preference
    assert done["result"]["metrics"]["eval_reward_accuracy"] >= 0.9
    assert any(e["type"] == "metrics" and "reward_margin" in e["message"] for e in events(service, job["id"]))
    formats = {a["format"] for a in service.get(f"/v1/fine_tuning/jobs/{job['id']}/artifacts")}
    assert formats == {"pytorch", "onnx"}


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_a_job_continued_from_a_fine_tuned_model_starts_from_its_weights(
    service: Client, tmp_path: Path
) -> None:
    """`model: ft:...` is a base: the second job's first loss is where the first job ended, not where it
    began (a fresh tiny-bert starts near ln 2)."""
    train = service.upload(DEMO / "sentiment_train.jsonl")
    body = {"training_file": train["id"], "backend": "torch", "seed": 3}
    hp = {"batch_size": 16, "learning_rate": 2e-3, "max_seq_length": 32}
    first = service.create_job(
        model="tiny-bert", **body, hyperparameters=hp | {"max_steps": 40}, checkpoint_every_steps=20
    )
    done = wait_for(service, first["id"], TERMINAL)
    assert done["status"] == "succeeded", done["error"]
    second = service.create_job(model=done["fine_tuned_model"], **body, hyperparameters=hp | {"max_steps": 3})
    again = wait_for(service, second["id"], TERMINAL)
    assert again["status"] == "succeeded", again["error"]

    def losses(job_id: str) -> list[float]:
        return list(
            service.get(f"/v1/fine_tuning/jobs/{job_id}/metrics", name="train_loss")["data"]["train_loss"][
                "values"
            ]
        )

    a, b = losses(first["id"]), losses(second["id"])
    assert b[0] < (a[0] + sum(a[-5:]) / 5) / 2, (a[:3], a[-5:], b)

    # a checkpoint, by the name the checkpoints list gives it, is a base too: it carries its tokenizer
    listed = service.get(f"/v1/fine_tuning/jobs/{first['id']}/checkpoints")["data"]
    at_20 = next(c["fine_tuned_model_checkpoint"] for c in listed if c["step_number"] == 20)
    third = service.create_job(model=at_20, **body, hyperparameters=hp | {"max_steps": 3})
    from_checkpoint = wait_for(service, third["id"], TERMINAL)
    assert from_checkpoint["status"] == "succeeded", from_checkpoint["error"]
    c = losses(third["id"])
    assert c[0] < (a[0] + a[19]) / 2, (a[:3], a[19], c)  # nearer step 20's loss than the start's


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_truncated_rows_refuse_fails_the_job_naming_the_lines(service: Client, tmp_path: Path) -> None:
    """hyperparameters.truncated_rows: refuse: rows whose reply max_seq_length would cut away fail the job
    at tokenizing, with the lines named, instead of being left out."""
    chat = [
        {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "hello"}]}
        for i in range(6)
    ]
    long = {"messages": [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "ok"}]}
    train = service.upload(write_jsonl(tmp_path / "chat.jsonl", [*chat, long, long]))
    hp = {"max_steps": 2, "batch_size": 4, "max_seq_length": 24, "truncated_rows": "refuse"}
    job = service.create_job(model="tiny-gpt2", training_file=train["id"], hyperparameters=hp)
    done = wait_for(service, job["id"], TERMINAL)
    assert done["status"] == "failed"
    assert "2 training rows (line 7, 8) were left out" in done["error"]["message"], done["error"]
    assert "truncated_rows is refuse" in done["error"]["message"]


@pytest.mark.parametrize("config", ["embedded"], indirect=True)  # the worker's staging, the same on both
def test_a_job_whose_file_is_gone_from_storage_fails_naming_the_file(
    service: Client, deployment: Deployment, tmp_path: Path
) -> None:
    """A file's bytes removed behind ortune's back (a bucket's lifecycle rule, an operator): the job fails
    at once with `file_missing`, naming the file, instead of a worker error about an object key."""
    unique = [
        {"text": f"{r['text']} {tmp_path.name}", "label": r["label"]} for r in rows(32)
    ]  # no cached store
    train = service.upload(write_jsonl(tmp_path / "gone.jsonl", unique))
    store_of(deployment.settings).delete(f"files/{train['id']}.jsonl")
    job = service.create_job(model="tiny-bert", training_file=train["id"], hyperparameters={"max_steps": 2})
    done = wait_for(service, job["id"], TERMINAL)
    assert done["status"] == "failed" and done["error"]["code"] == "file_missing", done["error"]
    assert (
        f"the training file {train['id']} (gone.jsonl) is gone from object storage"
        in done["error"]["message"]
    )

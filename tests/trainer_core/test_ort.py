"""The ORT engine: ORTModule really trains on torch 2.13, matches PyTorch, and never fails silently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import ROOT, launch_trainer, rows, write_jsonl
from trainer_core.data import prepare
from trainer_core.engine import backends, ort_setup, ort_trainer, trainer
from trainer_core.engine.launch import with_stores
from trainer_core.events import EventStream
from trainer_core.models import modeling, registry
from trainer_core.spec import Hyperparameters, Lora, TrainingSpec

BROKEN_ORT = """
import importlib.abc, sys
class _BrokenTraining(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "onnxruntime.training" or name.startswith("onnxruntime.training."):
            raise ImportError("simulated broken onnxruntime-training build")
sys.meta_path.insert(0, _BrokenTraining())
"""

FAILING_EXPORT = """
import functools, torch.onnx
_export = torch.onnx.export
@functools.wraps(_export)
def export(*args, dynamo=None, **kwargs):
    if not dynamo:  # ORTModule's TorchScript export; our own ONNX artifacts use dynamo and still work
        raise RuntimeError("simulated: Exporting the operator 'aten::frobnicate' to ONNX is not supported")
    return _export(*args, dynamo=dynamo, **kwargs)
torch.onnx.export = export
"""


def spec_for(tmp: Path, **kw: Any) -> TrainingSpec:
    train = write_jsonl(tmp / "train.jsonl", rows(48))
    base: dict[str, Any] = {
        "job_id": "ftjob-ort",
        "task": "sequence-classification",
        "model": "tiny-bert",
        "train_file": str(train),
        "labels": ["negative", "positive"],
        "output_dir": str(tmp / "out"),
        "seed": 3,
        "precision": "fp32",  # ORT training on CPU is fp32; `auto` would choose bf16 on this CPU
        "hyperparameters": Hyperparameters(max_steps=6, batch_size=8, learning_rate=1e-3).resolved(48),
    }
    return TrainingSpec(**(base | kw))


def losses_with(backend: str, tmp: Path, lora: bool = False) -> tuple[list[float], Any]:
    """Train through the real ORTTrainer with dropout off: what is left to differ is the engine."""
    # lr 1e-4: Adam's normalised update turns rounding-level gradient differences into parameter moves of
    # up to +-lr, so a smaller lr keeps the engines' drift small relative to the tolerance below.
    hp = Hyperparameters(max_steps=6, batch_size=8, learning_rate=1e-4).resolved(48)
    spec = spec_for(
        tmp, backend=backend, hyperparameters=hp, lora=Lora(r=4, alpha=8, dropout=0.0) if lora else None
    )
    choice = backends.choose(spec, cuda=False)
    torch.manual_seed(spec.seed)
    spec = with_stores(spec.model_copy(update={"output_dir": str(tmp / backend / "out")}))
    with (tmp / f"{backend}.prepare").open("w") as out:
        train, _ = prepare.ensure(spec, EventStream(out))
    loaded = modeling.load(
        registry.resolve("tiny-bert"),
        spec,
        tokenizer=prepare.load_tokenizer(spec, train),
        attn_implementation="eager",
    )
    for module in loaded.model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    with (tmp / f"{backend}.events").open("w") as out:
        hf = trainer.supervised_trainer(spec, choice, loaded, train, None, EventStream(out), cuda=False)
        hf.train()
    return [h["loss"] for h in hf.state.log_history if "loss" in h], hf


def parity_probe(tmp: str, lora: bool = False) -> dict[str, Any]:
    """Both trainings in one fresh process, so no earlier test's global torch state can leak in."""
    torch_losses, _ = losses_with("torch", Path(tmp), lora)
    ort_losses, hf = losses_with("ort", Path(tmp), lora)
    trained = [n for n, p in hf.plain_model.named_parameters() if p.requires_grad]
    return {
        "trained": trained,
        "torch": torch_losses,
        "ort": ort_losses,
        "nodes": ort_trainer.training_graph_nodes(hf.ort_module),
        "module": type(hf.ort_module).__name__,
        "policy": os.environ["ORTMODULE_FALLBACK_POLICY"],
    }


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_ort_matches_pytorch_losses_and_really_ran(tmp_path: Path, lora: bool) -> None:
    """Full fine-tuning, and a LoRA adapter: ORTModule over the PEFT model, the base frozen."""
    code = "import json; from tests.trainer_core.test_ort import parity_probe; "
    code += f"print(json.dumps(parity_probe({str(tmp_path)!r}, {lora})))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    torch_losses, ort_losses = probe["torch"], probe["ort"]
    assert len(torch_losses) == len(ort_losses) == 6
    # fp32 on both sides; ORT fuses ops and reorders reductions, so the losses may differ by rounding that
    # Adam's normalised update carries forward. Measured here: 6e-8 over 6 steps, the same on every run once
    # the tiny tokenizer was made deterministic (it had made the two trainings start from different vocabs).
    # 1e-4 is three orders above that and still far below a real divergence (a step's loss moves by ~1e-3).
    assert max(abs(a - b) for a, b in zip(torch_losses, ort_losses, strict=True)) < 1e-4
    assert ort_losses[-1] != ort_losses[0]  # it trained
    assert probe["module"] == "ORTModule" and probe["nodes"] > 50
    assert probe["policy"] == "FALLBACK_DISABLE"
    if lora:  # the adapter and the new classifier head (PEFT keeps it trainable), nothing of the base
        assert probe["trained"] and all("lora_" in n or "classifier" in n for n in probe["trained"])


def test_launch_with_ort_records_the_proof_and_exports(tmp_path: Path) -> None:
    code, events, _ = launch_trainer(spec_for(tmp_path, backend="ort"), tmp_path / "spec.json")
    assert code == 0, events[-1]
    backend = next(e for e in events if e["type"] == "backend")
    assert (backend["requested"], backend["used"]) == ("ort", "ort")
    result = events[-1]
    assert result["type"] == "result" and result["metrics"]["ort_training_graph_nodes"] > 50
    assert result["onnx_max_abs_diff"] < 1e-3
    manifest = json.loads((tmp_path / "out" / "pytorch" / "ortune_manifest.json").read_text())
    assert manifest["backend_used"] == "ort"


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_auto_measures_both_in_interleaved_rounds_and_keeps_ort_only_by_a_margin(
    tmp_path: Path, lora: bool
) -> None:
    adapter = Lora(r=4, alpha=8, dropout=0.0) if lora else None
    spec = spec_for(tmp_path, backend="auto", auto_budget_fraction=1000.0, lora=adapter)
    code, events, _ = launch_trainer(spec, tmp_path / "spec.json")
    assert code == 0, events[-1]
    backend = next(e for e in events if e["type"] == "backend")
    figures = backend["figures"]
    assert figures["torch_ms"] > 0 and figures["ort_ms"] > 0 and figures["batch_shape"][0] == 8
    assert figures["rounds"] >= 3 and figures["ort_export_s"] > 0
    faster = figures["ort_expected_s"] < figures["torch_expected_s"] * (1 - figures["margin"])
    assert backend["used"] == ("ort" if faster else "torch")
    assert f"kept {backend['used']}" in backend["reason"]


def test_auto_does_not_measure_a_job_too_short_to_pay_for_it(tmp_path: Path) -> None:
    # 6 steps of a tiny model: a fraction of a second, against seconds of ORT export
    code, events, _ = launch_trainer(spec_for(tmp_path, backend="auto"), tmp_path / "s.json")
    assert code == 0, events[-1]
    backend = next(e for e in events if e["type"] == "backend")
    assert backend["used"] == "torch" and "would cost more than 3%" in backend["reason"]
    assert "ort_ms" not in backend["figures"] and backend["figures"]["expected_job_s"] > 0


def test_auto_keeps_the_decision_of_the_jobs_first_attempt(tmp_path: Path) -> None:
    decided = {
        "used": "ort",
        "reason": "measured 9.0 ms/step with PyTorch and 4.0 ms/step with ORT; kept ort",
    }
    spec = spec_for(tmp_path, backend="auto", backend_decided=decided)
    code, events, _ = launch_trainer(spec, tmp_path / "spec.json")
    assert code == 0, events[-1]
    backend = next(e for e in events if e["type"] == "backend")
    assert backend["used"] == "ort" and "decided by this job's first attempt" in backend["reason"]
    assert backend["figures"] == {}  # nothing measured again
    assert events[-1]["metrics"]["ort_training_graph_nodes"] > 50


def measure_probe(tmp: str, margin: float) -> dict[str, Any]:
    """backends.measure on a tiny model with the margin forced: what the winner leaves behind."""
    spec = spec_for(Path(tmp))
    loaded = modeling.load(registry.resolve("tiny-bert"), spec, [r["text"] for r in rows(48)])
    batch = loaded.tokenizer([r["text"] for r in rows(8)], padding=True, return_tensors="pt")
    batch["labels"] = torch.tensor([0, 1] * 4)
    before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    backends.MARGIN = margin
    figures = backends.measure(loaded.model, [dict(batch)], micro_steps=1000, budget_fraction=1000.0)
    same = all(torch.equal(before[k], v) for k, v in loaded.model.state_dict().items())
    return {
        "used": figures["used"],
        "has_module": "ort_module" in figures,
        "attention": loaded.model.config._attn_implementation,
        "unchanged": same,
        "grads": any(p.grad is not None for p in loaded.model.parameters()),
    }


@pytest.mark.parametrize(("margin", "used", "attention"), [(0.99, "torch", "sdpa"), (-100.0, "ort", "eager")])
def test_measure_leaves_the_winner_ready_and_the_model_unchanged(
    tmp_path: Path, margin: float, used: str, attention: str
) -> None:
    code = "import json; from tests.trainer_core.test_ort import measure_probe; "
    code += f"print(json.dumps(measure_probe({str(tmp_path)!r}, {margin})))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(result.stdout.splitlines()[-1])
    assert probe == {
        "used": used,
        "has_module": used == "ort",  # the loser's ORTModule is dropped, the winner's kept for training
        "attention": attention,
        "unchanged": True,
        "grads": False,
    }


def test_broken_ort_fails_backend_ort_and_auto_falls_back(tmp_path: Path) -> None:
    shadow = tmp_path / "broken"
    shadow.mkdir()
    (shadow / "sitecustomize.py").write_text(BROKEN_ORT)
    env = {"PYTHONPATH": f"{shadow}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code, events, _ = launch_trainer(spec_for(tmp_path, backend="ort"), tmp_path / "spec.json", env)
    assert code == 2
    assert events[-1]["type"] == "error" and events[-1]["code"] == "BackendUnavailable"
    assert "simulated broken onnxruntime-training build" in events[-1]["message"]
    (tmp_path / "auto").mkdir()
    code, events, _ = launch_trainer(
        spec_for(tmp_path / "auto", backend="auto", auto_budget_fraction=1000.0),
        tmp_path / "auto" / "spec.json",
        env,
    )
    assert code == 0, events[-1]
    backend = next(e for e in events if e["type"] == "backend")
    assert backend["used"] == "torch" and "fell back to PyTorch" in backend["reason"]
    assert any(
        e["type"] == "message" and e["level"] == "warn" and "simulated broken" in e["message"] for e in events
    )


def test_a_model_ort_cannot_export_fails_ort_and_auto_falls_back(tmp_path: Path) -> None:
    """ORT imports fine but cannot take this model: `ort` fails with the exporter's reason, `auto` trains
    with PyTorch and says why, and the job's own ONNX artifact is still exported."""
    shadow = tmp_path / "failing"
    shadow.mkdir()
    (shadow / "sitecustomize.py").write_text(FAILING_EXPORT)
    env = {"PYTHONPATH": f"{shadow}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code, events, _ = launch_trainer(spec_for(tmp_path, backend="ort"), tmp_path / "spec.json", env)
    assert code != 0 and events[-1]["type"] == "error"
    assert "aten::frobnicate" in events[-1]["message"]
    (tmp_path / "auto").mkdir()
    code, events, _ = launch_trainer(
        spec_for(tmp_path / "auto", backend="auto", auto_budget_fraction=1000.0),
        tmp_path / "auto" / "spec.json",
        env,
    )
    assert code == 0, events[-1]
    backend = next(e for e in events if e["type"] == "backend")
    assert backend["used"] == "torch"
    assert "ORT failed on this model" in backend["reason"] and "aten::frobnicate" in backend["reason"]
    result = events[-1]
    assert result["type"] == "result" and result["onnx_max_abs_diff"] < 1e-3


def test_cuda_only_optimizer_on_cpu_is_substituted_and_said(tmp_path: Path) -> None:
    choice = backends.choose(spec_for(tmp_path, backend="ort", optim="adamw_ort_fused"), cuda=False)
    assert choice.optim == "adamw_torch_fused" and choice.ort_optim is None
    assert "CUDA-only FusedAdam" in (choice.optim_note or "")
    on_gpu = backends.choose(spec_for(tmp_path, backend="torch", optim="adamw_ort_fused"), cuda=True)
    assert on_gpu.optim == "adamw_torch_fused" and "needs the ORT backend" in (on_gpu.optim_note or "")


def test_mixed_precision_that_cpu_cannot_do_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(backends.BackendUnavailable, match="fp32 only"):
        backends.choose(spec_for(tmp_path, backend="ort", precision="bf16"), cuda=False)
    code, events, _ = launch_trainer(
        spec_for(tmp_path, backend="torch", precision="fp16"), tmp_path / "spec.json"
    )
    assert code == 2 and "fp16 needs a CUDA GPU" in events[-1]["message"]


def test_setup_ort_is_idempotent() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ortune.cli", "setup-ort"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sources already patched" in result.stdout and "extensions already built" in result.stdout
    assert "ORTModule trains with fallback disabled" in result.stdout


def fake_extensions(root: Path) -> Path:
    """The layout ort_setup reads: sources under cpu/, a build folder, the built .so files at the top."""
    src = root / "cpu" / "torch_interop_utils"
    src.mkdir(parents=True)
    (src / "ctx_pool.h").write_text("// source\n")
    (root / "build").mkdir()
    (root / "build" / "object.h").write_text("// build output\n")
    return root


def test_built_extensions_are_kept_and_restored_by_what_they_were_built_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ext = fake_extensions(tmp_path / "venv-a")
    key = ort_setup.cache_key(ext)
    (ext / "build" / "object.h").write_text("// another build\n")
    assert ort_setup.cache_key(ext) == key  # build output is not an input
    (ext / "cpu" / "torch_interop_utils" / "ctx_pool.h").write_text(f"{ort_setup.MARK}\n// source\n")
    assert ort_setup.cache_key(ext) != key  # patched sources are

    for name in ("aten_op_executor", "torch_interop_utils"):
        (ext / f"{name}.cpython-311-x86_64-linux-gnu.so").write_bytes(name.encode())
    cache = tmp_path / "cache" / ort_setup.cache_key(ext)
    ort_setup.save(ext, cache)
    assert sorted(p.name for p in cache.parent.iterdir()) == [cache.name]  # no staging folder left
    other = fake_extensions(tmp_path / "venv-b")
    assert not ort_setup.built(other)
    assert ort_setup.restore(other, cache) and ort_setup.built(other)
    assert (other / "aten_op_executor.cpython-311-x86_64-linux-gnu.so").read_bytes() == b"aten_op_executor"

    assert not ort_setup.restore(other, tmp_path / "cache" / "unknown-key")
    monkeypatch.setenv("ORTUNE_BUILD_CACHE", "")
    assert ort_setup.cache_root() is None
    monkeypatch.setenv("ORTUNE_BUILD_CACHE", str(tmp_path / "elsewhere"))
    assert ort_setup.cache_root() == tmp_path / "elsewhere"


def test_restored_extensions_that_do_not_run_are_built_again_and_the_entry_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ext = fake_extensions(tmp_path / "venv")
    monkeypatch.setenv("ORTUNE_BUILD_CACHE", str(tmp_path / "cache"))
    cache = tmp_path / "cache" / ort_setup.cache_key(ext)
    cache.mkdir(parents=True)
    for name in ("aten_op_executor", "torch_interop_utils"):
        (cache / f"{name}.so").write_bytes(b"stale")
    builds: list[Path] = []

    def build(ext_dir: Path) -> None:
        builds.append(ext_dir)
        for name in ("aten_op_executor", "torch_interop_utils"):
            (ext_dir / f"{name}.so").write_bytes(b"fresh")

    def smoke() -> str:  # the real smoke run imports ORT's extensions; here the bytes say which ones loaded
        if (ext / "aten_op_executor.so").read_bytes() != b"fresh":
            raise ort_setup.SetupError("undefined symbol")
        return "ok"

    monkeypatch.setattr(ort_setup, "extensions_dir", lambda: ext)
    monkeypatch.setattr(ort_setup, "patch_sources", lambda ext_dir: [])
    monkeypatch.setattr(ort_setup, "build", build)
    monkeypatch.setattr(ort_setup, "smoke", smoke)
    assert ort_setup.run() == "ok"
    assert builds == [ext]
    assert (cache / "aten_op_executor.so").read_bytes() == b"fresh"  # the stale entry is gone

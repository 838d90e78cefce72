"""precision: auto trains in bf16 mixed precision where the device has it, keeps fp32 master weights, and
tracks fp32's loss curve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import launch_trainer, rows, write_jsonl
from trainer_core.engine import precision
from trainer_core.models import modeling, registry
from trainer_core.spec import Hyperparameters, TrainingSpec


def spec_for(tmp: Path, **kw: Any) -> TrainingSpec:
    base: dict[str, Any] = {
        "job_id": "ftjob-precision",
        "task": "sequence-classification",
        "model": "tiny-bert",
        "train_file": str(write_jsonl(tmp / "train.jsonl", rows(64))),
        "labels": ["negative", "positive"],
        "output_dir": str(tmp / "out"),
        "seed": 5,
        "backend": "torch",
        "hyperparameters": Hyperparameters(max_steps=30, batch_size=8, learning_rate=1e-3).resolved(64),
    }
    return TrainingSpec(**(base | kw))


@pytest.mark.parametrize(
    ("asked", "backend", "flags", "used"),
    [
        ("auto", "torch", {"avx512f", "avx512_bf16"}, "bf16"),
        ("auto", "auto", {"amx_tile", "amx_bf16"}, "bf16"),
        ("auto", "torch", {"avx2", "avx512f"}, "fp32"),  # AVX-512 without its bf16 extension
        ("auto", "ort", {"avx512_bf16"}, "fp32"),  # ORTModule on CPU builds fp32 graphs only
        ("fp32", "torch", {"avx512_bf16"}, "fp32"),
        ("bf16", "torch", set(), "bf16"),  # asked for: emulated, slower, but what the user wants
    ],
)
def test_auto_is_bf16_where_the_cpu_has_it(
    tmp_path: Path, asked: str, backend: str, flags: set[str], used: str
) -> None:
    choice = precision.choose(spec_for(tmp_path, precision=asked, backend=backend), cuda=False, flags=flags)
    assert (choice.requested, choice.used) == (asked, used)
    assert choice.reason  # always says why


def test_this_cpu_is_read_from_proc_cpuinfo(tmp_path: Path) -> None:
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512_bf16 amx_bf16\n")
    flags = precision.cpu_flags(tmp_path / "cpuinfo")
    assert {"avx512_bf16", "amx_bf16"} <= flags
    assert "AMX" in (precision.native_bf16(cuda=False, flags=flags) or "")
    assert precision.cpu_flags(tmp_path / "missing") == set()


def test_fp16_without_cuda_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(precision.PrecisionUnavailable, match="fp16 needs a CUDA GPU"):
        precision.choose(spec_for(tmp_path, precision="fp16"), cuda=False)


def test_a_bf16_checkpoint_loads_as_fp32_master_weights(tmp_path: Path) -> None:
    spec = spec_for(tmp_path)
    built = modeling.load(registry.resolve("tiny-bert"), spec, [r["text"] for r in rows(64)])
    built.model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16-model")
    built.tokenizer.save_pretrained(tmp_path / "bf16-model")
    info = registry.resolve("bf16-model", tmp_path)
    loaded = modeling.load(info, spec)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float32}


def losses(tmp: Path, asked: str) -> tuple[list[float], dict[str, Any]]:
    """A tiny GPT-2 learning the demo's sentences: a loss that falls far in 30 steps."""
    (tmp / asked).mkdir()
    spec = spec_for(tmp / asked, precision=asked, task="causal-lm", model="tiny-gpt2", labels=[])
    code, events, err = launch_trainer(spec, tmp / asked / "spec.json")
    assert code == 0, err
    backend = next(e for e in events if e["type"] == "backend")
    return [e["train_loss"] for e in events if e["type"] == "metrics" and "train_loss" in e], backend


def test_bf16_tracks_fp32_and_saves_fp32_weights(tmp_path: Path) -> None:
    fp32, fp32_backend = losses(tmp_path, "fp32")
    bf16, bf16_backend = losses(tmp_path, "bf16")
    assert (fp32_backend["precision"], bf16_backend["precision"]) == ("fp32", "bf16")
    assert len(fp32) == len(bf16) >= 30
    assert bf16[-1] < bf16[0] * 0.9, bf16  # it trained
    # bf16 keeps 8 bits of mantissa: each matmul output is off by up to ~2^-9 relative, and over 30 Adam
    # steps the two runs drift apart like two seeds' rounding would. The bound is 5% of the loss at every
    # step (measured here: 1e-4), far below what a broken autocast (no training, or a NaN) would give.
    gaps = [abs(a - b) / a for a, b in zip(fp32, bf16, strict=True)]
    assert max(gaps) < 0.05, gaps
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "bf16" / "out" / "pytorch" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}  # mixed precision: master weights fp32

"""Save a trained model as a Hugging Face directory and as ONNX, checking ONNX against PyTorch.

The ONNX graph comes from torch's dynamo exporter with dynamic batch and sequence dimensions, and is run
with onnxruntime on inputs of other shapes than the export sample; the largest absolute difference of the
logits is recorded in the manifest, and a difference above `PARITY_TOLERANCE` fails the export. A causal LM
is exported with its KV cache by export/decoder.py.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer_core.engine.ort_compat import dynamo_export

PARITY_TOLERANCE = 1e-3
MANIFEST = "ortune_manifest.json"


class ExportError(RuntimeError):
    pass


@dataclass(frozen=True)
class HeldOut:
    """What every exporter checks its ONNX against: the held-out store (the training one when the job has
    none), the collator that batched it in training, and the job's sequence length.

    Every exporter family has one signature, `export_onnx(model, tokenizer, directory, held_out, manifest)`,
    named by its task's `TaskInfo.exporter`."""

    store: Any
    collator: Any
    max_len: int = 128

    @property
    def texts(self) -> list[str]:
        return list(self.store.meta.samples)


class _Logits(torch.nn.Module):
    def __init__(self, model: Any, names: Sequence[str]) -> None:
        super().__init__()
        self.model = model
        self.names = list(names)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        if not self.model.config.is_encoder_decoder and hasattr(self.model.config, "use_cache"):
            kwargs["use_cache"] = False
        return self.model(**kwargs).logits


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def save_pytorch(model: Any, tokenizer: Any, directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    manifest = {**manifest, "format": "pytorch", "files": sorted(p.name for p in directory.iterdir())}
    write_manifest(directory, manifest)
    return manifest


def save_adapter(model: Any, tokenizer: Any, directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """A LoRA job's adapter as PEFT saves it (adapter_config.json, adapter_model.safetensors), to load on
    its base with `PeftModel.from_pretrained`."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    manifest = {
        **manifest,
        "format": "adapter",
        "trainable_parameters": trainable,
        "total_parameters": total,
        "files": sorted(p.name for p in directory.iterdir()),
    }
    write_manifest(directory, manifest)
    return manifest


def _inputs(
    tokenizer: Any, texts: Sequence[str], names: Sequence[str], max_len: int
) -> dict[str, torch.Tensor]:
    enc = tokenizer(list(texts), padding=True, truncation=True, max_length=max_len, return_tensors="pt")
    return {n: enc[n] for n in names}


def export_onnx(
    model: Any, tokenizer: Any, directory: Path, held_out: HeldOut, manifest: dict[str, Any]
) -> dict[str, Any]:
    """An encoder classifier's logits graph, checked on the held-out rows' texts."""
    return export_texts(model, tokenizer, directory, held_out.texts, manifest, max_len=held_out.max_len)


def export_texts(
    model: Any,
    tokenizer: Any,
    directory: Path,
    sample_texts: Sequence[str],
    manifest: dict[str, Any],
    *,
    max_len: int = 128,
) -> dict[str, Any]:
    directory.mkdir(parents=True, exist_ok=True)
    model = model.float().eval().cpu()
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in tokenizer.model_input_names]
    texts = [t for t in sample_texts if t.strip()] or ["hello world", "a second sample"]
    # Two samples of different lengths, so neither batch nor sequence size is 1 (export would fix it).
    export_texts = (texts * 2)[:2]
    check_texts = (
        (texts * 4)[: min(len(texts) * 4, 7)] if len(texts) > 2 else [*texts, texts[0] + " " + texts[0]]
    )
    sample = _inputs(tokenizer, export_texts, names, max_len)
    if sample["input_ids"].shape[1] < 2:
        sample = _inputs(tokenizer, [t + " x" for t in export_texts], names, max_len)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence", max=max(max_len, 4))
    wrapper = _Logits(model, names)
    save_onnx(
        wrapper,
        directory / "model.onnx",
        kwargs=sample,
        input_names=names,
        output_names=["logits"],
        dynamic_shapes={n: {0: batch, 1: seq} for n in names},
    )
    tokenizer.save_pretrained(directory)
    model.config.save_pretrained(directory)

    import onnxruntime as ort

    session = ort.InferenceSession(str(directory / "model.onnx"), providers=["CPUExecutionProvider"])
    check = _inputs(tokenizer, check_texts, names, max_len)
    got = session.run(["logits"], {n: check[n].numpy() for n in names})[0]
    with torch.no_grad():
        want = wrapper(**check).numpy()
    # causal LM: positions under padding are not compared
    keep = check["attention_mask"].numpy().astype(bool) if got.ndim == 3 else None
    diff = logits_parity(got, want, keep)
    manifest = {
        **manifest,
        "format": "onnx",
        "onnx_opset": 18,
        "inputs": names,
        "outputs": ["logits"],
        "parity": {"max_abs_diff": diff, "tolerance": PARITY_TOLERANCE, "samples": len(check_texts)},
        "files": sorted(p.name for p in directory.iterdir()),
    }
    write_manifest(directory, manifest)
    return manifest


def save_onnx(
    module: torch.nn.Module,
    path: Path,
    *,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    input_names: Sequence[str],
    output_names: Sequence[str],
    dynamic_shapes: Any,
) -> None:
    """Export `module` with torch's dynamo exporter (opset 18) to `path`; any failure is an ExportError
    with the exporter's own first line."""
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    try:
        program = dynamo_export(
            module,
            args,
            kwargs=kwargs,
            input_names=list(input_names),
            output_names=list(output_names),
            dynamic_shapes=dynamic_shapes,
            opset_version=18,
            verbose=False,
        )
        assert program is not None
        program.save(str(path))
    except Exception as exc:
        raise _failed(exc) from exc


def logits_parity(got: np.ndarray, want: np.ndarray, keep: np.ndarray | None = None) -> float:
    """The largest difference of ONNX Runtime's logits from PyTorch's (over `keep` only, when given), or
    ExportError when the shapes differ or it is over PARITY_TOLERANCE."""
    if got.shape != want.shape:
        raise ExportError(f"ONNX logits shape {got.shape} != PyTorch {want.shape}")
    gap = np.abs(got - want)
    diff = float((gap[keep] if keep is not None else gap).max())
    if not np.isfinite(diff) or diff > PARITY_TOLERANCE:
        raise ExportError(f"ONNX logits differ from PyTorch by {diff:.3g} (tolerance {PARITY_TOLERANCE})")
    return diff


def _failed(exc: BaseException) -> ExportError:
    cause = exc.__cause__ or exc
    first = re.sub(r"\x1b\[[0-9;]*m", "", str(cause)).strip().splitlines()[0][:500]
    return ExportError(f"ONNX export failed: {type(cause).__name__}: {first}")

"""Which engine runs forward/backward, and why: decided before training and recorded on the job.

`torch` is plain PyTorch. `ort` asks for ONNX Runtime training's ORTModule and fails loudly when it cannot
run. `auto` takes ORT where it imports and runs, otherwise PyTorch, and says why in an event.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from trainer_core.spec import TrainingSpec


class BackendUnavailable(RuntimeError):
    """backend=ort was asked for and cannot run; the message is the reason shown to the user."""


@dataclass(frozen=True)
class BackendChoice:
    requested: str
    used: str
    reason: str | None = None
    optim: str = "adamw_torch"
    optim_note: str | None = None


def ort_import_error() -> str | None:
    """None when ORTModule imports, otherwise why not."""
    try:
        importlib.import_module("onnxruntime.training.ortmodule")
    except Exception as exc:  # an ImportError, or whatever a broken ORT build raises on import
        return f"onnxruntime-training's ORTModule does not import: {type(exc).__name__}: {exc}"
    return None


def _optim(spec: TrainingSpec, cuda: bool) -> tuple[str, str | None]:
    if spec.optim == "adamw_ort_fused" and not cuda:
        return (
            "adamw_torch_fused",
            "adamw_ort_fused is ONNX Runtime's CUDA-only FusedAdam; on CPU it is replaced by "
            "torch's fused AdamW (adamw_torch_fused)",
        )
    if spec.optim == "adamw_ort_fused":
        return "adamw_ort_fused", None
    return spec.optim, None


def choose(spec: TrainingSpec, *, cuda: bool) -> BackendChoice:
    optim, note = _optim(spec, cuda)
    if spec.backend == "torch":
        if optim == "adamw_ort_fused":
            optim, note = "adamw_torch_fused", "adamw_ort_fused needs backend ort; using adamw_torch_fused"
        return BackendChoice("torch", "torch", None, optim, note)
    problem = ort_import_error()
    if problem is None:
        # ORTModule imports; the engine that wraps the model with it lands with the ORT trainer.
        problem = "this build of trainer_core has no ORTModule engine yet"
    if spec.backend == "ort":
        raise BackendUnavailable(problem)
    if optim == "adamw_ort_fused":
        optim, note = "adamw_torch_fused", "adamw_ort_fused needs ORT; using adamw_torch_fused"
    return BackendChoice("auto", "torch", f"fell back to PyTorch: {problem}", optim, note)

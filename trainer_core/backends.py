"""Which engine runs forward/backward, and why: decided before training and recorded on the job.

`torch` is plain PyTorch. `ort` asks for ONNX Runtime training's ORTModule and fails the job, with the
reason, when it cannot run. `auto` measures both on the job's own model and first batch when ORT can run
(see `measure`) and keeps the faster; when ORT cannot run it trains with PyTorch and says why. Never silent.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from typing import Any

from trainer_core.spec import TrainingSpec


class BackendUnavailable(RuntimeError):
    """backend=ort was asked for and cannot run; the message is the reason shown to the user."""


@dataclass(frozen=True)
class BackendChoice:
    requested: str
    used: str | None  # "torch" or "ort"; None while `auto` with ORT available awaits `measure`
    reason: str | None = None
    optim: str = "adamw_torch"
    ort_optim: str | None = None
    optim_note: str | None = None
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def needs_measurement(self) -> bool:
        return self.used is None


def ort_problem(spec: TrainingSpec, *, cuda: bool) -> str | None:
    """None when ORTModule can train this spec here, otherwise why not."""
    if not cuda and spec.precision != "fp32":
        return f"ORT training on CPU runs fp32 only (precision {spec.precision} was asked for)"
    from trainer_core import ort_setup

    if (broken := ort_setup.reason_if_broken()) is not None:
        return broken
    try:
        from trainer_core import ort_compat

        ort_compat.apply()
        import onnxruntime.training.ortmodule  # noqa: F401
    except Exception as exc:  # an ImportError, or whatever a broken ORT build raises on import
        return f"onnxruntime-training's ORTModule does not import: {type(exc).__name__}: {exc}"
    return None


def choose(spec: TrainingSpec, *, cuda: bool) -> BackendChoice:
    problem = None if spec.backend == "torch" else ort_problem(spec, cuda=cuda)
    if spec.backend == "ort" and problem:
        raise BackendUnavailable(problem)
    if spec.backend == "torch":
        choice = BackendChoice("torch", "torch")
    elif problem:
        choice = BackendChoice("auto", "torch", f"fell back to PyTorch: {problem}")
    elif spec.backend == "auto" and spec.distributed.world_size > 1:
        # every rank timing its own steps could pick differently, and mixed backends would deadlock
        choice = BackendChoice(
            "auto", "torch", "auto runs PyTorch for multi-process jobs; ask for ort to use it"
        )
    else:
        choice = BackendChoice(spec.backend, "ort" if spec.backend == "ort" else None)
    return _with_optimizer(choice, spec.optim, cuda=cuda)


def _with_optimizer(choice: BackendChoice, optim: str, *, cuda: bool) -> BackendChoice:
    if optim != "adamw_ort_fused":
        return replace(choice, optim=optim)
    if not cuda:
        note = (
            "adamw_ort_fused is ONNX Runtime's CUDA-only FusedAdam; on CPU it is replaced by torch's "
            "fused AdamW (adamw_torch_fused)"
        )
        return replace(choice, optim="adamw_torch_fused", optim_note=note)
    if choice.used == "torch":
        return replace(
            choice,
            optim="adamw_torch_fused",
            optim_note="adamw_ort_fused needs the ORT backend; using adamw_torch_fused",
        )
    return replace(choice, optim="adamw_torch", ort_optim="adamw_ort_fused")


def describe(exc: BaseException) -> str:
    """One line naming a failure. ORTModule wraps the real cause as a traceback inside its own message
    ("There was an error while exporting ...:" then the text), so name the wrapper and that cause."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    head = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip()
    cause = next((x for x in reversed(lines[1:]) if re.match(r"^[\w.]+(Error|Exception)\b[^:]*: ", x)), None)
    return (f"{head} {cause}" if cause else head)[:400]


def decided(choice: BackendChoice, used: str, figures: dict[str, Any], cuda: bool) -> BackendChoice:
    """The choice after `measure`: the optimizer follows the backend that won."""
    reason = (
        f"measured {figures['torch_ms']:.1f} ms/step with PyTorch and {figures['ort_ms']:.1f} ms/step "
        f"with ORT on this job's model and batch; kept {used}"
    )
    out = replace(choice, used=used, reason=reason, figures=figures)
    return _with_optimizer(out, "adamw_ort_fused", cuda=cuda) if choice.ort_optim else out


def measure(
    model: Any, batch: dict[str, Any], *, steps: int = 3, log_level: str = "WARNING"
) -> dict[str, Any]:
    """Time forward+backward of PyTorch and ORTModule on the same model and batch.

    No optimizer step is taken and gradients are cleared, so the model is unchanged; the RNG state is
    restored, so training draws the same dropout masks as it would have. The ORTModule built here is
    returned for reuse, so its export is not paid twice.
    """
    import torch

    from trainer_core.ort_trainer import wrap

    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def timed(module: Any) -> float:
        module(**batch).loss.backward()  # warm-up: allocations, and ORT's export and graph build
        start = time.perf_counter()
        for _ in range(steps):
            module(**batch).loss.backward()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps * 1000

    t0 = time.perf_counter()
    torch_ms = timed(model)
    ort_module = wrap(model, log_level)
    ort_ms = timed(ort_module)
    model.zero_grad(set_to_none=True)
    torch.set_rng_state(rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)
    return {
        "torch_ms": torch_ms,
        "ort_ms": ort_ms,
        "steps": steps,
        "batch_shape": list(batch["input_ids"].shape),
        "cost_s": time.perf_counter() - t0,
        "ort_module": ort_module,
    }

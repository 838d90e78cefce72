"""Which engine runs forward/backward, and why: decided before training and recorded on the job.

`torch` is plain PyTorch. `ort` asks for ONNX Runtime training's ORTModule and fails the job, with the
reason, when it cannot run. `auto` measures both on the job's own model, device, precision and first batches
when ORT can run (see `measure`) and keeps ORT only when it is clearly faster; when ORT cannot run it trains
with PyTorch and says why. The decision is made once per job and kept by later attempts. Never silent.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
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
    """None when ORTModule can train this spec here, otherwise why not: what the job is first (its method,
    an adapter), then how it runs (its precision)."""
    if spec.hyperparameters.gradient_checkpointing:
        return (
            "gradient checkpointing runs under PyTorch: ORTModule exports one graph and plans its own memory"
        )
    if spec.method_info.ort_problem is not None:
        return spec.method_info.ort_problem
    if spec.packing:
        return (
            "packed sequences train under PyTorch: their attention mask is built from the position ids at "
            "run time, which is not verified under ORTModule in ortune"
        )
    if (unfit := _precision_problem(spec, cuda=cuda)) is not None:
        return unfit
    from trainer_core.engine import ort_setup

    if (broken := ort_setup.reason_if_broken()) is not None:
        return broken
    try:
        from trainer_core.engine import ort_compat

        ort_compat.apply()
        import onnxruntime.training.ortmodule  # noqa: F401
    except Exception as exc:  # an ImportError, or whatever a broken ORT build raises on import
        return f"onnxruntime-training's ORTModule does not import: {type(exc).__name__}: {exc}"
    return None


def _precision_problem(spec: TrainingSpec, *, cuda: bool) -> str | None:
    if not cuda and spec.precision in ("bf16", "fp16"):
        return f"ORT training on CPU runs fp32 only, and this job trains in {spec.precision}"
    return None


def choose(spec: TrainingSpec, *, cuda: bool) -> BackendChoice:
    """The backend for `spec`, whose precision is already decided (trainer_core/engine/precision.py)."""
    problem = None if spec.backend == "torch" else ort_problem(spec, cuda=cuda)
    if spec.backend == "ort" and problem:
        raise BackendUnavailable(problem)
    kept = spec.backend_decided if spec.backend == "auto" else None
    if spec.backend == "torch":
        choice = BackendChoice("torch", "torch")
    elif kept is not None and not (kept["used"] == "ort" and problem):
        why = "decided by this job's first attempt; kept so the engine never changes mid-job"
        reason = kept["reason"] if why in kept["reason"] else f"{kept['reason']} ({why})"  # a third attempt
        choice = BackendChoice("auto", kept["used"], reason)
    elif problem and problem == _precision_problem(spec, cuda=cuda):
        choice = BackendChoice("auto", "torch", f"PyTorch: {problem}")  # the precision's choice, not a fault
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
    if optim == "auto":  # torch's fused AdamW: one kernel per parameter group, on CPU and CUDA alike
        return replace(choice, optim="adamw_torch_fused")
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


# ORT is kept only when its expected cost (steps plus its export) is this much below PyTorch's: the median of
# a few interleaved rounds moves by a few percent between runs on a shared machine (bench/train_backends
# prints the spread), and within that band the simpler engine is the better bet.
MARGIN = 0.05
# ORTModule's export and graph build took at least this long for the smallest model here; a job whose
# measuring budget is below it is not measured, since ORT could not pay that back.
ORT_SETUP_FLOOR_S = 2.0
MAX_ROUNDS = 7


def measure(
    model: Any,
    batches: list[dict[str, Any]],
    *,
    micro_steps: int,
    autocast_dtype: Any = None,
    budget_fraction: float = 0.03,
    log_level: str = "WARNING",
) -> dict[str, Any]:
    """Time forward+backward with PyTorch (SDPA attention) and ORTModule (eager attention, which ORT's
    gradient builder needs) on the job's model, device, precision and first batches, in interleaved rounds.

    Spends at most `budget_fraction` of the job's expected time (`micro_steps` forward+backward passes at
    PyTorch's speed); when that budget cannot cover ORT's export, ORT is not tried. No optimizer step is
    taken and gradients are cleared, so the model is unchanged; the RNG state is restored, so training draws
    the same dropout masks as it would have. `used` is the winner; the winner's module is returned in
    `ort_module` when it is ORT (so its export is not paid twice), the loser's memory is freed, and the
    model is left with the attention the winner needs."""
    import statistics

    import torch

    from trainer_core.engine.ort_trainer import wrap

    device = next(model.parameters()).device
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    step = _step_timer(device, autocast_dtype)

    t0 = time.perf_counter()
    _set_attention(model, "sdpa")
    step(model, batches[0])  # warm-up: allocations, kernel choice
    torch_times = [step(model, batches[0])]
    expected_s = torch_times[0] / 1000 * micro_steps
    budget_s = budget_fraction * expected_s
    figures: dict[str, Any] = {
        "expected_job_s": round(expected_s, 2),
        "budget_s": round(budget_s, 2),
        # the model's first input: token ids, pixel values, audio samples or log-mel features
        "batch_shape": list(next(v for k, v in batches[0].items() if k != "labels").shape),
        "margin": MARGIN,
    }
    if budget_s < ORT_SETUP_FLOOR_S:
        model.zero_grad(set_to_none=True)
        return figures | _unmeasured(torch_times[0], expected_s, budget_fraction, time.perf_counter() - t0)
    _set_attention(model, "eager")
    ort_module = wrap(model, log_level)
    setup = time.perf_counter()
    step(ort_module, batches[0])  # ORT's export and graph build
    export_s = time.perf_counter() - setup
    ort_times = _interleaved(
        model, ort_module, step, batches, torch_times, lambda: time.perf_counter() - t0 > budget_s
    )
    model.zero_grad(set_to_none=True)
    torch.set_rng_state(rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)
    figures |= _verdict(
        statistics.median(torch_times[1:]), statistics.median(ort_times), export_s, micro_steps
    )
    figures["rounds"] = len(ort_times)
    _keep_winner(model, ort_module, figures)
    figures["cost_s"] = time.perf_counter() - t0
    return figures


def _keep_winner(model: Any, ort_module: Any, figures: dict[str, Any]) -> None:
    """The model left with the attention the winner needs; ORT's module handed on, or its memory freed."""
    import gc

    if figures["used"] == "ort":
        figures["ort_module"] = ort_module
        _set_attention(model, "eager")
    else:
        del ort_module
        gc.collect()
        _set_attention(model, "sdpa")


def _unmeasured(torch_ms: float, expected_s: float, budget_fraction: float, cost_s: float) -> dict[str, Any]:
    return {
        "torch_ms": torch_ms,
        "cost_s": cost_s,
        "used": "torch",
        "reason": (
            f"this job is expected to train for {expected_s:.0f}s with PyTorch; measuring ORT (its export "
            f"alone takes over {ORT_SETUP_FLOOR_S:.0f}s) would cost more than {budget_fraction:.0%} of that, "
            "so kept torch"
        ),
    }


def _step_timer(device: Any, autocast_dtype: Any) -> Callable[[Any, dict[str, Any]], float]:
    """One forward and backward of a module on a batch, in milliseconds (the device synchronised)."""
    import torch

    def step(module: Any, batch: dict[str, Any]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = module(**batch).loss
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1000

    return step


def _interleaved(
    model: Any,
    ort_module: Any,
    step: Callable[[Any, dict[str, Any]], float],
    batches: list[dict[str, Any]],
    torch_times: list[float],
    over_budget: Callable[[], bool],
) -> list[float]:
    """ORT's step times, a PyTorch step after each (appended to `torch_times`): interleaved, so drift on a
    shared machine hits both alike; at least three rounds, then until the budget is spent."""
    ort_times: list[float] = []
    for i in range(MAX_ROUNDS):
        batch = batches[i % len(batches)]
        _set_attention(model, "eager")
        ort_times.append(step(ort_module, batch))
        _set_attention(model, "sdpa")
        torch_times.append(step(model, batch))
        if i >= 2 and over_budget():
            break
    return ort_times


def _verdict(torch_ms: float, ort_ms: float, export_s: float, micro_steps: int) -> dict[str, Any]:
    """Which engine trains the job faster, its export counted, and why, as the job records it."""
    torch_cost = torch_ms / 1000 * micro_steps
    ort_cost = ort_ms / 1000 * micro_steps + export_s
    used = "ort" if ort_cost < torch_cost * (1 - MARGIN) else "torch"
    return {
        "torch_ms": torch_ms,
        "ort_ms": ort_ms,
        "ort_export_s": round(export_s, 2),
        "torch_expected_s": round(torch_cost, 1),
        "ort_expected_s": round(ort_cost, 1),
        "used": used,
        "reason": (
            f"measured {torch_ms:.1f} ms/step with PyTorch and {ort_ms:.1f} ms/step with ORT (plus "
            f"{export_s:.1f}s of export) on this job's model, device and batches: {torch_cost:.0f}s against "
            f"{ort_cost:.0f}s for the job; ORT is kept only when {MARGIN:.0%} faster; kept {used}"
        ),
    }


def _set_attention(model: Any, implementation: str) -> None:
    if model.config._attn_implementation != implementation:
        model.set_attn_implementation(implementation)


def decided(choice: BackendChoice, figures: dict[str, Any], cuda: bool) -> BackendChoice:
    """The choice after `measure`: the optimizer follows the backend that won."""
    used = figures["used"]
    kept = {k: v for k, v in figures.items() if k not in ("ort_module", "used", "reason")}
    out = replace(choice, used=used, reason=figures["reason"], figures=kept)
    return _with_optimizer(out, "adamw_ort_fused", cuda=cuda) if choice.ort_optim else out

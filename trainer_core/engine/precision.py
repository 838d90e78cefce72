"""Which number format training computes in, and why: decided before the model loads, recorded on the job.

`auto` (the default) trains in bf16 mixed precision where the device computes bf16 natively (a CUDA GPU of
compute capability 8.0 or later; a CPU with AMX or AVX512-BF16) and in fp32 elsewhere. Mixed precision means
fp32 master weights and optimizer state with bf16 autocast compute, so the model the job saves is fp32 either
way. `fp32`, `bf16` and `fp16` are taken as asked; fp16 needs CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer_core.spec import TrainingSpec


class PrecisionUnavailable(ValueError):
    """The precision asked for cannot run on this device; the message says why."""


@dataclass(frozen=True)
class PrecisionChoice:
    requested: str
    used: str  # "fp32", "bf16" or "fp16"
    reason: str


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def native_bf16(*, cuda: bool, flags: set[str] | None = None) -> str | None:
    """Why this device computes bf16 natively, or None when it does not."""
    if cuda:
        import torch

        major, minor = torch.cuda.get_device_capability()
        if major >= 8:
            name = torch.cuda.get_device_name()
            return f"{name} (compute capability {major}.{minor}) has bf16 tensor cores"
        return None
    flags = cpu_flags() if flags is None else flags
    if "amx_bf16" in flags:
        return "this CPU has AMX bf16 tiles (amx_bf16)"
    if "avx512_bf16" in flags:
        return "this CPU has AVX512-BF16 instructions (avx512_bf16)"
    return None


def choose(spec: TrainingSpec, *, cuda: bool, flags: set[str] | None = None) -> PrecisionChoice:
    asked = spec.precision
    if asked == "fp16" and not cuda:
        raise PrecisionUnavailable("precision fp16 needs a CUDA GPU; this worker has none (use fp32 or bf16)")
    if asked != "auto":
        return PrecisionChoice(asked, asked, f"{asked} as requested")
    if spec.backend == "ort" and not cuda:
        # ORTModule on CPU builds fp32 graphs only; asking for ORT is asking for what it can run
        return PrecisionChoice("auto", "fp32", "fp32: backend ort on CPU trains in fp32 only")
    why = native_bf16(cuda=cuda, flags=flags)
    if why is None:
        device = "GPU" if cuda else "CPU"
        return PrecisionChoice("auto", "fp32", f"fp32: this {device} has no native bf16")
    return PrecisionChoice("auto", "bf16", f"bf16 mixed precision (fp32 master weights): {why}")

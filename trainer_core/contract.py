"""The contract between the worker and the trainer process it launches: exit codes, the JSON-lines events
the trainer writes on stdout, the die-with-parent setup and reading the end of a trainer's log.

The trainer owns this protocol and the worker imports it from here: it imports nothing but the standard
library, so the worker can read it without torch, and trainer_core never reaches into the service.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections import deque
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict

# `python -m trainer_core.engine.launch spec.json` exits with:
EXIT_OK = 0  # trained, saved and exported
EXIT_FAILED = 1  # anything else went wrong; an `error` event says what where it could
EXIT_SPEC_ERROR = 2  # the spec cannot run here (bad spec, backend unavailable, model will not load)
EXIT_STOPPED = 3  # a SIGTERM stopped it after saving a checkpoint (a pause or a drain)

EventType = Literal[
    "metrics", "progress", "message", "backend", "checkpoint", "artifact", "result", "stopped", "error"
]


class Event(TypedDict):
    """What every event carries; `time` is the trainer's clock (seconds since the epoch)."""

    type: EventType
    time: float


class MetricsEvent(Event):
    step: int
    total_steps: int | None
    # plus any of the series the relay charts: train_loss, eval_loss, eval_accuracy, learning_rate, ...


class ProgressEvent(Event):
    step: int
    total_steps: int | None


class MessageEvent(Event):
    level: Literal["info", "warn", "error"]
    message: str
    data: NotRequired[dict[str, Any]]


class BackendEvent(Event):
    requested: str
    used: str
    reason: str | None
    optim: str
    optim_note: str | None
    figures: dict[str, Any]


class CheckpointEvent(Event):
    step: int
    path: str
    metrics: dict[str, Any]


class ArtifactEvent(Event):
    format: Literal["pytorch", "onnx", "adapter"]
    path: str
    manifest: dict[str, Any]


class ResultEvent(Event):
    metrics: dict[str, float]
    steps: int
    trained_tokens: int
    onnx_max_abs_diff: float | None
    # formats that could not be made, with the reason (a failed ONNX export); the job keeps the others
    failed_artifacts: NotRequired[dict[str, str]]


class StoppedEvent(Event):
    """Training stopped on request at `step`, after its checkpoint was saved."""

    step: int


class ErrorEvent(Event):
    code: str
    message: str


def die_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when its parent goes (PR_SET_PDEATHSIG), so a killed worker or
    torchrun never leaves a trainer holding a device. False where the call is unavailable."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        return False
    return True


def log_tail(path: Path, lines: int = 6, chars: int = 800) -> str:
    """The last `lines` lines of a log, at most `chars` characters: what a failed trainer said last."""
    with contextlib.suppress(OSError), path.open(errors="replace") as fh:
        return "".join(deque(fh, maxlen=lines)).strip()[-chars:]
    return ""


def user_cache(name: str) -> Path:
    """This user's folder for what ortune builds once and keeps across jobs and environments (the XDG base
    directory rule: $XDG_CACHE_HOME, else ~/.cache)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ortune" / name

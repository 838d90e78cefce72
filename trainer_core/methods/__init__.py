"""The method registry: how a job learns, in one torch-free table beside the task registry (tasks.py).

A row says which rows a method trains on, which tasks it can train, how many store rows one example lays
out (a preference pair is two: preferred, then not), why ONNX Runtime cannot run it, and the function that
builds its Trainer. The spec's options for each method are `spec.Supervised`, `spec.Dpo`, ..., a tagged
union on `type`; tests/trainer_core/test_registries.py holds that union to this table.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from trainer_core.data.rows import KINDS, MEDIA_KINDS
from trainer_core.tasks import NAMES as TASK_NAMES


@dataclass(frozen=True)
class MethodInfo:
    name: str
    row_kinds: tuple[str, ...]
    tasks: tuple[str, ...]
    trainer: str  # "module:function" building its Trainer (trainer_core/engine/trainer.py's signature)
    rows_per_example: int = 1
    example: str = "rows"  # what one example is called in messages ("pairs")
    ort_problem: str | None = None  # why ORTModule cannot train it; None: it can
    own_loss: bool = False  # a loss of its own (a mean), not the task's token-summed one
    hint: str = ""  # the method option a user gives to train this method's rows, for refusals

    def load(self, attribute: str) -> Any:
        module, _, name = str(getattr(self, attribute)).partition(":")
        return getattr(importlib.import_module(module), name)


METHODS: dict[str, MethodInfo] = {
    info.name: info
    for info in (
        MethodInfo(
            "supervised",
            row_kinds=tuple(k for k in (*KINDS, *MEDIA_KINDS) if k != "preference"),
            tasks=TASK_NAMES,
            trainer="trainer_core.engine.trainer:supervised_trainer",
            hint='{"type": "supervised"}',
        ),
        MethodInfo(
            "dpo",
            row_kinds=("preference",),
            tasks=("causal-lm",),
            trainer="trainer_core.engine.trainer:dpo_trainer",
            rows_per_example=2,
            example="pairs",
            own_loss=True,
            ort_problem="DPO trains under PyTorch: TRL's DPOTrainer runs a reference model beside the policy",
            hint='{"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1}}}',
        ),
    )
}
NAMES: tuple[str, ...] = tuple(METHODS)


class UnknownMethod(LookupError):
    pass


def get(name: str) -> MethodInfo:
    try:
        return METHODS[name]
    except KeyError:
        raise UnknownMethod(f"unknown method {name!r} (one of {', '.join(NAMES)})") from None


def for_rows(kind: str | None) -> MethodInfo | None:
    """The method that trains a file of this kind of rows, when exactly one does (for refusals)."""
    found = [m for m in METHODS.values() if kind in m.row_kinds]
    return found[0] if len(found) == 1 else None

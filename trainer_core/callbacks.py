"""A Trainer callback that turns the Trainer's own logs and saves into events."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from trainer_core import ranks
from trainer_core.events import EventStream

METRIC_NAMES = {
    "loss": "train_loss",
    "learning_rate": "learning_rate",
    "grad_norm": "grad_norm",
    "epoch": "epoch",
}


class EventCallback(TrainerCallback):
    def __init__(
        self, events: EventStream, samples_per_step: int, padding: Callable[[], float | None] | None = None
    ) -> None:
        self.events = events
        self.samples_per_step = samples_per_step
        self.padding = padding  # the padding fraction of the batches since the last log
        self._t0 = 0.0
        self._step0 = 0

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._t0, self._step0 = time.perf_counter(), state.global_step
        self.events.emit("phase", name="training")
        self.events.emit("progress", step=state.global_step, total_steps=state.max_steps)
        self.events.message(f"training started: {state.max_steps} steps, {args.num_train_epochs:g} epoch(s)")

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kw: Any,
    ) -> None:
        if not logs:
            return
        values: dict[str, float] = {}
        for key, value in logs.items():
            if not isinstance(value, int | float):
                continue
            if key.startswith("eval_"):
                if key in ("eval_loss", "eval_accuracy"):
                    values[key] = float(value)
            elif key in METRIC_NAMES:
                values[METRIC_NAMES[key]] = float(value)
        elapsed = time.perf_counter() - self._t0
        done = state.global_step - self._step0
        if "train_loss" in values and elapsed > 0 and done > 0:
            values["samples_per_second"] = done * self.samples_per_step / elapsed
        if "train_loss" in values and self.padding is not None and (fraction := self.padding()) is not None:
            values["padding_fraction"] = fraction
        if set(values) - {"epoch"}:
            self.events.emit("metrics", step=state.global_step, total_steps=state.max_steps, **values)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.events.emit("phase", name="export")

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        path = f"{args.output_dir}/checkpoint-{state.global_step}"
        self.events.emit(
            "checkpoint",
            step=state.global_step,
            path=path,
            metrics={"step": state.global_step, **(state.log_history[-1] if state.log_history else {})},
        )


class StopOnRequest(TrainerCallback):
    """SIGTERM (a pause, or a node going down): save a checkpoint at the end of the current step and stop.

    The handler only sets a flag; the Trainer saves at a step boundary, where model, optimizer, scheduler,
    RNG and data position are consistent."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> StopOnRequest:
        signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        # Under torchrun only rank 0 is signalled (a pause): the ranks vote each step, so all of them save
        # the same step (ZeRO-1 saves a shard on each) and stop together.
        self.requested = ranks.any_rank(self.requested)
        if self.requested:
            control.should_save = True
            control.should_training_stop = True

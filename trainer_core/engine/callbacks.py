"""A Trainer callback that turns the Trainer's own logs and saves into events."""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from trainer_core.engine import ranks
from trainer_core.events import EventStream

METRIC_NAMES = {
    "loss": "train_loss",
    "learning_rate": "learning_rate",
    "grad_norm": "grad_norm",
    "epoch": "epoch",
    # DPO (TRL): the implicit reward's margin and how often it ranks the preferred answer first
    "rewards/margins": "reward_margin",
    "rewards/accuracies": "reward_accuracy",
}
EVAL_NAMES = {
    "eval_loss": "eval_loss",
    "eval_accuracy": "eval_accuracy",
    "eval_wer": "eval_wer",  # speech recognition: greedy transcripts of held-out clips (speech.py)
    "eval_rewards/margins": "eval_reward_margin",
    "eval_rewards/accuracies": "eval_reward_accuracy",
    "eval_preference_accuracy": "eval_preference_accuracy",  # trainer_core/methods/dpo.py
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
                if key in EVAL_NAMES:
                    values[EVAL_NAMES[key]] = float(value)
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


class CheckpointPacing(TrainerCallback):
    """A floor on the time between periodic checkpoints: a job asking for one every step of a fast model
    would spend its time, and the store's, on checkpoints. A checkpoint asked for sooner than `min_seconds`
    after the last is skipped; the last step's, and a pause's (StopOnRequest runs after this and asks
    again), never are. The ranks vote, so all of them skip or save the same step."""

    def __init__(self, min_seconds: float, events: EventStream) -> None:
        self.min_seconds, self.events = min_seconds, events
        self.last = time.monotonic()
        self.skipped = 0

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if not control.should_save or self.min_seconds <= 0:  # the same on every rank: step-based
            return
        soon = time.monotonic() - self.last < self.min_seconds and state.global_step < state.max_steps
        if ranks.any_rank(soon):
            control.should_save = False
            if not self.skipped and ranks.rank() == 0:
                self.events.message(
                    f"Checkpoint at step {state.global_step} skipped: the last was taken less than "
                    f"{self.min_seconds:g} s ago, the minimum interval here; checkpoints come at most "
                    "that often",
                    level="warn",
                    step=state.global_step,
                )
            self.skipped += 1
            return
        self.last = time.monotonic()


class Diverged(RuntimeError):
    """Training produced a loss or gradient that is not a number: the weights are lost from there on."""


class DivergenceGuard(TrainerCallback):
    """Fails the job at the first step whose loss or gradient norm is NaN or infinite, naming the step and
    the precision, instead of training on (and exporting) weights that are no longer numbers. fp16 is left
    alone: its loss scaler skips such steps by design."""

    def __init__(self, precision: str) -> None:
        self.precision = precision

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kw: Any,
    ) -> None:
        if self.precision == "fp16" or not logs:
            return
        for key in ("loss", "grad_norm"):
            value = logs.get(key)
            if isinstance(value, int | float) and not math.isfinite(value):
                raise Diverged(
                    f"training diverged at step {state.global_step}: its {key.replace('_', ' ')} is {value} "
                    f"(precision {self.precision}, learning rate {args.learning_rate:g}); a lower "
                    "learning_rate_multiplier, or precision fp32, trains it in finite numbers"
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

"""The one validated spec per job. The API builds it from a request; `launch` reads it from spec.json.

Unknown keys are rejected everywhere (`extra="forbid"`), so a typo is an error naming the field, not a
silently ignored option.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer_core import methods, tasks

# The task and method registries' names as types (tests/trainer_core/test_registries.py keeps them equal).
Task = Literal[
    "sequence-classification",
    "causal-lm",
    "image-classification",
    "audio-classification",
    "automatic-speech-recognition",
]
FileFormat = Literal["jsonl", "csv", "zip", "tar"]  # zip and tar: image and audio archives
Backend = Literal["torch", "ort", "auto"]
Optim = Literal["auto", "adamw_torch", "adamw_torch_fused", "adamw_ort_fused"]
Precision = Literal["auto", "fp32", "fp16", "bf16"]
Auto = Literal["auto"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Hyperparameters(Strict):
    """OpenAI's three ("auto" or a value) plus the knobs a Trainer user expects."""

    n_epochs: Annotated[int, Field(ge=1, le=100)] | Auto = "auto"
    batch_size: Annotated[int, Field(ge=1, le=4096)] | Auto = "auto"
    learning_rate_multiplier: Annotated[float, Field(gt=0, le=100)] | Auto = "auto"
    learning_rate: Annotated[float, Field(gt=0, lt=1)] | None = None
    max_steps: Annotated[int, Field(ge=1)] | None = None
    # None: 128 tokens for a classifier, 2,048 for a causal LM (chat rows are long); a model whose tokenizer
    # says it reads fewer cuts there.
    max_seq_length: Annotated[int, Field(ge=8, le=8192)] | None = None
    warmup_ratio: Annotated[float, Field(ge=0, lt=1)] = 0.0
    weight_decay: Annotated[float, Field(ge=0, lt=1)] = 0.0
    eval_every_steps: Annotated[int, Field(ge=1)] | None = None
    gradient_accumulation_steps: Annotated[int, Field(ge=1, le=1024)] = 1
    # Recompute activations in the backward pass instead of keeping them: less memory for long sequences,
    # about a third more compute.
    gradient_checkpointing: bool = False
    # A causal-LM row whose every loss token max_seq_length cuts is left out and named in a warning
    # ("drop"), or fails the job naming its lines ("refuse"). A file of nothing else always fails.
    truncated_rows: Literal["drop", "refuse"] = "drop"

    def resolved(self, n_rows: int, task: str | None = None) -> ResolvedHyperparameters:
        """The values a job trains with; max_seq_length by the task when not given (tasks.py)."""
        max_length = tasks.get(task).max_length if task else tasks.DEFAULT_MAX_LENGTH
        batch = self.batch_size if self.batch_size != "auto" else max(1, min(16, n_rows // 8 or 1))
        epochs = self.n_epochs if self.n_epochs != "auto" else 3
        base_lr = 5e-5 if self.learning_rate is None else self.learning_rate
        mult = 1.0 if self.learning_rate_multiplier == "auto" else self.learning_rate_multiplier
        return ResolvedHyperparameters(
            n_epochs=epochs,
            batch_size=batch,
            learning_rate=base_lr * mult,
            max_steps=self.max_steps,
            max_seq_length=self.max_seq_length or max_length,
            warmup_ratio=self.warmup_ratio,
            weight_decay=self.weight_decay,
            eval_every_steps=self.eval_every_steps,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            gradient_checkpointing=self.gradient_checkpointing,
            truncated_rows=self.truncated_rows,
        )


class Lora(Strict):
    """A LoRA adapter (PEFT) instead of full fine-tuning: the base frozen, low-rank updates trained."""

    r: Annotated[int, Field(ge=1, le=256)] = 8
    alpha: Annotated[int, Field(ge=1, le=1024)] = 16
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.05
    # module names, or "all-linear": every linear layer but the output head
    target_modules: list[Annotated[str, Field(min_length=1, max_length=128)]] | Literal["all-linear"] = (
        "all-linear"
    )


class Supervised(Strict):
    """Supervised fine-tuning on the rows' own targets: labels, completions, assistant turns."""

    type: Literal["supervised"] = "supervised"
    packing: bool = False  # short causal-LM rows packed into full sequences (data.Packed)


class Dpo(Strict):
    """Direct preference optimisation (TRL's DPOTrainer) on preference pairs instead of supervised targets."""

    type: Literal["dpo"] = "dpo"
    # how strongly the model is held to its reference (the base it started from): higher stays closer
    beta: Annotated[float, Field(gt=0, le=10)] = 0.1


# One entry per row of trainer_core/methods/__init__.py, told apart by `type`.
Method = Annotated[Supervised | Dpo, Field(discriminator="type")]


def method_from_v1(data: Any) -> Any:
    """A version-1 spec's `dpo` and `packing` fields as the version-2 `method`, so stored specs load."""
    if not isinstance(data, dict) or "method" in data or not {"dpo", "packing"} & set(data):
        return data
    data = dict(data)
    dpo, packing = data.pop("dpo", None), data.pop("packing", False)
    data["method"] = {"type": "dpo", **dpo} if dpo is not None else {"type": "supervised", "packing": packing}
    return data


class ResolvedHyperparameters(Strict):
    n_epochs: int
    batch_size: int
    learning_rate: float
    max_steps: int | None
    max_seq_length: int
    warmup_ratio: float
    weight_decay: float
    eval_every_steps: int | None
    gradient_accumulation_steps: int
    gradient_checkpointing: bool = False
    truncated_rows: Literal["drop", "refuse"] = "drop"


class Distributed(Strict):
    nodes: Annotated[int, Field(ge=1, le=1024)] = 1
    procs_per_node: Annotated[int, Field(ge=1, le=64)] = 1
    strategy: Literal["ddp", "zero1"] = "ddp"

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


class TrainingSpec(Strict):
    """Everything one training run needs, with paths already staged on the local disk."""

    job_id: str
    task: Task
    model: str = Field(description="Registry id of the base model.")
    model_path: str | None = Field(default=None, description="Local directory; None for a built model.")
    train_file: str
    train_format: FileFormat = "jsonl"
    validation_file: str | None = None
    validation_format: FileFormat = "jsonl"
    # Where the files' tokenized stores are (or are to be built): trainer_core/data/datastore.py.
    train_store: str | None = None
    validation_store: str | None = None
    train_rows: int | None = Field(default=None, description="Rows in the training file, for progress.")
    labels: list[str | int] = Field(default_factory=list)
    output_dir: str
    hyperparameters: ResolvedHyperparameters
    backend: Backend = "auto"
    optim: Optim = "auto"
    precision: Precision = "auto"
    # A decision an earlier attempt of this job made ({"used", "reason"}), kept so an engine never switches
    # mid-job: `backend_decided` for backend=auto.
    backend_decided: dict[str, str] | None = None
    # The share of the job's expected time `backend=auto` may spend measuring the engines (over 1 measures
    # even a job too short to pay for it: the tests do).
    auto_budget_fraction: Annotated[float, Field(gt=0)] = 0.03
    seed: int = 42
    lora: Lora | None = None
    method: Method = Supervised()
    checkpoint_every_steps: Annotated[int, Field(ge=1)] | None = None
    min_checkpoint_seconds: Annotated[float, Field(ge=0)] = 0.0  # the service's floor (callbacks.py)
    resume_from: str | None = None
    distributed_timeout_seconds: int = 120
    distributed: Distributed = Distributed()

    @model_validator(mode="before")
    @classmethod
    def _version_1(cls, data: Any) -> Any:
        return method_from_v1(data)

    @model_validator(mode="after")
    def _fits_task_and_method(self) -> TrainingSpec:
        if self.task_info.classifies and len(self.labels) < 2:
            raise ValueError(f"{self.task} needs at least two distinct labels in the training file")
        if self.task not in self.method_info.tasks:
            raise ValueError(f"method {self.method.type} trains {', '.join(self.method_info.tasks)}")
        if isinstance(self.method, Supervised) and self.method.packing and not self.task_info.token_loss:
            raise ValueError(f"packing joins rows into full sequences; a {self.task} job has nothing to pack")
        return self

    @property
    def task_info(self) -> tasks.TaskInfo:
        return tasks.get(self.task)

    @property
    def method_info(self) -> methods.MethodInfo:
        return methods.get(self.method.type)

    @property
    def packing(self) -> bool:
        return isinstance(self.method, Supervised) and self.method.packing

    @classmethod
    def load(cls, path: Path) -> TrainingSpec:
        return cls.model_validate_json(path.read_text())

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(self.model_dump(mode="json"), indent=2))

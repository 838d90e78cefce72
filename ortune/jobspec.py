"""The job spec as stored on a job row: what the API decided when it accepted the job, read by the API's
responses, the scheduler, the search and the worker that stages the trainer's own `TrainingSpec`.

Torch-free, strict (`extra="forbid"`) and versioned: rows written before `version` existed load as version 1;
version 2 holds the method as a tagged union (`method: {"type": "dpo", "beta": ...}`) where version 1 had
`dpo` and `packing` fields, and version-1 rows load into it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_serializer, model_validator

from ortune.integrations import MlflowIntegration
from ortune.search_space import HyperparameterSearch
from trainer_core.spec import (
    Backend,
    Distributed,
    Hyperparameters,
    Lora,
    Method,
    Optim,
    Precision,
    ResolvedHyperparameters,
    Supervised,
    Task,
    method_from_v1,
)


class BaseModelRef(BaseModel):
    """The stored model an `ft:` job continues from: an earlier job's merged PyTorch artifact, or one of its
    checkpoints (`ft:...:ckpt-step-N`, whose archive holds `checkpoint-N/` with weights and tokenizer)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str
    object_key: str
    sha256: str
    checkpoint_step: int | None = None


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[2] = 2
    task: Task
    labels: list[str | int] = []
    backend: Backend = "auto"
    optim: Optim = "auto"
    precision: Precision = "auto"
    checkpoint_every_steps: int | None = None
    keep_checkpoints: int = 3  # the last N checkpoints are kept in storage, and the best one
    lora: Lora | None = None  # an adapter instead of full fine-tuning
    method: Method = Supervised()
    base: BaseModelRef | None = None  # continuing from an earlier job's model (`model: ft:...`)
    distributed: Distributed = Distributed()
    # As the user asked, with OpenAI's "auto" values shown resolved (the job's `hyperparameters` field)...
    hyperparameters: Hyperparameters
    # ...as asked (only what was set, stored without defaults), and as the trainer gets them.
    requested_hyperparameters: Hyperparameters = Hyperparameters()
    resolved_hyperparameters: ResolvedHyperparameters
    hyperparameter_search: HyperparameterSearch | None = None
    integrations: list[MlflowIntegration] = []  # where else the run is logged (the worker does it)
    # A search trial's own parameters (a child job of a search).
    search_params: dict[str, float | int] | None = None

    @model_validator(mode="before")
    @classmethod
    def _version_1(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("version", 1) == 1:
            data = {**method_from_v1(data), "version": 2}
        return data

    @field_serializer("requested_hyperparameters")
    def _only_what_was_asked(self, hp: Hyperparameters) -> dict[str, Any]:
        return hp.model_dump(mode="json", exclude_defaults=True)

    @classmethod
    def build(cls, hp: Hyperparameters, n_rows: int, *, world_size: int = 1, **fields: Any) -> JobSpec:
        """A spec with `hp` resolved for a file of `n_rows` rows. An "auto" batch of a multi-process job is
        rounded up to a multiple of `world_size`, so that it splits over its processes."""
        resolved = hp.resolved(n_rows, fields.get("task"))
        shown = hp.model_dump(mode="json") | {
            "n_epochs": resolved.n_epochs,
            "batch_size": resolved.batch_size,
            "max_seq_length": resolved.max_seq_length,
            "learning_rate_multiplier": hp.learning_rate_multiplier,
        }
        if hp.batch_size == "auto" and world_size > 1:
            batch = -(-resolved.batch_size // world_size) * world_size
            resolved = resolved.model_copy(update={"batch_size": batch})
        return cls(
            hyperparameters=Hyperparameters(**shown),
            requested_hyperparameters=hp,
            resolved_hyperparameters=resolved,
            **fields,
        )

    def trial(self, params: dict[str, Any], n_rows: int) -> JobSpec:
        """The spec of a search trial: this search's spec with `params` in place of the searched values."""
        hp = Hyperparameters(**self.requested_hyperparameters.model_dump(exclude_defaults=True) | params)
        kept = self.model_dump(
            exclude={
                "hyperparameters",
                "requested_hyperparameters",
                "resolved_hyperparameters",
                "hyperparameter_search",
                "search_params",
                "version",
            }
        )
        return JobSpec.build(hp, n_rows, search_params=params, **kept)

    def training_fields(self) -> dict[str, Any]:
        """What the trainer's own `TrainingSpec` takes from this spec as it is."""
        return {
            "task": self.task,
            "labels": self.labels,
            "hyperparameters": self.resolved_hyperparameters,
            "backend": self.backend,
            "optim": self.optim,
            "precision": self.precision,
            "checkpoint_every_steps": self.checkpoint_every_steps,
            "distributed": self.distributed,
            "lora": self.lora,
            "method": self.method,
        }

    @property
    def is_search(self) -> bool:
        return self.hyperparameter_search is not None

    def stored(self) -> dict[str, Any]:
        """The JSON the job row holds."""
        return self.model_dump(mode="json")

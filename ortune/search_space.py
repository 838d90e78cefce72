"""What a hyperparameter search may ask for: the space, the metric, the trial budget. The API validates it
and the job spec stores it; the worker samples it (worker/search.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainer_core.spec import Hyperparameters

# What a search may vary: the knobs of `Hyperparameters` that change training, not the data or its shape.
SEARCHABLE = {
    "learning_rate": "float",
    "learning_rate_multiplier": "float",
    "warmup_ratio": "float",
    "weight_decay": "float",
    "n_epochs": "int",
    "batch_size": "int",
    "gradient_accumulation_steps": "int",
}
Metric = Literal["eval_loss", "eval_accuracy", "train_loss"]


class Dimension(BaseModel):
    """One axis of the space: `float`/`int` between `low` and `high` (optionally `log`), or `categorical`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["float", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: Annotated[list[float | int], Field(min_length=1, max_length=32)] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Dimension:
        if self.type == "categorical":
            if self.choices is None or self.low is not None or self.high is not None:
                raise ValueError("a categorical dimension takes `choices` and no `low`/`high`")
            return self
        if self.choices is not None or self.low is None or self.high is None:
            raise ValueError(f"a {self.type} dimension takes `low` and `high` and no `choices`")
        if self.low >= self.high:
            raise ValueError(f"low ({self.low:g}) must be below high ({self.high:g})")
        if self.log and self.low <= 0:
            raise ValueError("a log dimension needs low > 0")
        if self.type == "int" and (self.low != int(self.low) or self.high != int(self.high)):
            raise ValueError("an int dimension needs whole-number bounds")
        return self

    def values(self) -> list[float | int]:
        """The extreme values a trial can get, to check them against the hyperparameters' own limits."""
        if self.choices is not None:
            return list(self.choices)
        assert self.low is not None and self.high is not None
        cast = int if self.type == "int" else float
        return [cast(self.low), cast(self.high)]


class HyperparameterSearch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n_trials: Annotated[int, Field(ge=1, le=100)]
    space: Annotated[dict[str, Dimension], Field(min_length=1, max_length=len(SEARCHABLE))]
    metric: Metric = "eval_loss"
    direction: Literal["minimize", "maximize"] = "minimize"
    parallelism: Annotated[int, Field(ge=1, le=16)] = 1

    @field_validator("space")
    @classmethod
    def _space_fits_the_hyperparameters(cls, space: dict[str, Dimension]) -> dict[str, Dimension]:
        for name, dim in space.items():
            kind = SEARCHABLE.get(name)
            if kind is None:
                raise ValueError(f"{name} is not searchable; choose from {', '.join(sorted(SEARCHABLE))}")
            if kind == "int" and dim.type == "float":
                raise ValueError(f"{name} is a whole number; search it with type int or categorical")
            for value in dim.values():
                try:
                    Hyperparameters(**{name: value})
                except ValidationError as exc:
                    reason = exc.errors()[0]["msg"]
                    raise ValueError(f"{value!r} is not a valid {name} ({reason})") from None
        return space

    @model_validator(mode="after")
    def _parallelism_fits(self) -> HyperparameterSearch:
        if self.parallelism > self.n_trials:
            raise ValueError(f"parallelism ({self.parallelism}) is more than n_trials ({self.n_trials})")
        return self

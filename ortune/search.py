"""Hyperparameter search on the job machinery: each trial is a child job, Optuna proposes the next one.

The study is never kept anywhere but in the jobs table: every time a trial finishes, the search task
rebuilds an in-memory Optuna study from the children that finished (their parameters and metric), asks it
for the next parameters and creates the next child job, which goes through the same queue as any job. A
lost worker or a restarted broker therefore loses no search state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

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


@dataclass(frozen=True)
class Trial:
    """A child job as the study sees it: the parameters it ran with, and its metric once it succeeded."""

    job_id: str
    params: dict[str, Any]
    status: str
    value: float | None


def _distributions(search: HyperparameterSearch) -> dict[str, Any]:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out: dict[str, Any] = {}
    for name, dim in search.space.items():
        if dim.type == "categorical":
            out[name] = CategoricalDistribution(dim.choices or [])
        elif dim.type == "int":
            out[name] = IntDistribution(int(dim.low or 0), int(dim.high or 0), log=dim.log)
        else:
            out[name] = FloatDistribution(float(dim.low or 0), float(dim.high or 0), log=dim.log)
    return out


def suggest(search: HyperparameterSearch, seed: int, trials: list[Trial]) -> dict[str, Any]:
    """The next trial's parameters, from a study rebuilt out of the trials so far (TPE, seeded)."""
    import optuna
    from optuna.trial import TrialState, create_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    dists = _distributions(search)
    sampler = optuna.samplers.TPESampler(
        seed=seed + len(trials), n_startup_trials=max(1, min(10, search.n_trials // 2))
    )
    study = optuna.create_study(direction=search.direction, sampler=sampler)
    for t in trials:
        if t.status == "succeeded" and t.value is not None:
            study.add_trial(create_trial(params=t.params, distributions=dists, value=t.value))
        elif t.status in ("failed", "cancelled"):
            study.add_trial(create_trial(params=t.params, distributions=dists, state=TrialState.FAIL))
    return dict(study.ask(dists).params)


def best(search: HyperparameterSearch, trials: list[Trial]) -> Trial | None:
    scored = [t for t in trials if t.status == "succeeded" and t.value is not None]
    if not scored:
        return None
    pick = min if search.direction == "minimize" else max
    return pick(scored, key=lambda t: t.value)  # type: ignore[arg-type, return-value]


def with_hyperparameters(spec: dict[str, Any], hp: Hyperparameters, n_rows: int) -> dict[str, Any]:
    """A job spec with `hp` as asked (the "auto" values shown resolved, as OpenAI does) and as resolved."""
    resolved = hp.resolved(n_rows)
    shown = hp.model_dump(mode="json") | {
        "n_epochs": resolved.n_epochs,
        "batch_size": resolved.batch_size,
        "learning_rate_multiplier": hp.learning_rate_multiplier,
    }
    return spec | {
        "hyperparameters": shown,
        "requested_hyperparameters": hp.model_dump(mode="json", exclude_defaults=True),
        "resolved_hyperparameters": resolved.model_dump(mode="json"),
    }

"""A job's `integrations` (OpenAI's field): where else its run is logged. MLflow is what ortune speaks; a
Weights & Biases entry is taken in OpenAI's shape so that a refusal can name it (its service is on the
internet, which a self-hosted trainer should not need)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Name = Annotated[str, Field(min_length=1, max_length=250)]


class MlflowOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # the tracking server's REST address (`mlflow server`, or a managed one)
    tracking_uri: Annotated[str, Field(pattern=r"^https?://[^\s/]+(/\S*)?$", max_length=512)]
    experiment: Name = "ortune"  # created when it does not exist
    run_name: Name | None = None  # default: the job's id
    tags: Annotated[dict[Annotated[str, Field(max_length=250)], Name], Field(max_length=20)] = {}
    log_model: bool = True  # the PyTorch and ONNX models as the run's artifacts


class MlflowIntegration(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["mlflow"]
    mlflow: MlflowOptions


class Integration(BaseModel):
    """One entry of a job request's `integrations`. One model, not a tagged union, so that an error's
    location reads `integrations.0.mlflow.tracking_uri` (a union would insert its tag)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["mlflow", "wandb"]
    mlflow: MlflowOptions | None = None
    wandb: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _options_of_its_type(self) -> Integration:
        if self.type == "mlflow" and self.mlflow is None:
            raise ValueError(
                'type mlflow needs its options: "mlflow": {"tracking_uri": ..., "experiment": ...}'
            )
        return self

    def accepted(self) -> MlflowIntegration | None:
        """What the job keeps: its MLflow options (None for a wandb entry, which the API refuses)."""
        return MlflowIntegration(type="mlflow", mlflow=self.mlflow) if self.mlflow is not None else None


WANDB_REFUSED = (
    "wandb is not available on this server: Weights & Biases logs to its own service on the internet, "
    "which ortune's trainers do not reach. Log to an MLflow tracking server you run instead: "
    '{"type": "mlflow", "mlflow": {"tracking_uri": "http://mlflow:5000", "experiment": "..."}}'
)

"""Request and response bodies: OpenAI's fine-tuning shapes, with our extensions as extra fields."""

from __future__ import annotations

from datetime import datetime
from types import SimpleNamespace
from typing import Annotated, Any, Generic, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from api.method_schemas import Method, stored_method
from ortune.db.models import Artifact, Checkpoint, File, Job, JobEvent
from ortune.integrations import Integration
from ortune.search_space import HyperparameterSearch
from trainer_core.spec import (
    Backend,
    Distributed,
    Hyperparameters,
    Lora,
    Optim,
    Precision,
    Supervised,
    Task,
)
from trainer_core.spec import Method as TrainedMethod

T = TypeVar("T")


def ts(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())


class Page(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


class _HasId(Protocol):
    id: str


H = TypeVar("H", bound=_HasId)


def page(data: list[H], has_more: bool) -> Page[H]:
    """A cursor page with OpenAI's first_id/last_id filled from the data."""
    return Page(
        data=data,
        has_more=has_more,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    status_details: str | None = None
    row_kind: str | None = None
    row_count: int = 0
    sha256: str

    @classmethod
    def of(cls, f: File) -> FileObject:
        return cls(
            id=f.id,
            bytes=f.bytes,
            created_at=ts(f.created_at) or 0,
            filename=f.filename,
            purpose=f.purpose,
            status=f.status.value,
            status_details=f.status_details,
            row_kind=f.row_kind,
            row_count=f.row_count,
            sha256=f.sha256,
        )


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class ModelDeleted(BaseModel):
    id: str
    object: Literal["model"] = "model"
    deleted: bool = True


class JobCreate(BaseModel):
    """POST /v1/fine_tuning/jobs. Unknown fields are rejected by name."""

    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Field(min_length=1, max_length=255)]
    training_file: Annotated[str, Field(min_length=1, max_length=64)]
    validation_file: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    suffix: Annotated[str, Field(max_length=64, pattern=r"^[A-Za-z0-9_-]*$")] | None = None
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = None
    task: Task | None = None
    backend: Backend = "auto"
    optim: Optim = "auto"
    precision: Precision = "auto"
    checkpoint_every_steps: Annotated[int, Field(ge=1)] | None = None
    keep_checkpoints: Annotated[int, Field(ge=1, le=100)] = 3
    priority: Annotated[int, Field(ge=-100, le=100)] = 0
    distributed: Distributed | None = None
    hyperparameter_search: HyperparameterSearch | None = None
    integrations: Annotated[list[Integration], Field(max_length=4)] = []

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (len(value) > 16 or any(len(k) > 64 for k in value)):
            raise ValueError("at most 16 keys of at most 64 characters")
        return value

    def lora(self) -> Lora | None:
        options = self.method.options if self.method else None
        return options.lora if options else None

    def trained_method(self) -> TrainedMethod:
        """The method the trainer runs (supervised when the request names none)."""
        return self.method.trained() if self.method else Supervised()

    def effective_hyperparameters(self) -> Hyperparameters:
        options = self.method.options if self.method else None
        if options is not None and options.hyperparameters is not None:
            asked = options.hyperparameters.model_dump(exclude_unset=True, exclude={"beta"})
            return Hyperparameters(**asked)
        return self.hyperparameters or Hyperparameters()


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class Progress(BaseModel):
    step: int
    total_steps: int | None


class FineTuningJob(BaseModel):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    finished_at: int | None
    model: str
    fine_tuned_model: str | None
    organization_id: str = "org-ortune"
    result_files: list[str] = []
    status: str
    training_file: str
    validation_file: str | None
    hyperparameters: dict[str, Any]
    trained_tokens: int | None
    error: JobError | None
    seed: int
    suffix: str | None
    metadata: dict[str, str] | None
    estimated_finish: int | None = None
    integrations: list[Any] = []
    method: dict[str, Any]
    # extensions
    task: str
    backend: str
    backend_used: str | None
    backend_reason: str | None
    optim: str
    precision: str
    precision_used: str | None = None
    precision_reason: str | None = None
    keep_checkpoints: int
    priority: int
    attempt: int
    progress: Progress
    result: dict[str, Any] | None
    started_at: int | None
    hyperparameter_search: dict[str, Any] | None = None
    parent_job_id: str | None = None
    search_params: dict[str, Any] | None = None
    distributed: dict[str, Any] | None = None

    @classmethod
    def of(cls, job: Job | SimpleNamespace) -> FineTuningJob:
        spec = job.spec
        hp = spec.hyperparameters.model_dump(mode="json")
        # OpenAI's three, and the sequence length the job is cut at (an extra field: it decides what trains)
        openai_hp = {
            k: hp.get(k) for k in ("n_epochs", "batch_size", "learning_rate_multiplier", "max_seq_length")
        }
        return cls(
            id=job.id,
            created_at=ts(job.created_at) or 0,
            finished_at=ts(job.finished_at),
            model=job.model,
            fine_tuned_model=job.fine_tuned_model,
            status=job.status.value,
            training_file=job.training_file_id,
            validation_file=job.validation_file_id,
            hyperparameters=openai_hp,
            trained_tokens=job.trained_tokens,
            result_files=list((job.result or {}).get("result_files") or []),
            error=JobError(**job.error) if job.error else None,
            seed=job.seed,
            suffix=job.suffix,
            metadata=job.user_metadata,
            method=stored_method(spec, hp),
            task=job.task,
            backend=job.backend_requested,
            backend_used=job.backend_used,
            backend_reason=job.backend_reason,
            optim=spec.optim,
            precision=spec.precision,
            precision_used=getattr(job, "precision_used", None),
            precision_reason=getattr(job, "precision_reason", None),
            keep_checkpoints=spec.keep_checkpoints,
            priority=job.priority,
            attempt=job.attempt,
            progress=Progress(step=job.step, total_steps=job.total_steps),
            result=job.result,
            started_at=ts(job.started_at),
            hyperparameter_search=(
                spec.hyperparameter_search.model_dump(mode="json") if spec.hyperparameter_search else None
            ),
            parent_job_id=job.parent_id,
            search_params=spec.search_params,
            distributed=spec.distributed.model_dump(mode="json"),
            integrations=[i.model_dump(mode="json") for i in spec.integrations],
        )


class JobEventObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: str
    message: str
    type: str
    data: dict[str, Any] | None

    @classmethod
    def of(cls, e: JobEvent | SimpleNamespace) -> JobEventObject:
        return cls(
            id=f"ftevent-{e.id}",
            created_at=ts(e.created_at) or 0,
            level=e.level,
            message=e.message,
            type=e.type,
            data=e.data,
        )


class CheckpointObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: dict[str, Any]
    step_number: int
    bytes: int
    sha256: str

    @classmethod
    def of(cls, c: Checkpoint, base_model: str) -> CheckpointObject:
        return cls(
            id=c.id,
            created_at=ts(c.created_at) or 0,
            fine_tuned_model_checkpoint=f"ft:{base_model}:{c.job_id}:ckpt-step-{c.step}",
            fine_tuning_job_id=c.job_id,
            metrics=c.metrics or {"step": c.step},
            step_number=c.step,
            bytes=c.bytes,
            sha256=c.sha256,
        )


class ArtifactObject(BaseModel):
    format: str
    bytes: int
    sha256: str
    manifest: dict[str, Any]
    url: str

    @classmethod
    def of(cls, a: Artifact) -> ArtifactObject:
        return cls(
            format=a.format,
            bytes=a.bytes,
            sha256=a.sha256,
            manifest=a.manifest,
            url=f"/v1/fine_tuning/jobs/{a.job_id}/artifacts/{a.format}",
        )


class Series(BaseModel):
    steps: list[int]
    values: list[float]


class MetricsObject(BaseModel):
    object: Literal["fine_tuning.job.metrics"] = "fine_tuning.job.metrics"
    job_id: str
    data: dict[str, Series]
    downsampled: bool


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    tasks: list[str] = []

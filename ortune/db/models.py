"""Typed SQLAlchemy 2.0 models. Postgres is the source of truth; the broker only carries ids."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Boolean,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Mapped, mapped_column
from sqlalchemy.types import JSON, TypeDecorator, TypeEngine

from ortune.db.base import Base, BigCount, BigIntId, JSONType, UTCDateTime, utcnow
from ortune.jobspec import JobSpec


class FileStatus(enum.StrEnum):
    uploaded = "uploaded"
    processed = "processed"
    error = "error"


class JobStatus(enum.StrEnum):
    validating_files = "validating_files"
    queued = "queued"
    running = "running"
    paused = "paused"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled)


class JobSpecType(TypeDecorator[JobSpec]):
    """A job's spec: stored as JSON, read back as the validated `JobSpec`."""

    impl = JSON
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        return dialect.type_descriptor(JSONType)

    def process_bind_param(self, value: JobSpec | None, dialect: Dialect) -> dict[str, Any] | None:
        return None if value is None else value.stored()

    def process_result_value(self, value: Any, dialect: Dialect) -> JobSpec | None:
        return None if value is None else JobSpec.model_validate(value)


def _enum(cls: type[enum.Enum], name: str) -> Enum:
    # Stored as plain strings with a CHECK, so adding a value is a one-line migration on every backend.
    return Enum(
        cls,
        name=name,
        native_enum=False,
        create_constraint=True,
        length=32,
        values_callable=lambda e: [m.value for m in e],
    )


DEFAULT_TENANT = "default"


class Tenant(Base):
    """Who owns jobs and files. A deployment without API keys runs everything as the default tenant."""

    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    # Unfinished jobs (queued, running, paused) the tenant may hold at once; None: the deployment's limit.
    max_concurrent_jobs: Mapped[int | None] = mapped_column(Integer)
    # The highest job priority the tenant's jobs get (a higher one asked for is lowered to it); None: any.
    max_priority: Mapped[int | None] = mapped_column(Integer)
    # Bytes of uploads, checkpoints and models the tenant may keep in object storage; None: the
    # deployment's limit.
    max_storage_bytes: Mapped[int | None] = mapped_column(BigCount)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class APIKey(Base):
    """A bearer key, stored as its SHA-256 (keys are 32 random bytes, so a slow hash buys nothing)."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    prefix: Mapped[str] = mapped_column(String(24))  # shown in listings to tell keys apart
    sha256: Mapped[str] = mapped_column(String(64), unique=True)
    # An admin key manages its own tenant's keys; a platform key (admin too) manages every tenant, the
    # cluster's nodes and /metrics.
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    platform: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class IdempotencyKey(Base):
    """A client's Idempotency-Key on a create: a retry with the same key and body gets the same resource."""

    __tablename__ = "idempotency_keys"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    request_sha256: Mapped[str] = mapped_column(String(64))
    resource_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)


class File(Base):
    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_id_created_at", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id"), default=DEFAULT_TENANT, server_default=DEFAULT_TENANT
    )
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigCount)
    sha256: Mapped[str] = mapped_column(String(64))
    object_key: Mapped[str] = mapped_column(String(512))
    status: Mapped[FileStatus] = mapped_column(_enum(FileStatus, "file_status"))
    status_details: Mapped[str | None] = mapped_column(Text)
    row_kind: Mapped[str | None] = mapped_column(String(32))
    row_count: Mapped[int] = mapped_column(Integer, default=0)
    labels: Mapped[list[Any] | None] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    deleted: Mapped[bool] = mapped_column(default=False)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_created_at_id", "created_at", "id"),
        Index("ix_jobs_status", "status"),
        Index("ix_jobs_parent_id", "parent_id"),
        Index("ix_jobs_tenant_id_created_at", "tenant_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id"), default=DEFAULT_TENANT, server_default=DEFAULT_TENANT
    )
    model: Mapped[str] = mapped_column(String(255))
    task: Mapped[str] = mapped_column(String(64))
    training_file_id: Mapped[str] = mapped_column(ForeignKey("files.id"))
    validation_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"))
    status: Mapped[JobStatus] = mapped_column(_enum(JobStatus, "job_status"))
    spec: Mapped[JobSpec] = mapped_column(JobSpecType)
    suffix: Mapped[str | None] = mapped_column(String(64))
    seed: Mapped[int] = mapped_column(Integer)
    user_metadata: Mapped[dict[str, str] | None] = mapped_column("metadata", JSONType)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    backend_requested: Mapped[str] = mapped_column(String(16))
    backend_used: Mapped[str | None] = mapped_column(String(16))
    backend_reason: Mapped[str | None] = mapped_column(Text)
    # what the trainer computed in (fp32, bf16, fp16) and why: `precision: auto` decides per device
    precision_used: Mapped[str | None] = mapped_column(String(8))
    precision_reason: Mapped[str | None] = mapped_column(Text)
    fine_tuned_model: Mapped[str | None] = mapped_column(String(512))
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int | None] = mapped_column(Integer)
    trained_tokens: Mapped[int | None] = mapped_column(BigCount)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # The worker that holds the running attempt (host:pid); cleared when it lets go (finished, paused).
    worker: Mapped[str | None] = mapped_column(String(255))
    # When the job's task was last handed to the broker: the sweep sends it again if nobody took it.
    enqueued_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Attempts lost with their worker (no heartbeat); the sweep gives up at the max_attempts setting.
    lost_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Processes the job trains with (distributed.nodes x procs_per_node); above 1, the scheduler places it.
    world_size: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # A hyperparameter search's trials are jobs whose parent is the search job.
    parent_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))


class JobEvent(Base):
    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    level: Mapped[str] = mapped_column(String(8), default="info")
    type: Mapped[str] = mapped_column(String(16), default="message")
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSONType)


class JobMetric(Base):
    """One value of one named series at one step (long format: cheap to append, easy to downsample)."""

    __tablename__ = "job_metrics"
    __table_args__ = (UniqueConstraint("job_id", "name", "step"),)

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(64))
    step: Mapped[int] = mapped_column(Integer)
    value: Mapped[float] = mapped_column(Float)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "step"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    object_key: Mapped[str] = mapped_column(String(512))
    bytes: Mapped[int] = mapped_column(BigCount)
    sha256: Mapped[str] = mapped_column(String(64))
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    # A multi-process job's checkpoint also has a part per other node (its ranks' RNG state, and under
    # ZeRO their optimizer shards): the object keys, added as each node uploads its part.
    parts: Mapped[list[str] | None] = mapped_column(JSONType)
    # Each part's sha256 by its key: a part (under ZeRO, optimizer shards a resume unpickles) is checked
    # before it is unpacked, like the main archive.
    part_sha256: Mapped[dict[str, str] | None] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Artifact(Base):
    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("job_id", "format"),)

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    format: Mapped[str] = mapped_column(String(16))
    object_key: Mapped[str] = mapped_column(String(512))
    bytes: Mapped[int] = mapped_column(BigCount)
    sha256: Mapped[str] = mapped_column(String(64))
    manifest: Mapped[dict[str, Any]] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Node(Base):
    """A machine a worker runs on, with its devices (CUDA GPUs, or CPU slots where there is none)."""

    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    device_kind: Mapped[str] = mapped_column(String(8))  # cuda | cpu
    devices: Mapped[int] = mapped_column(Integer)
    address: Mapped[str] = mapped_column(String(255))  # where the other nodes of a job reach its rank 0
    queue: Mapped[str] = mapped_column(String(255))  # the worker's own queue, for the tasks of its ranks
    worker: Mapped[str] = mapped_column(String(255))
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Assignment(Base):
    """One device of one node given to one attempt of a job, at one node rank, until released.

    The partial unique index is the last word on double-booking: whatever a scheduler believes, the database
    refuses a second live assignment of the same device."""

    __tablename__ = "assignments"
    __table_args__ = (
        Index(
            "uq_assignments_live_device",
            "node_name",
            "device",
            unique=True,
            postgresql_where=text("released_at IS NULL"),
            sqlite_where=text("released_at IS NULL"),
        ),
        Index("ix_assignments_job_id_attempt", "job_id", "attempt"),
    )

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    node_name: Mapped[str] = mapped_column(ForeignKey("nodes.name", ondelete="CASCADE"))
    node_rank: Mapped[int] = mapped_column(Integer)
    device: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    released_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)

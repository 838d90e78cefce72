"""All SQL lives in these repositories, one module per aggregate; `reads` in `api/` is the API's hot path."""

from ortune.db.repositories.artifacts import ArtifactRepository, CheckpointRepository
from ortune.db.repositories.events import EventRepository, MetricRepository
from ortune.db.repositories.files import FileRepository
from ortune.db.repositories.idempotency import IdempotencyRepository
from ortune.db.repositories.jobs import JobRepository
from ortune.db.repositories.nodes import NodeRepository, never_fits
from ortune.db.repositories.tenants import KeyRepository, TenantExists, TenantRepository

__all__ = [
    "ArtifactRepository",
    "CheckpointRepository",
    "EventRepository",
    "FileRepository",
    "IdempotencyRepository",
    "JobRepository",
    "KeyRepository",
    "MetricRepository",
    "NodeRepository",
    "TenantExists",
    "TenantRepository",
    "never_fits",
]

from __future__ import annotations

import re
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse
from sqlalchemy.orm import Session

from api import reads
from api.auth import CallerDep
from api.deps import ReadDep, SessionDep, SettingsDep, StoreDep
from api.errors import ERRORS, APIError, NotFound
from api.schemas import (
    ArtifactObject,
    CheckpointObject,
    FineTuningJob,
    JobCreate,
    JobEventObject,
    MetricsObject,
    Page,
    Series,
    page,
)
from api.services import artifacts, idempotency, jobs
from ortune.db.base import new_id
from ortune.db.models import JobStatus
from ortune.db.repositories import (
    ArtifactRepository,
    CheckpointRepository,
    JobRepository,
    MetricRepository,
)

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"], responses=ERRORS)
Limit = Annotated[int, Query(ge=1, le=100)]


@router.post("", response_model=FineTuningJob)
def create_job(
    req: JobCreate,
    request: Request,
    response: Response,
    session: SessionDep,
    settings: SettingsDep,
    caller: CallerDep,
) -> FineTuningJob:
    """Create a fine-tuning job; it is queued once the request commits. With an `Idempotency-Key`, a retry
    of the same request returns the job the first one created."""
    claim = idempotency.claim(
        session,
        settings,
        caller,
        idempotency.key_of(request),
        endpoint="POST /v1/fine_tuning/jobs",
        digest=idempotency.fingerprint(req.model_dump(mode="json")),
        new_id=new_id("ftjob"),
    )
    if claim.existing is not None:
        idempotency.mark_replayed(response)
        return FineTuningJob.of(jobs.get(session, caller, claim.existing))
    return FineTuningJob.of(jobs.create(session, settings, caller, req, job_id=claim.resource_id))


METADATA_PARAM = re.compile(r"^metadata\[(?P<key>[^\[\]]{1,64})\]$")


def metadata_filter(request: Request) -> dict[str, str]:
    """OpenAI's `metadata[key]=value` query parameters (every pair must match); a malformed one is a 400."""
    pairs = {}
    for name, value in request.query_params.multi_items():
        if not name.startswith("metadata"):
            continue
        if (match := METADATA_PARAM.match(name)) is None:
            raise APIError(
                f"{name!r} is not a metadata filter: use metadata[key]=value (keys of 1 to 64 characters)",
                param=name,
            )
        pairs[match["key"]] = value
    return pairs


@router.get("", response_model=Page[FineTuningJob])
async def list_jobs(
    request: Request,
    read: ReadDep,
    caller: CallerDep,
    after: str | None = None,
    limit: Limit = 20,
    status: JobStatus | None = None,
) -> Page[FineTuningJob]:
    """List jobs, newest first, in cursor pages; `status=` and `metadata[key]=value` narrow the list."""
    metadata = metadata_filter(request)

    def work(session: Session) -> Page[FineTuningJob]:
        rows, more = JobRepository(session).list(
            tenant_id=caller.tenant_id, after=after, limit=limit, status=status, metadata=metadata
        )
        return page([FineTuningJob.of(j) for j in rows], more)

    return await read(work)


@router.get("/{job_id}", response_model=FineTuningJob)
async def retrieve_job(job_id: str, read: ReadDep, caller: CallerDep) -> FineTuningJob:
    """Retrieve a job with its status, progress and the backend that ran it."""
    job = await read.one(reads.JOB, job_id=job_id)
    if job is None or job.tenant_id != caller.tenant_id:
        raise jobs.not_found(job_id)
    return FineTuningJob.of(job)


@router.post("/{job_id}/cancel", response_model=FineTuningJob)
def cancel_job(job_id: str, session: SessionDep, settings: SettingsDep, caller: CallerDep) -> FineTuningJob:
    """Cancel a job that has not finished; a running one stops within seconds, a search with its trials."""
    return FineTuningJob.of(jobs.cancel(session, settings, caller, job_id))


@router.post("/{job_id}/pause", response_model=FineTuningJob)
def pause_job(job_id: str, session: SessionDep, settings: SettingsDep, caller: CallerDep) -> FineTuningJob:
    """Pause a queued or running job: a running one saves a checkpoint and frees its worker."""
    return FineTuningJob.of(jobs.pause(session, settings, caller, job_id))


@router.post("/{job_id}/resume", response_model=FineTuningJob)
def resume_job(job_id: str, session: SessionDep, settings: SettingsDep, caller: CallerDep) -> FineTuningJob:
    """Queue a paused job again; it continues from its latest checkpoint."""
    return FineTuningJob.of(jobs.resume(session, settings, caller, job_id))


@router.get("/{job_id}/trials", response_model=Page[FineTuningJob])
async def list_trials(job_id: str, read: ReadDep, caller: CallerDep) -> Page[FineTuningJob]:
    """A hyperparameter search's trials (child jobs), oldest first."""

    def work(session: Session) -> Page[FineTuningJob]:
        jobs.require(session, caller, job_id)
        return page([FineTuningJob.of(j) for j in JobRepository(session).children(job_id)], False)

    return await read(work)


@router.get("/{job_id}/events", response_model=Page[JobEventObject])
async def list_events(
    job_id: str, read: ReadDep, caller: CallerDep, after: str | None = None, limit: Limit = 20
) -> Page[JobEventObject]:
    """Events newest first; `after` is the id of the last event seen (ftevent-N)."""
    cursor = None
    if after is not None:
        raw = after.removeprefix("ftevent-")
        if not raw.isdigit():
            raise APIError(f"after must be an event id like ftevent-123, got {after!r}", param="after")
        cursor = int(raw)

    # what a dashboard's event feed polls: one statement on the driver itself (api.reads)
    if cursor is None:
        rows = await read.rows(reads.EVENTS, job_id=job_id, limit=limit + 1)
    else:
        rows = await read.rows(reads.EVENTS_BEFORE, job_id=job_id, after=cursor, limit=limit + 1)
    if not rows or rows[0].tenant_id != caller.tenant_id:
        raise jobs.not_found(job_id)
    events = [e for e in rows if e.id is not None]
    return page([JobEventObject.of(e) for e in events[:limit]], len(events) > limit)


@router.get("/{job_id}/checkpoints", response_model=Page[CheckpointObject])
async def list_checkpoints(
    job_id: str, read: ReadDep, caller: CallerDep, after: str | None = None, limit: Limit = 10
) -> Page[CheckpointObject]:
    """Checkpoints stored in object storage, latest step first."""

    def work(session: Session) -> Page[CheckpointObject]:
        job = jobs.get(session, caller, job_id)
        rows, more = CheckpointRepository(session).list(job_id, after=after, limit=limit)
        return page([CheckpointObject.of(c, job.model) for c in rows], more)

    return await read(work)


@router.get("/{job_id}/metrics", response_model=MetricsObject)
async def metrics(
    job_id: str,
    read: ReadDep,
    caller: CallerDep,
    name: Annotated[list[str] | None, Query()] = None,
    max_points: Annotated[int, Query(ge=2, le=20000)] = 1000,
) -> MetricsObject:
    """Metric series for charts, downsampled on the server to at most `max_points` per series."""

    def work(session: Session) -> MetricsObject:
        jobs.require(session, caller, job_id)
        series = MetricRepository(session).series(job_id, name)
        data, downsampled = {}, False
        for key, points in series.items():
            if len(points) > max_points:
                points, downsampled = artifacts.downsample(points, max_points), True
            data[key] = Series(steps=[s for s, _ in points], values=[v for _, v in points])
        return MetricsObject(job_id=job_id, data=data, downsampled=downsampled)

    return await read(work)


@router.get("/{job_id}/artifacts", response_model=list[ArtifactObject])
async def list_artifacts(job_id: str, read: ReadDep, caller: CallerDep) -> list[ArtifactObject]:
    """The job's downloadable models with their manifests."""

    def work(session: Session) -> list[ArtifactObject]:
        jobs.require(session, caller, job_id)
        return [ArtifactObject.of(a) for a in ArtifactRepository(session).for_job(job_id)]

    return await read(work)


@router.get(
    "/{job_id}/artifacts/{fmt}",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-tar": {}}}, 206: {"description": "Partial content"}},
)
def download_artifact(
    job_id: str,
    fmt: Literal["pytorch", "onnx", "adapter", "merged"],
    request: Request,
    session: SessionDep,
    store: StoreDep,
    caller: CallerDep,
) -> Response:
    """Download the model as a tar archive, with its sha256 in headers and Range support. `merged` is a LoRA
    job's adapter merged into its base: its `pytorch` archive, by the name PEFT users look for."""
    jobs.require(session, caller, job_id)
    if fmt == "merged":
        if jobs.get(session, caller, job_id).spec.lora is None:
            raise NotFound(
                f"job {job_id} trained no adapter, so there is no merged model; its pytorch artifact is the "
                "model",
                param="format",
                code="artifact_not_found",
            )
        fmt = "pytorch"
    artifact = ArtifactRepository(session).get(job_id, fmt)
    if artifact is None:
        job = jobs.get(session, caller, job_id)  # the 404 says why, when an export failed
        reason = ((job.result or {}).get("failed_artifacts") or {}).get(fmt)
        said = f"its {fmt} export failed: {reason}" if reason else "(yet)"
        raise NotFound(
            f"job {job_id} has no {fmt} artifact {said}", param="format", code="artifact_not_found"
        )
    return artifacts.stream(store, artifact, request.headers.get("range"))

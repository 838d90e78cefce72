"""Jobs: check a request against the registry and the files, store it, and enqueue after commit."""

from __future__ import annotations

import re
import secrets

from sqlalchemy.orm import Session

from api.caller import Caller
from api.errors import APIError, Conflict, NotFound, TooManyRequests
from api.schemas import JobCreate
from api.services import job_checks as checks
from api.services import quota
from ortune import lifecycle
from ortune.db.base import new_id
from ortune.db.models import File, Job, JobStatus, Tenant
from ortune.db.repositories import (
    ArtifactRepository,
    CheckpointRepository,
    EventRepository,
    JobRepository,
    NodeRepository,
    TenantRepository,
    never_fits,
)
from ortune.integrations import WANDB_REFUSED
from ortune.jobspec import BaseModelRef, JobSpec
from ortune.queue import enqueue_for, on_commit
from ortune.search_space import HyperparameterSearch
from ortune.settings import Settings
from trainer_core import tasks
from trainer_core.models import registry
from trainer_core.spec import Distributed


def create(
    session: Session, settings: Settings, caller: Caller, req: JobCreate, job_id: str | None = None
) -> Job:
    # before the files and the base are read: a delete of either takes the same lock, so a job is never
    # created on something deleted meanwhile (it sees the delete, or the delete sees it and is refused)
    TenantRepository(session).lock(caller.tenant_id)
    model, source, base = _base_model(session, settings, caller, req.model)
    task, train, valid = _task_and_files(session, caller, req, model)
    method = req.trained_method()
    checks.method(method, train, task, req.backend)
    checks.lora(req, task)
    labels = checks.labels(train, valid, source, task, req.model)
    hp = req.effective_hyperparameters()
    _check_limits(req, hp.max_steps, settings)
    dist = req.distributed or Distributed()
    searching = req.hyperparameter_search is not None
    if dist.world_size > 1:
        _check_fits(session, dist, hp.batch_size, searching)
    if req.hyperparameter_search is not None:
        _check_search(req.hyperparameter_search, valid is not None)
    spec = JobSpec.build(
        hp,
        train.row_count,
        world_size=dist.world_size,
        task=task,
        labels=labels,
        backend=req.backend,
        optim=req.optim,
        precision=req.precision,
        checkpoint_every_steps=req.checkpoint_every_steps,
        keep_checkpoints=req.keep_checkpoints,
        distributed=dist,
        hyperparameter_search=req.hyperparameter_search,
        lora=req.lora(),
        method=method,
        base=base,
        integrations=[a for i in req.integrations if (a := i.accepted()) is not None],
    )
    _check_length(spec, train.row_count or 0, settings.max_steps)
    tenant = _check_quota(session, settings, caller)
    priority = req.priority
    if tenant is not None and tenant.max_priority is not None and priority > tenant.max_priority:
        priority = tenant.max_priority  # what an admin allows this tenant; said in the job's first event
    job = Job(
        id=job_id or new_id("ftjob"),
        tenant_id=caller.tenant_id,
        model=model.id,
        task=task,
        training_file_id=train.id,
        validation_file_id=valid.id if valid else None,
        status=JobStatus.queued,
        spec=spec,
        suffix=req.suffix,
        seed=req.seed if req.seed is not None else secrets.randbelow(2**31),
        user_metadata=req.metadata,
        priority=priority,
        backend_requested=req.backend,
        world_size=dist.world_size,
    )
    _record(session, settings, job, req.priority)
    return job


def _task_and_files(
    session: Session, caller: Caller, req: JobCreate, model: registry.ModelInfo
) -> tuple[str, File, File | None]:
    """The job's task (asked for, or the training rows' default) and its two files, checked for it."""
    train = checks.file(session, caller, req.training_file, "training_file", req.task)
    task = req.task or tasks.for_rows(train.row_kind).name
    if task not in model.tasks:
        raise APIError(
            f"model {model.id} cannot be fine-tuned for {task} (it supports {', '.join(model.tasks)})",
            param="model",
            code="unsupported_task",
        )
    valid = (
        checks.file(session, caller, req.validation_file, "validation_file", task)
        if req.validation_file
        else None
    )
    if valid is not None and valid.row_kind != train.row_kind:
        raise APIError(
            f"validation file holds {valid.row_kind} rows, training file {train.row_kind} rows",
            param="validation_file",
            code="invalid_file",
        )
    return task, train, valid


def _check_limits(req: JobCreate, max_steps: int | None, settings: Settings) -> None:
    if max_steps is not None and max_steps > settings.max_steps:
        raise APIError(
            f"max_steps {max_steps} is over this deployment's limit of {settings.max_steps}",
            param="hyperparameters.max_steps",
            code="limit_exceeded",
        )
    for i, integration in enumerate(req.integrations):
        if integration.type == "wandb":
            raise APIError(WANDB_REFUSED, param=f"integrations[{i}]", code="unsupported_integration")


def _record(session: Session, settings: Settings, job: Job, asked_priority: int) -> None:
    """The job's row and first events; its message is sent once they commit."""
    JobRepository(session).add(job)
    EventRepository(session).add(job.id, f"Created fine-tuning job {job.id}: {job.task} on {job.model}")
    if job.priority != asked_priority:
        EventRepository(session).add(
            job.id,
            f"Priority {asked_priority} was lowered to {job.priority}, this tenant's maximum",
            level="warn",
        )
    send, job_id = enqueue_for(job), job.id
    on_commit(session, lambda: send(settings, job_id))


CHECKPOINT_NAME = re.compile(r"^ft:.*:(?P<job>[^:]+):ckpt-step-(?P<step>\d+)$")


def _base_model(
    session: Session, settings: Settings, caller: Caller, name: str
) -> tuple[registry.ModelInfo, Job | None, BaseModelRef | None]:
    """The model a job starts from: one of the registry's, or (`ft:...`) an earlier job's, with that job
    and the stored artifact it continues from."""
    if name.startswith("ft:"):
        return _fine_tuned_base(session, caller, name)
    try:
        return registry.resolve(name, settings.models_dir), None, None
    except registry.UnknownModel as exc:
        raise NotFound(str(exc), param="model", code="model_not_found") from exc


def _fine_tuned_base(
    session: Session, caller: Caller, name: str
) -> tuple[registry.ModelInfo, Job, BaseModelRef]:
    """An earlier job's fine-tuned model, of this tenant, with its merged PyTorch model stored; or one of its
    checkpoints by the name the checkpoints list gives it."""
    if (named := CHECKPOINT_NAME.match(name)) is not None:
        return _checkpoint_base(session, caller, name, named["job"], int(named["step"]))
    job = JobRepository(session).by_fine_tuned_model(caller.tenant_id, name)
    artifact = ArtifactRepository(session).get(job.id, "pytorch") if job is not None else None
    if job is None or job.status != JobStatus.succeeded or artifact is None:
        raise NotFound(f"no fine-tuned model with id {name!r}", param="model", code="model_not_found")
    ref = BaseModelRef(job_id=job.id, object_key=artifact.object_key, sha256=artifact.sha256)
    return registry.ModelInfo(name, "local", None, (job.task,)), job, ref


def _checkpoint_base(
    session: Session, caller: Caller, name: str, job_id: str, step: int
) -> tuple[registry.ModelInfo, Job, BaseModelRef]:
    job = JobRepository(session).get(job_id)
    checkpoint = CheckpointRepository(session).at(job_id, step) if job is not None else None
    if job is None or job.tenant_id != caller.tenant_id or checkpoint is None:
        raise NotFound(
            f"no fine-tuned model checkpoint with id {name!r}", param="model", code="model_not_found"
        )
    if job.spec.lora is not None:
        raise APIError(
            f"{name} is a LoRA job's checkpoint, which holds the adapter alone; continue from the job's "
            "fine_tuned_model (the adapter merged into its base)",
            param="model",
            code="unsupported_base",
        )
    ref = BaseModelRef(
        job_id=job.id, object_key=checkpoint.object_key, sha256=checkpoint.sha256, checkpoint_step=step
    )
    return registry.ModelInfo(name, "local", None, (job.task,)), job, ref


def _check_fits(session: Session, dist: Distributed, batch_size: int | str, search: bool) -> None:
    """Refuse at once what can never run here; what cannot run now waits in `queued`. An "auto" batch is
    rounded up to a multiple of the processes (JobSpec.build): only a batch the user set can fail to split."""
    if search:
        raise APIError(
            "a hyperparameter search runs single-process trials; drop distributed or the search",
            param="distributed",
            code="unsupported",
        )
    if isinstance(batch_size, int) and batch_size % dist.world_size:
        raise APIError(
            f"batch_size {batch_size} (the global batch) does not split over {dist.world_size} processes; "
            "use a multiple",
            param="hyperparameters.batch_size",
            code="invalid_batch_size",
        )
    reason = never_fits(NodeRepository(session).all(), dist.nodes, dist.procs_per_node)
    if reason is not None:
        raise APIError(f"this job can never be placed: it {reason}", param="distributed", code="cannot_fit")


def _check_length(spec: JobSpec, rows: int, limit: int) -> None:
    """Without max_steps a job runs epochs x rows / batch optimizer steps: that too is held to the limit."""
    hp = spec.resolved_hyperparameters
    if hp.max_steps is not None:
        return
    steps = -(-rows // hp.batch_size) * hp.n_epochs // hp.gradient_accumulation_steps
    if steps > limit:
        raise APIError(
            f"this job would train {steps:,} steps ({hp.n_epochs} epochs of {rows:,} rows in batches of "
            f"{hp.batch_size}), over this deployment's limit of {limit:,}; set max_steps, fewer epochs or a "
            "larger batch",
            param="hyperparameters.n_epochs",
            code="limit_exceeded",
        )


def _check_quota(session: Session, settings: Settings, caller: Caller) -> Tenant | None:
    tenants = TenantRepository(session)
    tenant = tenants.lock(caller.tenant_id)  # two creates of one tenant count one after the other
    limit = (tenant.max_concurrent_jobs if tenant else None) or settings.max_concurrent_jobs
    held = tenants.unfinished_jobs(caller.tenant_id)
    if held >= limit:
        raise TooManyRequests(
            f"this tenant has {held} unfinished jobs and may hold {limit} at once; wait for one to finish "
            "or cancel one",
            param="max_concurrent_jobs",
            code="quota_exceeded",
        )
    quota.check_storage(session, settings, caller)  # a job stores checkpoints and models of its own
    return tenant


def _check_search(hs: HyperparameterSearch, has_validation: bool) -> None:
    if hs.metric.startswith("eval_") and not has_validation:
        raise APIError(
            f"metric {hs.metric} needs a validation_file; without one, search on train_loss",
            param="hyperparameter_search.metric",
            code="invalid_search",
        )


def get(session: Session, caller: Caller, job_id: str) -> Job:
    job = JobRepository(session).get(job_id)
    if job is None or job.tenant_id != caller.tenant_id:
        raise not_found(job_id)
    return job


def require(session: Session, caller: Caller, job_id: str) -> None:
    """The job exists for this caller (a read of its events, metrics or checkpoints needs no more)."""
    if JobRepository(session).tenant_of(job_id) != caller.tenant_id:
        raise not_found(job_id)


def not_found(job_id: str) -> NotFound:
    # another tenant's job does not exist for you: the same answer as a job that was never created
    return NotFound(
        f"no fine-tuning job with id {job_id!r}", param="fine_tuning_job_id", code="job_not_found"
    )


def cancel(session: Session, settings: Settings, caller: Caller, job_id: str) -> Job:
    job = get(session, caller, job_id)
    if not lifecycle.cancel(session, settings, job):
        raise Conflict(
            f"job {job_id} is already {JobRepository(session).status(job_id)}; only a job that has not "
            "finished can be cancelled",
            param="fine_tuning_job_id",
            code="job_not_cancellable",
        )
    session.refresh(job)
    return job


def pause(session: Session, settings: Settings, caller: Caller, job_id: str) -> Job:
    """A queued job is held; a running one checkpoints and lets go of its worker (worker/trainer_process)."""
    job = get(session, caller, job_id)
    if job.spec.is_search or job.parent_id is not None:
        raise Conflict(
            "a hyperparameter search and its trials cannot be paused; cancel the search instead",
            param="fine_tuning_job_id",
            code="job_not_pausable",
        )
    if not lifecycle.pause(session, job):
        raise Conflict(
            f"job {job_id} is {JobRepository(session).status(job_id)}; only a queued or running job can be "
            "paused",
            param="fine_tuning_job_id",
            code="job_not_pausable",
        )
    session.refresh(job)
    return job


def _stopping_on(session: Session, job: Job) -> str | None:
    """Where a paused job is still storing its checkpoint: its worker, or for a multi-process job the nodes
    that still upload their parts of it. None once it is stored everywhere."""
    if job.worker is not None:
        return f"worker {job.worker}"
    if job.world_size == 1:
        return None
    held = sorted(
        {
            a.node_name
            for a in NodeRepository(session).of_attempt(job.id, job.attempt)
            if a.released_at is None
        }
    )
    return f"node(s) {', '.join(held)}" if held else None


def resume(session: Session, settings: Settings, caller: Caller, job_id: str) -> Job:
    """A paused job is queued again; its next attempt continues from its latest checkpoint."""
    job = get(session, caller, job_id)
    if job.status == JobStatus.paused and (where := _stopping_on(session, job)) is not None:
        raise Conflict(
            f"job {job_id} is still stopping on {where}; resume it once its checkpoint is stored",
            param="fine_tuning_job_id",
            code="job_pausing",
            headers={"Retry-After": "2"},
        )
    if not lifecycle.resume(session, settings, job):
        raise Conflict(
            f"job {job_id} is {JobRepository(session).status(job_id)}; only a paused job can be resumed",
            param="fine_tuning_job_id",
            code="job_not_resumable",
        )
    session.refresh(job)
    return job

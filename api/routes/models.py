from __future__ import annotations

from fastapi import APIRouter

from api.auth import CallerDep
from api.deps import SessionDep, SettingsDep, StoreDep
from api.errors import ERRORS, APIError, Conflict, NotFound
from api.schemas import ModelDeleted, ModelObject, Page
from ortune.db.models import JobStatus
from ortune.db.repositories import ArtifactRepository, EventRepository, JobRepository, TenantRepository
from trainer_core.models import registry

router = APIRouter(prefix="/v1/models", tags=["models"], responses=ERRORS)


def _all(session: SessionDep, settings: SettingsDep, caller: CallerDep) -> list[ModelObject]:
    base = [
        ModelObject(id=m.id, created=0, owned_by=f"ortune:{m.source}", tasks=list(m.tasks))
        for m in registry.list_models(settings.models_dir)
    ]
    tuned = [
        ModelObject(id=name, created=int(at.timestamp()), owned_by="ortune:fine-tuned")
        for name, at in JobRepository(session).fine_tuned_models(caller.tenant_id)
    ]
    return base + tuned


@router.get("", response_model=Page[ModelObject])
def list_models(session: SessionDep, settings: SettingsDep, caller: CallerDep) -> Page[ModelObject]:
    """Base models this deployment can fine-tune, and the fine-tuned ones."""
    return Page(data=_all(session, settings, caller))


@router.get("/{model_id:path}", response_model=ModelObject)
def retrieve_model(
    model_id: str, session: SessionDep, settings: SettingsDep, caller: CallerDep
) -> ModelObject:
    """One model by id."""
    for model in _all(session, settings, caller):
        if model.id == model_id:
            return model
    raise NotFound(f"no model with id {model_id!r}", param="model", code="model_not_found")


@router.delete("/{model_id:path}", response_model=ModelDeleted)
def delete_model(
    model_id: str, session: SessionDep, settings: SettingsDep, store: StoreDep, caller: CallerDep
) -> ModelDeleted:
    """Delete a fine-tuned model: its downloads and its job's checkpoints leave object storage (and the
    tenant's storage quota); the job and its metrics stay."""
    # a job created on this model meanwhile waits for the delete's answer, or the delete for the create's
    TenantRepository(session).lock(caller.tenant_id)
    job = JobRepository(session).by_fine_tuned_model(caller.tenant_id, model_id)
    models = ArtifactRepository(session)
    if job is None or job.status != JobStatus.succeeded or not models.for_job(job.id):  # or deleted already
        if any(m.id == model_id for m in registry.list_models(settings.models_dir)):
            raise APIError(
                f"{model_id!r} is a base model; only fine-tuned models can be deleted", param="model"
            )
        raise NotFound(f"no fine-tuned model with id {model_id!r}", param="model", code="model_not_found")
    if using := JobRepository(session).starting_from(caller.tenant_id, job):
        raise Conflict(
            f"{model_id} is the base of {len(using)} unfinished job(s) ({', '.join(using[:5])}), which "
            "fetch it when they start; cancel them or wait for them to finish",
            param="model",
            code="model_in_use",
        )
    keys = models.remove_model(job.id)
    EventRepository(session).add(job.id, f"The fine-tuned model was deleted ({len(keys)} stored objects)")
    session.commit()  # the rows go first: an object deleted under a row that still names it is worse
    for key in keys:
        store.delete(key)
    return ModelDeleted(id=model_id)

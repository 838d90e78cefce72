from __future__ import annotations

from fastapi import APIRouter

from api.auth import CallerDep
from api.deps import SessionDep, SettingsDep
from api.errors import ERRORS, NotFound
from api.schemas import ModelObject, Page
from ortune.db.repositories import JobRepository
from trainer_core import registry

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

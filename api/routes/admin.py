"""Tenants and their API keys. A key's secret is shown once, when it is issued.

A platform key manages every tenant; a tenant's admin key manages that tenant's keys only, and another
tenant is as invisible to it (404) as to any other caller of that tenant."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from api.auth import AdminDep, KeyCache, PlatformDep
from api.caller import Caller
from api.deps import SessionDep
from api.errors import ERRORS, Conflict, Forbidden, NotFound
from api.schemas import Page, ts
from ortune.db.models import APIKey, Tenant
from ortune.db.repositories import KeyRepository, TenantExists, TenantRepository

router = APIRouter(prefix="/v1/admin", tags=["admin"], responses=ERRORS)


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
    max_concurrent_jobs: Annotated[int, Field(ge=1, le=10_000)] | None = None
    max_priority: Annotated[StrictInt, Field(ge=-100, le=100)] | None = None  # strict: false is no 0
    max_storage_bytes: Annotated[StrictInt, Field(ge=1)] | None = None


class TenantObject(BaseModel):
    id: str
    object: Literal["tenant"] = "tenant"
    name: str
    max_concurrent_jobs: int | None
    max_priority: int | None
    max_storage_bytes: int | None
    storage_bytes: int = Field(description="What the tenant keeps in object storage now.")
    created_at: int

    @classmethod
    def of(cls, t: Tenant, storage_bytes: int) -> TenantObject:
        return cls(
            id=t.id,
            name=t.name,
            max_concurrent_jobs=t.max_concurrent_jobs,
            max_priority=t.max_priority,
            max_storage_bytes=t.max_storage_bytes,
            storage_bytes=storage_bytes,
            created_at=ts(t.created_at) or 0,
        )


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(min_length=1, max_length=128)]
    admin: bool = False
    platform: bool = Field(default=False, description="Manages every tenant (implies admin).")


class KeyObject(BaseModel):
    id: str
    object: Literal["api_key"] = "api_key"
    tenant_id: str
    name: str
    prefix: str
    admin: bool
    platform: bool
    created_at: int
    revoked_at: int | None

    @classmethod
    def of(cls, k: APIKey) -> KeyObject:
        return cls(
            id=k.id,
            tenant_id=k.tenant_id,
            name=k.name,
            prefix=k.prefix,
            admin=k.admin,
            platform=k.platform,
            created_at=ts(k.created_at) or 0,
            revoked_at=ts(k.revoked_at),
        )


class KeyIssued(KeyObject):
    key: str = Field(description="The secret: shown this once, stored only as its SHA-256.")


def _tenant(session: SessionDep, tenant_id: str, caller: Caller) -> Tenant:
    tenant = TenantRepository(session).get(tenant_id) if caller.manages(tenant_id) else None
    if tenant is None:
        raise NotFound(f"no tenant with id {tenant_id!r}", param="tenant_id", code="tenant_not_found")
    return tenant


@router.post("/tenants", response_model=TenantObject)
def create_tenant(req: TenantCreate, session: SessionDep, _: PlatformDep) -> TenantObject:
    """Create a tenant (its jobs, files and models are invisible to every other tenant)."""
    try:
        tenant = TenantRepository(session).create(
            req.name, req.max_concurrent_jobs, req.max_priority, req.max_storage_bytes
        )
        return TenantObject.of(tenant, 0)
    except TenantExists as exc:
        raise Conflict(str(exc), param="name", code="tenant_exists") from exc


@router.get("/tenants", response_model=Page[TenantObject])
def list_tenants(session: SessionDep, _: PlatformDep) -> Page[TenantObject]:
    """All tenants, oldest first."""
    tenants = TenantRepository(session)
    return Page(data=[TenantObject.of(t, tenants.storage_bytes(t.id)) for t in tenants.list()])


@router.post("/tenants/{tenant_id}/api_keys", response_model=KeyIssued)
def issue_key(tenant_id: str, req: KeyCreate, session: SessionDep, caller: AdminDep) -> KeyIssued:
    """Issue an API key for a tenant; the response is the only time its secret is shown."""
    _tenant(session, tenant_id, caller)
    if req.platform and not caller.platform:
        raise Forbidden(
            "only a platform key can issue a platform key", param="platform", code="platform_key_required"
        )
    key, secret = KeyRepository(session).issue(tenant_id, req.name, admin=req.admin, platform=req.platform)
    return KeyIssued(**KeyObject.of(key).model_dump(), key=secret)


@router.get("/tenants/{tenant_id}/api_keys", response_model=Page[KeyObject])
def list_keys(tenant_id: str, session: SessionDep, caller: AdminDep) -> Page[KeyObject]:
    """A tenant's keys (prefixes only, never secrets), revoked ones included."""
    _tenant(session, tenant_id, caller)
    return Page(data=[KeyObject.of(k) for k in KeyRepository(session).list(tenant_id)])


@router.delete("/api_keys/{key_id}", response_model=KeyObject)
def revoke_key(key_id: str, request: Request, session: SessionDep, caller: AdminDep) -> KeyObject:
    """Revoke a key: this API process refuses it at once, others within `api_key_cache_seconds`."""
    keys = KeyRepository(session)
    found = keys.get(key_id)
    key = keys.revoke(key_id) if found is not None and caller.manages(found.tenant_id) else None
    if key is None:
        raise NotFound(f"no API key with id {key_id!r}", param="key_id", code="api_key_not_found")
    cache: KeyCache = request.app.state.key_cache
    cache.forget(key_id)
    return KeyObject.of(key)

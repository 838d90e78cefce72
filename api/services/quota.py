"""A tenant's storage quota: bytes of uploads, checkpoints and models it may keep in object storage."""

from __future__ import annotations

from sqlalchemy.orm import Session

from api.caller import Caller
from api.errors import TooManyRequests
from ortune.db.repositories import TenantRepository
from ortune.settings import Settings


def check_storage(
    session: Session, settings: Settings, caller: Caller, adding: int = 0, what: str = ""
) -> None:
    """Refuse when the tenant's stored bytes, with `adding` more, would pass its limit (at the limit
    already, for a job that will store checkpoints and models of its own)."""
    tenants = TenantRepository(session)
    tenant = tenants.get(caller.tenant_id)
    limit = (tenant.max_storage_bytes if tenant else None) or settings.max_tenant_storage_bytes
    used = tenants.storage_bytes(caller.tenant_id)
    if used + adding > limit or (adding == 0 and used >= limit):
        with_it = f"; {what} of {adding:,} bytes would make {used + adding:,}" if adding else ""
        raise TooManyRequests(
            f"this tenant keeps {used:,} bytes in storage and may keep {limit:,}{with_it}; delete files "
            "(DELETE /v1/files/{id}) or fine-tuned models (DELETE /v1/models/{id}) to make room",
            param="max_storage_bytes",
            code="storage_quota_exceeded",
        )

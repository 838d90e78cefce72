"""Who is asking: every resource an API call touches is scoped to the caller's tenant."""

from __future__ import annotations

from dataclasses import dataclass

from ortune.db.models import DEFAULT_TENANT


@dataclass(frozen=True)
class Caller:
    tenant_id: str
    admin: bool
    key_id: str | None = None


ANONYMOUS = Caller(DEFAULT_TENANT, admin=True)  # an open deployment (no keys required) is single-user

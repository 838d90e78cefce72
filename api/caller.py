"""Who is asking: every resource an API call touches is scoped to the caller's tenant."""

from __future__ import annotations

from dataclasses import dataclass

from ortune.db.models import DEFAULT_TENANT


@dataclass(frozen=True)
class Caller:
    tenant_id: str
    admin: bool = False  # manages its own tenant's API keys
    platform: bool = False  # manages every tenant, sees the cluster (nodes, /metrics); always an admin too
    key_id: str | None = None

    def manages(self, tenant_id: str) -> bool:
        return self.platform or (self.admin and tenant_id == self.tenant_id)


# An open deployment (no keys required) is single-user, but a caller without a key is never an admin:
# the admin routes take an admin key in every mode.
ANONYMOUS = Caller(DEFAULT_TENANT)

"""Tenants and their API keys: issued once, stored as SHA-256, looked up by digest.

The API authenticates with `KeyRepository.lookup`; the CLI (`ortune keys`) and the admin endpoints issue and
revoke keys.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

from sqlalchemy import func, select

from ortune.db.base import new_id, utcnow
from ortune.db.models import APIKey, Artifact, Checkpoint, File, Job, JobStatus, Tenant
from ortune.db.repositories.base import Repository

KEY_PREFIX = "ortune-sk-"
UNFINISHED = [s for s in JobStatus if not s.terminal]


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def looks_like_key(token: str) -> bool:
    return token.startswith(KEY_PREFIX)


class TenantExists(ValueError):
    pass


class TenantRepository(Repository):
    def get(self, tenant_id: str) -> Tenant | None:
        return self.session.get(Tenant, tenant_id)

    def by_name(self, name: str) -> Tenant | None:
        return self.session.scalars(select(Tenant).where(Tenant.name == name)).first()

    def list(self) -> Sequence[Tenant]:
        return self.session.scalars(select(Tenant).order_by(Tenant.created_at, Tenant.id)).all()

    def create(
        self,
        name: str,
        max_concurrent_jobs: int | None = None,
        max_priority: int | None = None,
        max_storage_bytes: int | None = None,
    ) -> Tenant:
        if self.by_name(name) is not None:
            raise TenantExists(f"a tenant named {name!r} exists already")
        tenant = Tenant(
            id=new_id("tenant"),
            name=name,
            max_concurrent_jobs=max_concurrent_jobs,
            max_priority=max_priority,
            max_storage_bytes=max_storage_bytes,
        )
        self.session.add(tenant)
        self.session.flush()
        return tenant

    def lock(self, tenant_id: str) -> Tenant | None:
        """Serialise a tenant's job creations (its quota check) on Postgres; SQLite writes one at a time.

        FOR NO KEY UPDATE, not FOR UPDATE: it still orders two creates, but leaves alone the KEY SHARE lock
        that inserting a row referencing the tenant takes (a file upload's foreign-key check), which a
        plain FOR UPDATE would make wait for the create's whole transaction."""
        stmt = select(Tenant).where(Tenant.id == tenant_id).with_for_update(key_share=True)
        return self.session.scalars(stmt).first()

    def storage_bytes(self, tenant_id: str) -> int:
        """What the tenant keeps in object storage: its files (not deleted), its jobs' checkpoints, and their
        models (an object a search's trial shares with its search counted once)."""
        files = select(func.coalesce(func.sum(File.bytes), 0)).where(
            File.tenant_id == tenant_id, File.deleted.is_(False)
        )
        checkpoints = (
            select(func.coalesce(func.sum(Checkpoint.bytes), 0))
            .join(Job, Job.id == Checkpoint.job_id)
            .where(Job.tenant_id == tenant_id)
        )
        models = (
            select(Artifact.object_key, func.max(Artifact.bytes).label("bytes"))
            .join(Job, Job.id == Artifact.job_id)
            .where(Job.tenant_id == tenant_id)
            .group_by(Artifact.object_key)
            .subquery()
        )
        stored = select(func.coalesce(func.sum(models.c.bytes), 0))
        return sum(int(self.session.scalar(q) or 0) for q in (files, checkpoints, stored))

    def unfinished_jobs(self, tenant_id: str) -> int:
        """Queued, running and paused jobs, a search's trials included: each holds a worker."""
        stmt = (
            select(func.count())
            .select_from(Job)
            .where(Job.tenant_id == tenant_id, Job.status.in_(UNFINISHED))
        )
        return int(self.session.scalar(stmt) or 0)


class KeyRepository(Repository):
    def issue(
        self, tenant_id: str, name: str, *, admin: bool = False, platform: bool = False
    ) -> tuple[APIKey, str]:
        """A new key; the secret is returned here once and never stored. A platform key is an admin key."""
        secret = KEY_PREFIX + secrets.token_urlsafe(32)
        key = APIKey(
            id=new_id("key"),
            tenant_id=tenant_id,
            name=name,
            prefix=secret[: len(KEY_PREFIX) + 4],
            sha256=digest(secret),
            admin=admin or platform,
            platform=platform,
        )
        self.session.add(key)
        self.session.flush()
        return key, secret

    def live_count(self) -> int:
        return int(
            self.session.scalar(select(func.count()).select_from(APIKey).where(APIKey.revoked_at.is_(None)))
            or 0
        )

    def lookup(self, secret: str) -> APIKey | None:
        """The live key with this secret, or None (unknown or revoked)."""
        stmt = select(APIKey).where(APIKey.sha256 == digest(secret), APIKey.revoked_at.is_(None))
        return self.session.scalars(stmt).first()

    def list(self, tenant_id: str) -> Sequence[APIKey]:
        stmt = select(APIKey).where(APIKey.tenant_id == tenant_id).order_by(APIKey.created_at, APIKey.id)
        return self.session.scalars(stmt).all()

    def get(self, key_id: str) -> APIKey | None:
        return self.session.get(APIKey, key_id)

    def revoke(self, key_id: str) -> APIKey | None:
        key = self.session.get(APIKey, key_id)
        if key is not None and key.revoked_at is None:
            key.revoked_at = utcnow()
            self.session.flush()
        return key

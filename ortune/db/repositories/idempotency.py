"""`Idempotency-Key` rows: which resource a tenant's key made, and for which request."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete

from ortune.db.models import IdempotencyKey
from ortune.db.repositories.base import Repository


class IdempotencyRepository(Repository):
    def get(self, tenant_id: str, key: str) -> IdempotencyKey | None:
        return self.session.get(IdempotencyKey, (tenant_id, key))

    def add(self, row: IdempotencyKey) -> None:
        """Flushes at once: a concurrent request holding the same key fails here with IntegrityError."""
        self.session.add(row)
        self.session.flush()

    def drop(self, row: IdempotencyKey) -> None:
        self.session.delete(row)
        self.session.flush()

    def expire_before(self, cutoff: datetime) -> int:
        result = self.session.execute(delete(IdempotencyKey).where(IdempotencyKey.created_at < cutoff))
        return int(result.rowcount or 0)  # type: ignore[attr-defined]

"""What every repository shares: the session it works in. Repositories flush, never commit: the caller owns
the transaction (a request dependency, a task's `session_scope`)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import and_, or_
from sqlalchemy.orm import Session


class Repository:
    def __init__(self, session: Session) -> None:
        self.session = session


def page_anchor(session: Session, model: Any, row_id: str | None, tenant_id: str) -> Any:
    """The row a page starts after: only one of the tenant's own (another's id is as good as unknown)."""
    row = session.get(model, row_id) if row_id else None
    return row if row is not None and row.tenant_id == tenant_id else None


def keyset_after(stmt: Any, model: Any, anchor: Any) -> Any:
    """Keyset pagination on (created_at, id), newest first."""
    if anchor is None:
        return stmt
    return stmt.where(
        or_(
            model.created_at < anchor.created_at,
            and_(model.created_at == anchor.created_at, model.id < anchor.id),
        )
    )

"""`Idempotency-Key` on creates: a retried request with the same key and body gets the resource the first
one made, never a second one.

The key row is written in the transaction that creates the resource, after the slow work (an upload's check
and storage) is done outside any transaction: of two requests racing on one key, the second waits on the
primary key, in a worker thread and at most the API's lock_timeout, then finds the first one's row (or gets
409 with Retry-After while it cannot be read yet). A key reused with a different body is refused; keys
expire after `idempotency_key_hours`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from fastapi import Request, Response
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from api.caller import Caller
from api.errors import APIError, Conflict
from ortune.db.base import utcnow
from ortune.db.models import IdempotencyKey
from ortune.db.repositories import IdempotencyRepository
from ortune.settings import Settings

HEADER = "Idempotency-Key"
LOCK_NOT_AVAILABLE = "55P03"  # Postgres: lock_timeout ran out
REPLAYED = "Idempotent-Replayed"


@dataclass
class Claim:
    """What a create does with its key: replay `existing`, or make `resource_id` (already reserved)."""

    existing: str | None
    resource_id: str


def key_of(request: Request) -> str | None:
    key = request.headers.get(HEADER)
    if key is None:
        return None
    if not 1 <= len(key) <= 255 or not key.isascii() or not key.isprintable():
        raise APIError(
            f"{HEADER} must be 1 to 255 printable ASCII characters",
            param=HEADER,
            code="invalid_idempotency_key",
        )
    return key


def fingerprint(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _existing(
    session: Session, settings: Settings, row: IdempotencyKey, endpoint: str, digest: str
) -> str | None:
    if row.created_at < utcnow() - timedelta(hours=settings.idempotency_key_hours):
        IdempotencyRepository(session).drop(row)
        return None
    if row.endpoint != endpoint or row.request_sha256 != digest:
        raise APIError(
            f"{HEADER} {row.key!r} was already used for a different request ({row.endpoint}); "
            "use a new key for a new request",
            param=HEADER,
            code="idempotency_key_reused",
        )
    return row.resource_id


def replay(
    session: Session, settings: Settings, caller: Caller, key: str | None, *, endpoint: str, digest: str
) -> str | None:
    """The resource a finished request with this key made, or None: a read, taking no lock, so that a retry
    is answered before its work is done again."""
    if key is None:
        return None
    row = IdempotencyRepository(session).get(caller.tenant_id, key)
    return None if row is None else _existing(session, settings, row, endpoint, digest)


def claim(
    session: Session,
    settings: Settings,
    caller: Caller,
    key: str | None,
    *,
    endpoint: str,
    digest: str,
    new_id: str,
) -> Claim:
    if key is None:
        return Claim(None, new_id)
    if (found := replay(session, settings, caller, key, endpoint=endpoint, digest=digest)) is not None:
        return Claim(found, found)
    keys = IdempotencyRepository(session)
    mine = IdempotencyKey(
        tenant_id=caller.tenant_id, key=key, endpoint=endpoint, request_sha256=digest, resource_id=new_id
    )
    try:
        keys.add(mine)  # waits, at most the API's lock_timeout, while a request with this key commits
    except OperationalError as exc:
        if getattr(exc.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
            raise
        session.rollback()
        raise _in_progress(key) from None
    except IntegrityError:  # a concurrent request with this key committed first
        session.rollback()
        theirs = keys.get(caller.tenant_id, key)
        if theirs is None:
            raise _in_progress(key) from None
        found = _existing(session, settings, theirs, endpoint, digest)
        return Claim(found, found or new_id)
    return Claim(None, new_id)


def _in_progress(key: str) -> Conflict:
    return Conflict(
        f"a request with {HEADER} {key!r} is in progress; retry it shortly",
        param=HEADER,
        code="idempotency_key_in_use",
        headers={"Retry-After": "1"},
    )


def mark_replayed(response: Response) -> None:
    response.headers[REPLAYED] = "true"

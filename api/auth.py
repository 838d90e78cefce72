"""Bearer API keys: who the caller is, and the tenant every query of the request is scoped to.

Lookups are cached per process for `api_key_cache_seconds` (a poll every 2 s should not cost a query for its
key); a key revoked through this process is dropped from its cache at once, other processes see it within
the cache time.
"""

from __future__ import annotations

import hmac
import time
from typing import Annotated

import anyio.to_thread
from fastapi import Depends, Request
from sqlalchemy.exc import DBAPIError

from api.caller import ANONYMOUS, Caller
from api.errors import Forbidden, Unauthorized
from ortune.db.models import DEFAULT_TENANT
from ortune.db.repositories import KeyRepository
from ortune.db.repositories.tenants import digest, looks_like_key
from ortune.db.session import session_scope
from ortune.settings import Settings


class KeyCache:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._entries: dict[str, tuple[float, Caller | None]] = {}

    def get(self, key_digest: str) -> tuple[bool, Caller | None]:
        hit = self._entries.get(key_digest)
        if hit is None or hit[0] < time.monotonic():
            return False, None
        return True, hit[1]

    def put(self, key_digest: str, caller: Caller | None) -> None:
        if len(self._entries) > 10_000:  # bounded: a flood of made-up keys cannot grow it without end
            self._entries.clear()
        self._entries[key_digest] = (time.monotonic() + self.seconds, caller)

    def forget(self, key_id: str) -> None:
        for k, (_, caller) in list(self._entries.items()):
            if caller is not None and caller.key_id == key_id:
                del self._entries[k]


def _lookup(settings: Settings, secret: str) -> Caller | None:
    with session_scope(settings.database_url) as session:
        key = KeyRepository(session).lookup(secret)
        if key is None:
            return None
        return Caller(key.tenant_id, admin=key.admin or key.platform, platform=key.platform, key_id=key.id)


class OpenWithKeys(RuntimeError):
    """The API would run open (no key needed) over a database where tenants have API keys."""


def refuse_open_with_keys(settings: Settings) -> None:
    """At start: an open deployment makes every caller without a key the default tenant; with tenants and
    keys in the database that is a misconfiguration, not a choice, unless ORTUNE_REQUIRE_API_KEY=false says
    it is one."""
    if settings.api_key_required or settings.require_api_key is False:
        return
    try:
        with session_scope(settings.database_url) as session:
            keys = KeyRepository(session).live_count()
    except DBAPIError:  # no database yet, or no schema: nothing to check (/readyz reports the database)
        return
    if keys:
        raise OpenWithKeys(
            f"{keys} API key(s) exist in this database, but ORTUNE_REQUIRE_API_KEY is not set and this is "
            "not a production deployment: callers without a key would not be refused. Set "
            "ORTUNE_REQUIRE_API_KEY=true, or ORTUNE_REQUIRE_API_KEY=false to run open on purpose"
        )


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("the Authorization header must be 'Bearer <API key>'", param="Authorization")
    return token.strip()


async def authenticate(request: Request) -> Caller:
    settings: Settings = request.app.state.settings
    token = _bearer(request)
    admin = settings.admin_api_key.get_secret_value() if settings.admin_api_key else None
    if token is not None and admin and hmac.compare_digest(token.encode(), admin.encode()):
        return Caller(DEFAULT_TENANT, admin=True, platform=True, key_id="admin")
    if token is not None and looks_like_key(token):
        cache: KeyCache = request.app.state.key_cache
        key_digest = digest(token)
        hit, caller = cache.get(key_digest)
        if not hit:
            caller = await anyio.to_thread.run_sync(_lookup, settings, token)
            cache.put(key_digest, caller)
        if caller is None:
            raise Unauthorized(f"API key {token[:14]}… is not valid (unknown or revoked)")
        return caller
    if settings.api_key_required:
        if token is None:
            raise Unauthorized("an API key is required: send 'Authorization: Bearer <API key>'")
        raise Unauthorized("the API key is not an ortune key (they start with 'ortune-sk-')")
    # An open deployment: no key, or a placeholder some clients insist on sending (openai's SDK does).
    return ANONYMOUS


async def require_admin(caller: Annotated[Caller, Depends(authenticate)]) -> Caller:
    if not caller.admin:
        raise Forbidden("this endpoint needs an admin API key", code="admin_key_required")
    return caller


async def require_platform(caller: Annotated[Caller, Depends(authenticate)]) -> Caller:
    if not caller.platform:
        raise Forbidden(
            "this endpoint needs a platform admin key (a tenant's admin key manages only that tenant)",
            code="platform_key_required",
        )
    return caller


CallerDep = Annotated[Caller, Depends(authenticate)]
AdminDep = Annotated[Caller, Depends(require_admin)]
PlatformDep = Annotated[Caller, Depends(require_platform)]

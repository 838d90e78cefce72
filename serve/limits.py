"""Fair use of the inference process, per tenant: how many requests a tenant may have generating at once, and
how many tokens it may spend a minute (a token bucket that refills continuously). A request reserves its
prompt and its max_tokens when it starts and gives back what it did not use when it ends, so a tenant cannot
overrun the minute by starting many long replies at once. The API names the tenant (`ortune_tenant`); the
inference process is the one place every request passes, so the counts here are exact for it."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class Limited(Exception):
    """Over a limit for now: answered 429 with Retry-After."""

    def __init__(self, message: str, retry_after: float, code: str = "rate_limit_exceeded") -> None:
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))
        self.code = code


class NeverFits(ValueError):
    """A request bigger than the whole of a limit: retrying cannot help (400)."""


@dataclass
class _Tenant:
    streams: int = 0
    tokens: float = 0.0
    at: float = 0.0


@dataclass
class Ticket:
    """One admitted request: its stream slot and its reserved tokens, settled once when it ends."""

    limits: TenantLimits
    tenant: str
    reserved: int = 0
    done: bool = field(default=False)

    def reserve(self, tokens: int) -> None:
        self.limits._reserve(self.tenant, tokens)
        self.reserved = tokens

    def close(self, used: int | None = None) -> None:
        """End the request: its slot freed, the tokens it reserved but did not use returned."""
        if not self.done:
            self.done = True
            self.limits._close(self.tenant, self.reserved - min(self.reserved, used or 0))


class TenantLimits:
    def __init__(
        self, max_streams: int, tokens_per_minute: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_streams, self.per_minute, self.clock = max_streams, tokens_per_minute, clock
        self.tenants: dict[str, _Tenant] = {}
        self.lock = threading.Lock()

    def admit(self, tenant: str) -> Ticket:
        """A slot for one more request of `tenant`, or `Limited` when it already has max_streams."""
        with self.lock:
            state = self._state(tenant)
            if state.streams >= self.max_streams:
                raise Limited(
                    f"this tenant already has {state.streams} inference requests under way, the most it may "
                    f"have at once (ORTUNE_SERVE_MAX_STREAMS_PER_TENANT={self.max_streams})",
                    retry_after=1,
                )
            state.streams += 1
        return Ticket(self, tenant)

    def under_way(self) -> dict[str, int]:
        """Requests generating now, by tenant (those with any)."""
        with self.lock:
            return {t: s.streams for t, s in self.tenants.items() if s.streams}

    def remaining(self, tenant: str) -> int:
        with self.lock:
            return int(self._state(tenant).tokens)

    def _state(self, tenant: str) -> _Tenant:
        now = self.clock()
        state = self.tenants.setdefault(tenant, _Tenant(tokens=self.per_minute, at=now))
        state.tokens = min(self.per_minute, state.tokens + (now - state.at) * self.per_minute / 60)
        state.at = now
        return state

    def _reserve(self, tenant: str, tokens: int) -> None:
        if tokens > self.per_minute:
            raise NeverFits(
                f"this request may use {tokens:,} tokens (its prompt and max_tokens), more than a tenant's "
                f"whole minute ({self.per_minute:,}, ORTUNE_SERVE_TOKENS_PER_MINUTE_PER_TENANT): ask for "
                "fewer max_tokens or send a shorter prompt"
            )
        with self.lock:
            state = self._state(tenant)
            if state.tokens < tokens:
                wait = (tokens - state.tokens) * 60 / self.per_minute
                raise Limited(
                    f"this request may use {tokens:,} tokens and this tenant has {int(state.tokens):,} of "
                    f"its {self.per_minute:,} a minute left (ORTUNE_SERVE_TOKENS_PER_MINUTE_PER_TENANT); "
                    f"enough are back in {math.ceil(wait)} s",
                    retry_after=wait,
                )
            state.tokens -= tokens

    def _close(self, tenant: str, unused: int) -> None:
        with self.lock:
            state = self._state(tenant)
            state.streams -= 1
            state.tokens = min(self.per_minute, state.tokens + unused)

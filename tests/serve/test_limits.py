"""A tenant's fair use of the inference process: requests at once, and a token bucket over the minute that
takes back what a reply reserved but did not use (the clock is the test's, so no waiting)."""

from __future__ import annotations

import pytest

from serve.limits import Limited, NeverFits, TenantLimits


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_tenant_has_at_most_its_requests_at_once_and_others_are_not_counted() -> None:
    limits = TenantLimits(max_streams=2, tokens_per_minute=1_000, clock=Clock())
    held = [limits.admit("a"), limits.admit("a")]
    with pytest.raises(Limited, match="already has 2 inference requests under way") as over:
        limits.admit("a")
    assert over.value.retry_after == 1
    limits.admit("b").close()  # another tenant is not held back
    assert limits.under_way() == {"a": 2}
    held[0].close()
    held[0].close()  # closing twice frees one slot, not two
    limits.admit("a")
    assert limits.under_way() == {"a": 2}


def test_tokens_are_reserved_refilled_over_the_minute_and_given_back_when_unused() -> None:
    clock = Clock()
    limits = TenantLimits(max_streams=10, tokens_per_minute=600, clock=clock)  # 10 a second
    first = limits.admit("a")
    first.reserve(500)
    second = limits.admit("a")
    with pytest.raises(Limited, match="may use 200 tokens and this tenant has 100") as short:
        second.reserve(200)
    assert short.value.retry_after == 10  # 100 more, at 10 a second
    first.close(used=120)  # 380 unused come back at once
    assert limits.remaining("a") == 480
    second.reserve(200)
    clock.now += 3
    assert limits.remaining("a") == 310
    clock.now += 3_600
    assert limits.remaining("a") == 600  # never more than a minute's worth
    with pytest.raises(NeverFits, match="more than a tenant's whole minute"):
        limits.admit("b").reserve(601)

"""CONSTRAIN: limits, one pending change, cooldowns, the shared budget, zero traffic."""

from __future__ import annotations

import pytest

from planner.constrain import Constrainer, Limits, PoolLimits
from planner.policy import Proposal


def _props(prefill: int, decode: int) -> list[Proposal]:
    return [Proposal("prefill", prefill, "p"), Proposal("decode", decode, "d")]


def _targets(decisions: list) -> dict[str, int]:  # type: ignore[type-arg]
    return {d.pool: d.target for d in decisions}


LIMITS = Limits(PoolLimits(1, 6), PoolLimits(1, 6), budget=None, up_cooldown_s=10,
                down_cooldown_s=60, idle_s=30)  # fmt: skip


def test_limits_clamp_and_say_so() -> None:
    c = Constrainer(LIMITS)
    ds = c.apply(0.0, _props(0, 9), {"prefill": 1, "decode": 1}, 0.0)
    assert _targets(ds) == {"prefill": 1, "decode": 6}
    assert "clamped to [1, 6]" in ds[1].reason and ds[1].changed and not ds[0].changed


def test_one_pending_change_per_pool_then_cooldowns() -> None:
    c = Constrainer(LIMITS)
    c.apply(0.0, _props(3, 1), {"prefill": 1, "decode": 1}, 0.0)
    # not ready yet: hold at 3 even though more is asked
    ds = c.apply(20.0, _props(5, 1), {"prefill": 2, "decode": 1}, 0.0)
    assert ds[0].target == 3 and "pending" in ds[0].reason
    # ready, but within the up-cooldown of the last change? (20 s > 10 s: no)
    ds = c.apply(21.0, _props(5, 1), {"prefill": 3, "decode": 1}, 0.0)
    assert ds[0].target == 5
    ds = c.apply(25.0, _props(6, 1), {"prefill": 5, "decode": 1}, 0.0)
    assert ds[0].target == 5 and "up-cooldown" in ds[0].reason
    ds = c.apply(40.0, _props(2, 1), {"prefill": 5, "decode": 1}, 0.0)
    assert ds[0].target == 5 and "down-cooldown" in ds[0].reason
    ds = c.apply(90.0, _props(2, 1), {"prefill": 5, "decode": 1}, 0.0)
    assert ds[0].target == 2


def test_the_budget_cuts_growth_in_proportion() -> None:
    lim = Limits(PoolLimits(1, 16), PoolLimits(1, 16, cost=2), budget=12, up_cooldown_s=0)
    c = Constrainer(lim, {"prefill": 2, "decode": 2})  # 2 + 4 = 6 accelerators in use
    ds = c.apply(0.0, _props(8, 5), {"prefill": 2, "decode": 2}, 0.0)
    t = _targets(ds)
    assert t["prefill"] * 1 + t["decode"] * 2 <= 12
    assert t["prefill"] > 2 and t["decode"] > 2  # both grew
    assert all("budget" in d.reason for d in ds)


def test_no_traffic_goes_to_the_minimum_whatever_the_policy_says() -> None:
    c = Constrainer(LIMITS, {"prefill": 4, "decode": 4})
    ready = {"prefill": 4, "decode": 4}
    assert _targets(c.apply(100.0, _props(4, 4), ready, 10.0)) == ready
    ds = c.apply(200.0, _props(4, 4), ready, 31.0)
    assert _targets(ds) == {"prefill": 1, "decode": 1}
    assert "no traffic" in ds[0].reason


def test_bad_limits_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="min <= max"):
        PoolLimits(3, 2)
    with pytest.raises(ValueError, match="below the minimums"):
        Limits(PoolLimits(2, 4), PoolLimits(2, 4), budget=3)

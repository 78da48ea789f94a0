"""Retry budget: retries stay within a share of admitted originals plus a floor, over a sliding window."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from extproc.core.retry_budget import SLOTS, RetryBudget, is_retry
from extproc.policy.ratelimit import RetryBudgetPolicy


@pytest.mark.parametrize(("headers", "expected"), [
    ({}, False),
    ({"x-stainless-retry-count": ""}, False),
    ({"x-stainless-retry-count": "0"}, False),
    ({"x-stainless-retry-count": "1"}, True),
    ({"x-stainless-retry-count": "12"}, True),
    ({"x-stainless-retry-count": " 2 "}, True),
    ({"x-stainless-retry-count": "2,0"}, True),
    ({"x-stainless-retry-count": "0,3"}, False),
    ({"x-stainless-retry-count": "-1"}, False),
    ({"x-stainless-retry-count": "1.5"}, False),
    ({"x-stainless-retry-count": "yes"}, False),
    ({"x-other": "3"}, False),
])
def test_is_retry(headers: dict[str, str], expected: bool) -> None:
    assert is_retry(headers, "x-stainless-retry-count") is expected


def test_is_retry_with_a_configured_header_in_any_case() -> None:
    assert is_retry({"x-attempt": "2"}, "X-Attempt")
    assert not is_retry({"x-stainless-retry-count": "2"}, "x-attempt")


def test_floor_allows_some_retries_without_any_originals() -> None:
    budget = RetryBudget(ratio=0.2, min_per_second=1.0, window_s=10.0)
    allowed = [budget.try_withdraw(now=0.0) for _ in range(12)]
    assert allowed == [True] * 10 + [False] * 2
    assert budget.balance(now=0.0) == 0


def test_retries_are_a_share_of_deposits() -> None:
    budget = RetryBudget(ratio=0.2, min_per_second=0.0, window_s=10.0)
    for _ in range(100):
        budget.deposit(now=1.0)
    allowed = sum(budget.try_withdraw(now=1.0) for _ in range(50))
    assert allowed == 20
    # New originals earn new retries.
    for _ in range(5):
        budget.deposit(now=1.5)
    assert budget.try_withdraw(now=1.5)
    assert not budget.try_withdraw(now=1.5)


def test_ratio_zero_and_no_floor_refuses_every_retry() -> None:
    budget = RetryBudget(ratio=0.0, min_per_second=0.0, window_s=10.0)
    for _ in range(100):
        budget.deposit(now=0.0)
    assert not budget.try_withdraw(now=0.0)


def test_spent_budget_recovers_once_the_window_has_passed() -> None:
    budget = RetryBudget(ratio=0.5, min_per_second=0.0, window_s=10.0)
    for _ in range(4):
        budget.deposit(now=0.0)
    assert [budget.try_withdraw(now=0.0) for _ in range(3)] == [True, True, False]
    # Deposits and withdrawals leave the window together: nothing earned, nothing owed.
    assert budget.balance(now=10.0) == 0
    for _ in range(2):
        budget.deposit(now=10.0)
    assert budget.try_withdraw(now=10.0)
    assert not budget.try_withdraw(now=10.0)


def test_the_window_slides_a_slot_at_a_time() -> None:
    budget = RetryBudget(ratio=1.0, min_per_second=0.0, window_s=10.0)
    budget.deposit(now=0.0)  # slot 0
    budget.deposit(now=5.0)  # slot 5
    assert budget.balance(now=9.9) == 2
    assert budget.balance(now=10.0) == 1  # slot 0 left the window
    assert budget.balance(now=14.9) == 1
    assert budget.balance(now=15.0) == 0


def test_a_long_quiet_gap_clears_everything() -> None:
    budget = RetryBudget(ratio=1.0, min_per_second=0.0, window_s=1.0)
    for _ in range(10):
        budget.deposit(now=0.0)
    budget.try_withdraw(now=0.0)
    assert budget.balance(now=1_000_000.0) == 0


def test_a_clock_stepping_back_erases_nothing() -> None:
    budget = RetryBudget(ratio=1.0, min_per_second=0.0, window_s=10.0)
    budget.deposit(now=50.0)
    budget.deposit(now=20.0)  # counted in the newest slot
    assert budget.balance(now=50.0) == 2
    assert budget.balance(now=math.nan) == 2


def test_a_retry_storm_adds_at_most_the_ratio() -> None:
    """Originals at 50/s, and every client retrying 20 times a second: retries stay near 10 %."""
    budget = RetryBudget(ratio=0.1, min_per_second=1.0, window_s=10.0)
    originals = retries = 0
    step = 0.01
    for i in range(int(60 / step)):
        now = i * step
        if i % 2 == 0:
            budget.deposit(now)
            originals += 1
        for _ in range(10):
            retries += budget.try_withdraw(now)
    # The floor adds at most min_per_second x window per window of 10 s: 6 windows in 60 s.
    assert retries <= 0.1 * originals + 1.0 * 10.0 * 6
    assert retries >= 0.1 * originals * 0.9


def test_of_policy() -> None:
    policy = RetryBudgetPolicy(ratio=0.3, min_per_second=2, window="1m")
    budget = RetryBudget.of(policy)
    assert (budget.ratio, budget.min_per_second, budget.window_s) == (0.3, 2.0, 60.0)
    assert budget.balance(now=0.0) == 120.0


def test_reconfigure_keeps_counts_unless_the_window_changes() -> None:
    budget = RetryBudget.of(RetryBudgetPolicy(ratio=0.5, min_per_second=0, window="10s"))
    for _ in range(10):
        budget.deposit(now=1.0)
    budget.try_withdraw(now=1.0)
    budget.reconfigure(RetryBudgetPolicy(ratio=1.0, min_per_second=0, window="10s"))
    assert budget.balance(now=1.0) == 9  # 10 deposits now earn 10, one already spent
    budget.reconfigure(RetryBudgetPolicy(ratio=1.0, min_per_second=1, window="20s"))
    assert budget.window_s == 20.0
    assert budget.balance(now=1.0) == 20  # counts start over; the floor alone remains
    for _ in range(4):
        budget.deposit(now=1.0)
    assert budget.balance(now=19.9) == 24
    assert budget.balance(now=21.0) == 20


@pytest.mark.parametrize(("ratio", "floor", "window", "message"), [
    (-0.1, 1, 10, "ratio"), (1.5, 1, 10, "ratio"), (math.nan, 1, 10, "ratio"),
    (0.2, -1, 10, "min_per_second"), (0.2, math.inf, 10, "min_per_second"),
    (0.2, 1, 0, "window_s"), (0.2, 1, -5, "window_s"), (0.2, 1, math.inf, "window_s"),
])
def test_refuses_nonsense(ratio: float, floor: float, window: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RetryBudget(ratio, floor, window)


def test_ring_has_constant_size() -> None:
    budget = RetryBudget(ratio=1.0, min_per_second=0.0, window_s=10.0)
    for i in range(10_000):
        budget.deposit(now=i * 0.37)
    assert len(budget._deposits) == SLOTS


# -- the policy model --------------------------------------------------------------------


def test_policy_defaults() -> None:
    policy = RetryBudgetPolicy()
    assert policy.enabled
    assert policy.header == "x-stainless-retry-count"
    assert (policy.ratio, policy.min_per_second, policy.window) == (0.1, 1.0, 10.0)


def test_policy_header_is_lower_cased_and_window_takes_durations() -> None:
    policy = RetryBudgetPolicy.model_validate({"header": "X-Retry-Attempt", "window": "250ms"})
    assert policy.header == "x-retry-attempt"
    assert policy.window == 0.25


@pytest.mark.parametrize(("data", "field"), [
    ({"ratio": 1.5}, "ratio"),
    ({"ratio": -0.1}, "ratio"),
    ({"min_per_second": -1}, "min_per_second"),
    ({"window": "0s"}, "window"),
    ({"window": "2h"}, "window"),
    ({"window": "soon"}, "window"),
    ({"header": "bad header"}, "header"),
    ({"budget": 3}, "budget"),
])
def test_policy_refuses_bad_values(data: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        RetryBudgetPolicy.model_validate(data)
    assert info.value.errors()[0]["loc"][0] == field


def test_reserved_retries_are_let_through_and_never_exceed_the_budget() -> None:
    budget = RetryBudget(ratio=0.0, min_per_second=0.2, window_s=10.0)  # room for 2 retries
    assert budget.reserve(0.0)
    assert budget.reserve(0.1)
    # No room left: the next rejection must tell its client not to retry.
    assert not budget.reserve(0.2)
    # The two clients told to retry come back (retries are not told apart: any pays with any
    # reservation); a third retry finds neither a reservation nor room.
    assert budget.try_withdraw(1.0)
    assert budget.try_withdraw(1.5)
    assert not budget.try_withdraw(1.6)


def test_reservations_lapse_with_the_window() -> None:
    budget = RetryBudget(ratio=0.0, min_per_second=0.1, window_s=10.0)  # room for 1 retry
    assert budget.reserve(0.0)
    # Never used: after the window it pays for nothing, and the room it took is back.
    assert budget.balance(20.0) >= 1
    assert budget.try_withdraw(20.0)
    assert not budget.try_withdraw(20.1)

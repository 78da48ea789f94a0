"""Budget: per-key token buckets that start full, refill, go into debt, and stay bounded."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.budget import Budget, Refill

TEN_PER_SECOND = Refill(per_second=10.0, burst=5.0)


def test_a_new_key_starts_full_and_takes_until_empty() -> None:
    budget = Budget(max_keys=10)
    verdicts = [budget.take("acme", TEN_PER_SECOND, 1, now=0.0) for _ in range(6)]
    assert [v.allowed for v in verdicts] == [True] * 5 + [False]
    assert [v.remaining for v in verdicts] == [4, 3, 2, 1, 0, 0]
    assert verdicts[0].wait_s == 0.0
    # Empty: one unit comes back after 1/10 s, the whole burst after 1/2 s.
    assert verdicts[-1].wait_s == pytest.approx(0.1)
    assert verdicts[-1].full_s == pytest.approx(0.5)


def test_a_refused_take_takes_nothing() -> None:
    budget = Budget(max_keys=10)
    assert budget.take("acme", TEN_PER_SECOND, 4, now=0.0).allowed
    refused = budget.take("acme", TEN_PER_SECOND, 3, now=0.0)
    assert not refused.allowed
    assert refused.remaining == 1
    assert refused.wait_s == pytest.approx(0.2)
    assert budget.take("acme", TEN_PER_SECOND, 1, now=0.0).allowed


def test_refill_is_continuous_and_capped_at_burst() -> None:
    budget = Budget(max_keys=10)
    budget.take("acme", TEN_PER_SECOND, 5, now=0.0)
    assert budget.check("acme", TEN_PER_SECOND, 1, now=0.25).remaining == pytest.approx(2.5)
    later = budget.check("acme", TEN_PER_SECOND, 1, now=100.0)
    assert later.remaining == 5.0
    assert later.full_s == 0.0


def test_keys_are_independent() -> None:
    budget = Budget(max_keys=10)
    budget.take("acme", TEN_PER_SECOND, 5, now=0.0)
    assert not budget.take("acme", TEN_PER_SECOND, 1, now=0.0).allowed
    assert budget.take("globex", TEN_PER_SECOND, 5, now=0.0).allowed


def test_charge_goes_into_debt_and_check_refuses_until_it_is_repaid() -> None:
    tokens = Refill(per_second=100.0, burst=1000.0)
    budget = Budget(max_keys=10)
    assert budget.check("acme", tokens, 1, now=0.0).allowed
    charged = budget.charge("acme", tokens, 1500, now=0.0)
    assert charged.remaining == -500
    assert not charged.allowed
    during = budget.check("acme", tokens, 1, now=2.0)
    assert not during.allowed
    assert during.remaining == pytest.approx(-300)
    # 301 tokens short of one: 3.01 s more at 100 tokens/s.
    assert during.wait_s == pytest.approx(3.01)
    assert during.full_s == pytest.approx(13.0)
    assert budget.check("acme", tokens, 1, now=5.02).allowed


def test_charge_of_a_negative_amount_gives_nothing_back() -> None:
    budget = Budget(max_keys=10)
    budget.take("acme", TEN_PER_SECOND, 5, now=0.0)
    assert budget.charge("acme", TEN_PER_SECOND, -100, now=0.0).remaining == 0


def test_check_alone_stores_nothing() -> None:
    budget = Budget(max_keys=10)
    verdict = budget.check("acme", TEN_PER_SECOND, 1, now=0.0)
    assert verdict.allowed
    assert verdict.remaining == 5.0
    assert len(budget) == 0
    assert not budget.check("acme", TEN_PER_SECOND, 6, now=0.0).allowed


def test_least_recently_used_key_is_forgotten_first_and_comes_back_full() -> None:
    budget = Budget(max_keys=2)
    budget.take("a", TEN_PER_SECOND, 5, now=0.0)
    budget.take("b", TEN_PER_SECOND, 5, now=0.0)
    budget.check("a", TEN_PER_SECOND, 1, now=0.0)  # a is now more recent than b
    budget.take("c", TEN_PER_SECOND, 5, now=0.0)
    assert len(budget) == 2
    assert not budget.take("a", TEN_PER_SECOND, 1, now=0.0).allowed  # still tracked, still empty
    assert budget.take("b", TEN_PER_SECOND, 5, now=0.0).allowed  # forgotten: full again


def test_memory_stays_bounded_with_many_keys() -> None:
    budget = Budget(max_keys=100)
    for i in range(10_000):
        budget.take(f"tenant-{i}", TEN_PER_SECOND, 1, now=i * 0.001)
    assert len(budget) == 100


def test_resize_keeps_the_most_recent_keys() -> None:
    budget = Budget(max_keys=10)
    for name in "abcde":
        budget.take(name, TEN_PER_SECOND, 5, now=0.0)
    budget.resize(2)
    assert len(budget) == 2
    assert budget.max_keys == 2
    assert not budget.take("e", TEN_PER_SECOND, 1, now=0.0).allowed
    assert budget.take("a", TEN_PER_SECOND, 1, now=0.0).allowed


def test_a_clock_stepping_back_neither_drains_nor_fills() -> None:
    budget = Budget(max_keys=10)
    budget.take("acme", TEN_PER_SECOND, 5, now=10.0)
    assert budget.check("acme", TEN_PER_SECOND, 1, now=5.0).remaining == 0
    # Refill resumes from the latest time seen, not from the earlier one.
    assert budget.check("acme", TEN_PER_SECOND, 1, now=10.1).remaining == pytest.approx(1.0)


def test_a_smaller_burst_after_a_reload_caps_the_level() -> None:
    budget = Budget(max_keys=10)
    budget.take("acme", Refill(1.0, 100.0), 1, now=0.0)
    assert budget.check("acme", Refill(1.0, 3.0), 1, now=1.0).remaining == 3.0


@pytest.mark.parametrize(("per_second", "burst"), [(0, 1), (-1, 1), (1, 0), (1, -1), (math.inf, 1),
                                                   (1, math.nan), (math.nan, 1)])
def test_rate_refuses_nonsense(per_second: float, burst: float) -> None:
    with pytest.raises(ValueError, match="must be a positive number"):
        Refill(per_second, burst)


def test_max_keys_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_keys"):
        Budget(max_keys=0)
    with pytest.raises(ValueError, match="max_keys"):
        Budget(max_keys=1).resize(0)


@settings(max_examples=200, deadline=None)
@given(
    per_second=st.floats(0.1, 1000),
    burst=st.floats(1, 1000),
    steps=st.lists(st.tuples(st.floats(0, 2), st.floats(0, 50)), min_size=1, max_size=60),
)
def test_takes_never_exceed_burst_plus_refill(per_second: float, burst: float,
                                              steps: list[tuple[float, float]]) -> None:
    budget = Budget(max_keys=4)
    rate = Refill(per_second, burst)
    now = 0.0
    taken = 0.0
    for gap, amount in steps:
        now += gap
        verdict = budget.take("k", rate, amount, now)
        if verdict.allowed:
            taken += amount
        assert verdict.remaining <= burst + 1e-9
        assert verdict.remaining >= -1e-9
    assert taken <= burst + per_second * now + 1e-6


def test_random_mix_keeps_levels_within_bounds() -> None:
    rng = random.Random(7)
    budget = Budget(max_keys=8)
    rate = Refill(5.0, 20.0)
    now = 0.0
    for _ in range(2000):
        now += rng.uniform(0, 0.5)
        key = f"t{rng.randrange(20)}"
        op = rng.choice(["take", "charge", "check"])
        if op == "take":
            verdict = budget.take(key, rate, rng.uniform(0, 5), now)
        elif op == "charge":
            verdict = budget.charge(key, rate, rng.uniform(0, 30), now)
        else:
            verdict = budget.check(key, rate, 1, now)
        assert verdict.remaining <= 20.0
        assert verdict.wait_s >= 0
        assert verdict.full_s >= 0
        assert verdict.allowed == (verdict.wait_s == 0)
    assert len(budget) <= 8

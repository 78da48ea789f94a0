"""retry_after: whole seconds, bounded by the policy and by 60, jittered, never 0."""

from __future__ import annotations

import math
import random

import pytest

from extproc.core.retry import CEILING_S, retry_after
from extproc.policy.schema import RetryAfter

SPECIAL_DRAINS = [0.0, -0.0, -1.0, -1e308, 1e-12, 0.4, 1.0, 59.999, 60.0, 61.0, 1e9, 1e308,
                  math.inf, -math.inf, math.nan]


def drains(rng: random.Random) -> list[float]:
    uniform = [rng.uniform(-10, 200) for _ in range(50)]
    spread = [10 ** rng.uniform(-6, 12) for _ in range(20)]
    return SPECIAL_DRAINS + uniform + spread


def test_bounds_for_random_configs_and_drain_times() -> None:
    rng = random.Random(2024)
    for _ in range(300):
        low = rng.uniform(1, 60)
        config = RetryAfter(min=low, max=rng.uniform(low, 60), jitter=rng.choice([0.0, 1.0, rng.random()]))
        allowed_low = math.ceil(config.min)
        allowed_high = max(allowed_low, math.floor(config.max))
        for drain in drains(rng):
            value = retry_after(drain, config, random.Random(rng.getrandbits(32)))
            assert type(value) is int
            assert 1 <= value <= CEILING_S == 60
            assert allowed_low <= value <= allowed_high, (config, drain, value)


@pytest.mark.parametrize(("low", "high"), [(1, 1), (1, 30), (5, 10), (60, 60), (1, 60)])
def test_whole_second_configs_stay_within_min_and_max(low: int, high: int) -> None:
    rng = random.Random(low * 100 + high)
    for jitter in (0.0, 0.2, 1.0):
        config = RetryAfter(min=low, max=high, jitter=jitter)
        for drain in drains(rng):
            value = retry_after(drain, config, rng)
            assert low <= value <= high


def test_without_jitter_the_drain_time_is_rounded_up() -> None:
    config = RetryAfter(min=1, max=30, jitter=0)
    rng = random.Random(0)
    assert retry_after(7.2, config, rng) == 8
    assert retry_after(7.0, config, rng) == 7
    assert retry_after(0.0, config, rng) == 1
    assert retry_after(1000.0, config, rng) == 30
    assert retry_after(math.nan, config, rng) == 1
    assert retry_after(math.inf, config, rng) == 1  # unknown drain: the minimum, not the maximum


def test_unknown_drain_time_falls_back_to_min() -> None:
    config = RetryAfter(min=5, max=30, jitter=0)
    for drain in (0.0, -3.0, math.nan, math.inf, -math.inf):
        assert retry_after(drain, config, random.Random(1)) == 5


def test_jitter_spreads_values() -> None:
    config = RetryAfter(min=1, max=60, jitter=0.5)
    values = [retry_after(20.0, config, random.Random(seed)) for seed in range(200)]
    assert len(set(values)) >= 10
    assert min(values) >= 10
    assert max(values) <= 30
    # Spread on both sides of the drain time.
    assert min(values) < 20 < max(values)


def test_jitter_spreads_values_from_one_shared_generator() -> None:
    config = RetryAfter(min=1, max=30, jitter=0.2)
    rng = random.Random(9)
    values = {retry_after(15.0, config, rng) for _ in range(100)}
    assert len(values) > 1
    assert values <= set(range(12, 19))


def test_same_seed_same_value() -> None:
    config = RetryAfter(min=1, max=60, jitter=0.5)
    assert retry_after(20.0, config, random.Random(3)) == retry_after(20.0, config, random.Random(3))

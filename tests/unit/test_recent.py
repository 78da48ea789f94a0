"""The last minute's rates and wait percentiles per lane (the live view's numbers)."""

from __future__ import annotations

import pytest

from extproc.core.recent import ADMIT, REJECT, SHADOW, WAITS_PER_SECOND, Recent, quantile, weighted_quantile


def test_rates_and_percentiles_over_the_window() -> None:
    r = Recent(window_s=10.0)
    for i in range(100):
        r.add("a", ADMIT, i * 0.1, wait=i / 100)
    for i in range(20):
        r.add("a", REJECT, 5.0 + i * 0.1)
    r.add("b", SHADOW, 9.0, wait=0.0)
    summary = r.summary(10.0)
    a = summary["a"]
    assert a.admit_per_s == pytest.approx(10.0)
    assert a.reject_per_s == pytest.approx(2.0)
    assert a.wait_p50 == pytest.approx(0.49)
    assert a.wait_p95 == pytest.approx(0.94)
    b = summary["b"]
    assert b.shadow_reject_per_s == pytest.approx(0.1)
    assert b.admit_per_s == pytest.approx(0.1)


def test_old_records_fall_out_of_the_window() -> None:
    r = Recent(window_s=10.0)
    r.add("a", ADMIT, 0.0, wait=5.0)
    r.add("a", ADMIT, 15.0, wait=1.0)
    a = r.summary(20.0)["a"]
    assert a.wait_p95 == 1.0
    assert a.admit_per_s == pytest.approx(0.1)
    empty = r.summary(100.0)["a"]
    assert (empty.admit_per_s, empty.wait_p50) == (0.0, None)


def test_a_young_window_divides_by_the_time_it_has_seen() -> None:
    r = Recent(window_s=60.0)
    for i in range(10):
        r.add("a", ADMIT, 100.0 + i * 0.5)
    assert r.summary(105.0)["a"].admit_per_s == pytest.approx(2.0)


def test_quantile_is_nearest_rank() -> None:
    assert quantile([], 0.5) is None
    assert quantile([1.0], 0.95) == 1.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.95) == 4.0


def test_memory_is_bounded_by_the_window_not_the_rate() -> None:
    # 10,000 decisions a second for two minutes: a record per decision would hold 600,000.
    r = Recent(window_s=60.0)
    for i in range(1_200_000):
        r.add("a", ADMIT if i % 10 else REJECT, i / 10_000, wait=(i % 1000) / 1000)
    assert r.records() <= 61 * (1 + WAITS_PER_SECOND)
    a = r.summary(120.0)["a"]
    # The rates stay exact; the percentiles come from the sample, within a few per cent.
    assert a.admit_per_s == pytest.approx(9_000.0, rel=0.02)
    assert a.reject_per_s == pytest.approx(1_000.0, rel=0.02)
    assert a.wait_p50 == pytest.approx(0.5, abs=0.05)
    assert a.wait_p95 == pytest.approx(0.95, abs=0.03)


def test_a_busy_second_weighs_as_much_as_its_traffic() -> None:
    # One second of 10,000 short waits, one of 10 long ones: the long ones are 0.1 % of the traffic,
    # so they must not reach the median although each second keeps the same number of samples.
    r = Recent(window_s=60.0)
    for i in range(10_000):
        r.add("a", ADMIT, 1.0 + i / 10_001, wait=0.001)
    for i in range(10):
        r.add("a", ADMIT, 2.0 + i / 11, wait=9.0)
    a = r.summary(3.0)["a"]
    assert (a.wait_p50, a.wait_p95) == (0.001, 0.001)


def test_weighted_quantile_with_unit_weights_is_nearest_rank() -> None:
    for n in (1, 2, 3, 7, 100):
        values = [float(v) for v in range(n)]
        for q in (0.0, 0.5, 0.95, 1.0):
            assert weighted_quantile([(v, 1.0) for v in values], q) == quantile(values, q)
    assert weighted_quantile([], 0.5) is None

"""The last minute's rates and wait percentiles per lane (the live view's numbers)."""

from __future__ import annotations

import pytest

from extproc.core.recent import ADMIT, REJECT, SHADOW, Recent, quantile


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

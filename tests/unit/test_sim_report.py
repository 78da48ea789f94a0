"""Load-test arithmetic on known inputs."""

from __future__ import annotations

import pytest

from extproc.sim.report import Result, Slo, grouped, length_class, percentile, summarise


def test_percentile_on_known_inputs() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None
    assert percentile([5.0, 1.0], 0) == 1.0


def row(i: int, status: int, ttft: float | None, e2e: float | None, attempts: int = 1, cls: str = "a",
        output: int = 50) -> Result:
    return Result(i, cls, "t", float(i), status, ttft, e2e, attempts, output)


def test_summary_goodput_rejections_and_retry_amplification() -> None:
    rows = [
        row(0, 200, 0.5, 2.0),            # meets the SLO
        row(1, 200, 1.5, 3.0),            # TTFT too slow: served but not good
        row(2, 200, 0.2, 20.0, 2),        # E2E too slow, after one retry
        row(3, 429, None, None, 3),       # rejected after two retries
        row(4, -1, None, None),           # client timeout
        row(5, 0, None, None, 3),         # connection errors
    ]
    s = summarise(rows, {"a": Slo(ttft=1.0, e2e=10.0)}, duration=2.0)
    assert (s.requests, s.ok, s.rejected, s.timeouts, s.errors, s.met_slo) == (6, 3, 1, 1, 1, 1)
    assert s.goodput_rps == pytest.approx(0.5)
    assert s.throughput_rps == pytest.approx(1.5)
    assert s.rejection_rate == pytest.approx(1 / 6)
    assert s.retry_amplification == pytest.approx(11 / 6)
    assert s.ttft["p50"] == pytest.approx(0.5)
    assert s.e2e["p99"] == pytest.approx(3.0 + (20.0 - 3.0) * 0.98)


def test_summary_splits_first_attempts_and_the_engines_share_of_a_ttft() -> None:
    rows = [
        Result(0, "a", "t", 0.0, 200, 0.5, 2.0, 1, 50, engine_ttft=0.1),
        Result(1, "a", "t", 1.0, 200, 8.0, 9.0, 2, 50, engine_ttft=0.2),   # served on its retry
        Result(2, "a", "t", 2.0, 200, 0.3, 1.0, 1, 50),                    # over HTTP: engine unknown
        Result(3, "a", "t", 3.0, 429, None, None, 3, 50),
    ]
    s = summarise(rows, {"a": Slo(ttft=1.0, e2e=10.0)}, duration=1.0)
    assert s.retried == 1
    assert s.first_attempt_ttft["p50"] == pytest.approx(0.4)
    assert s.first_attempt_ttft["p99"] == pytest.approx(0.3 + 0.2 * 0.99)
    assert s.ttft["p99"] > 7.0
    assert s.engine_ttft["p50"] == pytest.approx(0.15)
    assert summarise(rows[2:], {}, 1.0).engine_ttft["p99"] is None


def test_grouped_by_class_and_by_length_judges_each_request_by_its_class_slo() -> None:
    slos = {"fast": Slo(ttft=0.1, e2e=1.0), "slow": Slo(ttft=10, e2e=100)}
    rows = [row(0, 200, 0.5, 0.9, cls="fast"), row(1, 200, 0.5, 50, cls="slow", output=2000)]
    per_class = grouped(rows, slos, 1.0)
    assert per_class["fast"].met_slo == 0
    assert per_class["slow"].met_slo == 1
    per_length = grouped(rows, slos, 1.0, key=length_class)
    assert set(per_length) == {"short", "long"}
    assert per_length["long"].met_slo == 1

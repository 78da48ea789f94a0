"""Saturation rules: thresholds with hysteresis, min_active, staleness policies, per-lane effects."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.saturation import NO_EFFECT, Effect, Reading, Saturation, is_stale
from extproc.policy.signals import Signals


def rule(name: str = "backlog", signal: str = "pending", **extra: Any) -> dict[str, Any]:
    return {"name": name, "signal": signal, "above": 10, "below": 5, **extra}


def config(*rules: dict[str, Any], on_stale: str = "ignore", stale_after: str = "10s") -> Signals:
    return Signals.model_validate({
        "sources": {"prom": {"prometheus": {"url": "http://127.0.0.1:9090", "interval": "1s"}}},
        "read": {
            "pending": {"source": "prom", "query": "sum(kueue_pending_workloads)", "stale_after": stale_after,
                        "on_stale": on_stale},
            "kv": {"source": "prom", "query": "max(vllm:kv_cache_usage_perc)", "stale_after": stale_after,
                   "on_stale": on_stale},
        },
        "saturation": list(rules),
    })


def at(value: float, now: float, **more: float) -> dict[str, Reading]:
    readings = {"pending": Reading(value, now)}
    readings.update({name: Reading(v, now) for name, v in more.items()})
    return readings


def active(s: Saturation, now: float) -> dict[str, bool]:
    return {state.name: state.active for state in s.rules(now)}


# -- thresholds and hysteresis ------------------------------------------------------------------


def test_a_value_above_the_threshold_activates_and_sheds_naming_rule_and_signal() -> None:
    s = Saturation(config(rule(shed=["best-effort"], shrink={"batch": 0.5})))
    assert s.update(at(10, 0.0), 0.0) == []  # equal is not above
    assert s.effect("best-effort") == NO_EFFECT

    [change] = s.update(at(11, 1.0), 1.0)
    assert (change.rule, change.signal, change.active, change.at, change.value, change.stale) == (
        "backlog", "pending", True, 1.0, 11.0, False)
    assert change.why == "pending = 11 > above 10"
    assert s.effect("best-effort") == Effect(shed_by="backlog", signal="pending")
    assert s.effect("best-effort").shed
    assert s.effect("batch") == Effect(factor=0.5, shrunk_by="backlog", signal="pending")
    assert not s.effect("batch").shed
    assert s.effect("interactive") is NO_EFFECT


def test_between_below_and_above_the_rule_keeps_its_state_both_ways() -> None:
    s = Saturation(config(rule(shed=["best-effort"])))
    for now, value in enumerate([7, 9, 10, 6]):
        assert s.update(at(value, now), now) == [], value
    assert s.update(at(12, 10), 10)  # activates
    for now, value in enumerate([9, 7, 5, 10, 6], start=11):
        assert s.update(at(value, now), now) == [], value  # 5 is not below 5
        assert s.effect("best-effort").shed
    [change] = s.update(at(4.9, 20), 20)
    assert not change.active
    assert change.why == "pending = 4.9 < below 5"
    assert s.effect("best-effort") is NO_EFFECT


def test_without_below_the_threshold_is_the_same_both_ways() -> None:
    s = Saturation(config({"name": "r", "signal": "pending", "above": 10, "shed": ["x"]}))
    assert s.update(at(11, 0), 0)
    assert s.update(at(10, 1), 1) == []
    [change] = s.update(at(9.5, 2), 2)
    assert change.why == "pending = 9.5 < below 10"


def test_min_active_holds_a_rule_even_when_the_value_drops() -> None:
    s = Saturation(config(rule(min_active="10s", shed=["best-effort"])))
    s.update(at(20, 100.0), 100.0)
    assert s.update(at(0, 101.0), 101.0) == []
    assert s.update(at(0, 109.9), 109.9) == []
    assert s.effect("best-effort").shed
    [change] = s.update(at(0, 110.0), 110.0)
    assert not change.active
    # Once released it takes a value above `above` again, however soon.
    assert s.update(at(8, 110.5), 110.5) == []
    assert s.update(at(11, 111.0), 111.0)


@given(st.lists(st.floats(min_value=0, max_value=20, allow_nan=False), max_size=60))
def test_state_changes_only_across_the_band(values: list[float]) -> None:
    s = Saturation(config(rule(shed=["x"])))
    expected = False
    for now, value in enumerate(values):
        changes = s.update(at(value, now), now)
        if not expected and value > 10:
            expected = True
        elif expected and value < 5:
            expected = False
        assert s.effect("x").shed is expected
        assert len(changes) <= 1
        assert all(change.active is expected for change in changes)


# -- stale signals --------------------------------------------------------------------------------


def test_is_stale_counts_from_the_last_good_reading_or_from_when_watching_began() -> None:
    assert not is_stale(Reading(1.0, 100.0), 10, 110.0, 0.0)
    assert is_stale(Reading(1.0, 100.0), 10, 110.1, 0.0)
    # A failed poll keeps the last good value and time: its age decides.
    assert is_stale(Reading(1.0, 100.0, "timeout: no answer"), 10, 111.0, 0.0)
    assert not is_stale(None, 10, 105.0, 100.0)
    assert is_stale(None, 10, 110.5, 100.0)
    assert is_stale(Reading(None, None, "unreachable: refused"), 10, 111.0, 100.0)
    assert is_stale(Reading(math.nan, 105.0), 10, 111.0, 100.0)


def test_on_stale_ignore_releases_an_active_rule_and_never_activates_one() -> None:
    s = Saturation(config(rule(min_active="1h", shed=["best-effort"]), on_stale="ignore", stale_after="10s"))
    s.update(at(50, 0.0), 0.0)
    assert s.update({"pending": Reading(50, 0.0, "unreachable: refused")}, 10.0) == []
    [change] = s.update({"pending": Reading(50, 0.0, "unreachable: refused")}, 10.5)
    assert not change.active
    assert change.stale
    assert change.why == "signal pending is stale (on_stale: ignore)"
    assert s.effect("best-effort") is NO_EFFECT  # fails open despite min_active
    assert s.update({}, 100.0) == []
    assert s.update(at(50, 101.0), 101.0)  # fresh again: acts again


def test_on_stale_saturated_activates_once_stale_and_releases_when_fresh_and_low() -> None:
    s = Saturation(config(rule(shed=["best-effort"], shrink={"batch": 0.25}), on_stale="saturated",
                          stale_after="10s"))
    # A replica that has just started gets stale_after to make its first reading.
    assert s.update({}, 1000.0) == []
    assert s.update({}, 1010.0) == []
    [change] = s.update({}, 1010.5)
    assert change.active
    assert change.stale
    assert change.value is None
    assert change.why == "signal pending is stale (on_stale: saturated)"
    assert s.effect("best-effort") == Effect(shed_by="backlog", signal="pending")
    assert s.effect("batch").limit(8) == 2
    # Fresh but inside the band: hysteresis keeps it.
    assert s.update(at(7, 1011), 1011) == []
    [change] = s.update(at(1, 1012), 1012)
    assert not change.active
    assert not change.stale


def test_on_stale_hold_keeps_whatever_state_the_rule_had() -> None:
    s = Saturation(config(rule(name="on", shed=["a"]), rule(name="off", signal="kv", shed=["b"]),
                          on_stale="hold", stale_after="5s"))
    s.update(at(20, 0.0, kv=1), 0.0)
    assert active(s, 0.0) == {"on": True, "off": False}
    assert s.update({}, 100.0) == []
    assert active(s, 100.0) == {"on": True, "off": False}
    assert all(state.stale for state in s.rules(100.0))
    assert s.update(at(0, 101.0, kv=20), 101.0)
    assert active(s, 101.0) == {"on": False, "off": True}


def test_a_nan_reading_is_no_reading() -> None:
    s = Saturation(config(rule(shed=["x"]), on_stale="saturated", stale_after="1s"))
    s.update({"pending": Reading(math.nan, 0.0)}, 0.0)
    assert s.update({"pending": Reading(math.nan, 2.0)}, 2.0)[0].why.endswith("(on_stale: saturated)")


# -- several rules, effects, reporting ---------------------------------------------------------


def test_several_active_rules_shed_if_any_does_and_take_the_smallest_factor() -> None:
    s = Saturation(config(
        rule(name="kv-full", signal="kv", above=0.9, below=0.8, shrink={"batch": 0.5, "interactive": 0.8}),
        rule(name="backlog", shed=["best-effort", "batch"], shrink={"interactive": 0.5}),
        rule(name="deep-backlog", above=50, below=40, shed=["best-effort"], shrink={"batch": 0.1}),
    ))
    s.update(at(60, 0.0, kv=0.95), 0.0)
    assert active(s, 0.0) == {"kv-full": True, "backlog": True, "deep-backlog": True}
    # The first shedding rule in policy order is the cause that is reported.
    assert s.effect("best-effort") == Effect(shed_by="backlog", signal="pending")
    assert s.effect("batch") == Effect(shed_by="backlog", signal="pending", factor=0.1,
                                       shrunk_by="deep-backlog")
    assert s.effect("interactive") == Effect(factor=0.5, shrunk_by="backlog", signal="pending")

    s.update(at(1, 1.0, kv=0.95), 1.0)
    assert active(s, 1.0) == {"kv-full": True, "backlog": False, "deep-backlog": False}
    assert s.effect("batch") == Effect(factor=0.5, shrunk_by="kv-full", signal="kv")
    assert s.effect("best-effort") is NO_EFFECT
    assert s.lanes() == ["batch", "best-effort", "interactive"]


def test_a_dry_run_rule_reports_without_effect() -> None:
    s = Saturation(config(rule(name="watch")))
    assert s.update(at(99, 0.0), 0.0)
    assert active(s, 0.0) == {"watch": True}
    assert s.lanes() == []


@pytest.mark.parametrize(("factor", "base", "limit"), [
    (1.0, 7, 7), (0.5, 10, 5), (0.5, 7, 3), (0.1, 3, 1), (0.01, 1, 1),
])
def test_a_shrunk_limit_rounds_down_but_keeps_one_slot(factor: float, base: int, limit: int) -> None:
    assert Effect(factor=factor).limit(base) == limit


def test_rules_report_value_staleness_error_and_since() -> None:
    s = Saturation(config(rule(shed=["best-effort"], shrink={"batch": 0.5}), stale_after="10s"))
    assert [r.active for r in s.rules(0.0)] == [False]
    assert s.rules(0.0)[0].since is None
    s.update(at(12, 5.0), 5.0)
    s.update({"pending": Reading(12, 5.0, "timeout: no answer")}, 6.0)
    [state] = s.rules(7.0)
    assert (state.name, state.signal, state.active, state.since, state.value, state.stale, state.error) == (
        "backlog", "pending", True, 5.0, 12.0, False, "timeout: no answer")
    assert state.shed == ("best-effort",)
    assert state.shrink == {"batch": 0.5}
    assert s.rules(15.5)[0].stale


def test_reconfigure_keeps_surviving_rules_and_drops_the_rest() -> None:
    s = Saturation(config(rule(name="backlog", shed=["best-effort"]), rule(name="gone", shed=["batch"])))
    s.update(at(20, 0.0), 0.0)
    assert s.effect("batch").shed

    s.reconfigure(config(rule(name="backlog", above=30, below=25, shed=["best-effort"]),
                         rule(name="new", signal="kv", above=0.9, shed=["batch"])))
    assert active(s, 1.0) == {"backlog": True, "new": False}
    assert s.effect("best-effort").shed
    assert s.effect("batch") is NO_EFFECT  # "gone" no longer sheds it
    # The surviving rule is judged by its new thresholds: 20 is below the new release point.
    [change] = s.update(at(20, 2.0, kv=0.5), 2.0)
    assert (change.rule, change.active) == ("backlog", False)


def test_reconfigure_to_another_signal_restarts_the_grace_for_a_first_reading() -> None:
    s = Saturation(config(rule(shed=["x"]), on_stale="saturated", stale_after="10s"))
    s.update(at(1, 0.0), 0.0)
    s.reconfigure(config(rule(signal="kv", shed=["x"]), on_stale="saturated", stale_after="10s"))
    # Without the restart the never-read kv signal would count as stale since t=0.
    assert s.update({}, 50.0) == []
    assert s.update({}, 60.5)[0].why == "signal kv is stale (on_stale: saturated)"

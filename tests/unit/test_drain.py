"""How fast lanes drain, and the Retry-After it gives: pure, explicit time."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from extproc.core.admission import Scheduler
from extproc.core.decision import Outcome, Reason
from extproc.core.drain import FleetRate, Rate, RetryCalendar
from extproc.core.edge import SchedulerPressure
from tests.unit.test_admission import job, lane, make_policy


def test_a_rate_follows_the_events_and_decays_without_them() -> None:
    rate = Rate(tau=10)
    assert rate.value(0) == 0
    assert not rate.known(0)
    for t in range(100):  # 2 events per second for 50 s
        rate.add(t / 2)
    assert rate.known(50)
    assert rate.value(49.5) == pytest.approx(2.0, rel=0.05)
    assert rate.value(59.5) == pytest.approx(2.0 / math.e, rel=0.05)  # one tau without events


def test_fleet_rate_reads_counters_and_survives_a_reset() -> None:
    fleet = FleetRate(tau=10)
    fleet.update({"a": 100}, 0)  # a baseline, not 100 completions at once
    assert fleet.rates(0) == {}
    for t in range(1, 31):
        fleet.update({"a": 100 + 3 * t, "b": 7}, t)
    rates = fleet.rates(30)
    assert rates["a"] == pytest.approx(3.0, rel=0.1)
    assert rates["b"] == 0  # watched for a while, nothing completed
    fleet.update({"a": 2}, 31)  # the store restarted empty: a new baseline, no negative rate
    assert fleet.rates(31)["a"] > 0


def drained_scheduler(rate_per_s: float, seconds: float = 30.0) -> tuple[Scheduler, float]:
    """Lane a (2 slots) kept full for ``seconds`` with completions at ``rate_per_s``."""
    s = Scheduler(make_policy([lane("a", 2, max_queued=50)]), rng=random.Random(0))
    now = 0.0
    running = [s.submit("a", "t", job(), now)[0].ticket for _ in range(2)]
    gap = 1 / rate_per_s
    while now < seconds:
        now += gap
        done = running.pop(0)
        admitted = s.release(done, now)
        if not admitted:
            admitted = [s.submit("a", "t", job(), now)[0]]
        running.extend(d.ticket for d in admitted)
    return s, now


def test_drain_wait_is_the_queue_ahead_over_the_measured_rate() -> None:
    s, now = drained_scheduler(rate_per_s=4.0)
    assert s.drain_rate("a", now) == pytest.approx(4.0, rel=0.1)
    for _ in range(7):
        assert s.submit("a", "t", job(), now)[0].outcome is Outcome.QUEUED
    assert s.drain_wait("a", now) == pytest.approx(8 / 4.0, rel=0.1)  # 7 ahead, then itself
    s.set_others({}, {"a": 12}, now)  # other replicas queue 12 more in the lane
    s.set_drain_rates({"a": 10.0}, replicas=2)  # and the fleet drains faster than this one alone
    assert s.drain_wait("a", now) == pytest.approx(20 / 10.0)
    # The edge answers from the same drain as the scheduler's own rejections.
    edge = SchedulerPressure(s, lambda: now)
    assert edge.drain_s("a") == s.drain_wait("a", now)
    # Given that drain (2 s), the edge books the lane's return schedule as ext_proc does: 2 s, and
    # the next client (ext_proc's) 1/5 s later, at this replica's half of 10/s: ceil(2.2) = 3 s.
    assert edge.retry_after("a", Reason.QUEUE_FULL, edge.drain_s("a")) == 2
    assert s.retry_after(Reason.QUEUE_FULL, "a", now) == 3


def test_drain_wait_is_zero_with_a_slot_free_and_list_scheduling_before_any_rate() -> None:
    s = Scheduler(make_policy([lane("a", 2, max_queued=50)]), rng=random.Random(0))
    assert s.drain_wait("a", 0) == 0
    for _ in range(3):
        s.submit("a", "t", job(1.0), 0)
    assert s.drain_rate("a", 0) is None
    assert s.drain_wait("a", 0) == pytest.approx(s.backlog_wait("a", 0))
    assert s.drain_wait("nope", 0) == 0


def test_retry_after_follows_the_drain() -> None:
    s, now = drained_scheduler(rate_per_s=1.0)
    for _ in range(50):
        s.submit("a", "t", job(), now)
    decision = s.submit("a", "t", job(), now)[0]  # the queue is full
    assert decision.outcome is Outcome.REJECTED
    assert decision.reason is Reason.QUEUE_FULL
    config = s.policy.retry_after
    # 50 ahead at one per second: far beyond the policy's ceiling, so the ceiling (jittered down).
    assert config.max * (1 - config.jitter) - 1 <= decision.retry_after <= config.max


def test_the_calendar_books_returns_no_faster_than_the_lane_drains() -> None:
    calendar = RetryCalendar()
    told = [calendar.book("a", 100.4, earliest=2.5, latest=6, rate=2.0) for _ in range(9)]
    assert told == [3, 3, 4, 4, 5, 5, 6, 6, None]  # from ceil(2.5), two a second, then full
    slow = [calendar.book("b", 100.4, earliest=0.2, latest=20, rate=0.2) for _ in range(4)]
    assert slow == [1, 6, 11, 16]  # one every 5 s: a lane completing one request per 5 s
    assert calendar.book("c", 0, earliest=math.inf, latest=6, rate=1.0) is None
    assert calendar.book("c", 0, earliest=9, latest=6, rate=1.0) is None  # beyond what it may say
    calendar.forget({"a"})
    assert calendar.book("b", 100.4, earliest=0.2, latest=20, rate=0.2) == 1  # b was forgotten


def test_a_burst_of_rejections_is_told_to_come_back_at_the_pace_the_lane_drains() -> None:
    s, now = drained_scheduler(rate_per_s=4.0)
    for _ in range(50):
        s.submit("a", "t", job(), now)
    told = [s.submit("a", "t", job(), now)[0].retry_after for _ in range(40)]  # the queue is full
    assert all(t is not None for t in told)
    per_second = Counter(told)
    assert max(per_second.values()) <= 4  # no wave: at most what the lane completes per second
    assert min(t for t in told if t is not None) >= 10  # 51 ahead at 4/s: not before the drain
    assert len(per_second) >= 8


def test_a_lane_idle_for_hours_keeps_its_pace_and_never_breaks_retry_after() -> None:
    s, now = drained_scheduler(rate_per_s=4.0)
    for ticket in list(s._inflight["a"].values()):  # the lane empties, then idles for two hours
        s.release(ticket, now)
    later = now + 7200
    assert s.drain_rate("a", later) == pytest.approx(4.0, rel=0.1)  # paused, not decayed
    decisions = [s.submit("a", "t", job(), later)[0] for _ in range(70)]  # a burst: no exception
    rejected = [d for d in decisions if d.outcome is Outcome.REJECTED]
    assert rejected
    assert all(d.retry_after is not None and 1 <= d.retry_after <= 30 for d in rejected)


def test_a_rate_too_slow_to_say_falls_back_to_list_scheduling() -> None:
    s = Scheduler(make_policy([lane("a", 1, max_queued=5)]), rng=random.Random(0))
    first = s.submit("a", "t", job(), 0)[0].ticket
    s.release(first, 0.5)
    assert s.submit("a", "t", job(), 0.5)[0].outcome is Outcome.ADMITTED  # busy, nothing completes
    s.submit("a", "t", job(), 0.5)
    assert s.drain_rate("a", 10_000) is None  # decayed below one per 1,000 s: not a pace
    assert s.drain_wait("a", 10_000) == pytest.approx(s.backlog_wait("a", 10_000))
    assert s.submit("a", "t", job(), 10_000)[0].outcome is Outcome.QUEUED  # no OverflowError
    told = s.retry_after(Reason.QUEUE_FULL, "a", 10_000)
    assert 1 <= told <= s.policy.retry_after.max


def test_fleet_rate_rebaselines_after_missed_readings() -> None:
    fleet = FleetRate(tau=10)
    for t in range(0, 31):
        fleet.update({"a": 100 * t}, t)  # 100 per second
    assert fleet.rates(30)["a"] == pytest.approx(100, rel=0.1)
    fleet.update({"a": 100 * 60}, 60)  # 30 s without a reading: not 3,000 completions at once
    assert fleet.rates(60)["a"] < 100
    fleet.update({"b": 3}, 61)  # a lane gone from the store (a reload) is forgotten
    assert "a" not in fleet.rates(61)


def test_this_replica_s_own_rate_drains_only_its_own_queue() -> None:
    s, now = drained_scheduler(rate_per_s=4.0)
    for _ in range(3):
        s.submit("a", "t", job(), now)
    s.set_others({}, {"a": 40}, now)  # others queue 40, but the fleet's rate is not known
    assert s.drain_wait("a", now) == pytest.approx(4 / 4.0, rel=0.1)
    s.set_drain_rates({"a": 8.0}, replicas=2)
    assert s.drain_wait("a", now) == pytest.approx(44 / 8.0)

"""How fast lanes drain, and the Retry-After it gives: pure, explicit time."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest

from extproc.core.admission import Scheduler
from extproc.core.decision import Outcome, Reason, reject
from extproc.core.drain import CompletionRate, FleetRate, ReturnSchedule
from extproc.core.edge import SchedulerPressure
from extproc.core.machine import Machine
from tests.unit.test_admission import job, lane, make_policy


def test_a_rate_follows_the_events_and_decays_without_them() -> None:
    rate = CompletionRate(tau=10)
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


def drained_scheduler(rate_per_s: float, seconds: float = 30.0, scheduler: Scheduler | None = None,
                      **policy: object) -> tuple[Scheduler, float]:
    """Lane a (2 slots) kept full for ``seconds`` with completions at ``rate_per_s``; tenants come
    from a header the gateway vouches for (only such a tenant may claim a booked return)."""
    policy = {"tenants": {"header": "x-tenant"}, "trusted_headers": ["x-tenant"], **policy}
    s = scheduler or Scheduler(make_policy([lane("a", 2, max_queued=50)], **policy), rng=random.Random(0))
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
    # Short requests (16 tokens unless a body says otherwise): a return fits the lane's allowance.
    s, now = drained_scheduler(rate_per_s=4.0, estimation={"default_max_tokens": 16})
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
    # the next client (ext_proc's) one place later: retry_after.share (0.08) of this replica's
    # half of 10/s is one return per 2.5 s, so ceil(4.5) = 5 s.
    told = edge.retry_after("a", Reason.QUEUE_FULL, edge.drain_s("a"), "t")
    assert (told.seconds, told.ms, told.booked, told.allowed) == (2, 2000, True, True)
    # Sized as ext_proc sizes a request whose body it did not read: the return's slot time is
    # spent as ext_proc would spend it (a long default size finds none: no return promised).
    long_jobs, _ = drained_scheduler(rate_per_s=4.0, estimation={"default_max_tokens": 4000})
    for _ in range(7):
        long_jobs.submit("a", "t", job(), now)
    edge = SchedulerPressure(long_jobs, lambda: now)
    told = edge.retry_after("a", Reason.QUEUE_FULL, edge.drain_s("a"), "t")
    assert (told.booked, told.allowed) == (False, False)
    assert s.retry_after(Reason.QUEUE_FULL, "a", now, tenant="t").seconds == 5


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


def test_the_schedule_books_returns_no_faster_than_its_pace() -> None:
    schedule = ReturnSchedule()
    due = []
    for _ in range(9):
        at = schedule.place("a", 100.4, earliest=2.5, latest=6, pace=2.0)
        if at is not None:
            schedule.book("a", "t", at, 2.0, 100.4, now=100.4)
        due.append(at)
    assert due[:8] == pytest.approx([102.9, 103.4, 103.9, 104.4, 104.9, 105.4, 105.9, 106.4])
    assert due[8] is None
    assert len(schedule) == 8  # full to the longest wait: the ninth is not booked
    assert schedule.place("c", 0, earliest=math.inf, latest=6, pace=1.0) is None
    assert schedule.place("c", 0, earliest=9, latest=6, pace=1.0) is None  # beyond what it may say
    assert schedule.place("c", 0, earliest=1, latest=6, pace=0.0) is None
    schedule.forget({"b"})
    assert len(schedule) == 0
    assert schedule.place("a", 100.4, earliest=2.5, latest=6, pace=2.0) == pytest.approx(102.9)


def test_a_claim_takes_one_booking_of_its_own_tenant_and_lane_around_its_due_time() -> None:
    schedule = ReturnSchedule()
    schedule.book("a", "acme", 10.0, 1.0, first=3.0, now=0)
    schedule.book("a", "acme", 11.0, 1.0, first=4.0, now=0)
    assert schedule.claim("a", "globex", 10.0) is None  # another tenant's booking: nothing
    assert schedule.claim("b", "acme", 10.0) is None  # another lane's: nothing
    assert schedule.claim("a", "acme", 8.9) is None  # more than EARLY before it is due
    assert schedule.claimable("a", "acme", 9.5)  # asking takes a pass, not the booking
    assert schedule.claim("a", "acme", 9.5) == 3.0  # the earliest, with its first attempt's arrival
    assert schedule.claim("a", "acme", 10.2) == 4.0
    assert schedule.claim("a", "acme", 10.4) is None  # both consumed: a third retry is ordinary
    assert len(schedule) == 0


def test_bookings_lapse_late_after_their_due_time() -> None:
    schedule = ReturnSchedule()
    schedule.book("a", "t", 10.0, 1.0, first=0.0, now=0)
    schedule.book("a", "u", 10.0, 1.0, first=0.0, now=0)
    assert not schedule.claimable("a", "t", 10.0 + schedule.LATE + 0.01)
    assert schedule.claim("a", "t", 10.0 + schedule.LATE + 0.01) is None
    assert len(schedule) == 1  # u's is still counted until a sweep
    schedule.expire(100.0)
    assert len(schedule) == 0


def full_lane(rate_per_s: float = 4.0, **policy: object) -> tuple[Scheduler, float]:
    """Lane a kept busy at ``rate_per_s``, then its queue filled (50 places)."""
    s, now = drained_scheduler(rate_per_s, **policy)
    for _ in range(50):
        s.submit("a", "t", job(), now)
    return s, now


def test_a_booked_retry_claims_its_place_and_a_forged_one_gains_nothing() -> None:
    s, now = full_lane()
    # A retry header alone holds no booking: refused like any request (and booked, as any is).
    rejected = s.submit("a", "t", job(), now, retry=True)[0]
    assert rejected.outcome is Outcome.REJECTED
    assert rejected.ticket.first is None
    assert rejected.retry_after_ms is not None
    assert rejected.retry_allowed
    due = now + rejected.retry_after_ms / 1000
    # Meanwhile the lane moved on: slots freed and newer arrivals refilled the queue.
    later = now + 2
    for ticket in list(s._lanes.inflight["a"].values()):
        s.release(ticket, later)
    while s.submit("a", "t", job(), later)[0].outcome is Outcome.QUEUED:
        pass
    assert s.submit("a", "t", job(), due - 2, retry=True)[0].outcome is Outcome.REJECTED  # too early
    # The booked client comes back on time: it ranks from its first attempt, ahead of what arrived
    # since, and takes the place of the worst of those.
    back, evicted = s.submit("a", "t", job(), due, retry=True)
    assert back.outcome is Outcome.QUEUED
    assert back.ticket.first == rejected.ticket.arrival == back.ticket.entry.rank
    assert [d.reason for d in evicted] == [Reason.EVICTED]
    assert evicted[0].ticket.arrival == later
    # Its booking is spent: the same claim again is an ordinary (refused) request.
    again = s.submit("a", "t", job(), due, retry=True)[0]
    assert again.outcome is Outcome.REJECTED
    assert again.ticket.first is None


def test_the_default_tenant_cannot_claim_anyones_return() -> None:
    # Without a tenant the gateway vouches for, anyone is the default tenant: no claims at all.
    s, now = drained_scheduler(4.0, tenants={"header": "x-tenant", "default": "anonymous"})
    for _ in range(50):
        s.submit("a", "anonymous", job(), now)
    rejected = s.submit("a", "anonymous", job(), now)[0]
    assert rejected.retry_after_ms is not None  # told when to come back, as anyone
    due = now + rejected.retry_after_ms / 1000
    assert not s.holds_booking("a", "anonymous", due)
    assert not s.claimable("a", "anonymous", due)
    assert s.submit("a", "anonymous", job(), due, retry=True)[0].ticket.first is None


def test_a_claimed_return_displaces_only_its_own_tenants_entries() -> None:
    # u weighs so much that fair share never pushes u out for t; the queue is full of u's.
    s, now = drained_scheduler(4.0, tenants={"header": "x-tenant", "weights": {"u": 100}})
    for _ in range(50):
        s.submit("a", "u", job(), now)
    s._returns._schedule.book("a", "t", now + 1, 1.0, first=0.0, now=now)  # t was told to come back now
    back, evicted = s.submit("a", "t", job(), now + 1, retry=True)
    # Its place is older than every u entry, but none of them is t's to give up.
    assert back.ticket.first is not None
    assert back.outcome is Outcome.REJECTED
    assert evicted == []


def test_one_tenant_cannot_take_every_return() -> None:
    def booked_for_t(u_waits: bool) -> int:
        s, now = full_lane(retry_after={"max": 60, "share": 0.5}, tenants={"weights": {"t": 1, "u": 1}})
        if u_waits:
            s._returns._schedule.book("a", "u", now + 1, 1000.0, first=now, now=now)  # u holds a return too
        told = [s.submit("a", "t", job(), now)[0] for _ in range(200)]
        assert not told[-1].retry_allowed
        return sum(1 for d in told if d.retry_after_ms is not None)

    alone, shared = booked_for_t(False), booked_for_t(True)
    # 0.5 of 4/s over 60 s: 120 places; t alone takes what fits of them after the drain (the slot
    # time allowed for returns bounds it too), and no more than half of all once u waits too.
    assert alone >= 50
    assert shared <= alone / 2 + 1


def test_the_edge_lets_one_retry_through_per_booking() -> None:
    schedule = ReturnSchedule()
    schedule.book("a", "acme", 10.0, 1.0, first=3.0, now=0)
    assert schedule.claimable("a", "acme", 10.0)
    assert not schedule.claimable("a", "acme", 10.1)  # the pass is taken: the next one is shed
    assert schedule.claimable("a", "acme", 10.0 + schedule.PASS_HOLD + 0.2)  # not claimed: again
    assert schedule.claim("a", "acme", 11.3) == 3.0
    assert not schedule.claimable("a", "acme", 11.4)


def test_a_claim_gives_back_its_pass_so_the_next_due_booking_passes_the_edge() -> None:
    schedule = ReturnSchedule()
    schedule.book("a", "acme", 10.0, 1.0, first=3.0, now=0)
    schedule.book("a", "acme", 10.2, 1.0, first=4.0, now=0)
    assert schedule.claimable("a", "acme", 10.0)
    assert schedule.claim("a", "acme", 10.0) == 3.0
    assert schedule.holds("a", "acme", 10.2)
    assert schedule.claimable("a", "acme", 10.2)  # not shed for a pass its sibling already spent
    assert schedule.claim("a", "acme", 10.2) == 4.0


def test_a_claim_without_a_pass_never_frees_another_bookings_pass() -> None:
    schedule = ReturnSchedule()
    schedule.book("a", "acme", 10.0, 1.0, first=3.0, now=0)
    schedule.book("a", "acme", 10.1, 1.0, first=4.0, now=0)
    assert schedule.claimable("a", "acme", 10.2)  # retry A, at a full lane: passes for one booking
    assert schedule.claim("a", "acme", 10.2) == 3.0  # retry B found room: claims without a pass
    assert schedule.claim("a", "acme", 10.25) == 4.0  # A reaches ext_proc: the other booking
    assert not schedule.claimable("a", "acme", 10.3)  # C: two bookings, both spent


def test_the_held_weights_follow_bookings_and_reloads() -> None:
    weights = {"t": 3.0}
    schedule = ReturnSchedule(lambda name: weights.get(name, 1.0))
    schedule.book("a", "t", 10.0, 1.0, first=0.0, now=0)
    schedule.book("a", "t", 11.0, 1.0, first=0.0, now=0)
    schedule.book("a", "u", 12.0, 1.0, first=0.0, now=0)
    assert schedule.held_weight("a") == 4.0
    assert dict(schedule.holders("a")) == {"t": 2, "u": 1}
    schedule.claim("a", "t", 10.0)
    assert schedule.held_weight("a") == 4.0  # t still holds one
    schedule.claim("a", "t", 11.0)
    assert schedule.held_weight("a") == 1.0
    weights["u"] = 5.0
    schedule.reweigh(lambda name: weights.get(name, 1.0))
    assert schedule.held_weight("a") == 5.0
    schedule.expire(100.0)  # u's lapsed
    assert schedule.held_weight("a") == 0.0
    assert dict(schedule.holders("a")) == {}


def test_a_rejection_when_the_schedule_is_full_says_do_not_retry() -> None:
    s, now = full_lane(retry_after={"max": 6, "share": 0.1})
    told = [s.submit("a", "t", job(), now)[0] for _ in range(10)]
    booked = [d for d in told if d.retry_after_ms is not None]
    # 0.1 of 4/s: a return every 2.5 s, from the longest allowed (the drain is beyond it) to it.
    assert len(booked) == 1
    assert booked[0].retry_allowed
    assert all(not d.retry_allowed and d.retry_after_ms is None for d in told if d not in booked)


def test_no_room_in_the_retry_budget_books_nothing() -> None:
    s, now = full_lane()
    s.permit = lambda now: False
    d = s.submit("a", "t", job(), now)[0]
    assert not d.retry_allowed
    assert d.retry_after_ms is None
    assert s.bookings == 0


def test_the_edge_lets_a_booked_retry_through_and_sheds_a_forged_one() -> None:
    s, now = full_lane()
    pressure = SchedulerPressure(s, lambda: now)
    told = pressure.retry_after("a", Reason.QUEUE_FULL, pressure.drain_s("a"), "acme")
    assert told.booked
    due = now + (told.ms or 0) / 1000
    later = SchedulerPressure(s, lambda: due)
    assert later.claimable("a", "acme")
    assert not later.claimable("a", "globex")
    assert not SchedulerPressure(s, lambda: due + 10).claimable("a", "acme")  # lapsed


def test_a_lane_idle_for_hours_keeps_its_pace_and_never_breaks_retry_after() -> None:
    s, now = drained_scheduler(rate_per_s=4.0)
    for ticket in list(s._lanes.inflight["a"].values()):  # the lane empties, then idles for two hours
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
    told = s.retry_after(Reason.QUEUE_FULL, "a", 10_000, tenant="t")
    assert 1 <= told.seconds <= s.policy.retry_after.max


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


def test_a_burst_of_rejections_is_told_to_come_back_at_the_schedule_s_pace() -> None:
    s, now = full_lane(retry_after={"share": 0.5})
    told = [s.submit("a", "t", job(), now)[0] for _ in range(40)]  # the queue is full
    returns = [now + d.retry_after_ms / 1000 for d in told if d.retry_after_ms is not None]
    # Half of 4/s: one return every 0.5 s (to the millisecond), from the drain (51 ahead at 4/s)
    # on; then the schedule is full to the longest allowed (30 s): the rest are told not to retry.
    assert returns[0] - now >= 51 / 4 - 0.01
    gaps = [b - a for a, b in itertools.pairwise(returns)]
    rate = s.drain_rate("a", now)
    assert rate == pytest.approx(4.0, rel=0.05)
    assert len(gaps) > 10
    assert all(g == pytest.approx(1 / (0.5 * rate), abs=0.002) for g in gaps)
    assert all(not d.retry_allowed for d in told[len(returns):])
    assert all(1 <= d.retry_after <= 30 for d in told)


def test_returns_spread_evenly_once_the_schedule_is_busy() -> None:
    s, now = full_lane(retry_after={"share": 1.0, "max": 60})
    s.set_others({}, {}, now)
    per_second: Counter[int] = Counter()
    for k in range(200):  # rejections keep coming, 10 a second
        d = s.submit("a", "t", job(), now + k / 10)[0]
        if d.retry_after_ms is not None:
            per_second[int(now + k / 10 + d.retry_after_ms / 1000)] += 1
    assert per_second
    assert max(per_second.values()) <= 5


def test_returns_take_at_most_their_share_of_the_lane_s_slot_time() -> None:
    # Half of the lane's 2 slots: 1 slot-second per second for returns, at most 20 s worth held.
    s, now = full_lane(retry_after={"share": 0.5, "max": 20})
    for _ in range(2):
        assert s.submit("a", "t", job(8.0), now)[0].retry_after_ms is not None
    longer = s.submit("a", "t", job(8.0), now)[0]  # 4 slot-seconds left: not booked
    assert not longer.retry_allowed
    assert longer.retry_after_ms is None
    short = s.submit("a", "t", job(1.0), now)[0]  # but a short job still is
    assert short.retry_after_ms is not None
    # The allowance refills at its rate: 8 s later a long job fits again.
    assert s.submit("a", "t", job(8.0), now + 8)[0].retry_after_ms is not None


def test_the_drain_counts_only_what_is_ahead_of_the_request_s_place() -> None:
    s, now = drained_scheduler(rate_per_s=4.0)
    for i in range(8):
        s.submit("a", "t", job(), now + i / 100)  # sjf_weight 0: ranked by arrival
    later = now + 0.1
    rate = s.drain_rate("a", later)
    assert rate is not None
    assert s.drain_wait("a", later) == pytest.approx(9 / rate, rel=0.01)  # behind all 8 (the edge's)
    assert s.drain_wait("a", later, rank=now + 0.035) == pytest.approx(5 / rate, rel=0.01)  # 4 ahead
    s.set_others({}, {"a": 8}, later)
    s.set_drain_rates({"a": rate}, replicas=2)
    # The other replicas' queue counts in the share this one's has ahead: half of 8.
    assert s.drain_wait("a", later, rank=now + 0.035) == pytest.approx(9 / rate, rel=0.01)


def test_a_booked_return_is_not_refused_by_the_retry_budget_after_its_reservation_lapsed() -> None:
    policy = make_policy([lane("a", 2, max_queued=50)], retry_after={"max": 30, "share": 1, "jitter": 0},
                         retry_budget={"ratio": 0, "min_per_second": 0.2, "window": "10s"},
                         tenants={"header": "x-tenant"}, trusted_headers=["x-tenant"])
    gate = Machine(policy, random.Random(0))
    _, now = drained_scheduler(rate_per_s=4.0, scheduler=gate._scheduler)
    while (told := gate.submit("a", "t", job(), now).decision).outcome is Outcome.QUEUED:
        pass
    assert told.retry_after_ms is not None  # full: a retry reserved, a return booked
    due = now + told.retry_after_ms / 1000
    assert due - now > 10  # beyond the budget's window: the reservation lapses first
    # Other clients' unbooked retries take what the budget allows meanwhile.
    refused = [gate.submit("a", "u", job(), due - 1.5, retry=True).decision.reason for _ in range(5)]
    assert Reason.RETRY_BUDGET in refused
    back = gate.submit("a", "t", job(), due, retry=True).decision
    assert back.reason is not Reason.RETRY_BUDGET
    assert back.ticket.first is not None  # it claimed its booking


@pytest.mark.parametrize("budget", [{"ratio": 0, "min_per_second": 0}, {"ratio": 1, "min_per_second": 50}])
def test_a_drain_never_tells_a_client_not_to_retry_whatever_the_retry_budget(
        budget: dict[str, float]) -> None:
    gate = Machine(make_policy([lane("a", 1, max_queued=1)], retry_budget={**budget, "window": "10s"}),
                   random.Random(0))
    assert gate.submit("a", "t", job(), 0.0).decision.outcome is Outcome.ADMITTED
    queued = gate.submit("a", "t", job(), 0.0).decision
    assert queued.outcome is Outcome.QUEUED
    full = gate.submit("a", "t", job(), 0.0).decision
    assert full.reason is Reason.QUEUE_FULL
    # The control: an ordinary refusal asks the budget, and a spent one says not to retry.
    assert full.retry_allowed is (budget["ratio"] > 0)
    gate.retry_budget_unsent()
    withdrawn = gate.drain(1.0)
    new = gate.submit("a", "t", job(), 1.0).decision
    retry = gate.submit("a", "t", job(), 1.0, retry=True).decision
    assert [d.ticket for d in withdrawn] == [queued.ticket]
    for refused in (*withdrawn, new, retry):
        assert (refused.reason, refused.retry_allowed) == (Reason.DRAINING, True)
        assert refused.retry_after is not None
        assert refused.retry_after >= 1
        rejection = reject(Reason.DRAINING, "a", refused.retry_after, retry_allowed=refused.retry_allowed)
        assert rejection.status == 503
        assert "x-should-retry" not in dict(rejection.headers)
    # Nothing set aside or spent: the retries go to other replicas, not to this one's budget.
    assert gate.retry_budget_unsent() == (0, 0)

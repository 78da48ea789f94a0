"""Scheduler: slots, queues, deadlines, borrowing, eviction, draining; plus a property-based check."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from extproc.core.admission import Scheduler
from extproc.core.decision import Decision, Outcome, Reason, State, Ticket
from extproc.core.estimate import Job
from extproc.policy import Policy

#: 10 ms per output token and nothing else: a job of n00 tokens takes n seconds.
COST = {"prefill_ms_per_token": 0, "decode_ms_per_token": 10, "overhead_ms": 0}


def lane(name: str, max_inflight: int, **extra: Any) -> dict[str, Any]:
    return {"name": name, "max_inflight": max_inflight, "max_queued": 10, "deadline": "60s", **extra}


def make_policy(lanes: list[dict[str, Any]], **extra: Any) -> Policy:
    data: dict[str, Any] = {
        "lanes": lanes,
        "classification": {"default_lane": lanes[0]["name"]},
        "queueing": {"sjf_weight": 0},
        "estimation": {"default": COST, "learning_rate": 0, "occupancy_slowdown": 0},
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return Policy.model_validate(data)


def job(seconds: float = 1.0) -> Job:
    return Job(None, 0, max(1, round(seconds * 100)))


def scheduler(policy: Policy) -> Scheduler:
    return Scheduler(policy, rng=random.Random(0))


def submit(s: Scheduler, lane_name: str, now: float, seconds: float = 1.0, tenant: str = "t") -> Decision:
    decision, evicted = s.submit(lane_name, tenant, job(seconds), now)
    assert evicted == []
    return decision


def admitted(decisions: list[Decision]) -> list[Ticket]:
    assert all(d.outcome is Outcome.ADMITTED for d in decisions), decisions
    return [d.ticket for d in decisions]


def assert_rejected(decision: Decision, reason: Reason, policy: Policy) -> None:
    assert decision.outcome is Outcome.REJECTED
    assert decision.reason is reason
    assert decision.ticket.state is State.DONE
    assert isinstance(decision.retry_after, int)
    assert policy.retry_after.min <= decision.retry_after <= policy.retry_after.max


# -- slots and queues ---------------------------------------------------------------------------------


def test_admit_until_max_inflight_then_queue() -> None:
    s = scheduler(make_policy([lane("a", 2)]))
    first, second, third = (submit(s, "a", 0.0) for _ in range(3))
    outcomes = [first.outcome, second.outcome, third.outcome]
    assert outcomes == [Outcome.ADMITTED, Outcome.ADMITTED, Outcome.QUEUED]
    assert first.ticket.state is State.INFLIGHT
    assert first.ticket.queue_wait == 0.0
    assert (first.reason, first.retry_after) == (None, None)
    assert third.ticket.state is State.QUEUED
    assert (s.total_inflight, s.total_queued) == (2, 1)
    view = s.snapshot(0.0)["a"]
    assert (view.inflight, view.limit, view.queued, view.borrowed) == (2, 2, 1, 0)
    assert view.queued_work == pytest.approx(1.0)


def test_release_dispatches_the_queued_request_with_its_queue_wait() -> None:
    s = scheduler(make_policy([lane("a", 1)]))
    running = submit(s, "a", 0.0).ticket
    waiting = submit(s, "a", 0.5).ticket
    out = s.release(running, 3.0)
    assert admitted(out) == [waiting]
    assert waiting.state is State.INFLIGHT
    assert waiting.admitted_at == 3.0
    assert waiting.queue_wait == pytest.approx(2.5)
    assert running.state is State.DONE
    assert (s.total_inflight, s.total_queued) == (1, 0)
    assert s.release(waiting, 4.0) == []
    assert s.total_inflight == 0


def test_queued_requests_are_dispatched_in_queue_order() -> None:
    s = scheduler(make_policy([lane("a", 1)], queueing={"sjf_weight": 4}))
    running = submit(s, "a", 0.0).ticket
    long = submit(s, "a", 0.1, seconds=5.0).ticket
    short = submit(s, "a", 0.2, seconds=0.5).ticket
    assert admitted(s.release(running, 1.0)) == [short]
    assert admitted(s.release(short, 2.0)) == [long]


def test_release_teaches_the_estimator() -> None:
    s = scheduler(make_policy([lane("a", 1)], estimation={"learning_rate": 0.5}))
    ticket = submit(s, "a", 0.0).ticket
    s.release(ticket, 3.0)  # took three times the predicted second
    assert s.estimator.decode_ms_per_token(None) == pytest.approx(0.5 * 10 + 0.5 * 30)


def test_queue_full_is_rejected_with_retry_after() -> None:
    policy = make_policy([lane("a", 1, max_queued=1)])
    s = scheduler(policy)
    submit(s, "a", 0.0)
    submit(s, "a", 0.0)
    decision = submit(s, "a", 0.0)
    assert_rejected(decision, Reason.QUEUE_FULL, policy)
    assert decision.reason is not None
    assert decision.reason.http_status == 429
    assert (s.total_inflight, s.total_queued) == (1, 1)


def test_lane_without_queue_rejects_at_once() -> None:
    policy = make_policy([lane("a", 1, max_queued=0)])
    s = scheduler(policy)
    submit(s, "a", 0.0)
    assert_rejected(submit(s, "a", 0.0), Reason.QUEUE_FULL, policy)


def test_retry_after_reflects_the_backlog() -> None:
    policy = make_policy([lane("a", 1, max_queued=3)], retry_after={"jitter": 0, "max": 60})
    s = scheduler(policy)
    for _ in range(4):
        submit(s, "a", 0.0, seconds=10.0)
    decision = submit(s, "a", 0.0)
    assert decision.reason is Reason.QUEUE_FULL
    assert decision.retry_after == 40  # 10 s running + 3 × 10 s queued, on one slot


def test_unmeetable_deadline_is_rejected_at_once() -> None:
    policy = make_policy([lane("a", 1, deadline="2s")])
    s = scheduler(policy)
    submit(s, "a", 0.0)  # 1 s running
    assert submit(s, "a", 0.1).outcome is Outcome.QUEUED  # 1 s ahead
    assert submit(s, "a", 0.2).outcome is Outcome.QUEUED  # 2 s ahead: just meetable
    decision = submit(s, "a", 0.3)  # 3 s ahead on one slot > 2 s deadline
    assert_rejected(decision, Reason.DEADLINE_UNMEETABLE, policy)
    assert s.total_queued == 2


def test_wait_estimate_uses_the_soonest_free_slots_not_the_total_backlog() -> None:
    # Four slots: three long jobs and one short one in flight. The next request waits
    # for the short one (0.5 s), although the lane's whole backlog is 30.5 s / 4 slots.
    policy = make_policy([lane("a", 4, deadline="1s")])
    s = scheduler(policy)
    for seconds in (10.0, 10.0, 10.0, 0.5):
        assert submit(s, "a", 0.0, seconds).outcome is Outcome.ADMITTED
    assert submit(s, "a", 0.0, 0.5).outcome is Outcome.QUEUED  # starts at 0.5 s
    assert submit(s, "a", 0.0, 0.5).outcome is Outcome.QUEUED  # starts at 1.0 s: just meetable
    assert_rejected(submit(s, "a", 0.0, 0.5), Reason.DEADLINE_UNMEETABLE, policy)


def test_wait_estimate_counts_only_requests_ranked_ahead() -> None:
    # With SJF, a short request is placed before a queued long one and can meet a
    # deadline that the long one's work would otherwise have broken.
    policy = make_policy([lane("a", 1, deadline="3s", sjf_weight=1)])
    s = scheduler(policy)
    assert submit(s, "a", 0.0, 1.0).outcome is Outcome.ADMITTED
    assert submit(s, "a", 0.0, 2.5).outcome is Outcome.QUEUED  # rank 2.5, starts at 1 s
    assert submit(s, "a", 0.0, 0.5).outcome is Outcome.QUEUED  # rank 0.5: ahead of it
    s_fifo = scheduler(make_policy([lane("a", 1, deadline="3s")]))
    submit(s_fifo, "a", 0.0, 1.0)
    submit(s_fifo, "a", 0.0, 2.5)
    assert s_fifo.submit("a", "t", job(0.5), 0.0)[0].reason is Reason.DEADLINE_UNMEETABLE


def test_lane_sjf_weight_overrides_the_global_one() -> None:
    policy = make_policy([lane("a", 1, sjf_weight=1), lane("b", 1)], queueing={"sjf_weight": 0})
    s = scheduler(policy)
    for name in ("a", "b"):
        submit(s, name, 0.0, 1.0)
        long_job = submit(s, name, 0.1, 5.0)
        short_job = submit(s, name, 0.2, 0.5)
        assert long_job.outcome is short_job.outcome is Outcome.QUEUED
    first_a = admitted(s.release(next(iter(s._lanes.inflight["a"].values())), 1.0))[0]
    first_b = admitted(s.release(next(iter(s._lanes.inflight["b"].values())), 1.0))[0]
    assert first_a.job.output_tokens == 50  # lane a is shortest-first
    assert first_b.job.output_tokens == 500  # lane b is first come, first served
    assert policy.needs_body


def test_full_queue_gives_a_place_to_a_tenant_below_its_share() -> None:
    policy = make_policy([lane("a", 1, max_queued=4)], trusted_headers=["x-tenant-id"],
                         tenants={"header": "x-tenant-id", "weights": {"big": 3, "small": 1}})
    s = scheduler(policy)
    submit(s, "a", 0.0, tenant="small")  # in flight
    for _ in range(4):
        assert submit(s, "a", 0.0, tenant="small").outcome is Outcome.QUEUED
    # The queue is full of "small"; "big" (weight 3) pushes out small's worst entry.
    decision, evicted = s.submit("a", "big", job(1.0), 0.0)
    assert decision.outcome is Outcome.QUEUED
    assert [(d.reason, d.ticket.tenant) for d in evicted] == [(Reason.FAIR_SHARE, "small")]
    assert s.total_queued == 4
    # Places split 3 big : 1 small... until "small" holds no more than its share.
    for _ in range(2):
        assert s.submit("a", "big", job(1.0), 0.0)[1]
    third, pushed = s.submit("a", "big", job(1.0), 0.0)
    assert (third.outcome, third.reason, pushed) == (Outcome.REJECTED, Reason.QUEUE_FULL, [])
    assert s.snapshot(0.0)["a"].tenants == {"big": 3, "small": 1}
    # A tenant already at its share cannot push out anybody.
    assert s.submit("a", "small", job(1.0), 0.0)[0].reason is Reason.QUEUE_FULL


def test_deadline_expiry_and_next_timer() -> None:
    policy = make_policy([lane("a", 1, deadline="10s")], capacity={"max_request_duration": "1h"})
    s = scheduler(policy)
    assert s.next_timer() is None
    running = submit(s, "a", 0.0).ticket
    assert s.next_timer() == 3600.0
    waiting = submit(s, "a", 2.0).ticket
    assert s.next_timer() == 12.0
    assert s.expire(11.999) == []
    assert waiting.state is State.QUEUED
    (decision,) = s.expire(12.0)
    assert decision.ticket is waiting
    assert_rejected(decision, Reason.DEADLINE_EXPIRED, policy)
    assert s.total_queued == 0
    assert s.next_timer() == 3600.0
    assert s.expire(13.0) == []
    assert running.state is State.INFLIGHT


def test_next_timer_skips_requests_that_left() -> None:
    s = scheduler(make_policy([lane("a", 1, deadline="10s")], capacity={"max_request_duration": "100s"}))
    running = submit(s, "a", 0.0).ticket
    waiting = submit(s, "a", 1.0).ticket
    assert s.next_timer() == 11.0
    s.release(waiting, 2.0)
    assert s.next_timer() == 100.0
    s.release(running, 3.0)
    assert s.next_timer() is None


def test_client_gone_while_queued_is_removed_and_release_is_idempotent() -> None:
    s = scheduler(make_policy([lane("a", 1)]))
    running = submit(s, "a", 0.0).ticket
    gone = submit(s, "a", 1.0).ticket
    stays = submit(s, "a", 2.0).ticket
    assert s.release(gone, 3.0) == []
    assert gone.state is State.DONE
    assert gone.entry is not None
    assert not gone.entry.queued
    before = s.snapshot(3.0)
    assert before["a"].queued == 1
    assert s.release(gone, 4.0) == []
    assert s.snapshot(4.0) == before
    assert admitted(s.release(running, 5.0)) == [stays]
    assert s.release(running, 6.0) == []
    assert (s.total_inflight, s.total_queued) == (1, 0)


def test_lease_backstop_reclaims_the_slot_and_reports_who_got_it() -> None:
    policy = make_policy([lane("a", 1, deadline="100s")],
                         capacity={"max_request_duration": "60s", "max_hold": "300s"},
                         estimation={"learning_rate": 0.5})
    s = scheduler(policy)
    stuck = submit(s, "a", 0.0).ticket
    waiting = submit(s, "a", 10.0).ticket
    assert s.next_timer() == 60.0
    assert s.expire(59.0) == []
    out = s.expire(60.0)
    assert stuck.state is State.DONE
    assert s.reclaimed == 1
    assert admitted(out) == [waiting]  # the caller must learn that this request may go
    assert waiting.admitted_at == 60.0
    assert s.estimator.learned() == {}  # a reclaimed slot says nothing about service time
    # The stream finally ends: nothing is freed twice.
    assert s.release(stuck, 70.0) == []
    assert s.total_inflight == 1


def test_closed_lane_rejects() -> None:
    policy = make_policy([lane("open", 1), lane("shut", 1, closed=True)])
    s = scheduler(policy)
    assert_rejected(submit(s, "shut", 0.0), Reason.LANE_CLOSED, policy)
    assert submit(s, "open", 0.0).outcome is Outcome.ADMITTED
    assert (s.total_inflight, s.total_queued) == (1, 0)


def test_drain_rejects_queued_and_new_requests() -> None:
    policy = make_policy([lane("a", 1), lane("b", 1)])
    s = scheduler(policy)
    running = submit(s, "a", 0.0).ticket
    queued = [submit(s, "a", 1.0).ticket, submit(s, "a", 2.0).ticket]
    out = s.drain(3.0)
    assert {d.ticket for d in out} == set(queued)
    for decision in out:
        assert_rejected(decision, Reason.DRAINING, policy)
        assert decision.reason is not None
        assert decision.reason.http_status == 503
    assert s.total_queued == 0
    assert running.state is State.INFLIGHT  # in-flight work finishes
    assert_rejected(submit(s, "b", 4.0), Reason.DRAINING, policy)
    assert s.release(running, 5.0) == []
    assert s.total_inflight == 0


# -- borrowing -----------------------------------------------------------------------------------------


def test_borrowing_is_capped_by_max_borrow() -> None:
    policy = make_policy([lane("interactive", 2, priority=100, borrow=True, max_borrow=1),
                          lane("batch", 2, priority=50)])
    s = scheduler(policy)
    outcomes = [submit(s, "interactive", 0.0).outcome for _ in range(4)]
    assert outcomes == [Outcome.ADMITTED] * 3 + [Outcome.QUEUED]
    assert s.snapshot(0.0)["interactive"].borrowed == 1
    assert submit(s, "batch", 0.0).outcome is Outcome.ADMITTED  # the one slot nobody borrowed


def test_unlimited_borrowing_uses_every_idle_slot() -> None:
    s = scheduler(make_policy([lane("interactive", 2, priority=100, borrow=True), lane("batch", 2)]))
    outcomes = [submit(s, "interactive", 0.0).outcome for _ in range(5)]
    assert outcomes == [Outcome.ADMITTED] * 4 + [Outcome.QUEUED]
    assert s.snapshot(0.0)["interactive"].borrowed == 2


def test_lane_without_borrow_stays_within_its_quota() -> None:
    s = scheduler(make_policy([lane("interactive", 2, borrow=True), lane("batch", 2)]))
    assert [submit(s, "batch", 0.0).outcome for _ in range(3)] == [Outcome.ADMITTED] * 2 + [Outcome.QUEUED]
    assert s.total_inflight == 2  # two slots stay idle


def test_freed_slots_go_back_to_the_lending_lane_first() -> None:
    s = scheduler(make_policy([lane("interactive", 2, priority=100, borrow=True),
                               lane("batch", 2, priority=10)]))
    borrowed = [submit(s, "interactive", 0.0).ticket for _ in range(4)]
    extra_interactive = submit(s, "interactive", 0.5).ticket
    batch = [submit(s, "batch", 1.0).ticket, submit(s, "batch", 1.0).ticket]
    assert extra_interactive.state is State.QUEUED
    assert all(t.state is State.QUEUED for t in batch)
    # The owner is owed its quota: it gets freed slots even though the borrower ranks higher.
    assert admitted(s.release(borrowed[0], 2.0)) == [batch[0]]
    assert admitted(s.release(borrowed[1], 3.0)) == [batch[1]]
    assert extra_interactive.state is State.QUEUED
    # Batch is at quota again; now interactive (under its own quota) gets the next slot.
    assert admitted(s.release(borrowed[2], 4.0)) == [extra_interactive]


def test_borrower_does_not_take_a_slot_owed_to_a_waiting_lane() -> None:
    # Capacity 3 shared by quotas 2 + 2: batch's queued request is owed a slot.
    policy = make_policy([lane("interactive", 2, priority=100, borrow=True), lane("batch", 2, priority=10)],
                         capacity={"max_inflight": 3})
    s = scheduler(policy)
    first = submit(s, "interactive", 0.0).ticket
    submit(s, "interactive", 0.0)
    submit(s, "batch", 0.0)
    waiting_batch = submit(s, "batch", 0.0).ticket
    waiting_interactive = submit(s, "interactive", 0.0).ticket
    assert (waiting_batch.state, waiting_interactive.state) == (State.QUEUED, State.QUEUED)
    assert admitted(s.release(first, 1.0)) == [waiting_interactive]  # under its own quota again
    assert waiting_batch.state is State.QUEUED


# -- eviction under capacity.max_queued -----------------------------------------------------------------


def eviction_policy() -> Policy:
    return make_policy(
        [lane("high", 1, priority=100), lane("mid", 1, priority=50),
         lane("low", 1, priority=0, evictable=True)],
        capacity={"max_queued": 2},
    )


def full(policy: Policy) -> Scheduler:
    s = scheduler(policy)
    for name in ("high", "mid", "low"):
        assert submit(s, name, 0.0).outcome is Outcome.ADMITTED
    return s


def test_higher_priority_arrival_evicts_the_worst_entry_of_an_evictable_lane() -> None:
    policy = eviction_policy()
    s = full(policy)
    older = submit(s, "low", 1.0).ticket
    newer = submit(s, "low", 2.0).ticket
    decision, evicted = s.submit("high", "t", job(), 3.0)
    assert decision.outcome is Outcome.QUEUED
    (gone,) = evicted
    assert gone.ticket is newer
    assert_rejected(gone, Reason.EVICTED, policy)
    assert older.state is State.QUEUED
    assert s.total_queued == 2
    # A lower-priority arrival cannot evict a higher one, nor its own lane.
    assert_rejected(submit(s, "low", 4.0), Reason.QUEUE_FULL, policy)
    decision, evicted = s.submit("mid", "t", job(), 5.0)
    assert decision.outcome is Outcome.QUEUED
    assert [d.ticket for d in evicted] == [older]
    # Only high and mid are queued now, neither evictable.
    assert_rejected(submit(s, "high", 6.0), Reason.QUEUE_FULL, policy)
    assert s.snapshot(6.0)["high"].queued == 1
    assert s.snapshot(6.0)["mid"].queued == 1


def test_non_evictable_lower_lane_is_never_evicted() -> None:
    policy = eviction_policy()
    s = full(policy)
    mids = [submit(s, "mid", 1.0).ticket, submit(s, "mid", 2.0).ticket]
    assert_rejected(submit(s, "high", 3.0), Reason.QUEUE_FULL, policy)
    assert all(t.state is State.QUEUED for t in mids)


def test_evictable_lane_of_equal_priority_is_not_evicted() -> None:
    policy = make_policy([lane("a", 1, priority=10, evictable=True), lane("b", 1, priority=10)],
                         capacity={"max_queued": 1})
    s = scheduler(policy)
    submit(s, "a", 0.0)
    submit(s, "b", 0.0)
    queued = submit(s, "a", 1.0).ticket
    assert_rejected(submit(s, "b", 2.0), Reason.QUEUE_FULL, policy)
    assert queued.state is State.QUEUED


def test_eviction_picks_by_rank_not_arrival() -> None:
    policy = make_policy(
        [lane("high", 1, priority=100), lane("low", 1, evictable=True)],
        capacity={"max_queued": 2}, queueing={"sjf_weight": 4},
    )
    s = scheduler(policy)
    submit(s, "high", 0.0)
    submit(s, "low", 0.0)
    long = submit(s, "low", 1.0, seconds=8.0).ticket  # rank 33
    short = submit(s, "low", 2.0, seconds=0.5).ticket  # rank 4
    _, evicted = s.submit("high", "t", job(), 3.0)
    assert [d.ticket for d in evicted] == [long]
    assert short.state is State.QUEUED


# -- priority --------------------------------------------------------------------------------------------


def test_dispatch_serves_higher_priority_lanes_first() -> None:
    # Capacity 2 shared by two lanes with quota 2 each: both are under quota and waiting.
    s = scheduler(make_policy([lane("low", 2, priority=10), lane("high", 2, priority=100)],
                              capacity={"max_inflight": 2}))
    low_running = submit(s, "low", 0.0).ticket
    high_running = submit(s, "high", 0.0).ticket
    low_waiting = submit(s, "low", 1.0).ticket
    high_waiting = submit(s, "high", 2.0).ticket  # queued after low's, still goes first
    assert admitted(s.release(low_running, 3.0)) == [high_waiting]
    assert admitted(s.release(high_running, 4.0)) == [low_waiting]


def test_new_arrival_does_not_jump_a_non_empty_queue() -> None:
    s = scheduler(make_policy([lane("a", 1), lane("b", 1)], capacity={"max_inflight": 1}))
    running = submit(s, "a", 0.0).ticket
    waiting = submit(s, "a", 1.0).ticket
    s.release(running, 2.0)
    assert waiting.state is State.INFLIGHT
    assert submit(s, "a", 2.0).outcome is Outcome.QUEUED


# -- reconfiguration ---------------------------------------------------------------------------------------


def test_reconfigure_keeps_places_and_survives_a_removed_lane() -> None:
    before = make_policy([lane("a", 1), lane("b", 1, deadline="10s")])
    s = scheduler(before)
    submit(s, "a", 0.0)
    submit(s, "b", 0.0)
    orphan = submit(s, "b", 1.0).ticket
    kept = submit(s, "a", 1.0).ticket
    s.reconfigure(make_policy([lane("a", 3)]))
    assert (orphan.state, kept.state) == (State.QUEUED, State.QUEUED)
    rejected, dispatched = s.expire(11.0)  # must not fail on the lane that is gone
    assert rejected.ticket is orphan
    assert rejected.reason is Reason.DEADLINE_EXPIRED
    assert isinstance(rejected.retry_after, int)
    assert admitted([dispatched]) == [kept]  # the larger quota is used at the next call
    assert s.drain(12.0) == []


def test_drain_after_a_lane_was_removed() -> None:
    s = scheduler(make_policy([lane("a", 1), lane("b", 1)]))
    submit(s, "b", 0.0)
    orphan = submit(s, "b", 0.5).ticket
    s.reconfigure(make_policy([lane("a", 1)]))
    (decision,) = s.drain(1.0)
    assert decision.ticket is orphan
    assert decision.reason is Reason.DRAINING


# -- property-based: invariants over random operation sequences ---------------------------------------------


def _machine_policies() -> list[Policy]:
    lanes = [
        lane("gold", 2, priority=100, max_queued=3, deadline="5s", borrow=True, max_borrow=1),
        lane("silver", 2, priority=50, max_queued=3, deadline="10s", borrow=True),
        lane("bronze", 1, priority=0, max_queued=3, deadline="3s", evictable=True),
    ]
    common: dict[str, Any] = {
        "queueing": {"sjf_weight": 4},
        "estimation": {"learning_rate": 0.1, "occupancy_slowdown": 1.0},
        "tenants": {"weights": {"a": 3}},
    }
    return [
        make_policy(lanes, capacity={"max_inflight": 4, "max_queued": 5, "max_request_duration": "20s"},
                    **common),
        make_policy(lanes, capacity={"max_inflight": 7, "max_request_duration": "15s"}, **common),
        make_policy([{**x, "borrow": False, "max_borrow": None} for x in lanes],
                    capacity={"max_queued": 4, "max_request_duration": "12s"}, **common),
    ]


POLICIES = _machine_policies()
LANES = ["gold", "silver", "bronze"]


class SchedulerMachine(RuleBasedStateMachine):
    """Random submit / release / expire with time moving on; the scheduler's own reports are the model."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.tickets: list[Ticket] = []
        self.expected: dict[int, State] = {}

    @initialize(index=st.integers(0, len(POLICIES) - 1), seed=st.integers(0, 2**32 - 1))
    def setup(self, index: int, seed: int) -> None:
        self.policy = POLICIES[index]
        self.s = Scheduler(self.policy, rng=random.Random(seed))

    def _apply(self, decisions: list[Decision], *, queued_before: bool) -> None:
        for d in decisions:
            ticket = d.ticket
            if queued_before:
                assert self.expected[ticket.id] is State.QUEUED, d
            if d.outcome is Outcome.ADMITTED:
                assert d.reason is None
                self.expected[ticket.id] = State.INFLIGHT
            elif d.outcome is Outcome.QUEUED:
                self.expected[ticket.id] = State.QUEUED
            else:
                assert d.outcome is Outcome.REJECTED
                assert d.reason is not None
                assert isinstance(d.retry_after, int)
                assert 1 <= d.retry_after <= 60
                self.expected[ticket.id] = State.DONE

    @rule(lane_name=st.sampled_from(LANES), tenant=st.sampled_from(["a", "b", "c"]),
          tokens=st.integers(1, 400), dt=st.sampled_from([0.0, 0.0, 0.1, 0.5, 1.0, 2.5]))
    def submit(self, lane_name: str, tenant: str, tokens: int, dt: float) -> None:
        self.now += dt
        decision, evicted = self.s.submit(lane_name, tenant, Job(None, 0, tokens), self.now)
        assert decision.ticket not in self.tickets
        self.tickets.append(decision.ticket)
        self._apply([decision], queued_before=False)
        if evicted:
            assert decision.outcome is Outcome.QUEUED
            for d in evicted:
                assert d.reason in (Reason.EVICTED, Reason.FAIR_SHARE)
                if d.reason is Reason.FAIR_SHARE:
                    # Pushed out of a full lane queue by another tenant of the same lane.
                    assert d.ticket.lane == lane_name
                    assert d.ticket.tenant != tenant
                else:
                    assert self.policy.lane(d.ticket.lane).evictable
                    assert self.policy.lane(d.ticket.lane).priority < self.policy.lane(lane_name).priority
        self._apply(evicted, queued_before=True)

    @rule(data=st.data(), dt=st.sampled_from([0.0, 0.3, 1.0, 4.0]))
    def release(self, data: st.DataObject, dt: float) -> None:
        if not self.tickets:
            return
        self.now += dt
        ticket = data.draw(st.sampled_from(self.tickets))
        was = ticket.state
        out = self.s.release(ticket, self.now)
        if was is State.DONE:
            assert out == []
        assert ticket.state is State.DONE
        self.expected[ticket.id] = State.DONE
        self._apply(out, queued_before=True)
        assert self.s.release(ticket, self.now) == []

    @rule(dt=st.sampled_from([0.0, 0.5, 2.0, 6.0, 13.0]))
    def expire(self, dt: float) -> None:
        self.now += dt
        out = self.s.expire(self.now)
        for d in out:
            if d.outcome is Outcome.REJECTED:
                assert d.reason is Reason.DEADLINE_EXPIRED
                assert d.ticket.deadline <= self.now
        self._apply(out, queued_before=True)
        for ticket in self.tickets:
            if self.expected[ticket.id] is State.INFLIGHT and ticket.state is State.DONE:
                # Reclaimed by the lease backstop.
                assert ticket.admitted_at is not None
                assert self.now >= ticket.admitted_at + self.policy.capacity.max_request_duration
                self.expected[ticket.id] = State.DONE
            if ticket.state is State.QUEUED:
                assert ticket.deadline > self.now
        timer = self.s.next_timer()
        assert timer is None or timer > self.now

    @rule(lane_name=st.sampled_from(LANES), dt=st.sampled_from([0.0, 1.0]))
    def pause_or_resume(self, lane_name: str, dt: float) -> None:
        self.now += dt
        if lane_name in self.s.paused:
            self._apply(self.s.resume(lane_name, self.now), queued_before=True)
        else:
            self.s.pause(lane_name)
            assert self.s.snapshot(self.now)[lane_name].paused

    @invariant()
    def limits_hold(self) -> None:
        if not hasattr(self, "s"):
            return
        s, policy = self.s, self.policy
        capacity = policy.total_capacity
        views = s.snapshot(self.now)
        assert s.total_inflight <= capacity
        for lane_cfg in policy.lanes:
            view = views[lane_cfg.name]
            limit = lane_cfg.max_inflight
            if lane_cfg.borrow:
                limit += lane_cfg.max_borrow if lane_cfg.max_borrow is not None else capacity
            assert view.inflight <= min(limit, capacity)
            assert view.queued <= lane_cfg.max_queued
        if policy.capacity.max_queued is not None:
            assert s.total_queued <= policy.capacity.max_queued

    @invariant()
    def every_ticket_is_in_exactly_one_state(self) -> None:
        if not hasattr(self, "s"):
            return
        queued = {e.id for q in self.s._lanes.queues.values() for e in q.entries()}
        inflight = {t for tickets in self.s._lanes.inflight.values() for t in tickets}
        assert not queued & inflight
        for ticket in self.tickets:
            assert ticket.state is self.expected[ticket.id], ticket
            assert (ticket.id in queued) == (ticket.state is State.QUEUED)
            assert (ticket.id in inflight) == (ticket.state is State.INFLIGHT)
        assert len(queued) == self.s.total_queued
        assert len(inflight) == self.s.total_inflight

    @invariant()
    def no_queued_request_is_admissible(self) -> None:
        if not hasattr(self, "s"):
            return
        for lane_cfg in self.policy.lanes:
            if len(self.s._lanes.queues[lane_cfg.name]):
                assert not self.s._lanes.admits(lane_cfg), lane_cfg.name


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerProperties = SchedulerMachine.TestCase


def test_held_back_says_whether_more_slots_would_let_queued_work_start() -> None:
    from extproc.core.saturation import Effect

    p = make_policy([lane("a", 2), lane("b", 2)])
    s = scheduler(p)
    assert not s.held_back  # nothing queued
    for _ in range(2):
        submit(s, "a", 0)
    assert not s.held_back  # at its share, but nothing waits
    assert submit(s, "a", 0).outcome is Outcome.QUEUED
    assert s.held_back  # a lane at its share with a queue: a larger limit lets it start
    s.pause("a")
    assert not s.held_back  # paused: slots are not what holds it
    s.resume("a", 0)
    assert s.held_back
    s.apply_saturation({"a": Effect(signal="kv", factor=0.5, shrunk_by="kv-high")}, 0)
    assert not s.held_back  # shrunk by a saturation rule: the engines said so, not the limit


def test_a_refusal_for_want_of_a_slot_is_noted_for_the_self_sizing_limit() -> None:
    """A request refused because its lane is at its share (its queue full, or its deadline out of
    reach behind the slots) is work a larger limit would have started, like held work, though none
    waits after it: the scheduler notes when. A refusal for any other reason is not noted."""
    from extproc.core.saturation import Effect

    p = make_policy([lane("a", 1, max_queued=0), lane("b", 1, deadline="2s")])
    s = scheduler(p)
    submit(s, "a", 0.0)
    assert s.turned_away_at is None
    assert submit(s, "a", 1.0).reason is Reason.QUEUE_FULL  # no queue: refused at its share
    assert s.turned_away_at == 1.0
    assert not s.held_back  # nothing waits, yet a slot was wanted
    submit(s, "b", 2.0, seconds=5.0)
    assert submit(s, "b", 3.0).reason is Reason.DEADLINE_UNMEETABLE  # 4 s behind the one slot
    assert s.turned_away_at == 3.0
    # Paused, or shed by a saturation rule: refused, but not for want of a slot.
    s.pause("a")
    assert submit(s, "a", 4.0).reason is Reason.QUEUE_FULL
    assert s.turned_away_at == 3.0
    s.resume("a", 4.0)
    s.apply_saturation({"b": Effect(signal="kv", shed_by="kv-high")}, 5.0)
    assert submit(s, "b", 5.0).reason is Reason.SATURATED
    assert s.turned_away_at == 3.0
    # Shrunk by a saturation rule and full: refused as its queue full, but the engines said so, not the
    # limit (the same reason that is noted above, so only the lane's state tells them apart).
    s.apply_saturation({"a": Effect(signal="kv", factor=0.5, shrunk_by="kv-high")}, 6.0)
    assert submit(s, "a", 6.0).reason is Reason.QUEUE_FULL
    assert s.turned_away_at == 3.0
    s.apply_saturation({}, 7.0)
    assert submit(s, "a", 7.0).reason is Reason.QUEUE_FULL
    assert s.turned_away_at == 7.0

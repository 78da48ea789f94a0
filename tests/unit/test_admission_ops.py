"""Scheduler under an operator's hand: policy swaps, shadow mode, paused lanes, drain and undrain."""

from __future__ import annotations

import pytest

from extproc.core.decision import Outcome, Reason, State
from extproc.core.saturation import Effect
from tests.unit.test_admission import admitted, job, lane, make_policy, scheduler, submit


def test_reload_keeps_queued_requests_in_place_and_admits_what_a_bigger_limit_allows() -> None:
    s = scheduler(make_policy([lane("a", 1)]))
    running = submit(s, "a", 0.0)
    queued = [submit(s, "a", 0.1 * i) for i in range(1, 4)]
    assert [d.outcome for d in queued] == [Outcome.QUEUED] * 3
    started = admitted(s.reconfigure(make_policy([lane("a", 3)]), now=1.0))
    # Two more slots: the two best-placed queued requests start, in queue order.
    assert started == [queued[0].ticket, queued[1].ticket]
    assert queued[2].ticket.state is State.QUEUED
    assert running.ticket.state is State.INFLIGHT
    assert s.snapshot(1.0)["a"].limit == 3


def test_a_shrinking_limit_cuts_nothing_short_and_takes_effect_as_slots_free() -> None:
    s = scheduler(make_policy([lane("a", 4)]))
    running = [submit(s, "a", 0.0).ticket for _ in range(4)]
    assert s.reconfigure(make_policy([lane("a", 2)]), now=1.0) == []
    assert all(t.state is State.INFLIGHT for t in running)
    waiting = submit(s, "a", 1.0)
    assert waiting.outcome is Outcome.QUEUED
    # Releasing two of four leaves two running: still at the new limit, nothing starts.
    assert s.release(running[0], 2.0) == []
    assert s.release(running[1], 2.0) == []
    assert admitted(s.release(running[2], 3.0)) == [waiting.ticket]
    assert s.snapshot(3.0)["a"].inflight == 2


def test_a_removed_lane_is_retired_drains_cleanly_and_then_disappears() -> None:
    s = scheduler(make_policy([lane("a", 1), lane("b", 1)]))
    running = submit(s, "b", 0.0).ticket
    queued = submit(s, "b", 0.5).ticket
    assert queued.state is State.QUEUED
    s.reconfigure(make_policy([lane("a", 1)]), now=1.0)
    view = s.snapshot(1.0)["b"]
    assert (view.retired, view.inflight, view.queued, view.limit) == (True, 1, 1, 0)
    with pytest.raises(KeyError):
        s.submit("c", "t", job(), 1.0)
    # Its queued request still starts when its running one ends, under the lane's last limits.
    assert admitted(s.release(running, 2.0)) == [queued]
    assert "b" in s.snapshot(2.0)
    assert s.release(queued, 3.0) == []
    assert "b" not in s.snapshot(3.0)
    # The name can come back later as a fresh lane.
    s.reconfigure(make_policy([lane("a", 1), lane("b", 2)]), now=4.0)
    assert s.snapshot(4.0)["b"].limit == 2
    assert not s.snapshot(4.0)["b"].retired


def test_a_retired_lanes_queued_request_still_expires_at_its_deadline() -> None:
    s = scheduler(make_policy([lane("a", 1), lane("b", 1, deadline="5s")]))
    running = submit(s, "b", 0.0).ticket
    queued = submit(s, "b", 0.0, seconds=0.1).ticket
    s.reconfigure(make_policy([lane("a", 1)]), now=1.0)
    (expired,) = s.expire(6.0)
    assert (expired.ticket, expired.reason) == (queued, Reason.DEADLINE_EXPIRED)
    s.release(running, 7.0)
    assert "b" not in s.snapshot(7.0)


def test_reload_reweights_tenants_already_queued() -> None:
    policy = make_policy([lane("a", 1, max_queued=100)])
    s = scheduler(policy)
    blocker = submit(s, "a", 0.0).ticket
    for i in range(4):
        submit(s, "a", 0.01 * i, tenant="x")
        submit(s, "a", 0.01 * i, tenant="y")
    s.reconfigure(make_policy([lane("a", 1, max_queued=100)], tenants={"weights": {"y": 3.0}}), now=0.1)
    order = []
    ticket = blocker
    for step in range(8):
        (started,) = admitted(s.release(ticket, 1.0 + step))
        order.append(started.tenant)
        ticket = started
    # y's weight of 3 lets it take three of the first four slots, not an equal two.
    assert order[:4].count("y") == 3


def test_shadow_mode_admits_everything_and_says_what_enforcing_would_have_done() -> None:
    s = scheduler(make_policy([lane("a", 1, max_queued=1)], shadow=True))
    first = submit(s, "a", 0.0)
    assert (first.outcome, first.shadow) == (Outcome.ADMITTED, None)
    would_queue = submit(s, "a", 0.0)
    assert (would_queue.outcome, would_queue.shadow) == (Outcome.ADMITTED, Outcome.QUEUED)
    # Nothing is ever held in shadow mode, so the queue never fills: each verdict is "queue".
    more = [submit(s, "a", 0.0) for _ in range(3)]
    assert [(d.outcome, d.shadow) for d in more] == [(Outcome.ADMITTED, Outcome.QUEUED)] * 3
    view = s.snapshot(0.0)["a"]
    assert (view.inflight, view.queued, view.shadow) == (5, 0, True)
    assert all(t.state is State.INFLIGHT for t in [first.ticket, would_queue.ticket])


def test_shadow_mode_counts_a_full_queue_rejection() -> None:
    s = scheduler(make_policy([lane("a", 1, max_queued=0)], shadow=True))
    submit(s, "a", 0.0)
    decision = submit(s, "a", 0.0)
    assert (decision.outcome, decision.shadow, decision.reason) == (
        Outcome.ADMITTED, Outcome.REJECTED, Reason.QUEUE_FULL)


def test_shadow_per_lane_leaves_other_lanes_enforcing() -> None:
    s = scheduler(make_policy([lane("a", 1, shadow=True), lane("b", 1, max_queued=0)]))
    assert s.shadowed("a")
    assert not s.shadowed("b")
    submit(s, "a", 0.0)
    assert submit(s, "a", 0.0).outcome is Outcome.ADMITTED
    submit(s, "b", 0.0)
    assert submit(s, "b", 0.0).outcome is Outcome.REJECTED


def test_shadow_mode_never_evicts_other_lanes_queued_work() -> None:
    s = scheduler(make_policy([lane("hi", 1, priority=10, shadow=True), lane("lo", 1, evictable=True)],
                              capacity={"max_queued": 1}))
    submit(s, "lo", 0.0)
    low = submit(s, "lo", 0.0)
    assert low.outcome is Outcome.QUEUED
    submit(s, "hi", 0.0)
    decision, evicted = s.submit("hi", "t", job(), 0.0)
    assert decision.outcome is Outcome.ADMITTED
    assert decision.shadow is Outcome.QUEUED
    assert evicted == []
    assert low.ticket.state is State.QUEUED


def test_draining_is_enforced_even_in_shadow_mode() -> None:
    s = scheduler(make_policy([lane("a", 1)], shadow=True))
    s.drain(0.0)
    decision = submit(s, "a", 0.0)
    assert (decision.outcome, decision.reason) == (Outcome.REJECTED, Reason.DRAINING)


def test_a_paused_lane_queues_and_resumes_in_order() -> None:
    s = scheduler(make_policy([lane("a", 2), lane("b", 2)]))
    s.pause("a")
    first, second = submit(s, "a", 0.0), submit(s, "a", 0.1)
    assert first.outcome is second.outcome is Outcome.QUEUED
    assert submit(s, "b", 0.0).outcome is Outcome.ADMITTED
    assert s.snapshot(0.0)["a"].paused
    assert admitted(s.resume("a", 1.0)) == [first.ticket, second.ticket]
    with pytest.raises(KeyError):
        s.pause("nope")


def test_a_paused_lanes_requests_still_expire() -> None:
    s = scheduler(make_policy([lane("a", 1, deadline="2s")]))
    s.pause("a")
    queued = submit(s, "a", 0.0, seconds=0.1)
    (expired,) = s.expire(3.0)
    assert (expired.ticket, expired.reason) == (queued.ticket, Reason.DEADLINE_EXPIRED)


def test_undrain_admits_again() -> None:
    s = scheduler(make_policy([lane("a", 1)]))
    s.drain(0.0)
    assert submit(s, "a", 0.0).reason is Reason.DRAINING
    s.undrain(1.0)
    assert submit(s, "a", 1.0).outcome is Outcome.ADMITTED


def test_saturation_sheds_a_lane_naming_the_rule_and_signal_and_drops_its_queue() -> None:
    s = scheduler(make_policy([lane("a", 1), lane("b", 1)]))
    submit(s, "b", 0.0)
    queued = submit(s, "b", 0.0)
    effect = Effect(shed_by="kueue-backlog", signal="kueue_pending")
    (dropped,) = s.apply_saturation({"b": effect}, 1.0)
    assert (dropped.ticket, dropped.reason, dropped.saturation) == (queued.ticket, Reason.SATURATED, effect)
    rejected = submit(s, "b", 1.0)
    assert (rejected.outcome, rejected.reason) == (Outcome.REJECTED, Reason.SATURATED)
    assert rejected.saturation == effect
    assert submit(s, "a", 1.0).outcome is Outcome.ADMITTED
    assert s.snapshot(1.0)["b"].shed_by == "kueue-backlog"
    # Recovered: the lane admits again.
    assert s.apply_saturation({}, 2.0) == []
    assert submit(s, "b", 2.0).outcome is Outcome.QUEUED


def test_saturation_shrinks_a_limit_and_gives_it_back() -> None:
    s = scheduler(make_policy([lane("a", 4)]))
    running = [submit(s, "a", 0.0).ticket for _ in range(2)]
    s.apply_saturation({"a": Effect(signal="kv", shrunk_by="kv-high", factor=0.5)}, 1.0)
    assert s.snapshot(1.0)["a"].effective_limit == 2
    waiting = submit(s, "a", 1.0)
    assert waiting.outcome is Outcome.QUEUED
    assert admitted(s.apply_saturation({}, 2.0)) == [waiting.ticket]
    assert all(t.state is State.INFLIGHT for t in running)


def test_shadow_mode_only_counts_saturation_shedding() -> None:
    s = scheduler(make_policy([lane("a", 1, shadow=True)]))
    s.apply_saturation({"a": Effect(shed_by="r", signal="sig")}, 0.0)
    decision = submit(s, "a", 0.0)
    assert (decision.outcome, decision.shadow, decision.reason) == (
        Outcome.ADMITTED, Outcome.REJECTED, Reason.SATURATED)


def test_other_replicas_counts_take_slots_and_owed_places() -> None:
    s = scheduler(make_policy([lane("a", 2), lane("b", 2, borrow=True)], capacity={"max_inflight": 4}))
    assert s.set_others({"a": 1}, {}, 0.0) == []
    assert submit(s, "a", 0.0).outcome is Outcome.ADMITTED
    # One held elsewhere, one here: a is at its limit of 2 cluster-wide.
    assert submit(s, "a", 0.0).outcome is Outcome.QUEUED
    # b may borrow a free slot, unless other replicas have queued work owed it.
    s.set_others({"a": 1}, {"a": 5}, 0.0)
    submit(s, "b", 0.0)
    submit(s, "b", 0.0)
    assert submit(s, "b", 0.0).outcome is Outcome.QUEUED
    # The other replica's request ended: the queued a request starts here.
    (started,) = admitted(s.set_others({}, {}, 1.0))
    assert started.lane == "a"


def test_a_refused_request_goes_back_to_its_place_and_its_lane_waits_for_a_wake_up() -> None:
    s = scheduler(make_policy([lane("a", 2)]))
    first = submit(s, "a", 0.0).ticket
    later = submit(s, "a", 0.5)
    assert later.outcome is Outcome.ADMITTED
    requeued = s.requeue(first, 1.0)
    assert (requeued.outcome, first.state, first.admitted_at) == (Outcome.QUEUED, State.QUEUED, None)
    assert s.snapshot(1.0)["a"].queued == 1
    assert "a" in s.blocked
    # A slot frees locally, but the lane is blocked until the store says a slot freed.
    assert s.release(later.ticket, 2.0) == []
    assert s.heads() == {"a": s.rank(first)}
    assert admitted(s.unblock(2.5, {"a"})) == [first]
    assert s.heads() == {}


def test_a_requeued_request_still_expires_at_its_deadline() -> None:
    s = scheduler(make_policy([lane("a", 1, deadline="5s")]))
    ticket = submit(s, "a", 0.0, seconds=0.1).ticket
    s.requeue(ticket, 1.0)
    (expired,) = s.expire(6.0)
    assert (expired.ticket, expired.reason) == (ticket, Reason.DEADLINE_EXPIRED)

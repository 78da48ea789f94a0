"""The self-sizing fleet limit (capacity.max_inflight: auto): pure, explicit time, no sockets."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.admission import held_queued
from extproc.core.capacity import AutoLimit, size
from extproc.core.decision import Reason
from extproc.core.machine import Machine
from extproc.core.saturation import Reading
from extproc.policy import PolicyError, parse_policy
from extproc.policy.schema import Policy
from tests.unit.test_admission import job

SIGNALS = {
    "sources": {"engines": {"scrape": {"targets": ["http://127.0.0.1:8000/metrics"], "interval": "1s"}}},
    "read": {
        "waiting": {"source": "engines", "preset": "waiting_requests", "stale_after": "5s"},
        "tpot": {"source": "engines", "metric": "tpot_p95", "stale_after": "5s"},
        "ttft": {"source": "engines", "metric": "ttft_p95", "stale_after": "5s"},
    },
}


def policy(**auto: Any) -> Policy:
    config: dict[str, Any] = {"min": 4, "max": 256, "signals": {"waiting": "waiting", "tpot_p95": "tpot",
                                                                 "ttft_p95": "ttft"},
                              "target": {"tpot_p95": "50ms", "ttft_p95": "1s"}}
    config.update(auto)
    return Policy.model_validate({
        "lanes": [{"name": "interactive", "priority": 10, "max_inflight": 75, "max_queued": 100,
                   "deadline": "60s"},
                  {"name": "batch", "max_inflight": 25, "max_queued": 100, "deadline": "60s", "borrow": True,
                   "max_borrow": 10}],
        "classification": {"default_lane": "batch"},
        "capacity": {"max_inflight": "auto", "auto": config},
        "signals": SIGNALS,
    })


def readings(now: float, waiting: float | None = 0, tpot: float | None = 0.02,
             ttft: float | None = 0.6) -> dict[str, Reading]:
    # TTFT p95 over half its target (1 s) and under 90 % of it: a few requests waiting count as a
    # queue, and there is headroom to grow.
    values = {"waiting": waiting, "tpot": tpot, "ttft": ttft}
    return {name: Reading(value, now) for name, value in values.items() if value is not None}


def auto_of(p: Policy) -> AutoLimit:
    assert p.capacity.auto is not None
    return AutoLimit(p.capacity.auto, p.signals)


def test_it_grows_only_while_there_is_headroom_and_the_limit_holds_traffic_back() -> None:
    a = auto_of(policy())
    assert a.limit == 4  # starts at min
    assert a.update(readings(0), inflight=1, held=False, now=0) is None  # nothing presses against it
    move = a.update(readings(2), inflight=4, held=False, now=2)
    assert move is not None
    assert (move.previous, move.limit, move.reason) == (4, 8, "headroom")  # slow start: doubling
    assert a.update(readings(4), inflight=5, held=True, now=4) is None  # a limit far above what runs
    a.update(readings(6), inflight=8, held=False, now=6)
    assert a.limit == 16
    # The first fall ends the slow start; from then on +5 %, doubling per growth up to +25 %.
    a.update(readings(8, waiting=50), inflight=16, held=False, now=8)
    assert a.limit == 8
    limits = [a.limit]
    for t in range(10, 50, 2):
        a.update(readings(t), inflight=a.limit, held=False, now=t)
        limits.append(a.limit)
    assert limits == sorted(limits)
    assert limits[1] == 9
    assert limits[-1] > 40
    assert all(b <= max(a_ * 1.25 + 1, a_ + 1) for a_, b in itertools.pairwise(limits))


def test_moves_at_most_once_per_interval() -> None:
    a = auto_of(policy(interval="2s"))
    assert a.update(readings(0), 4, False, 0) is not None
    assert a.update(readings(1), 8, False, 1) is None
    assert a.update(readings(2), 8, False, 2) is not None


def test_one_sample_of_a_small_engine_queue_is_not_yet_a_fall() -> None:
    a = auto_of(policy(start=100))
    assert a.update(readings(0, waiting=2), inflight=100, held=True, now=0) is None  # nor a growth
    assert a.limit == 100
    assert a.update(readings(2, waiting=0), inflight=100, held=True, now=2) is not None  # gone: grows
    assert a.limit == 200
    assert a.update(readings(4, waiting=2), inflight=180, held=True, now=4) is None
    move = a.update(readings(6, waiting=3), inflight=180, held=True, now=6)  # still there: falls
    assert move is not None
    assert (move.limit, move.reason) == (177, "engine_queue")  # what runs (180) less the excess


def test_a_few_waiting_that_cost_no_first_token_are_not_a_queue() -> None:
    """An engine that takes new requests into its batch every few steps shows a few waiting at most
    samples although it has free slots; while TTFT p95 stays under half its target they cost no one a
    first token: no fall, and growth goes on. The same few with TTFT at 60 % of it are a queue."""
    calm = auto_of(policy(start=64))
    for t in range(0, 20, 2):
        calm.update(readings(t, waiting=3, ttft=0.3), inflight=calm.limit, held=True, now=t)
    assert calm.limit > 64
    assert calm.state().reason == "headroom"
    slow = auto_of(policy(start=64))
    assert slow.update(readings(0, waiting=3), inflight=64, held=True, now=0) is None
    move = slow.update(readings(2, waiting=3), inflight=64, held=True, now=2)
    assert move is not None
    assert (move.limit, move.reason) == (61, "engine_queue")
    # A queue four times over the target is one whatever TTFT says; with TTFT under half its target
    # it costs no first token yet: a quarter over what runs (44), not down to it.
    big = auto_of(policy(start=64))
    move = big.update(readings(0, waiting=20, ttft=0.3), inflight=64, held=True, now=0)
    assert move is not None
    assert (move.limit, move.reason) == (55, "engine_queue")
    assert "a quarter over the 44 they run" in move.why


def test_a_queue_that_costs_no_first_token_keeps_a_buffer_over_what_runs_once_per_cooldown() -> None:
    """An engine that prefills waiting requests first (or preempts and resumes) queues at a low TTFT:
    the limit keeps a quarter over what the engines run, at most halving, and moves again only after
    the cooldown. The same queue at a TTFT over half its target falls to what runs."""
    a = auto_of(policy(start=160, cooldown="6s"))
    move = a.update(readings(0, waiting=20, ttft=0.3), inflight=100, held=True, now=0)
    assert move is not None
    assert (move.previous, move.limit) == (160, 100)  # 80 run: 100, where the start's doubling stops
    assert a.update(readings(2, waiting=30, ttft=0.3), inflight=100, held=True, now=2) is None
    assert a.update(readings(4, waiting=30, ttft=0.3), inflight=100, held=True, now=4) is None
    assert a.limit == 100  # the queue grew, but within the cooldown
    move = a.update(readings(6, waiting=30, ttft=0.3), inflight=100, held=True, now=6)
    assert move is not None
    assert move.limit == 87  # a quarter over the 70 that run
    # Far above what runs, it falls at most by half.
    halved = auto_of(policy(start=256))
    assert halved.update(readings(0, waiting=20, ttft=0.3), inflight=60, held=True, now=0) is not None
    assert halved.limit == 128
    # The queue gone, growth resumes (+5 %: the start ended at the queue, no doubling).
    assert a.update(readings(8, ttft=0.3), inflight=87, held=True, now=8) is not None
    assert a.limit == 91
    # The same queue with TTFT over half its target costs first tokens: down to what runs.
    move = a.update(readings(10, waiting=20, ttft=0.6), inflight=91, held=True, now=10)
    assert move is not None
    assert move.limit == 71


def test_a_queue_is_not_cheap_once_ttft_has_tripled_since_the_engines_had_none() -> None:
    """TTFT p95 still under half its target, but three times what it was at the last reading without an
    engine queue: the first tokens wait in that queue. The limit falls to what runs (70), not to a
    quarter over it (87). Where TTFT was already as high with no queue (an engine that queues a few
    between join points), or under a tenth of its target, the queue is cheap."""
    costly = auto_of(policy(start=100))
    assert costly.update(readings(0, waiting=0, ttft=0.06), inflight=50, held=False, now=0) is None
    move = costly.update(readings(2, waiting=20, ttft=0.3), inflight=90, held=True, now=2)
    assert move is not None
    assert (move.limit, move.reason) == (70, "engine_queue")
    cheap = auto_of(policy(start=100))
    assert cheap.update(readings(0, waiting=0, ttft=0.2), inflight=50, held=False, now=0) is None
    move = cheap.update(readings(2, waiting=20, ttft=0.3), inflight=90, held=True, now=2)
    assert move is not None
    assert move.limit == 87
    assert "a quarter over the 70 they run" in move.why
    fast = auto_of(policy(start=100))
    assert fast.update(readings(0, waiting=0, ttft=0.005), inflight=50, held=False, now=0) is None
    move = fast.update(readings(2, waiting=20, ttft=0.09), inflight=90, held=True, now=2)
    assert move is not None
    assert move.limit == 87
    # What it adds to is the TTFT at the last reading with no queue (0.2 s here), not an earlier one.
    later = auto_of(policy(start=100))
    assert later.update(readings(0, waiting=0, ttft=0.06), inflight=50, held=False, now=0) is None
    assert later.update(readings(2, waiting=0, ttft=0.2), inflight=50, held=False, now=2) is None
    move = later.update(readings(4, waiting=20, ttft=0.3), inflight=90, held=True, now=4)
    assert move is not None
    assert move.limit == 87


def test_a_few_waiting_once_ttft_has_tripled_since_the_engines_had_none_are_a_queue() -> None:
    """A few waiting at a TTFT p95 under half its target are no queue, but not once that TTFT is three
    times what it was at the last reading with none: two samples running, the limit sheds them."""
    a = auto_of(policy(start=64))
    assert a.update(readings(0, waiting=0, ttft=0.05), inflight=40, held=False, now=0) is None
    assert a.update(readings(2, waiting=3, ttft=0.3), inflight=64, held=True, now=2) is None  # one sample
    move = a.update(readings(4, waiting=3, ttft=0.3), inflight=64, held=True, now=4)
    assert move is not None
    assert (move.limit, move.reason) == (61, "engine_queue")


def test_a_reload_that_changes_the_targets_forgets_the_last_calm_ttft_and_queue() -> None:
    """What a queue's TTFT is measured against, and when the engines last queued beyond the target, are
    readings against the old targets: a reload with other targets starts them afresh."""
    a = auto_of(policy(start=100))
    assert a.update(readings(0, waiting=0, ttft=0.06), inflight=50, held=False, now=0) is None
    p = policy(start=100, target={"tpot_p95": "50ms", "ttft_p95": "1s", "queue": 2})
    assert p.capacity.auto is not None
    a.reconfigure(p.capacity.auto, p.signals, 1)
    move = a.update(readings(2, waiting=20, ttft=0.3), inflight=90, held=True, now=2)
    assert move is not None
    assert move.limit == 90  # cheap: a quarter over the 72 that run (not down to them: 72)


def test_a_request_or_two_waiting_below_a_loose_limit_trims_it_not_down_to_what_runs() -> None:
    # 47 run under a limit of 64 and one request waits at the engines twice running: it may be
    # one caught between two engine steps; the limit sheds that one, not 17 slots.
    a = auto_of(policy(start=64))
    assert a.update(readings(0, waiting=1), inflight=47, held=False, now=0) is None
    move = a.update(readings(2, waiting=1), inflight=47, held=False, now=2)
    assert move is not None
    assert (move.limit, move.reason) == (63, "engine_queue")


def test_an_engine_queue_takes_the_excess_off_at_once() -> None:
    a = auto_of(policy(start=100))
    move = a.update(readings(0, waiting=30), inflight=100, held=True, now=0)
    assert move is not None
    assert (move.limit, move.reason) == (70, "engine_queue")
    assert "queue 30" in move.why
    # A huge queue cuts at most half at once, and never below min.
    move = a.update(readings(2, waiting=1000), inflight=70, held=True, now=2)
    assert move is not None
    assert move.limit == 35
    for t in range(4, 40, 2):
        a.update(readings(t, waiting=1000), 35, False, t)
    assert a.limit == 4


def test_a_limit_that_already_left_the_queue_out_holds_while_admitted_requests_drain() -> None:
    # The engines lose half their slots: 128 in flight, 64 of them now queued at the engines.
    a = auto_of(policy(start=128))
    assert a.update(readings(0, waiting=64), inflight=128, held=True, now=0) is not None
    assert a.limit == 64
    # The queue stays while running requests finish; what is in flight falls towards the limit.
    for t, inflight, waiting in ((2, 126, 62), (4, 120, 56), (6, 100, 36), (8, 80, 16)):
        assert a.update(readings(t, waiting=waiting), inflight=inflight, held=True, now=t) is None
        assert a.limit == 64
    # A queue that outlasts that is real: 70 in flight, 10 waiting, so the engines run 60.
    move = a.update(readings(10, waiting=10), inflight=70, held=True, now=10)
    assert move is not None
    assert move.limit == 60


def test_a_latency_over_target_cuts_in_proportion_then_waits_for_the_window() -> None:
    a = auto_of(policy(start=100, cooldown="6s"))
    move = a.update(readings(0, ttft=1.25), inflight=100, held=False, now=0)  # 1 / 1.25 = 0.8
    assert move is not None
    assert (move.limit, move.reason) == (80, "ttft")
    assert a.update(readings(2, ttft=4.0), 80, False, 2) is None  # within the cooldown: the p95 lags
    move = a.update(readings(6, ttft=4.0), 80, False, 6)
    assert move is not None
    assert move.limit == 40  # cut at most by half
    move = a.update(readings(12, ttft=1.05), 40, False, 12)
    assert move is not None
    assert (move.limit, move.reason) == (38, "ttft")  # at least 5 %


def test_a_tpot_over_target_cuts_a_tenth_at_most() -> None:
    """A step takes a fixed time plus a little per sequence: halving the batch does not halve TPOT."""
    a = auto_of(policy(start=100, cooldown="6s"))
    move = a.update(readings(0, tpot=0.2), inflight=100, held=False, now=0)  # 4x the 50 ms target
    assert move is not None
    assert (move.limit, move.reason) == (90, "tpot")
    move = a.update(readings(6, tpot=0.0515), 90, False, 6)
    assert move is not None
    assert (move.limit, move.reason) == (85, "tpot")  # at least 5 %, as any cut


def test_a_ttft_over_target_after_the_engines_queue_drained_cuts_a_tenth_at_most() -> None:
    """The percentile looks back over its window (here the TTFT itself, 2 s): a TTFT over target while
    the engines queue nothing, though they did within it, is that queue's first tokens, and the queue is
    gone. It cuts by a tenth at most; in proportion (by half) where no queue was seen in that window,
    as before it, or long ago."""
    drained = auto_of(policy(start=100, cooldown="6s"))
    assert drained.update(readings(0, waiting=2), inflight=60, held=False, now=0) is None  # one sample
    move = drained.update(readings(2, waiting=0, ttft=2.0), inflight=60, held=False, now=2)
    assert move is not None
    assert (move.limit, move.reason) == (90, "ttft")
    never = auto_of(policy(start=100, cooldown="6s"))
    move = never.update(readings(2, waiting=0, ttft=2.0), inflight=60, held=False, now=2)
    assert move is not None
    assert move.limit == 50
    long_ago = auto_of(policy(start=100, cooldown="6s"))
    assert long_ago.update(readings(0, waiting=2), inflight=60, held=False, now=0) is None
    move = long_ago.update(readings(3, waiting=0, ttft=2.0), inflight=60, held=False, now=3)
    assert move is not None
    assert move.limit == 50
    # A queue still there is no drained one: in proportion.
    queued = auto_of(policy(start=100, cooldown="6s"))
    move = queued.update(readings(0, waiting=1, ttft=2.0), inflight=60, held=False, now=0)
    assert move is not None
    assert move.limit == 50


def test_a_percentile_cuts_again_only_after_its_window_has_passed() -> None:
    # The p95 over the last 10 s still holds what the engines did before the first cut: a second
    # cut 6 s later would act on the same samples twice.
    p = policy(start=100, cooldown="6s")
    signals = p.signals.model_copy(update={"read": {
        **p.signals.read,
        "tpot": p.signals.read["tpot"].model_copy(update={"metric": None, "query": "tpot_p95[10s]"}),
    }})
    assert p.signals.read["tpot"].lookback is None
    assert signals.read["tpot"].lookback == 10.0
    assert p.capacity.auto is not None
    a = AutoLimit(p.capacity.auto, signals)
    assert a.update(readings(0, tpot=0.0625), inflight=100, held=False, now=0) is not None
    assert a.limit == 90
    assert a.update(readings(6, tpot=0.2), 90, False, 6) is None  # past the cooldown, not the window
    move = a.update(readings(10, tpot=0.2), 90, False, 10)
    assert move is not None
    assert move.limit == 81


def test_a_slow_first_token_seen_after_a_fall_is_of_a_request_admitted_before_it() -> None:
    p = policy(start=100, cooldown="2s")
    signals = p.signals.model_copy(update={"read": {
        **p.signals.read,
        "ttft": p.signals.read["ttft"].model_copy(update={"metric": None, "query": "ttft_p95[10s]"}),
    }})
    assert p.capacity.auto is not None
    a = AutoLimit(p.capacity.auto, signals)
    assert a.update(readings(0, waiting=40), inflight=100, held=True, now=0) is not None
    assert a.limit == 60  # the engines queue: down to what they run
    # First tokens of 5 s come in: requests that waited in the engines' queue before the fall.
    for t in (2, 6, 10, 14):
        assert a.update(readings(t, ttft=5.0), inflight=60, held=True, now=t) is None
    move = a.update(readings(16, ttft=5.0), inflight=60, held=True, now=16)  # 10 s window + 5 s TTFT
    assert move is not None
    assert move.reason == "ttft"


def test_out_of_the_start_the_point_of_the_fall_is_what_the_engines_ran_not_the_overshoot() -> None:
    a = auto_of(policy(start=100))
    # Still starting: the engines queue 10 of 100 in flight. They run 90; 100 was the start's overshoot.
    assert a.update(readings(0, waiting=10), inflight=100, held=True, now=0) is not None
    assert a.limit == 90
    limits = []
    for t in range(2, 12, 2):
        a.update(readings(t), inflight=a.limit, held=True, now=t)
        limits.append(a.limit)
    assert limits == [91, 92, 93, 94, 95]  # one slot at a time through what ran: no quick return to 100


def test_growth_creeps_past_the_point_of_the_last_fall_then_probes_on() -> None:
    a = auto_of(policy(start=110))
    assert a.update(readings(0, waiting=10), inflight=110, held=True, now=0) is not None  # the start ends
    a.adopt(100)
    # The engines queue at 100 running: the limit falls to 90, and 100 is remembered.
    assert a.update(readings(2, waiting=10), inflight=100, held=True, now=2) is not None
    assert a.limit == 90
    limits = [a.limit]
    for t in range(4, 42, 2):
        a.update(readings(t), inflight=a.limit, held=True, now=t)
        limits.append(a.limit)
    assert limits[:4] == [90, 94, 95, 96]  # quickly back near 100 (95 %), then one slot at a time
    near = [limit for limit in limits if 95 <= limit < 105]
    assert len(near) >= 8  # the creep through [95, 105)
    assert limits[-1] > 120  # past it nothing said "too many": the growth speeds up again
    assert limits == sorted(limits)


def test_the_point_of_a_fall_is_what_ran_not_a_limit_far_above_it() -> None:
    a = auto_of(policy(start=200))
    # Limit 200, but only 60 ran when the engines queued: 60 is where they had too many.
    assert a.update(readings(0, waiting=20), inflight=60, held=False, now=0) is not None
    assert a.limit == 100  # at most halved in one move
    assert a.update(readings(2, waiting=20), inflight=60, held=False, now=2) is not None
    assert a.limit == 50  # 60 running less the excess of 20, but at most halved
    # Growing back: quickly to 95 % of 60, then one slot per interval.
    grown = []
    for t in range(4, 20, 2):
        a.update(readings(t), inflight=a.limit, held=True, now=t)
        grown.append(a.limit)
    assert grown[:4] == [52, 57, 58, 59]


def test_an_unreachable_target_stops_at_min_and_says_so() -> None:
    a = auto_of(policy(start=8, cooldown=0, target={"tpot_p95": "1ms"}))
    for t in range(0, 40, 2):
        a.update(readings(t, tpot=0.02), 8, False, t)
    assert a.limit == 4
    state = a.state()
    assert state.unreachable is not None
    assert "tpot_p95 20ms > target 1ms at min 4" in state.unreachable


def test_stale_signals_hold_then_decay_to_min_and_say_so() -> None:
    a = auto_of(policy(start=100, stale_hold="10s"))
    a.update(readings(0), 50, False, 0)
    # Readings of t=0 go stale after 5 s.
    for t in range(2, 12, 2):
        a.update(readings(0), 50, False, t)
    assert a.limit == 100
    assert a.state().stale
    assert a.state().reason == "stale"
    moves = [a.update(readings(0), 50, False, t) for t in range(16, 120, 2)]
    assert a.limit == 4
    assert any(m is not None and "decaying to min 4" in m.why for m in moves)
    # A fresh reading ends it.
    a.update(readings(120), 4, False, 120)
    assert not a.state().stale


def test_missing_signals_count_as_stale() -> None:
    a = auto_of(policy(start=20, stale_hold="2s"))
    assert a.update({}, 20, False, 0) is None  # the first stale tick starts the hold
    move = a.update({}, 20, False, 2)
    assert move is not None
    assert move.reason == "stale"


def test_reload_keeps_the_learned_limit_inside_the_new_bounds() -> None:
    p = policy(start=100)
    a = auto_of(p)
    q = policy(start=10, max=50)
    assert q.capacity.auto is not None
    move = a.reconfigure(q.capacity.auto, q.signals, 5)
    assert move is not None
    assert (move.limit, move.reason) == (50, "reload")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 500), st.floats(0, 2), st.floats(0, 20), st.integers(0, 400),
                          st.booleans()), max_size=60),
       st.integers(1, 50), st.integers(0, 200))
def test_the_limit_never_leaves_its_bounds(steps: list[tuple[float, float, float, int, bool]], lo: int,
                                           span: int) -> None:
    a = auto_of(policy(min=lo, max=lo + span, cooldown=0))
    t = 0.0
    for waiting, tpot, ttft, inflight, fresh in steps:
        t += 2
        a.update(readings(t if fresh else 0, waiting, tpot, ttft), inflight, False, t)
        assert lo <= a.limit <= lo + span


def test_size_makes_lanes_shares_of_the_limit() -> None:
    p = policy()
    sized = size(p, 40)
    assert sized.capacity.max_inflight == 40
    assert [lane.max_inflight for lane in sized.lanes] == [30, 10]
    assert sized.lane("batch").max_borrow == 4
    assert size(size(p, 40), 80) == size(p, 40)  # a sized policy is concrete: left as it is
    tiny = size(p, 1)
    assert [lane.max_inflight for lane in tiny.lanes] == [1, 1]  # never below one slot


def test_the_machine_enforces_the_limit_it_moves_to() -> None:
    gate = Machine(policy(start=4, interval="1s"))
    assert gate.policy.total_capacity == 4
    admitted = [gate.submit("interactive", "t", job(), 0).decision for _ in range(10)]
    assert sum(d.outcome.value == "admitted" for d in admitted) == 3  # 75 % of 4
    result = gate.on_signals(readings(1), 1)
    assert result.move is not None
    assert result.move.limit == 8
    assert gate.policy.total_capacity == 8
    assert gate.policy.lane("interactive").max_inflight == 6
    assert [d.outcome.value for d in result.decisions] == ["admitted"] * 3  # queued requests start
    # The engine queues: the limit falls; nothing running is cut short.
    result = gate.on_signals(readings(3, waiting=30), 3)
    assert result.move is not None
    assert gate.policy.total_capacity == 4
    assert gate.total_inflight == 6


def test_fleet_managed_moves_are_proposals_until_set_limit() -> None:
    gate = Machine(policy(start=4))
    gate.fleet_managed = True
    for _ in range(4):
        gate.submit("interactive", "t", job(), 0)
    result = gate.on_signals(readings(2), 2)
    assert result.move is not None
    assert gate.policy.total_capacity == 4  # not yet enforced
    gate.set_limit(9, 2)
    assert gate.policy.total_capacity == 9
    assert gate.auto is not None
    assert gate.auto.limit == 9  # the fleet's value, adopted


def test_shadow_computes_but_enforces_the_number() -> None:
    base = policy()
    assert base.capacity.auto is not None
    watched = base.capacity.auto.model_copy(update={"shadow": True})
    p = Policy.model_validate({**base.model_dump(), "capacity": {"max_inflight": 100, **{
        "auto": watched.model_dump()}}})
    gate = Machine(p)
    for _ in range(4):
        gate.submit("interactive", "t", job(), 0)
    result = gate.on_signals(readings(2), 2)
    assert result.move is not None
    assert gate.policy.total_capacity == 100
    assert gate.auto is not None
    assert gate.auto.limit == 8


BASE = """
lanes:
  - {name: a, max_inflight: 3, max_queued: 4, deadline: 1s}
classification: {default_lane: a}
signals:
  sources: {e: {scrape: {targets: ["http://127.0.0.1:8000/metrics"], interval: 1s}}}
  read: {w: {source: e, preset: waiting_requests, stale_after: 5s}}
"""


@pytest.mark.parametrize(("capacity", "message"), [
    ("{max_inflight: auto}", "capacity.auto: required with capacity.max_inflight: auto"),
    ("{max_inflight: 8, auto: {max: 9, signals: {waiting: w}}}",
     "set capacity.max_inflight: auto to enforce"),
    ("{max_inflight: auto, auto: {max: 9, shadow: true, signals: {waiting: w}}}",
     "shadow mode enforces a number"),
    ("{max_inflight: auto, auto: {max: 9, signals: {waiting: nope}}}",
     "capacity.auto.signals.waiting: unknown signal 'nope', expected one of ['w']"),
    ("{max_inflight: auto, auto: {max: 9}}", "name at least one of waiting, ttft_p95, tpot_p95"),
    ("{max_inflight: auto, auto: {max: 9, signals: {waiting: w, kv_cache: w}}}",
     "capacity.auto.signals.kv_cache: needs capacity.auto.signals.running"),
    ("{max_inflight: auto, auto: {max: 9, signals: {waiting: w}, target: {tpot_p95: 50ms}}}",
     "capacity.auto.target.tpot_p95: needs capacity.auto.signals.tpot_p95"),
    ("{max_inflight: auto, auto: {min: 10, max: 9, signals: {waiting: w}}}",
     "min (10) must not exceed max (9)"),
    ("{max_inflight: auto, auto: {max: 9, start: 20, signals: {waiting: w}}}", "start (20) must lie within"),
    ("{max_inflight: automatic}", "a whole number of slots or auto"),
    ("{max_inflight: 0}", "greater than or equal to 1"),
])
def test_bad_auto_settings_are_clear_errors(capacity: str, message: str) -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy(BASE + f"capacity: {capacity}\n", "p.yaml")
    assert message in str(err.value)


def test_a_good_auto_policy_loads() -> None:
    p = parse_policy(BASE + "capacity: {max_inflight: auto, auto: {min: 2, max: 9, signals: {waiting: w}}}\n",
                     "p.yaml")
    assert p.auto_capacity
    assert p.total_capacity == 2


async def test_a_frozen_or_floored_limit_is_exported_and_named_by_readiness() -> None:
    """The limit's bounds and the sources feeding it are exported (the alerts compare the limit with its
    min, and scrape targets with what feeds it); readiness names stale signals and an unreachable
    target (and stays ready); a policy without auto exports neither."""
    from prometheus_client import CollectorRegistry

    from extproc.app import _capacity_notes
    from extproc.controller import Controller
    from extproc.metrics import Metrics

    registry = CollectorRegistry()
    now = [0.0]
    controller = Controller(policy(stale_hold="10s"), Metrics(registry), clock=lambda: now[0])

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert sample("extproc_capacity_limit_bounds", bound="min") == 4
    assert sample("extproc_capacity_limit_bounds", bound="max") == 256
    sources = {s.labels["source"] for m in registry.collect() if m.name == "extproc_capacity_source"
               for s in m.samples}
    assert sources == {SIGNALS["read"][name]["source"] for name in ("waiting", "tpot", "ttft")}
    controller.on_signals(readings(0), 0)
    assert _capacity_notes(controller) == []
    # Every signal goes stale: the limit holds, then decays; readiness says so.
    for t in range(1, 40, 2):
        now[0] = float(t)
        controller.on_signals({}, float(t))
    assert sample("extproc_capacity_signals_stale") == 1
    notes = _capacity_notes(controller)
    assert len(notes) == 1
    assert notes[0].startswith("capacity signals stale: limit ")
    # A TPOT target missed at the min: unreachable, named.
    for t in range(40, 120, 2):
        now[0] = float(t)
        controller.on_signals(readings(float(t), tpot=0.5), float(t))
    assert sample("extproc_capacity_target_unreachable") == 1
    notes = _capacity_notes(controller)
    assert any(note.startswith("capacity latency target unreachable (tpot_p95") for note in notes)
    controller.reconfigure(Policy.model_validate({
        "lanes": [{"name": "interactive", "max_inflight": 4, "deadline": "1s"}],
        "classification": {"default_lane": "interactive"}}))
    assert sample("extproc_capacity_limit_bounds", bound="min") is None
    assert not [s for m in registry.collect() if m.name == "extproc_capacity_source" for s in m.samples]
    assert _capacity_notes(controller) == []


async def test_a_starting_replica_takes_the_fleet_s_stored_limit_when_no_leader_lives() -> None:
    """A whole-fleet restart (the leader gone, its limit stored and fresh): the first replica up starts
    from the fleet's limit, not from capacity.auto.start; once it has a limit of its own it proposes it."""
    from prometheus_client import CollectorRegistry

    from extproc.controller import Controller
    from extproc.metrics import Metrics
    from extproc.state.memory import MemoryHub, MemoryLedger

    now = [0.0]
    hub = MemoryHub(clock=lambda: now[0])
    gone = MemoryLedger(hub, renew=False, replica="gone")
    assert await gone.agree_limit(48) == (48, True)
    now[0] = 10.0  # the leader's TTL passed; the stored limit is ten seconds old
    ledger = MemoryLedger(hub, renew=False, replica="new")
    controller = Controller(policy(start=4), Metrics(CollectorRegistry()), clock=lambda: now[0],
                            ledger=ledger)
    machine = controller.machine
    assert machine.auto is not None
    assert machine.auto.limit == 4
    assert controller.fleet is not None
    await controller.fleet.sync_once()
    assert (machine.auto.limit, controller.fleet_leader) == (48, True)
    assert machine.policy.total_capacity == 48
    await controller.fleet.sync_once()
    assert machine.auto.limit == 48


def test_a_starting_limit_begins_from_what_the_engines_run() -> None:
    signals = {**SIGNALS, "read": {**SIGNALS["read"],
                                   "running": {"source": "engines", "preset": "running_requests",
                                               "stale_after": "5s"}}}

    def started(running: float, waiting: float) -> AutoLimit:
        p = Policy.model_validate({**policy(start=4).model_dump(), "signals": signals, "capacity": {
            "max_inflight": "auto", "auto": {"min": 4, "max": 256, "start": 4,
                                             "signals": {"waiting": "waiting", "running": "running"}}}})
        assert p.capacity.auto is not None
        auto = AutoLimit(p.capacity.auto, p.signals)
        move = auto.update({"waiting": Reading(waiting, 0), "running": Reading(running, 0)}, 0, False, 0)
        assert move is not None
        assert move.reason == "running"
        assert not auto.starting
        return auto

    # Engines running 40 with room: at least that, and it grows from there (slow start).
    roomy = started(40, 0)
    assert roomy.limit == 40
    assert roomy.update({"waiting": Reading(0, 2), "running": Reading(40, 2)}, 40, True, 2) is not None
    assert roomy.limit > 40
    # Engines running 48 and queueing 10: exactly what they run, where they said "too many".
    full = started(48, 10)
    assert full.limit == 48
    # Only the first reading seeds: later ones follow the usual rules.
    assert full.update({"waiting": Reading(0, 2), "running": Reading(200, 2)}, 0, False, 2) is None
    assert full.limit == 48
    # Without a running role nothing changes: the limit starts at start.
    plain = auto_of(policy(start=4))
    assert plain.update(readings(0), 0, False, 0) is None
    assert plain.limit == 4


def running_policy(**auto: Any) -> Policy:
    """``policy`` with a ``running`` signal role beside waiting, TTFT and TPOT."""
    signals = {**SIGNALS, "read": {**SIGNALS["read"],
                                   "running": {"source": "engines", "preset": "running_requests",
                                               "stale_after": "5s"}}}
    config: dict[str, Any] = {"min": 4, "max": 512, "signals": {
        "waiting": "waiting", "running": "running", "tpot_p95": "tpot", "ttft_p95": "ttft"},
        "target": {"tpot_p95": "50ms", "ttft_p95": "1s"}, **auto}
    return Policy.model_validate({**policy().model_dump(), "signals": signals,
                                  "capacity": {"max_inflight": "auto", "auto": config}})


def engines(now: float, running: float, waiting: float = 0, ttft: float = 0.6) -> dict[str, Reading]:
    return {**readings(now, waiting=waiting, ttft=ttft), "running": Reading(running, now)}


def test_a_start_doubles_on_every_fresh_reading_while_requests_are_held_back() -> None:
    a = auto_of(running_policy())
    a.update(engines(0, 0), 0, False, 0)
    assert a.limit == 4
    # Readings a second apart (the interval is 2 s): each new one doubles a pressed, held-back limit.
    for t, limit in ((1, 8), (2, 16), (3, 32)):
        assert a.update(engines(t, a.limit), a.limit, True, t) is not None
        assert a.limit == limit
    # The same reading again is no news: no tick before the interval.
    assert a.update(engines(3, 32), 32, True, 3.5) is None
    # Nothing held back: the interval again.
    assert a.update(engines(4, 32), 32, False, 4) is None
    assert a.update(engines(5, 32), 32, False, 5) is not None  # 2 s since the last tick
    assert a.limit == 64


def test_a_start_doubles_on_a_reading_after_requests_were_refused_for_want_of_a_slot() -> None:
    """At a small limit a lane's requests may be refused at once (no room in its queue, or a deadline
    out of reach behind its few slots) instead of held: nothing waits after them, yet more slots would
    have started them. A refusal for want of a slot within the limit's interval counts as held work:
    a start doubles on the next fresh reading, as it does for a queue. An older one does not."""
    data = running_policy(start=4).model_dump()
    data["lanes"][0]["max_queued"] = 0  # interactive: no queue, refused at its share
    p = Policy.model_validate(data)

    def refused_at(t: float) -> Machine:
        gate = Machine(p)
        gate.on_signals(engines(0, 0), 0)
        outcomes = [gate.submit("interactive", "t", job(), t).decision.outcome.value for _ in range(4)]
        assert outcomes == ["admitted"] * 3 + ["rejected"]  # its share of 4 is 3
        assert not gate._scheduler.held_back  # nothing waits
        return gate

    gate = refused_at(0.9)
    result = gate.on_signals(engines(1, 3), 1)
    assert result.move is not None
    assert (result.move.previous, result.move.limit, result.move.reason) == (4, 8, "headroom")
    # A refusal at the limit before (4) says nothing of this one (8): six in flight, nothing refused
    # since, no doubling on the next fresh reading, though the old refusal is within the interval.
    for _ in range(3):
        assert gate.submit("interactive", "t", job(), 1.2).decision.outcome.value == "admitted"
    assert gate.on_signals(engines(1.5, 6), 1.5).move is None
    assert gate.policy.total_capacity == 8
    # One refused at this limit does: the next fresh reading doubles it.
    assert gate.submit("interactive", "t", job(), 1.6).decision.outcome.value == "rejected"
    result = gate.on_signals(engines(1.8, 6), 1.8)
    assert result.move is not None
    assert (result.move.previous, result.move.limit) == (8, 16)
    # The same refusal 2.5 s before the reading (the interval is 2 s): nothing says slots are
    # wanted now, and three of four in flight is no pressure alone.
    gate = refused_at(0.5)
    assert gate.on_signals(engines(3, 3), 3).move is None
    assert gate.policy.total_capacity == 4


def test_a_refusal_at_the_edge_for_want_of_a_slot_is_noted_too() -> None:
    """A lane without a queue is refused at the edge (the rate limit service) once its slots are taken,
    before the scheduler sees the request: that refusal counts as held work for the limit too. A refusal
    at the edge for another reason (a lane closed) does not."""
    data = running_policy(start=4).model_dump()
    data["lanes"][1].update(max_queued=0, borrow=False, max_borrow=None)  # batch: no queue, no borrowing
    gate = Machine(Policy.model_validate(data))
    gate.on_signals(engines(0, 0), 0)
    config = gate.policy.ratelimit
    entries = {"generic_key": config.request_descriptor,
               **gate.intake.descriptor("POST", "/v1/completions", {})}
    assert gate.submit("batch", "t", job(), 0.5).decision.outcome.value == "admitted"  # its one slot
    for _ in range(2):
        assert gate.submit("interactive", "t", job(), 0.5).decision.outcome.value == "admitted"
    judgement = gate.judge(config, entries, 1, 0.6)
    assert judgement.lane == "batch"
    assert judgement.reason is Reason.QUEUE_FULL
    assert gate._scheduler.turned_away_at is None  # judged, not yet answered
    gate.shed([judgement], 0.6)
    assert gate._scheduler.turned_away_at == 0.6
    result = gate.on_signals(engines(1, 3), 1)
    assert result.move is not None
    assert (result.move.previous, result.move.limit) == (4, 8)


def test_at_a_few_slots_per_lane_a_lane_held_at_its_share_is_pressure_enough() -> None:
    p = running_policy()
    assert p.capacity.auto is not None
    # Three lanes at min 4: their rounded shares (each at least one slot) hold requests back with
    # only 1 of the 4 slots in flight (the small lanes full, the large one's arrivals still to come).
    three = AutoLimit(p.capacity.auto, p.signals, lanes=3)
    three.update(engines(0, 0), 0, False, 0)
    assert three.update(engines(1, 1), 1, False, 1) is None  # nothing held back: no pressure
    move = three.update(engines(2, 1), 1, True, 2)
    assert move is not None
    assert (move.previous, move.limit) == (4, 8)
    assert move.why.startswith("headroom: running 1, ")  # a count, not a duration
    # One lane: 75 % of the limit, as before (4 - 1 lane is 3 = 75 % of 4).
    one = AutoLimit(p.capacity.auto, p.signals, lanes=1)
    one.update(engines(0, 0), 0, False, 0)
    assert one.update(engines(1, 2), 2, True, 1) is None
    assert one.update(engines(2, 3), 3, True, 2) is not None
    # Far from min the lanes make no difference: 75 % while held back.
    roomy = AutoLimit(p.capacity.auto, p.signals, lanes=3)
    roomy.update(engines(0, 0), 0, False, 0)
    for t in range(1, 4):  # 4 -> 32
        roomy.update(engines(t, roomy.limit), roomy.limit, True, t)
    assert roomy.limit == 32
    assert roomy.update(engines(4, 23), 23, True, 4) is None  # 23 < 24 = 75 % of 32
    assert roomy.update(engines(5, 24), 24, True, 5) is not None
    # The machine sizes it by the policy's lanes, and a reload that changes them follows.
    machine = Machine(p)
    assert machine.auto is not None
    assert machine.auto.lanes == 2
    three_lanes = Policy.model_validate({**p.model_dump(), "lanes": [
        *p.model_dump()["lanes"], {"name": "spare", "max_inflight": 5, "max_queued": 10, "deadline": "60s"}]})
    machine.reconfigure(three_lanes, 1)
    assert machine.auto.lanes == 3


def test_a_start_goes_on_through_a_few_waiting_between_engine_steps_and_ends_at_a_real_queue() -> None:
    a = auto_of(running_policy(start=16))
    assert a.update(engines(0, 16), 16, True, 0) is not None
    assert a.limit == 32
    # A few wait twice running, but what runs rises: the engines still take more in. The start goes on.
    assert a.update(engines(1, 20, waiting=3), 32, True, 1) is not None
    assert a.update(engines(2, 29, waiting=3), 32, True, 2) is None  # (not pressed at 64: no growth)
    assert a.limit == 64
    # The same few waiting while what runs stays put, seen twice: trimmed, but the start goes on
    # (at a high arrival rate a few are as often requests between steps; the next doubling tells).
    assert a.update(engines(3, 29, waiting=3), 32, True, 3) is None
    move = a.update(engines(4, 29, waiting=3), 32, True, 4)
    assert move is not None
    assert move.reason == "engine_queue"
    assert a.limit == 61
    assert a.update(engines(5, 61), 61, True, 5) is not None
    assert a.limit == 122
    # A queue the engines cannot clear (four times over) ends it: down to what they run, and that
    # is where they had too many (not the 122 the doubling reached).
    move = a.update(engines(6, 100, waiting=22), 122, True, 6)
    assert move is not None
    assert move.reason == "engine_queue"
    assert a.limit == 100
    assert a.update(engines(8, 100), 100, True, 8) is not None
    assert a.limit == 101  # one slot at a time through what ran, no longer doubling


def test_a_start_goes_on_through_a_cheap_queue_while_what_runs_still_rises() -> None:
    """An engine that takes new requests in only at join points (every so many steps) holds a
    doubling's burst in its queue until the next one: more than four times the target waiting, at a
    TTFT p95 under half its target, while what runs rises. The start goes on through it. The same
    queue once what runs stays put ends it (a quarter over what runs), and a queue that costs first
    tokens ends it as before, even while what runs rises."""
    a = auto_of(running_policy(start=16))
    assert a.update(engines(0, 16, ttft=0.3), 16, True, 0) is not None
    assert a.limit == 32
    move = a.update(engines(1, 20, waiting=12, ttft=0.3), 32, True, 1)
    assert move is not None
    assert (move.limit, move.reason) == (64, "headroom")
    # What runs stays put with the queue still there: the engines are full, the start is over.
    move = a.update(engines(2, 20, waiting=12, ttft=0.3), 32, True, 2)
    assert move is not None
    assert (move.limit, move.reason) == (32, "engine_queue")
    assert "a quarter over the 20 they run" in move.why
    assert a.update(engines(4, 32, ttft=0.3), 32, True, 4) is not None
    assert a.limit == 33  # +5 % from here: the start has ended
    # The queue stays while what runs creeps up by one: the engines are not taking it in (a rise of
    # half what waited would be), the start's overshoot builds up at them. The start ends.
    creep = auto_of(running_policy(start=16))
    assert creep.update(engines(0, 16, ttft=0.3), 16, True, 0) is not None
    assert creep.update(engines(1, 20, waiting=12, ttft=0.3), 32, True, 1) is not None
    assert creep.limit == 64
    move = creep.update(engines(2, 21, waiting=30, ttft=0.3), 64, True, 2)
    assert move is not None
    assert (move.limit, move.reason) == (42, "engine_queue")
    assert "a quarter over the 34 they run" in move.why  # what is in flight less what waits
    assert creep.update(engines(4, 40, ttft=0.3), 42, True, 4) is not None
    assert creep.limit == 44  # +5 %: the start has ended
    # A rise of half what waited at the last reading (12 → 6) with a queue still there: taken in.
    taken = auto_of(running_policy(start=16))
    assert taken.update(engines(0, 16, ttft=0.3), 16, True, 0) is not None
    assert taken.update(engines(1, 20, waiting=12, ttft=0.3), 32, True, 1) is not None
    move = taken.update(engines(2, 26, waiting=30, ttft=0.3), 64, True, 2)
    assert move is not None
    assert (move.limit, move.reason) == (128, "headroom")
    # The same rise with a queue whose first tokens come at 60 % of the target: the engines' room
    # is spent, the start ends at once at what they run.
    costly = auto_of(running_policy(start=16))
    assert costly.update(engines(0, 16, ttft=0.3), 16, True, 0) is not None
    move = costly.update(engines(1, 20, waiting=12, ttft=0.6), 32, True, 1)
    assert move is not None
    assert (move.limit, move.reason) == (20, "engine_queue")
    assert costly.update(engines(3, 20, ttft=0.3), 20, True, 3) is not None
    assert costly.limit == 21  # +5 %: no doubling after it


def test_a_reload_that_changes_the_signals_forgets_their_last_readings() -> None:
    """The start's "what runs rose by half of what waited" compares a reading with the last one: after
    a reload that reads other signals, the last one says nothing, and a large queue at the next
    reading ends the start as it would without a previous reading."""
    def started() -> AutoLimit:
        a = auto_of(running_policy(start=16))
        assert a.update(engines(0, 16, ttft=0.3), 16, True, 0) is not None
        assert a.limit == 32
        return a

    same = started()  # a reload with the same signals: the rise from 16 to 20 counts
    p = running_policy(start=16)
    assert p.capacity.auto is not None
    same.reconfigure(p.capacity.auto, p.signals, 0.5)
    move = same.update(engines(1, 20, waiting=12, ttft=0.3), 32, True, 1)
    assert move is not None
    assert (move.limit, move.reason) == (64, "headroom")
    other = started()
    changed = p.capacity.auto.model_copy(update={"signals": p.capacity.auto.signals.model_copy(
        update={"tpot_p95": None})})
    other.reconfigure(changed, p.signals, 0.5)
    move = other.update(engines(1, 20, waiting=12, ttft=0.3), 32, True, 1)
    assert move is not None
    assert (move.limit, move.reason) == (25, "engine_queue")  # a quarter over the 20 they run


def test_a_latency_cut_during_the_start_pauses_it_for_the_window_then_it_doubles_on() -> None:
    a = auto_of(running_policy(start=64, cooldown="2s"))
    a.update(engines(0, 64), 64, True, 0)
    assert a.limit == 128
    # The burst the doubling let in shows as a TTFT p95 of 2 s: cut in proportion (at most halved).
    move = a.update(engines(1, 128, ttft=2.0), 128, True, 1)
    assert move is not None
    assert move.reason == "ttft"
    assert a.limit == 64
    # The percentile still holds the burst: no growth, and no second cut within its window.
    assert a.update(engines(2, 64, ttft=1.5), 64, True, 2) is None
    assert a.limit == 64
    # Once it reads clean the start goes on doubling (not a few per cent per interval).
    assert a.update(engines(3, 64, ttft=0.2), 64, True, 3) is not None
    assert a.limit == 128


def kv_policy(**auto: Any) -> Policy:
    """``running_policy`` with a ``kv_cache`` role (the engines' KV-cache usage, 0 to 1)."""
    p = running_policy(**auto)
    signals = p.signals.model_dump()
    signals["read"]["kv"] = {"source": "engines", "preset": "kv_cache_usage", "stale_after": "5s"}
    assert p.capacity.auto is not None
    config = p.capacity.auto.model_dump()
    config["signals"]["kv_cache"] = "kv"
    return Policy.model_validate({**p.model_dump(), "signals": signals,
                                  "capacity": {"max_inflight": "auto", "auto": config}})


def test_a_start_doubles_no_further_than_the_kv_cache_holds_and_ends_there() -> None:
    def kv(now: float, running: float, usage: float) -> dict[str, Reading]:
        return {**engines(now, running), "kv": Reading(usage, now)}

    a = auto_of(kv_policy(start=128))
    a.update(engines(0, 0), 0, False, 0)
    assert a.limit == 128
    # 95 run in 75 % of the cache: it holds about 127 at that usage, so a doubling to 256 would overfill
    # it (90 % of it: 114, under the limit already). Not doubled: the ordinary first step, +5 %.
    move = a.update(kv(1, 95, 0.75), 120, True, 1)
    assert move is not None
    assert move.reason == "headroom"
    assert a.limit == 134
    assert "kv_cache 75%" in move.why
    assert "not doubled: at that usage the KV cache holds about 127; the start ends" in move.why
    # The start is over: the next reading, within the interval (2 s), moves nothing, though requests
    # are held back (a start moves on every fresh reading) and the cache now shows room for twice as
    # many; the one after the interval grows by the careful first step (+5 %), not to the cache's room
    # (126 / 0.5 × 0.9 = 226) nor by a doubling.
    assert a.update(kv(2, 126, 0.5), 130, True, 2) is None
    assert a.limit == 134
    move = a.update(kv(3, 126, 0.5), 130, True, 3)
    assert move is not None
    assert a.limit == 141  # (134.4 × 1.05)
    assert "not doubled" not in move.why
    # A cache with room for twice as many doubles in full, and the start goes on, up to max (and the
    # why blames max, not the cache: 250 / 0.4 × 0.9 = 562 is past the doubling to 512).
    b = auto_of(kv_policy(start=128))
    b.update(engines(0, 0), 0, False, 0)
    move = b.update(kv(1, 120, 0.2), 120, True, 1)
    assert move is not None
    assert b.limit == 256
    assert "not doubled" not in move.why
    move = b.update(kv(2, 250, 0.4), 250, True, 2)  # (within the interval: the start's quick reading)
    assert move is not None
    assert b.limit == 512
    assert "not doubled" not in move.why  # (the cache allows 562: max stops it first)
    # ... and so does a start without a usage to go by: missing, too little in use to tell, or garbage
    # (negative, not a number, infinite).
    for usage in (None, 0.01, -0.5, math.nan, math.inf):
        b = auto_of(kv_policy(start=16))
        b.update(engines(0, 0), 0, False, 0)
        reading = {} if usage is None else {"kv": Reading(usage, 1)}
        assert b.update({**engines(1, 15), **reading}, 15, True, 1) is not None
        assert b.limit == 32
    # A usage past full (a percentage where a fraction belongs) only slows the start to the ordinary
    # step: it never ends it or moves the limit down (nor does it stop a limit out of the start, as
    # a cache 90 % full does: a misread metric must not hold the limit where it is for good).
    for usage in (75.0, 1.5):
        c = auto_of(kv_policy(start=16))
        c.update(engines(0, 0), 0, False, 0)
        assert c.update({**engines(1, 15), "kv": Reading(usage, 1)}, 15, True, 1) is not None
        assert c.limit == 17
        assert c.update({**engines(2, 16), "kv": Reading(0.2, 2)}, 17, True, 2) is not None
        assert c.limit == 34
        c._slow_start = False  # (as after a fall)
        assert c.update({**engines(4, 34), "kv": Reading(usage, 4)}, 34, True, 4) is not None
        assert c.limit > 34


def test_out_of_the_start_the_kv_cache_caps_no_growth_but_a_full_one_stops_it() -> None:
    a = auto_of(kv_policy(start=64))
    a.update(engines(0, 0), 0, False, 0)
    assert a.update(engines(1, 60), 64, True, 1) is not None
    assert a.limit == 128
    # A queue the engines cannot clear ends the start: down to what they ran (98).
    assert a.update(engines(2, 98, waiting=30), 128, True, 2) is not None
    assert a.limit == 98
    # Out of the start the cache does not cap a growth: it creeps through where they had too many
    # (+1 %, at least a slot) with the cache 10 % or 89 % full, as without one...
    assert a.update({**engines(4, 98), "kv": Reading(0.1, 4)}, 98, True, 4) is not None
    assert a.limit == 99
    assert a.update({**engines(6, 99), "kv": Reading(0.89, 6)}, 99, True, 6) is not None
    assert a.limit == 100
    # ... but a cache 90 % full or more is a signal without headroom, as a latency near its target:
    # no growth (a KV-bound engine preempts and recomputes past it), in the start or out of it.
    for t, usage in ((8, 0.9), (10, 0.99), (12, 1.0)):  # (each a tick: the interval is 2 s)
        assert a.update({**engines(t, 100), "kv": Reading(usage, t)}, 100, True, t) is None
        assert a.limit == 100
    assert a.update({**engines(14, 100), "kv": Reading(0.5, 14)}, 100, True, 14) is not None
    assert a.limit == 101
    start = auto_of(kv_policy(start=16))
    start.update(engines(0, 0), 0, False, 0)
    assert start.update({**engines(1, 15), "kv": Reading(0.95, 1)}, 15, True, 1) is None
    assert start.limit == 16


async def test_with_a_store_the_limit_waits_for_the_fleet_s_answer_before_it_moves() -> None:
    """Signals that come before the first sync (a busy restart: the limit pressed, room to grow) do not
    move the limit: the first limit is the fleet's stored one, and the limit moves from there."""
    from prometheus_client import CollectorRegistry

    from extproc.controller import Controller
    from extproc.metrics import Metrics
    from extproc.state.memory import MemoryHub, MemoryLedger

    now = [0.0]
    hub = MemoryHub(clock=lambda: now[0])
    assert await MemoryLedger(hub, renew=False, replica="gone").agree_limit(48) == (48, True)
    now[0] = 10.0
    controller = Controller(policy(start=4), Metrics(CollectorRegistry()), clock=lambda: now[0],
                            ledger=MemoryLedger(hub, renew=False, replica="new"))
    machine = controller.machine
    assert machine.auto is not None
    for _ in range(4):
        controller.submit("interactive", "t", job())
    controller.on_signals(readings(10.0), 10.0)
    assert machine.auto.limit == 4  # no move (nor proposal) before the store answered
    assert controller.fleet is not None
    await controller.fleet.sync_once()
    assert machine.auto.limit == 48
    now[0] = 13.0
    controller.on_signals(readings(13.0), 13.0)  # from the fleet's limit on, the usual rules
    assert machine.auto.limit == 48  # (48 is far above what runs: no growth)


def test_a_start_at_a_few_slots_per_lane_wants_its_next_reading_soon_while_work_is_held() -> None:
    """Under four slots per lane a start wants its next reading after a quarter of the interval while
    requests are held back or were refused for want of a slot (the interactive lane refuses within a
    fraction of a second at 4): Machine.reading_wanted, which the signal hub and the simulator ask.
    Not with nothing held, not from four slots per lane up, not once the start has ended."""
    data = running_policy(start=4).model_dump()
    data["lanes"][0]["max_queued"] = 0  # interactive: refused at its share (3 of 4)
    gate = Machine(Policy.model_validate(data))
    assert gate.auto is not None
    assert gate.auto.lanes == 2
    gate.on_signals(engines(0, 0), 0)
    assert not gate.reading_wanted(0.1)  # nothing held or refused
    for _ in range(3):
        assert gate.submit("interactive", "t", job(), 0.1).decision.outcome.value == "admitted"
    assert not gate.reading_wanted(0.1)
    assert gate.submit("interactive", "t", job(), 0.2).decision.outcome.value == "rejected"
    assert gate.reading_wanted(0.2)
    # The reading it wanted doubles the limit: 8 slots for two lanes are four each, readings at the
    # interval from here, held or not.
    assert gate.on_signals(engines(0.25, 3), 0.25).move is not None
    assert gate.policy.total_capacity == 8
    outcomes = [gate.submit("interactive", "t", job(), 0.3).decision.outcome.value for _ in range(4)]
    assert outcomes == ["admitted"] * 3 + ["rejected"]  # its share of 8 is 6
    assert gate.auto.reading_soon is False
    assert not gate.reading_wanted(0.3)
    # Out of the start, however small the limit: no reading soon.
    p = running_policy(start=4)
    assert p.capacity.auto is not None
    a = AutoLimit(p.capacity.auto, p.signals, lanes=len(p.lanes))
    assert a.reading_soon
    a.update(engines(0, 4, waiting=30, ttft=0.9), 4, True, 0)  # engines that queue: what they run
    assert a.limit == 4
    assert not a.reading_soon


def test_a_few_waiting_at_a_cheap_ttft_on_the_first_reading_are_not_a_full_engine() -> None:
    """An engine that takes new requests in only every few steps shows one or two waiting with slots
    free: the first reading of what runs does not take that for engines out of room (which ended the
    start with what ran then, two sequences, as where they had too many)."""
    p = running_policy(start=4)
    assert p.capacity.auto is not None
    a = AutoLimit(p.capacity.auto, p.signals, lanes=len(p.lanes))
    # At least what runs (4), and the start doubles on the same reading (the lanes hold work back).
    move = a.update(engines(0, 2, waiting=1, ttft=0.1), 2, True, 0)
    assert move is not None
    assert move.reason == "headroom"
    assert a.limit == 8
    assert a.update(engines(0.25, 8, waiting=0, ttft=0.1), 8, True, 0.25) is not None
    assert a.limit == 16
    # The same few waiting at a TTFT over half its target are a queue: the limit is what runs.
    b = auto_of(running_policy(start=8))
    assert b.update(engines(0, 6, waiting=1, ttft=0.7), 6, True, 0) is not None
    assert b.limit == 6
    assert not b.reading_soon


def test_in_the_start_held_work_that_would_fill_the_limit_at_idle_engines_is_pressure() -> None:
    """At 16 slots a lane below the highest held at its share (two of 16) while the highest had few
    requests: in flight sat at half the limit, under the three quarters that press it. In the start,
    work held back that would fill the limit with what is in flight doubles it while the engines are
    idle (KV cache under half full, TTFT p95 under a quarter of its target); not when they are not,
    not when what waits would not fill it, and not out of the start."""

    def kv(now: float, running: float, usage: float, ttft: float) -> dict[str, Reading]:
        return {**engines(now, running, ttft=ttft), "kv": Reading(usage, now)}

    def started() -> AutoLimit:
        a = auto_of(kv_policy(start=16))
        a.update(engines(0, 0), 0, False, 0)
        assert a.limit == 16
        return a

    # Eight in flight, ten waiting for want of a slot, idle engines: doubled.
    a = started()
    assert a.update(kv(1, 8, 0.1, 0.1), 8, True, 1, queued=10) is not None
    assert a.limit == 32
    # What waits would not fill it (eight and seven of 16): not pressed.
    a = started()
    assert a.update(kv(1, 8, 0.1, 0.1), 8, True, 1, queued=7) is None
    assert a.limit == 16
    # Nothing held back for want of a slot (what waits waits for something else): not pressed.
    assert a.update(kv(3, 8, 0.1, 0.1), 8, False, 3, queued=10) is None
    # A KV cache half full, or TTFT p95 a quarter of its target (1 s): not idle.
    a = started()
    assert a.update(kv(1, 8, 0.5, 0.1), 8, True, 1, queued=10) is None
    a = started()
    assert a.update(kv(1, 8, 0.1, 0.25), 8, True, 1, queued=10) is None
    # Neither read: nothing says the engines are idle.
    b = auto_of(policy(start=16))
    assert b.update(readings(0, ttft=None), 8, True, 0, queued=10) is None
    assert b.limit == 16
    # Out of the start (the engines queued: 8 of 16 is what they run), the usual pressure only.
    a = started()
    a.update(kv(1, 8, 0.1, 0.1) | {"waiting": Reading(30, 1)}, 16, True, 1)
    assert a.limit == 8
    assert a.update(kv(5, 4, 0.1, 0.1), 4, True, 5, queued=10) is None
    assert a.limit == 8


def test_the_machine_gives_the_limit_the_work_that_waits_only_for_a_slot() -> None:
    """Machine.on_signals passes the limit what waits only for want of a slot (admission.held_queued):
    the queues of lanes held at their shares, with what the other replicas queue in them; not a paused
    lane's backlog, which more slots would not start."""

    def gate_with(batch: int, paused: int) -> Machine:
        gate = Machine(kv_policy(start=16))
        gate.on_signals({**engines(0, 0), "kv": Reading(0.0, 0)}, 0)
        assert gate.policy.total_capacity == 16
        gate.pause("interactive")
        for _ in range(paused):
            assert gate.submit("interactive", "t", job(), 0.5).decision.outcome.value == "queued"
        outcomes = [gate.submit("batch", "t", job(), 0.5).decision.outcome.value for _ in range(batch)]
        # Its share (4), and two borrowed while the interactive lane has nothing waiting.
        admitted = 4 if paused else 6
        assert outcomes == ["admitted"] * admitted + ["queued"] * (batch - admitted)
        return gate

    idle = {**engines(1, 6, ttft=0.1), "kv": Reading(0.1, 1)}
    # Six in flight and twelve held for a slot fill 16: it doubles.
    gate = gate_with(18, 0)
    assert held_queued(gate._scheduler) == 12
    move = gate.on_signals(idle, 1).move
    assert move is not None
    assert (move.previous, move.limit) == (16, 32)
    # Four held for a slot and twelve in a paused lane: 4 + 4 do not fill 16.
    gate = gate_with(8, 12)
    assert held_queued(gate._scheduler) == 4
    assert gate.on_signals({**idle, "running": Reading(4, 1)}, 1).move is None
    # Ten more queued in batch at the other replicas (as the store last showed): they do.
    gate.set_others({}, {"batch": 10, "interactive": 5}, 1)
    assert held_queued(gate._scheduler) == 14
    move = gate.on_signals({**idle, "running": Reading(4, 1.5)}, 1.5).move
    assert move is not None
    assert move.limit == 32


def test_in_the_start_a_cheap_queue_at_idle_engines_is_trimmed_and_the_start_goes_on() -> None:
    """A doubling's prefills wait at engines that are idle (KV cache under half full, TTFT p95 under a
    quarter of its target): the limit keeps a quarter over what runs, and the next growth doubles
    again. At a TTFT p95 of 0.3 s (not idle, still cheap) the same trim ends the start: +5 % then."""

    def kv(now: float, running: float, waiting: float, ttft: float) -> dict[str, Reading]:
        return {**engines(now, running, waiting=waiting, ttft=ttft), "kv": Reading(0.05, now)}

    for ttft, regrown in ((0.1, 67), (0.3, 35)):
        a = auto_of(kv_policy(start=16))
        assert a.update(kv(0, 20, 0, ttft), 20, False, 0) is not None  # starts from the 20 running
        assert a.update(kv(1, 27, 0, ttft), 20, True, 1) is not None
        assert a.limit == 40
        # Five waiting (four times the target over) while what runs no longer rises.
        move = a.update(kv(2, 27, 5, ttft), 32, True, 2)
        assert move is not None
        assert move.limit == 33  # a quarter over the 27 that run
        assert a.update(kv(4, 31, 0, ttft), 31, True, 4) is not None
        assert a.limit == regrown


async def test_the_controller_asks_for_a_reading_soon_with_the_limit_s_sources() -> None:
    """A request held or refused while the start wants a reading soon calls ``want_reading`` (the
    app wires SignalHub.hurry) with the sources that feed the limit; an admitted one does not, nor
    does a limit at its max, or one waiting out a latency percentile's window."""
    from prometheus_client import CollectorRegistry

    from extproc.controller import Controller
    from extproc.metrics import Metrics

    now = [0.0]
    data = running_policy(start=4).model_dump()
    data["lanes"][0]["max_queued"] = 0  # interactive: refused at its share (3 of 4)
    controller = Controller(Policy.model_validate(data), Metrics(CollectorRegistry()), clock=lambda: now[0])
    asked: list[frozenset[str]] = []
    controller.want_reading = asked.append
    controller.on_signals(engines(0, 0), 0)
    assert asked == []
    for _ in range(3):
        assert controller.submit("interactive", "t", job()).outcome.value == "admitted"
    assert asked == []
    now[0] = 0.1
    assert controller.submit("interactive", "t", job()).outcome.value == "rejected"
    assert asked == [frozenset({"engines"})]
    controller.refused("interactive", Reason.QUEUE_FULL, "t")  # (refused before the scheduler)
    assert len(asked) == 2
    # A latency percentile over its target: the start waits out its window, no reading soon.
    now[0] = 0.2
    controller.on_signals(engines(0.2, 3, ttft=1.5), 0.2)
    assert controller.machine.auto is not None
    assert not controller.machine.auto.reading_soon
    assert controller.submit("interactive", "t", job()).outcome.value == "rejected"
    assert len(asked) == 2
    # At its max: nothing more to double into.
    for start, soon in ((4, True), (6, False)):
        auto = running_policy(start=start, max=6).capacity.auto
        assert auto is not None
        assert AutoLimit(auto, running_policy().signals, lanes=2).reading_soon is soon

"""What a replica makes of the shared store's answers: the others' part, and backing off a refusal."""

from __future__ import annotations

import random

from extproc.state import GlobalView, LaneLimits, Limits
from extproc.state.cluster import RETRY_MAX_S, RETRY_MIN_S, Others, RefusalBackoff, others

LIMITS = Limits((LaneLimits("chat", 6), LaneLimits("bulk", 2, True)), 8)


def test_the_others_are_the_view_less_what_this_replica_holds_and_queues() -> None:
    view = GlobalView(inflight={"chat": 5, "bulk": 1}, queued={"chat": 4}, heads={}, replicas=2)
    got = others(view, mine={"chat": 2}, queued_here={"chat": 1, "bulk": 0}, limits=LIMITS, alone=None)
    assert got == Others({"chat": 3, "bulk": 1}, {"chat": 3})


def test_degraded_with_an_allotment_the_others_hold_everything_beyond_it() -> None:
    view = GlobalView(inflight={"chat": 1}, queued={}, heads={}, degraded=True, reason="down")
    alone = Limits((LaneLimits("chat", 2), LaneLimits("bulk", 1, True)), 3)
    got = others(view, mine={"chat": 1}, queued_here={}, limits=LIMITS, alone=alone)
    # The scheduler then sees 2 of chat's 6 and 1 of bulk's 2 as its own room, and 3 of 8 in all.
    assert got == Others({"chat": 4, "bulk": 1}, {}, 5)


def test_degraded_and_failing_closed_knows_nothing_of_the_others() -> None:
    view = GlobalView(inflight={}, queued={}, heads={}, degraded=True, reason="down")
    assert others(view, {}, {}, LIMITS, alone=None) == Others({}, {})


def test_a_refused_lane_backs_off_doubling_with_jitter_up_to_the_max() -> None:
    backoff = RefusalBackoff(random.Random(1))
    waits = [backoff.refused("chat", 100.0) - 100.0 for _ in range(12)]
    for n, wait in enumerate(waits):
        base = min(RETRY_MIN_S * 2 ** n, RETRY_MAX_S)
        assert 0.5 * base <= wait <= 1.5 * base, (n, wait)
    assert max(waits) <= 1.5 * RETRY_MAX_S
    assert waits[-1] >= 0.5 * RETRY_MAX_S  # capped, still jittered


def test_a_grant_resets_the_backoff_and_due_lists_lanes_whose_wait_is_over() -> None:
    backoff = RefusalBackoff(random.Random(2))
    at = backoff.refused("chat", 0.0)
    backoff.refused("bulk", 0.0)
    backoff.refused("bulk", 0.0)
    assert backoff.due({"chat", "bulk", "never-refused"}, 0.0) == {"never-refused"}
    assert "chat" in backoff.due({"chat"}, at)
    backoff.granted("bulk")
    assert backoff.due({"bulk"}, 0.0) == {"bulk"}
    # After a grant the next refusal starts from the minimum again.
    assert backoff.refused("bulk", 0.0) <= 1.5 * RETRY_MIN_S


def test_replicas_refused_together_do_not_come_back_together() -> None:
    times = {RefusalBackoff(random.Random(seed)).refused("chat", 0.0) for seed in range(20)}
    assert len(times) == 20

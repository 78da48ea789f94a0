"""How replicas that lost the shared store divide the limits: never more than the limits together."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.state import LaneLimits, Limits, fill

LIMITS = Limits((LaneLimits("interactive", 8), LaneLimits("batch", 4, True, 3), LaneLimits("free", 2)), 12)


def test_fill_tops_up_the_lowest_first() -> None:
    assert fill([3, 0], 1) == [3, 1]
    assert fill([0, 0], 5) == [3, 2]
    assert fill([5, 1, 2], 4) == [5, 4, 3]
    assert fill([2, 2], 0) == [2, 2]


def test_a_replica_that_held_more_keeps_it_and_the_other_gets_the_rest() -> None:
    held = {"a": {"interactive": 6, "batch": 5, "free": 1}, "b": {"interactive": 0, "batch": 0, "free": 0}}
    a = LIMITS.allotment("a", ["a", "b"], held)
    b = LIMITS.allotment("b", ["a", "b"], held)
    assert (a.lane("interactive").max_inflight, b.lane("interactive").max_inflight) == (6, 2)
    # batch: a holds 5 of its 4 (one borrowed); b gets nothing of the quota, half the borrow room left.
    assert (a.lane("batch").max_inflight, b.lane("batch").max_inflight) == (5, 0)
    assert a.lane("batch").max_borrow + b.lane("batch").max_borrow == 2  # 4 + 3 - 5
    assert (a.lane("free").max_inflight, b.lane("free").max_inflight) == (1, 1)
    assert (a.capacity, b.capacity) == (12, 0)  # a holds 12 of 12


def test_dead_replicas_leases_count_but_get_no_part() -> None:
    held = {"a": {"interactive": 1}, "dead": {"interactive": 5}}
    a = LIMITS.allotment("a", ["a", "b"], held)
    b = LIMITS.allotment("b", ["a", "b"], held)
    assert a.lane("interactive").max_inflight + b.lane("interactive").max_inflight == 8 - 5
    assert (a.lane("interactive").max_inflight, b.lane("interactive").max_inflight) == (2, 1)


replicas = st.lists(st.sampled_from("abcde"), min_size=1, max_size=5, unique=True)
counts = st.integers(min_value=0, max_value=12)


@settings(max_examples=300, deadline=None)
@given(live=replicas, data=st.data())
def test_allotments_never_add_up_to_more_than_a_limit(live: list[str], data: st.DataObject) -> None:
    lanes = [lane.name for lane in LIMITS.lanes]
    holders = data.draw(st.lists(st.sampled_from("abcdefg"), unique=True, max_size=6))
    held = {r: {lane: data.draw(counts) for lane in lanes} for r in holders}
    # What the store allowed before the outage: within every limit (it is exact).
    for lane in LIMITS.lanes:
        ceiling = lane.max_inflight + (lane.max_borrow or 0)
        assert_fits = sum(h[lane.name] for h in held.values()) <= ceiling
        if not assert_fits:
            return
    if sum(sum(h.values()) for h in held.values()) > LIMITS.capacity:
        return
    parts = {r: LIMITS.allotment(r, live, held) for r in live}
    for lane in LIMITS.lanes:
        total_held = sum(h[lane.name] for h in held.values())
        quotas = sum(p.lane(lane.name).max_inflight for p in parts.values())
        others = sum(h[lane.name] for r, h in held.items() if r not in live)
        assert quotas + others <= max(lane.max_inflight, total_held)
        if lane.borrow:
            ceiling = lane.max_inflight + (lane.max_borrow or 0)
            reach = sum(p.lane(lane.name).max_inflight + (p.lane(lane.name).max_borrow or 0)
                        for p in parts.values())
            assert reach + others <= max(ceiling, total_held)
        for r in live:
            assert parts[r].lane(lane.name).max_inflight >= held.get(r, {}).get(lane.name, 0)
    dead = sum(sum(h.values()) for r, h in held.items() if r not in live)
    assert sum(p.capacity for p in parts.values()) + dead <= LIMITS.capacity

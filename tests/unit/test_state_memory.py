"""The in-process ledger (the shared contract) and the pure rules every ledger applies."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from extproc.core.admission import Scheduler
from extproc.core.decision import Outcome
from extproc.core.estimate import Job
from extproc.policy import Policy
from extproc.state import (
    LaneLimits,
    Limits,
    SlotVerdict,
    outranked,
    summary_changes,
)
from extproc.state.memory import MemoryHub, MemoryLedger
from extproc.state.store import open_ledger
from tests.state_contract import BORROW, TWO, LedgerContract


class MemoryBackend:
    def __init__(self) -> None:
        self.hub = MemoryHub()
        self.ledgers: list[MemoryLedger] = []

    async def make(self, **options: Any) -> MemoryLedger:
        ledger = MemoryLedger(self.hub, **options)
        await ledger.start()
        self.ledgers.append(ledger)
        return ledger


class TestMemoryLedger(LedgerContract):
    @pytest.fixture
    async def backend(self) -> AsyncIterator[MemoryBackend]:
        backend = MemoryBackend()
        yield backend
        for ledger in backend.ledgers:
            await ledger.close()


# -- verdicts and limits ----------------------------------------------------------------------


def test_only_a_grant_is_true() -> None:
    assert [v for v in SlotVerdict if v] == [SlotVerdict.GRANTED]


def test_limits_reject_repeated_lanes_and_negative_numbers() -> None:
    with pytest.raises(ValueError, match="repeat"):
        Limits((LaneLimits("a", 1), LaneLimits("a", 2)), 3)
    with pytest.raises(ValueError, match="negative"):
        Limits((LaneLimits("a", -1),), 3)
    with pytest.raises(ValueError, match="negative"):
        Limits((LaneLimits("a", 1),), -1)


def policy(lanes: list[dict[str, Any]], capacity: int | None = None) -> Policy:
    data: dict[str, Any] = {
        "lanes": [{"max_queued": 100, "deadline": "120s", **lane} for lane in lanes],
        "classification": {"default_lane": lanes[0]["name"]},
        "queueing": {"sjf_weight": 0},
        "estimation": {"default": {"prefill_ms_per_token": 0, "decode_ms_per_token": 10, "overhead_ms": 0},
                       "learning_rate": 0, "occupancy_slowdown": 0},
    }
    if capacity is not None:
        data["capacity"] = {"max_inflight": capacity}
    return Policy.model_validate(data)


def test_limits_come_from_the_policy_with_retired_lanes_added() -> None:
    p = policy([{"name": "chat", "max_inflight": 4, "priority": 10},
                {"name": "bulk", "max_inflight": 2, "borrow": True, "max_borrow": 3}], capacity=8)
    retired = LaneLimits("old", 1)
    assert Limits.of(p, [retired]) == Limits(
        (LaneLimits("chat", 4), LaneLimits("bulk", 2, True, 3), retired), 8)
    assert Limits.of(policy([{"name": "chat", "max_inflight": 4}])).capacity == 4


def test_an_unknown_lane_is_a_key_error() -> None:
    with pytest.raises(KeyError, match="nope"):
        TWO.check("nope", {}, {})


@pytest.mark.parametrize(("lane", "inflight", "queued", "expected"), [
    ("batch", {}, {}, (SlotVerdict.GRANTED, 2)),
    ("batch", {"batch": 1, "interactive": 3}, {}, (SlotVerdict.GRANTED, 1)),
    ("interactive", {"interactive": 2, "batch": 2}, {}, (SlotVerdict.GRANTED, 1)),
    ("interactive", {"interactive": 3}, {}, (SlotVerdict.LANE_FULL, 0)),
    ("batch", {"batch": 2}, {}, (SlotVerdict.GRANTED, 3)),           # borrows 3 idle slots
    ("batch", {"batch": 5}, {}, (SlotVerdict.CAPACITY, 0)),
    ("batch", {"batch": 2}, {"interactive": 2}, (SlotVerdict.GRANTED, 1)),   # 2 of 3 idle slots owed
    ("batch", {"batch": 2}, {"interactive": 3}, (SlotVerdict.OWED, 0)),
    ("batch", {"batch": 2, "interactive": 2}, {"interactive": 9}, (SlotVerdict.OWED, 0)),  # 1 idle, owed
    ("batch", {"batch": 2}, {"batch": 9}, (SlotVerdict.GRANTED, 3)),  # its own queue is not owed
])
def test_the_rule_over_counts(lane: str, inflight: dict[str, int], queued: dict[str, int],
                              expected: tuple[SlotVerdict, int]) -> None:
    assert BORROW.check(lane, inflight, queued) == expected


def test_max_borrow_bounds_the_free_slots_of_a_borrower() -> None:
    limits = Limits((LaneLimits("interactive", 3), LaneLimits("batch", 2, True, 2)), 10)
    assert limits.check("batch", {"batch": 2}, {}) == (SlotVerdict.GRANTED, 2)
    assert limits.check("batch", {"batch": 4}, {}) == (SlotVerdict.BORROW_LIMIT, 0)


@given(st.lists(st.tuples(st.integers(0, 40), st.booleans(), st.one_of(st.none(), st.integers(0, 9))),
                min_size=1, max_size=5),
       st.integers(0, 60), st.integers(1, 7))
def test_shares_add_up_to_the_limits(lanes: list[tuple[int, bool, int | None]], capacity: int,
                                     replicas: int) -> None:
    limits = Limits(tuple(LaneLimits(f"l{i}", n, b, m) for i, (n, b, m) in enumerate(lanes)), capacity)
    shares = [limits.share(position, replicas) for position in range(replicas)]
    assert sum(s.capacity for s in shares) == capacity
    for i, lane in enumerate(limits.lanes):
        assert sum(s.lanes[i].max_inflight for s in shares) == lane.max_inflight
        if lane.max_borrow is not None:
            assert sum(s.lanes[i].max_borrow or 0 for s in shares) == lane.max_borrow
        parts = {s.lanes[i].max_inflight for s in shares}
        assert max(parts) - min(parts) <= 1
    assert limits.share(0, 1) is limits


def test_outranked_needs_a_better_head_for_every_free_slot() -> None:
    assert not outranked(None, [0.0], 0.0, 1)
    assert outranked(10.0, [5.0], 1.0, 1)
    assert not outranked(10.0, [9.5], 1.0, 1)   # within tolerance
    assert not outranked(10.0, [9.0], 1.0, 1)   # exactly at the tolerance is not better
    assert not outranked(10.0, [5.0], 1.0, 2)
    assert outranked(10.0, [5.0, 6.0, 12.0], 1.0, 2)


def test_summary_changes_name_lanes_where_others_may_get_in() -> None:
    before = ({"a": 2, "b": 1, "c": 1}, {"a": 5.0, "b": 3.0, "c": 4.0})
    after = ({"a": 2, "b": 1, "d": 1}, {"a": 6.0, "b": 2.0, "d": 1.0})
    # a: head got worse; b: better head, same count (nothing to gain); c: emptied; d: new.
    assert summary_changes(before, after) == ["a", "c"]
    assert summary_changes(({"a": 3}, {"a": 1.0}), ({"a": 2}, {"a": 1.0})) == ["a"]


# -- the same rule as the scheduler -----------------------------------------------------------


lane_specs = st.tuples(st.integers(1, 4), st.booleans(), st.one_of(st.none(), st.integers(0, 3)))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(lane_specs, min_size=2, max_size=3), st.integers(0, 4),
       st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["submit", "submit", "release", "pause"])),
                min_size=8, max_size=40))
def test_the_rule_is_the_schedulers(specs: list[tuple[int, bool, int | None]], extra: int,
                                    steps: list[tuple[int, str]]) -> None:
    """Limits.check over the scheduler's own counts agrees with Lanes.admits, always.

    Pausing a lane makes its requests queue while it is under quota: that is what gives other
    lanes' borrowers slots they owe it.
    """
    lanes = [{"name": f"l{i}", "max_inflight": n, "priority": 10 * i, "borrow": b,
              **({"max_borrow": m} if b and m is not None else {})} for i, (n, b, m) in enumerate(specs)]
    borrowing = any(b for _, b, _ in specs)
    capacity = sum(n for n, _, _ in specs) + (extra if borrowing else 0)
    assume(capacity >= max(n for n, _, _ in specs))
    p = policy(lanes, capacity=capacity)
    s = Scheduler(p, rng=random.Random(0))
    limits = Limits.of(p)
    running = []
    now = 0.0
    for lane_index, action in steps:
        now += 1.0
        name = f"l{lane_index % len(specs)}"
        if action == "release" and running:
            s.release(running.pop(0), now)
        elif action == "pause":
            if name in s.paused:
                running += [d.ticket for d in s.resume(name, now)]
            else:
                s.pause(name)
        else:
            decision, _ = s.submit(name, "t", Job(None, 0, 100), now)
            if decision.outcome is Outcome.ADMITTED:
                running.append(decision.ticket)
        views = s.snapshot(now)
        inflight = {lane: v.inflight for lane, v in views.items()}
        queued = {lane: v.queued for lane, v in views.items()}
        for lane in p.lanes:
            if lane.name in s.paused:
                continue  # pausing is the scheduler's own business, not a limit
            verdict, free = limits.check(lane.name, inflight, queued)
            assert bool(verdict) == s._lanes.admits(lane), (lane.name, inflight, queued, verdict)
            assert (free > 0) == bool(verdict)


def test_a_borrower_is_refused_the_slots_a_paused_lanes_queue_is_owed_as_by_the_scheduler() -> None:
    p = policy([{"name": "chat", "max_inflight": 2}, {"name": "bulk", "max_inflight": 1, "borrow": True}],
               capacity=4)
    s = Scheduler(p, rng=random.Random(0))
    for _ in range(2):
        assert s.submit("bulk", "t", Job(None, 0, 100), 0.0)[0].outcome is Outcome.ADMITTED  # 1 borrowed
    s.pause("chat")
    for _ in range(2):
        assert s.submit("chat", "t", Job(None, 0, 100), 0.0)[0].outcome is Outcome.QUEUED
    views = s.snapshot(0.0)
    inflight = {lane: v.inflight for lane, v in views.items()}
    queued = {lane: v.queued for lane, v in views.items()}
    bulk = next(lane for lane in p.lanes if lane.name == "bulk")
    assert Limits.of(p).check("bulk", inflight, queued) == (SlotVerdict.OWED, 0)
    assert not s._lanes.admits(bulk)


# -- time by hand -----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def manual(clock: Clock, hub: MemoryHub | None = None, **options: Any) -> MemoryLedger:
    ledger = MemoryLedger(hub or MemoryHub(clock), ttl=10.0, queue_ttl=3.0, renew=False, **options)
    await ledger.start()
    return ledger


async def test_a_lease_lasts_exactly_its_ttl_unless_renewed() -> None:
    clock = Clock()
    hub = MemoryHub(clock)
    holder, other = await manual(clock, hub), await manual(clock, hub)
    await holder.acquire("batch", "1", TWO)
    await holder.acquire("batch", "2", TWO)
    clock.now += 9.999
    assert await other.acquire("batch", "x", TWO) is SlotVerdict.LANE_FULL
    clock.now += 0.001
    assert await other.acquire("batch", "x", TWO)
    await other.release("batch", "x")

    await holder.renew()  # the holder was stalled, not dead: its running requests count again
    assert (await other.view()).inflight["batch"] == 2
    assert holder.held == {"batch": 2}


async def test_a_replica_counts_as_alive_for_the_queue_ttl_after_its_last_sign() -> None:
    clock = Clock()
    hub = MemoryHub(clock)
    a, b = await manual(clock, hub), await manual(clock, hub)
    await b.publish_queue({"batch": 1}, {"batch": 1.0})
    assert (await a.view()).replicas == 2
    clock.now += 2.9
    await a.renew()
    clock.now += 0.2
    view = await a.view()
    assert (view.replicas, view.queued) == (1, {})


async def test_queue_ttl_may_not_exceed_the_lease_ttl() -> None:
    with pytest.raises(ValueError, match="queue_ttl"):
        MemoryLedger(ttl=1.0, queue_ttl=2.0)


async def test_open_ledger_without_a_store_is_in_memory() -> None:
    assert isinstance(open_ledger(None), MemoryLedger)
    assert isinstance(open_ledger("memory://"), MemoryLedger)
    with pytest.raises(ValueError, match="expected redis"):
        open_ledger("http://example")

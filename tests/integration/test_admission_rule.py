"""One admission rule, four implementations, the same answer on the same random states.

Whether one more request of a lane may start is decided in four places: the store-free rule
``Limits.check`` (with ``outranked`` for the global order), the scheduler
(``Scheduler.admissible``, which ext_proc and the simulator run), the edge shed (which reads
the scheduler's verdict through ``SchedulerPressure``), and the shared store: the in-memory
ledger and the Lua script ``acquire.lua`` in a real ``redis-server``. Hypothesis draws lanes
(limits, borrowing, max_borrow), a capacity, the leases other replicas hold, what they queue
and the ranks of their best waiting requests; every implementation is asked about every lane
of that state, and all must agree with ``Limits.check``: the ledgers verdict for verdict
(lane_full, borrow_limit, owed, capacity, outranked), the scheduler and the edge on yes/no
(the global order is the store's own final check).
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from extproc.core.admission import Scheduler
from extproc.core.edge import SchedulerPressure
from extproc.policy.schema import Policy
from extproc.state import RANK_TOLERANCE, LaneLimits, Limits, SlotVerdict, outranked
from extproc.state.memory import MemoryHub, MemoryLedger
from extproc.state.redis import RedisLedger
from tests.integration.test_state_redis import RedisServer

#: Limits loose enough to seed any number of leases with.
_SEED_LANE = 1000


@dataclass(frozen=True)
class State:
    lanes: tuple[LaneLimits, ...]
    capacity: int
    held: dict[str, int]
    """Leases other replicas hold, per lane."""
    queued: tuple[dict[str, int], dict[str, int]]
    """What two other replicas queue, per lane."""
    heads: tuple[dict[str, float], dict[str, float]]
    """Their best waiting request's rank, per lane they queue in."""
    ranks: dict[str, float | None]
    """The rank of the request asking, per lane (None: no global order)."""

    @property
    def limits(self) -> Limits:
        return Limits(self.lanes, self.capacity)

    def queued_total(self) -> dict[str, int]:
        return {lane.name: self.queued[0].get(lane.name, 0) + self.queued[1].get(lane.name, 0)
                for lane in self.lanes}

    def expected(self, lane: str) -> SlotVerdict:
        verdict, free = self.limits.check(lane, self.held, self.queued_total())
        rank = self.ranks[lane]
        heads = [h[lane] for h in self.heads if lane in h]
        if verdict and outranked(rank, heads, RANK_TOLERANCE, free):
            return SlotVerdict.OUTRANKED
        return verdict


@st.composite
def states(draw: st.DrawFn) -> State:
    n = draw(st.integers(1, 3))
    lanes = []
    for i in range(n):
        borrow = draw(st.booleans())
        max_borrow = draw(st.one_of(st.none(), st.integers(0, 3))) if borrow else None
        lanes.append(LaneLimits(f"l{i}", draw(st.integers(1, 4)), borrow, max_borrow))
    # The policy needs room for its largest lane; borrowing lanes may get more than the sum.
    total = sum(lane.max_inflight for lane in lanes)
    extra = 3 if any(lane.borrow for lane in lanes) else 0
    capacity = draw(st.integers(max(lane.max_inflight for lane in lanes), total + extra))
    names = [lane.name for lane in lanes]
    held = {name: draw(st.integers(0, 6)) for name in names}
    queued: list[dict[str, int]] = []
    heads: list[dict[str, float]] = []
    for _ in range(2):
        q = {name: draw(st.integers(0, 3)) for name in names}
        queued.append({name: k for name, k in q.items() if k})
        heads.append({name: draw(st.floats(0, 10, allow_nan=False)) for name, k in q.items() if k})
    ranks = {name: draw(st.one_of(st.none(), st.floats(0, 10, allow_nan=False))) for name in names}
    return State(tuple(lanes), capacity, held, (queued[0], queued[1]), (heads[0], heads[1]), ranks)


def _policy(state: State) -> Policy:
    return Policy.model_validate({
        "lanes": [{"name": lane.name, "max_inflight": lane.max_inflight, "max_queued": 100, "deadline": "60s",
                   "priority": 10 * i, "borrow": lane.borrow,
                   **({"max_borrow": lane.max_borrow} if lane.max_borrow is not None else {})}
                  for i, lane in enumerate(state.lanes)],
        "capacity": {"max_inflight": state.capacity},
        "classification": {"default_lane": state.lanes[0].name},
    })


def scheduler_says(state: State) -> tuple[dict[str, bool], dict[str, bool]]:
    """The scheduler's and the edge's yes/no per lane, with the other replicas' counts as its view."""
    scheduler = Scheduler(_policy(state), rng=random.Random(0))
    scheduler.set_others(state.held, state.queued_total(), now=0.0)
    pressure = SchedulerPressure(scheduler, lambda: 0.0)
    admissible = {lane.name: scheduler.admissible(lane.name) for lane in state.lanes}
    edge = {}
    for lane in state.lanes:
        seen = pressure.lane(lane.name)
        assert seen is not None
        edge[lane.name] = seen.slot_free
    return admissible, edge


async def _seed(holder: Any, others: list[Any], state: State) -> None:
    seed = Limits(tuple(LaneLimits(lane.name, _SEED_LANE) for lane in state.lanes),
                  _SEED_LANE * len(state.lanes))
    for lane, n in state.held.items():
        for k in range(n):
            assert await holder.acquire(lane, f"seed-{lane}-{k}", seed) is SlotVerdict.GRANTED
    for ledger, queued, heads in zip(others, state.queued, state.heads, strict=True):
        await ledger.publish_queue(queued, heads)


async def ledger_says(make: Any, state: State) -> dict[str, SlotVerdict]:
    """Each lane's verdict from a fresh replica sharing a store the others filled."""
    holder, queue_b, queue_c, me = [await make(replica) for replica in ("b", "c", "d", "me")]
    try:
        await _seed(holder, [queue_b, queue_c], state)
        out = {}
        for lane in state.lanes:
            probe = f"probe-{lane.name}"
            out[lane.name] = await me.acquire(lane.name, probe, state.limits, state.ranks[lane.name])
            if out[lane.name]:
                await me.release(lane.name, probe)
        return out
    finally:
        for ledger in (holder, queue_b, queue_c, me):
            await ledger.close()


def memory_says(state: State) -> dict[str, SlotVerdict]:
    hub = MemoryHub()

    async def make(replica: str) -> MemoryLedger:
        ledger = MemoryLedger(hub, renew=False, replica=replica, ttl=60, queue_ttl=30)
        await ledger.start()
        return ledger

    return asyncio.run(ledger_says(make, state))


def redis_says(url: str, state: State) -> dict[str, SlotVerdict]:
    prefix = f"rule-{uuid.uuid4().hex[:8]}"

    async def make(replica: str) -> RedisLedger:
        ledger = RedisLedger(url, prefix=prefix, renew=False, replica=replica, ttl=60, queue_ttl=30,
                             timeout=2.0)
        await ledger.start()
        return ledger

    return asyncio.run(ledger_says(make, state))


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = RedisServer(Path(tmp_path_factory.mktemp("rule-redis")))
    server.start()
    try:
        yield server.url
    finally:
        server.kill()


SEEN: set[tuple[str, bool]] = set()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(states())
# One of each verdict for certain, whatever the draw: a borrower at its max_borrow while slots are
# free; a borrower whose free slot another lane's queue is owed; a better head elsewhere; a lane at
# its own limit that may not borrow, with capacity to spare.
@example(State((LaneLimits("l0", 1), LaneLimits("l1", 2)), 3, {"l0": 1}, ({}, {}), ({}, {}),
               {"l0": None, "l1": None}))
@example(State((LaneLimits("l0", 2), LaneLimits("l1", 1, True, 1)), 6, {"l0": 0, "l1": 2},
               ({}, {}), ({}, {}), {"l0": None, "l1": None}))
@example(State((LaneLimits("l0", 2), LaneLimits("l1", 1, True)), 4, {"l0": 1, "l1": 2},
               ({"l0": 2}, {}), ({"l0": 1.0}, {}), {"l0": None, "l1": 5.0}))
@example(State((LaneLimits("l0", 2),), 2, {"l0": 1}, ({"l0": 1}, {"l0": 1}), ({"l0": 1.0}, {"l0": 2.0}),
               {"l0": 5.0}))
def test_every_implementation_gives_the_same_verdict(redis_url: str, state: State) -> None:
    expected = {lane.name: state.expected(lane.name) for lane in state.lanes}
    admissible, edge = scheduler_says(state)
    bare = {lane.name: bool(state.limits.check(lane.name, state.held, state.queued_total())[0])
            for lane in state.lanes}
    assert admissible == bare, state
    assert edge == bare, state
    assert memory_says(state) == expected, state
    assert redis_says(redis_url, state) == expected, state
    SEEN.update((verdict.value, state.ranks[lane] is not None) for lane, verdict in expected.items())


def test_the_random_states_reached_every_verdict() -> None:
    """Runs after the property (file order): the states drawn exercised each branch of the rule."""
    if not SEEN:
        pytest.skip("the property test did not run in this session")
    verdicts = {verdict for verdict, _ in SEEN}
    # Every verdict of the rule (unavailable is the store's own failure, not the rule's).
    assert verdicts == {v.value for v in SlotVerdict} - {"unavailable"}, sorted(verdicts)
    assert {ranked for _, ranked in SEEN} == {True, False}


def test_the_verdicts_are_all_named() -> None:
    # The Lua script answers with these strings: a new verdict must be added to both.
    assert {v.value for v in SlotVerdict} == {"granted", "lane_full", "borrow_limit", "owed", "capacity",
                                          "outranked", "unavailable"}
    assert [v for v in SlotVerdict if v] == [SlotVerdict.GRANTED]

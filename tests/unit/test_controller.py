"""The controller: the core run live (futures for held requests, the timer, the shared ledger).

Every decision is the core's; these tests hold the controller to running them faithfully: a
held request wakes when its slot frees or its deadline passes, nothing is counted twice, a
ledger's refusal puts the request back in its queue and backs the lane off, a client that left
while the ledger answered gives its slot back, and a drain or a reload reaches every waiter.
The in-memory ledger stands in for Redis (the same contract suite holds both); no sockets.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from extproc.controller import Controller
from extproc.core.decision import Outcome, Reason, State, Ticket
from extproc.metrics import Metrics
from extproc.state import LaneLimits, Limits, SlotVerdict
from extproc.state.memory import MemoryHub, MemoryLedger
from tests.unit.test_admission import job, lane, make_policy


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def controller(*lanes: dict[str, Any], ledger: Any = None,
               **policy: Any) -> tuple[Controller, CollectorRegistry]:
    registry = CollectorRegistry()
    c = Controller(make_policy(list(lanes), **policy), Metrics(registry), rng=random.Random(0), ledger=ledger)
    return c, registry


async def test_a_held_request_wakes_when_a_slot_frees_and_everything_is_counted_once() -> None:
    c, registry = controller(lane("a", 1))
    first = c.submit("a", "t", job())
    second = c.submit("a", "t", job())
    assert (first.outcome, second.outcome) == (Outcome.ADMITTED, Outcome.QUEUED)
    waiting = asyncio.create_task(c.wait(second.ticket))
    await asyncio.sleep(0)
    assert not waiting.done()
    c.release(first.ticket)
    decision = await asyncio.wait_for(waiting, 5)
    assert decision.outcome is Outcome.ADMITTED
    assert second.ticket.state is State.INFLIGHT
    c.release(second.ticket)
    c.release(second.ticket)  # idempotent: a second end counts nothing
    assert sample(registry, "inference_admission_decisions_total", lane="a", outcome="admitted") == 2
    assert sample(registry, "inference_admission_decisions_total", lane="a", outcome="queued") == 1
    assert sample(registry, "inference_service_seconds_count", lane="a") == 2
    assert sample(registry, "inference_queue_wait_seconds_count", lane="a") == 2
    assert c.lanes()["a"].inflight == 0


async def test_a_queued_request_whose_client_left_is_counted_cancelled() -> None:
    c, registry = controller(lane("a", 1))
    c.submit("a", "t", job())
    queued = c.submit("a", "t", job())
    c.release(queued.ticket)
    assert sample(registry, "inference_admission_decisions_total", lane="a", outcome="cancelled") == 1
    assert c.lanes()["a"].queued == 0


async def test_the_timer_rejects_a_request_past_its_deadline() -> None:
    c, registry = controller(lane("a", 1, deadline="0.2s"))
    c.start()
    try:
        # Predicted to end in time (so the second is held, not refused at once), it runs on.
        c.submit("a", "t", job(0.05))
        queued = c.submit("a", "t", job(0.05))
        assert queued.outcome is Outcome.QUEUED
        decision = await asyncio.wait_for(c.wait(queued.ticket), 5)
        assert (decision.outcome, decision.reason) == (Outcome.REJECTED, Reason.DEADLINE_EXPIRED)
        assert decision.retry_after is not None
        assert decision.retry_after >= 1
        rejected = sample(
            registry, "inference_admission_rejections_total", lane="a", reason="deadline_expired"
        )
        assert rejected == 1
    finally:
        await c.stop()


async def test_drain_answers_every_waiter_and_wait_idle_waits_for_the_running() -> None:
    c, _ = controller(lane("a", 1))
    running = c.submit("a", "t", job())
    queued = c.submit("a", "t", job())
    waiting = asyncio.create_task(c.wait(queued.ticket))
    c.drain()
    decision = await asyncio.wait_for(waiting, 5)
    assert (decision.outcome, decision.reason) == (Outcome.REJECTED, Reason.DRAINING)
    assert c.submit("a", "t", job()).reason is Reason.DRAINING
    assert await c.wait_idle(0.05) is False
    c.release(running.ticket)
    assert await c.wait_idle(1.0) is True
    c.undrain()
    assert c.submit("a", "t", job()).outcome is Outcome.ADMITTED


async def test_a_reload_admits_what_a_bigger_limit_lets_start_and_tells_the_listeners() -> None:
    c, _ = controller(lane("a", 1))
    seen: list[int] = []
    c.on_reconfigure.append(lambda p: seen.append(p.lanes[0].max_inflight))
    c.submit("a", "t", job())
    queued = c.submit("a", "t", job())
    waiting = asyncio.create_task(c.wait(queued.ticket))
    c.reconfigure(make_policy([lane("a", 2)]))
    assert (await asyncio.wait_for(waiting, 5)).outcome is Outcome.ADMITTED
    assert seen == [2]
    assert c.policy.lanes[0].max_inflight == 2


async def test_pause_holds_a_lane_and_resume_admits_its_queue() -> None:
    c, _ = controller(lane("a", 2))
    c.pause("a")
    held = c.submit("a", "t", job())
    assert held.outcome is Outcome.QUEUED
    waiting = asyncio.create_task(c.wait(held.ticket))
    c.resume("a")
    assert (await asyncio.wait_for(waiting, 5)).outcome is Outcome.ADMITTED
    with pytest.raises(KeyError):
        c.pause("nope")


# -- with a shared ledger ------------------------------------------------------------------------


async def started(ledger: MemoryLedger) -> MemoryLedger:
    await ledger.start()
    return ledger


async def test_confirm_takes_the_slot_in_the_ledger_and_release_gives_it_back() -> None:
    hub = MemoryHub()
    ledger = await started(MemoryLedger(hub, renew=False, replica="me"))
    c, registry = controller(lane("a", 2), ledger=ledger)
    decision = c.submit("a", "t", job())
    assert decision.outcome is Outcome.ADMITTED
    # Not counted before the ledger granted it: the gauges never show more than the ledger holds.
    assert sample(registry, "inference_admission_decisions_total", lane="a", outcome="admitted") == 0
    assert c.lanes()["a"].inflight == 0
    confirmed = await c.confirm(decision)
    assert confirmed.outcome is Outcome.ADMITTED
    assert (await ledger.view()).inflight["a"] == 1
    assert c.lanes()["a"].inflight == 1
    assert sample(registry, "inference_admission_decisions_total", lane="a", outcome="admitted") == 1
    c.release(decision.ticket)
    await c.stop()  # waits for the give-back
    assert (await ledger.view()).inflight.get("a", 0) == 0
    assert c.lanes()["a"].inflight == 0
    await ledger.close()


async def test_a_refusal_requeues_the_request_and_a_freed_slot_anywhere_brings_it_back() -> None:
    hub = MemoryHub()
    other = await started(MemoryLedger(hub, renew=False, replica="other"))
    limits = Limits((LaneLimits("a", 1),), 1)
    assert await other.acquire("a", "theirs", limits) is SlotVerdict.GRANTED
    ledger = await started(MemoryLedger(hub, renew=False, replica="me"))
    c, registry = controller(lane("a", 1), ledger=ledger)
    c.start()
    try:
        decision = c.submit("a", "t", job())  # the scheduler has not seen the other's lease yet
        assert decision.outcome is Outcome.ADMITTED
        again = await c.confirm(decision)
        assert again.outcome is Outcome.QUEUED
        assert decision.ticket.state is State.QUEUED
        assert sample(registry, "extproc_ledger_refusals_total", lane="a", verdict="capacity") == 1
        waiting = asyncio.create_task(c.wait(decision.ticket))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # no loop of grants and refusals while the slot is taken
        assert sample(registry, "extproc_ledger_refusals_total", lane="a", verdict="capacity") <= 2
        await other.release("a", "theirs")  # the ledger wakes every replica
        readmitted = await asyncio.wait_for(waiting, 5)
        assert readmitted.outcome is Outcome.ADMITTED
        assert (await c.confirm(readmitted)).outcome is Outcome.ADMITTED
        assert (await ledger.view()).inflight["a"] == 1
        c.release(decision.ticket)
    finally:
        await c.stop()
        await ledger.close()
        await other.close()


class SlowLedger(MemoryLedger):
    """A real in-memory ledger whose grants arrive only when the test says (a slow store)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = asyncio.Event()

    async def acquire(self, lane: str, lease: str, limits: Limits, rank: float | None = None) -> SlotVerdict:
        verdict = await super().acquire(lane, lease, limits, rank)
        await self.gate.wait()
        return verdict


async def test_a_client_gone_while_the_ledger_answered_gives_the_slot_back() -> None:
    ledger = SlowLedger(MemoryHub(), renew=False, replica="me")
    await ledger.start()
    c, registry = controller(lane("a", 1), ledger=ledger)
    decision = c.submit("a", "t", job())
    confirming = asyncio.create_task(c.confirm(decision))
    await asyncio.sleep(0)
    ticket: Ticket = decision.ticket
    c.release(ticket)  # the client went away
    ledger.gate.set()
    await asyncio.wait_for(confirming, 5)
    await c.stop()
    assert (await ledger.view()).inflight.get("a", 0) == 0
    assert c.lanes()["a"].inflight == 0
    assert sample(registry, "inference_admission_decisions_total", lane="a", outcome="admitted") == 0
    await ledger.close()


async def test_shadow_lanes_never_wait_for_the_ledger() -> None:
    hub = MemoryHub()
    ledger = await started(MemoryLedger(hub, renew=False, replica="me"))
    c, _ = controller(lane("a", 1, shadow=True), ledger=ledger)
    decision = c.submit("a", "t", job())
    assert (await c.confirm(decision)) is decision
    assert (await ledger.view()).inflight.get("a", 0) == 0
    c.release(decision.ticket)
    await ledger.close()


async def test_a_replica_reads_the_fleet_s_drain_rate_from_the_store() -> None:
    # Replica A completes two requests a second for 30 s; replica B completes none, but reads the
    # fleet's completion counters on each sync: its Retry-After and its metric use A's pace.
    hub = MemoryHub()
    clock = [0.0]
    a_ledger = await started(MemoryLedger(hub, renew=False, replica="a"))
    b_ledger = await started(MemoryLedger(hub, renew=False, replica="b"))
    registry_b = CollectorRegistry()
    a = Controller(make_policy([lane("a", 4)]), Metrics(CollectorRegistry()), clock=lambda: clock[0],
                   rng=random.Random(0), ledger=a_ledger)
    b = Controller(make_policy([lane("a", 4)]), Metrics(registry_b), clock=lambda: clock[0],
                   rng=random.Random(0), ledger=b_ledger)
    for step in range(60):
        clock[0] = step * 0.5
        decision = a.submit("a", "t", job())
        confirmed = await a.confirm(decision)
        assert confirmed.outcome is Outcome.ADMITTED
        a.release(decision.ticket)
        for _ in range(3):
            await asyncio.sleep(0)  # the give-back to the ledger
        await b.fleet.sync_once()
    rate = b.machine._scheduler.drain_rate("a", clock[0])
    assert rate == pytest.approx(2.0, rel=0.15)
    assert sample(registry_b, "extproc_lane_drain_rate", lane="a") == pytest.approx(rate)
    assert b.machine._scheduler._returns._completions == {}  # nothing completed on B itself
    await a.stop()
    await b.stop()
    await a_ledger.close()
    await b_ledger.close()

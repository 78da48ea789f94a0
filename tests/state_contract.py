"""The ledger contract: every implementation (memory, Redis) passes the same tests.

A test module subclasses :class:`LedgerContract` and provides a ``backend`` fixture whose
``make(**options)`` returns a started ledger; ledgers made by one backend share one store
(one hub, one Redis prefix), so several of them play several replicas. Options:
``ttl``, ``queue_ttl``, ``rank_tolerance``, ``renew`` (False: a replica that has stopped
renewing, i.e. one that died without releasing).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import pytest

from extproc.state import GlobalView, LaneLimits, Ledger, Limits, SlotVerdict

#: Short enough that expiry tests wait well under a second, long enough to renew several times.
TINY_TTL = 0.4

TWO = Limits((LaneLimits("interactive", 3), LaneLimits("batch", 2)), capacity=5)
BORROW = Limits((LaneLimits("interactive", 3), LaneLimits("batch", 2, borrow=True)), capacity=5)
CAPPED = Limits((LaneLimits("interactive", 3), LaneLimits("batch", 2, borrow=True, max_borrow=1)), capacity=5)


class Backend(Protocol):
    async def make(self, **options: Any) -> Any: ...


async def eventually(check: Callable[[], Awaitable[bool]], within: float = 5.0) -> None:
    """Wait until ``check()`` holds (expiry and wake-ups take real time); fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within}s")
        await asyncio.sleep(0.02)


async def grant_all(ledger: Ledger, lane: str, leases: list[str], limits: Limits,
                    rank: float | None = None) -> list[SlotVerdict]:
    return [await ledger.acquire(lane, lease, limits, rank) for lease in leases]


def inflight(view: GlobalView, lane: str) -> int:
    return view.inflight.get(lane, 0)


class Woken:
    """Collects ``on_freed`` lanes."""

    def __init__(self, ledger: Ledger) -> None:
        self.lanes: list[str] = []
        ledger.on_freed(self.lanes.append)

    async def wait_for(self, lane: str) -> None:
        async def seen() -> bool:
            return lane in self.lanes
        await eventually(seen)


class LedgerContract:
    # -- lane limits --------------------------------------------------------------------------

    async def test_grants_up_to_the_lane_limit_then_refuses(self, backend: Backend) -> None:
        ledger = await backend.make()
        assert await grant_all(ledger, "batch", ["b1", "b2"], TWO) == [SlotVerdict.GRANTED] * 2
        verdict = await ledger.acquire("batch", "b3", TWO)
        assert verdict is SlotVerdict.LANE_FULL
        assert not verdict
        assert await ledger.acquire("interactive", "i1", TWO)  # the other lane is unaffected
        view = await ledger.view()
        assert (inflight(view, "batch"), inflight(view, "interactive")) == (2, 1)

    async def test_release_frees_a_slot_and_is_idempotent(self, backend: Backend) -> None:
        a, b = await backend.make(), await backend.make()
        await grant_all(a, "batch", ["x", "y"], TWO)
        assert await b.acquire("batch", "z", TWO) is SlotVerdict.LANE_FULL
        await a.release("batch", "x")
        await a.release("batch", "x")
        await a.release("batch", "never-acquired")
        await b.release("batch", "y")  # the same lease id from another replica is another lease
        assert inflight(await a.view(), "batch") == 1
        assert await b.acquire("batch", "z", TWO)
        assert await b.acquire("batch", "w", TWO) is SlotVerdict.LANE_FULL

    async def test_completions_are_counted_per_lane_over_every_replica(self, backend: Backend) -> None:
        a, b = await backend.make(), await backend.make()
        before = dict((await a.view()).completed)
        await grant_all(a, "batch", ["x", "y"], TWO)
        assert await b.acquire("interactive", "z", TWO)
        await a.release("batch", "x")
        await a.release("batch", "x")  # a second release of the same lease completes nothing
        await a.release("batch", "never-acquired")
        await b.release("interactive", "z")
        after = (await b.view()).completed
        assert after.get("batch", 0) - before.get("batch", 0) == 1
        assert after.get("interactive", 0) - before.get("interactive", 0) == 1
        assert (await a.view()).completed == after  # one count for the fleet

    async def test_acquiring_a_held_lease_again_counts_once(self, backend: Backend) -> None:
        ledger = await backend.make()
        assert await ledger.acquire("batch", "same", TWO)
        assert await ledger.acquire("batch", "same", TWO)
        assert inflight(await ledger.view(), "batch") == 1
        assert await ledger.acquire("batch", "other", TWO)
        assert await ledger.acquire("batch", "same", TWO)  # still held: granted even at the limit
        await ledger.release("batch", "same")
        assert inflight(await ledger.view(), "batch") == 1

    async def test_an_unknown_lane_is_a_key_error(self, backend: Backend) -> None:
        ledger = await backend.make()
        with pytest.raises(KeyError, match="nope"):
            await ledger.acquire("nope", "1", TWO)

    async def test_concurrent_acquires_from_several_replicas_never_exceed_the_limits(
            self, backend: Backend) -> None:
        limits = Limits((LaneLimits("a", 5), LaneLimits("b", 3)), capacity=7)
        replicas = [await backend.make() for _ in range(3)]
        attempts = [(replicas[i % 3], "ab"[i % 2], f"r{i}") for i in range(300)]
        verdicts = await asyncio.gather(*(r.acquire(lane, lease, limits) for r, lane, lease in attempts))
        granted = Counter(lane for (_, lane, _), v in zip(attempts, verdicts, strict=True) if v)
        assert granted["a"] <= 5
        assert granted["b"] <= 3
        assert granted["a"] + granted["b"] == 7
        view = await replicas[0].view()
        assert (inflight(view, "a"), inflight(view, "b")) == (granted["a"], granted["b"])
        await asyncio.gather(*(r.release(lane, lease) for (r, lane, lease), v
                               in zip(attempts, verdicts, strict=True) if v))
        view = await replicas[1].view()
        assert (inflight(view, "a"), inflight(view, "b")) == (0, 0)

    # -- capacity and borrowing ---------------------------------------------------------------

    async def test_capacity_caps_every_lane_together(self, backend: Backend) -> None:
        limits = Limits((LaneLimits("interactive", 3), LaneLimits("batch", 3)), capacity=4)
        ledger = await backend.make()
        await grant_all(ledger, "interactive", ["i1", "i2", "i3"], limits)
        assert await ledger.acquire("batch", "b1", limits)
        assert await ledger.acquire("batch", "b2", limits) is SlotVerdict.CAPACITY
        assert await ledger.acquire("interactive", "i4", limits) is SlotVerdict.CAPACITY

    async def test_a_lane_that_may_not_borrow_stops_at_its_quota_with_slots_idle(
            self, backend: Backend) -> None:
        ledger = await backend.make()
        await grant_all(ledger, "batch", ["b1", "b2"], TWO)
        assert await ledger.acquire("batch", "b3", TWO) is SlotVerdict.LANE_FULL
        assert sum((await ledger.view()).inflight.values()) == 2  # 3 slots of capacity idle

    async def test_a_borrowing_lane_takes_idle_slots(self, backend: Backend) -> None:
        ledger = await backend.make()
        verdicts = await grant_all(ledger, "batch", ["b1", "b2", "b3", "b4", "b5"], BORROW)
        assert verdicts == [SlotVerdict.GRANTED] * 5
        assert await ledger.acquire("batch", "b6", BORROW) is SlotVerdict.CAPACITY

    async def test_borrowing_stops_at_max_borrow(self, backend: Backend) -> None:
        ledger = await backend.make()
        await grant_all(ledger, "batch", ["b1", "b2", "b3"], CAPPED)
        assert await ledger.acquire("batch", "b4", CAPPED) is SlotVerdict.BORROW_LIMIT
        assert await ledger.acquire("interactive", "i1", CAPPED)

    async def test_borrowing_stops_where_slots_are_owed_to_work_queued_on_another_replica(
            self, backend: Backend) -> None:
        a, b = await backend.make(), await backend.make()
        await grant_all(a, "batch", ["b1", "b2"], BORROW)  # batch at quota, 3 slots free
        await b.publish_queue({"interactive": 2}, {"interactive": 100.0})
        assert await a.acquire("batch", "b3", BORROW)  # 3 free, 2 owed to interactive: 1 to lend
        assert await a.acquire("batch", "b4", BORROW) is SlotVerdict.OWED
        await b.publish_queue({"interactive": 0}, {"interactive": None})
        assert await a.acquire("batch", "b4", BORROW)

    async def test_what_is_owed_is_capped_by_the_owed_lanes_own_free_quota(self, backend: Backend) -> None:
        a, b = await backend.make(), await backend.make()
        await grant_all(a, "interactive", ["i1", "i2"], BORROW)  # interactive: 1 slot of quota left
        await grant_all(a, "batch", ["b1", "b2"], BORROW)
        await b.publish_queue({"interactive": 5}, {"interactive": 100.0})
        # 1 free, owed min(5 queued, 1 of quota left) = 1: nothing to lend.
        assert await a.acquire("batch", "b3", BORROW) is SlotVerdict.OWED
        assert await a.acquire("interactive", "i3", BORROW)  # a lane within quota is never owed-blocked

    async def test_a_dead_replicas_queue_stops_counting(self, backend: Backend) -> None:
        a = await backend.make(ttl=TINY_TTL, queue_ttl=TINY_TTL)
        b = await backend.make(ttl=TINY_TTL, queue_ttl=TINY_TTL, renew=False)  # dies after publishing
        await grant_all(a, "batch", ["b1", "b2"], BORROW)
        await b.publish_queue({"interactive": 3}, {"interactive": 1.0})
        assert (await a.view()).queued == {"interactive": 3}
        assert await a.acquire("batch", "b3", BORROW) is SlotVerdict.OWED

        async def forgotten() -> bool:
            return (await a.view()).queued == {}
        await eventually(forgotten)
        assert await a.acquire("batch", "b3", BORROW, rank=50.0)

    # -- global order -------------------------------------------------------------------------

    async def test_a_better_head_waiting_on_another_replica_outranks(self, backend: Backend) -> None:
        a = await backend.make(rank_tolerance=0.5)
        b = await backend.make(rank_tolerance=0.5)
        await grant_all(a, "batch", ["b1"], TWO)  # one batch slot left
        await b.publish_queue({"batch": 4}, {"batch": 100.0})
        assert await a.acquire("batch", "x", TWO, rank=101.0) is SlotVerdict.OUTRANKED
        assert await a.acquire("batch", "x", TWO, rank=100.5) is SlotVerdict.GRANTED  # within tolerance
        await a.release("batch", "x")
        assert await a.acquire("batch", "y", TWO)  # no rank: no global-order check
        await a.release("batch", "y")
        assert await b.acquire("batch", "z", TWO, rank=100.0)  # its own head does not block it

    async def test_a_better_head_claims_one_slot_not_all(self, backend: Backend) -> None:
        a, b = await backend.make(rank_tolerance=0.0), await backend.make(rank_tolerance=0.0)
        await b.publish_queue({"batch": 1}, {"batch": 1.0})
        assert await a.acquire("batch", "x", TWO, rank=9.0)  # 2 free, 1 better head elsewhere
        assert await a.acquire("batch", "y", TWO, rank=9.0) is SlotVerdict.OUTRANKED
        c = await backend.make(rank_tolerance=0.0)
        await c.publish_queue({"interactive": 1}, {"interactive": 2.0})
        assert await a.acquire("interactive", "i", TWO, rank=9.0)  # 3 free, 1 better
        assert await a.acquire("interactive", "j", TWO, rank=9.0)  # 2 free, 1 better
        assert await a.acquire("interactive", "k", TWO, rank=9.0) is SlotVerdict.OUTRANKED

    # -- leases ------------------------------------------------------------------------------

    async def test_leases_of_a_replica_that_stops_renewing_expire(self, backend: Backend) -> None:
        dead = await backend.make(ttl=TINY_TTL, queue_ttl=TINY_TTL, renew=False)
        live = await backend.make(ttl=TINY_TTL, queue_ttl=TINY_TTL)
        await grant_all(dead, "batch", ["b1", "b2"], TWO)
        assert await live.acquire("batch", "x", TWO) is SlotVerdict.LANE_FULL

        async def freed() -> bool:
            return bool(await live.acquire("batch", "x", TWO))
        await eventually(freed)
        assert inflight(await live.view(), "batch") == 1

    async def test_renewal_keeps_leases_past_their_ttl(self, backend: Backend) -> None:
        holder = await backend.make(ttl=TINY_TTL, queue_ttl=TINY_TTL)
        other = await backend.make(ttl=TINY_TTL, queue_ttl=TINY_TTL)
        await grant_all(holder, "batch", ["b1", "b2"], TWO)
        await asyncio.sleep(TINY_TTL * 2)
        assert await other.acquire("batch", "x", TWO) is SlotVerdict.LANE_FULL
        assert inflight(await other.view(), "batch") == 2

    async def test_a_restarted_replica_never_double_counts(self, backend: Backend) -> None:
        before = await backend.make(ttl=TINY_TTL, queue_ttl=TINY_TTL, renew=False)  # killed
        await grant_all(before, "batch", ["1", "2"], TWO)
        after = await backend.make(ttl=TINY_TTL, queue_ttl=TINY_TTL)  # the same replica, restarted
        assert after.replica != before.replica
        assert await after.acquire("batch", "1", TWO) is SlotVerdict.LANE_FULL  # "1" is not its lease

        async def settled() -> bool:
            return inflight(await after.view(), "batch") == 0
        await eventually(settled)
        assert await after.acquire("batch", "1", TWO)
        assert inflight(await after.view(), "batch") == 1
        await after.release("batch", "1")
        # A heartbeat on its way when the release ran puts the lease back, then releases it again
        # (RedisLedger.renew): the count is 0 once that round trip ends, and stays there. A first 0
        # may be read before such a heartbeat lands (a loaded CI machine read 1 after it), so the
        # count is read again once every heartbeat sent before the release has ended (a heartbeat
        # goes every ttl / 3): later ones no longer hold the lease and cannot put it back.
        await eventually(settled)
        await asyncio.sleep(TINY_TTL)
        await eventually(settled)
        for _ in range(3):
            await asyncio.sleep(TINY_TTL / 3)
            assert inflight(await after.view(), "batch") == 0

    async def test_close_gives_back_leases_and_withdraws_the_queue(self, backend: Backend) -> None:
        a, b = await backend.make(), await backend.make()
        await grant_all(a, "batch", ["b1", "b2"], TWO)
        await a.publish_queue({"batch": 2}, {"batch": 5.0}, {"batch": {"acme": 2}})
        woken = Woken(b)
        await a.close()
        view = await b.view()
        assert (inflight(view, "batch"), view.queued, view.tenants, view.replicas) == (0, {}, {}, 1)
        await woken.wait_for("batch")

    # -- wake-ups ----------------------------------------------------------------------------

    async def test_a_release_wakes_the_other_replicas_while_one_has_requests_waiting(
            self, backend: Backend) -> None:
        a, b = await backend.make(), await backend.make()
        woken = Woken(b)
        await b.publish_queue({"interactive": 1}, {"interactive": 1.0})
        await woken.wait_for("interactive")  # it starts queueing: one check at once
        woken.lanes.clear()
        await a.acquire("interactive", "i1", TWO)
        await a.release("interactive", "i1")
        await woken.wait_for("interactive")

    async def test_an_expired_lease_wakes_the_other_replicas(self, backend: Backend) -> None:
        dead = await backend.make(ttl=TINY_TTL, queue_ttl=TINY_TTL, renew=False)
        live = await backend.make(ttl=TINY_TTL, queue_ttl=TINY_TTL)
        woken = Woken(live)
        await grant_all(dead, "batch", ["b1", "b2"], TWO)
        assert await live.acquire("batch", "x", TWO) is SlotVerdict.LANE_FULL
        # As the controller does: wait to be woken, retry, and go back to waiting if still full.
        # Nobody acquires or releases meanwhile: only expiry (of the leases, or of the dead
        # replica's liveness mark) can wake it, and only the leases' can let it in.
        async with asyncio.timeout(10):
            while True:
                await woken.wait_for("batch")
                woken.lanes.clear()
                if await live.acquire("batch", "x", TWO):
                    break

    async def test_a_queue_change_that_may_let_others_in_wakes_them(self, backend: Backend) -> None:
        a, b = await backend.make(), await backend.make()
        await b.publish_queue({"batch": 2}, {"batch": 5.0})
        woken = Woken(a)
        await b.publish_queue({"batch": 1}, {"batch": 7.0})  # its best request was admitted
        await woken.wait_for("batch")

    # -- the view ----------------------------------------------------------------------------

    async def test_queue_summaries_add_up_across_replicas(self, backend: Backend) -> None:
        a, b = await backend.make(), await backend.make()
        await a.publish_queue({"batch": 2, "interactive": 0}, {"batch": 5.0, "interactive": None},
                              {"batch": {"acme": 1, "zeta": 1}})
        await b.publish_queue({"batch": 3}, {"batch": 4.5}, {"batch": {"acme": 3}})
        await a.acquire("interactive", "i1", TWO)
        view = await b.view()
        assert view.queued == {"batch": 5}
        assert view.heads == {"batch": 4.5}
        assert view.tenants == {"batch": {"acme": 4, "zeta": 1}}
        assert inflight(view, "interactive") == 1
        assert view.replicas == 2
        assert not view.degraded

    async def test_a_fleet_that_restarts_resumes_from_its_stored_limit_while_it_is_fresh(
            self, backend: Backend) -> None:
        # A whole-fleet restart: the leader set 48 and is gone; a replica that starts (its proposal is
        # its starting value) takes the stored limit instead of writing its own start over it.
        a = await backend.make(ttl=TINY_TTL, queue_ttl=TINY_TTL)
        assert await a.agree_limit(48) == (48, True)
        await a.close()
        b = await backend.make(ttl=TINY_TTL, queue_ttl=TINY_TTL)

        async def took_over() -> bool:
            return await b.agree_limit(4, starting=True) == (48, True)

        await eventually(took_over)
        assert await b.agree_limit(50) == (50, True)  # from then on it leads with its own proposals
        # A replica that already moved (not starting) and finds no leader leads from its own proposal.
        await b.close()
        c = await backend.make(ttl=TINY_TTL, queue_ttl=TINY_TTL)

        async def c_leads() -> bool:
            return (await c.agree_limit(30))[1]

        await eventually(c_leads)
        assert await c.agree_limit(30) == (30, True)
        await c.close()

    async def test_a_stored_limit_too_old_to_trust_is_not_resumed(self, backend: Backend) -> None:
        a = await backend.make(ttl=TINY_TTL, queue_ttl=TINY_TTL, limit_ttl=TINY_TTL)
        assert await a.agree_limit(48) == (48, True)
        await a.close()
        b = await backend.make(ttl=TINY_TTL, queue_ttl=TINY_TTL, limit_ttl=TINY_TTL)
        await asyncio.sleep(TINY_TTL * 1.5)  # the leader and the limit it stored are gone

        async def leads() -> bool:
            return (await b.agree_limit(4, starting=True))[1]

        await eventually(leads)
        assert await b.agree_limit(4, starting=True) == (4, True)
        await b.close()

    async def test_one_fleet_limit_the_leader_sets_and_a_follower_takes_over(self, backend: Backend) -> None:
        # capacity.max_inflight: auto: every replica enforces the one limit the leading replica proposes.
        a = await backend.make(ttl=TINY_TTL, queue_ttl=TINY_TTL)
        b = await backend.make(ttl=TINY_TTL, queue_ttl=TINY_TTL)
        assert await a.agree_limit(40) == (40, True)
        assert await b.agree_limit(90) == (40, False)  # b follows: its proposal does not count
        assert await a.agree_limit(36) == (36, True)
        assert await b.agree_limit(36) == (36, False)

        async def took_over() -> bool:  # a stops calling: within its TTL b leads from its proposal
            return await b.agree_limit(37) == (37, True)

        await eventually(took_over)
        assert await a.agree_limit(50) == (37, False)  # a came back: it follows now

"""The in-process ledger: the default for a single replica.

How this works: a :class:`MemoryHub` holds the leases (per lane: member → expiry) and the
replicas' queue summaries; each :class:`MemoryLedger` is one replica's handle on it. In
production every process has its own hub, so the ledger only mirrors the local scheduler.
Several ledgers sharing one hub play several replicas in one process, which is how the
contract tests hold this implementation to the same rules as the Redis one: leases expire
unless renewed, lease members carry the replica id, summaries expire with the replica's
liveness mark, and every release or expiry wakes every ledger on the hub.

Time comes from the hub's clock (monotonic by default; an injected clock lets pure tests and
the simulator move time by hand).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from extproc.state import (
    ALL_LANES,
    LEASE_TTL,
    LIMIT_TTL,
    QUEUE_TTL,
    RANK_TOLERANCE,
    FreedCallback,
    GlobalView,
    Limits,
    SlotVerdict,
    outranked,
    summary_changes,
    wake,
)

#: Wakes every lane: a replica's queue vanished, so any lane may have room again.


@dataclass(slots=True)
class _Summary:
    queued: dict[str, int] = field(default_factory=dict)
    heads: dict[str, float | None] = field(default_factory=dict)
    tenants: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass(slots=True)
class _Lane:
    expiry: dict[str, float] = field(default_factory=dict)
    # (expiry, member), stale entries skipped when popped: renewals push, never search.
    heap: list[tuple[float, str]] = field(default_factory=list)

    def put(self, member: str, expiry: float) -> None:
        self.expiry[member] = expiry
        heapq.heappush(self.heap, (expiry, member))
        if len(self.heap) > 4 * len(self.expiry) + 64:
            self.heap = [(e, m) for m, e in self.expiry.items()]
            heapq.heapify(self.heap)

    def purge(self, now: float) -> int:
        purged = 0
        while self.heap and self.heap[0][0] <= now:
            expiry, member = heapq.heappop(self.heap)
            if self.expiry.get(member) == expiry:
                del self.expiry[member]
                purged += 1
        return purged


class MemoryHub:
    """What the ledgers of one process share."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.lanes: dict[str, _Lane] = {}
        self.alive: dict[str, float] = {}
        self.summaries: dict[str, _Summary] = {}
        self.members: list[MemoryLedger] = []
        #: The self-sizing fleet limit: who leads (and until when), and the limit it set.
        self.leader: tuple[str, float] | None = None
        self.limit: int | None = None
        self.limit_until = 0.0
        self.completed: dict[str, int] = {}
        """Completions per lane (what the fleet's drain rate is read from)."""

    def lane(self, name: str) -> _Lane:
        lane = self.lanes.get(name)
        if lane is None:
            lane = self.lanes[name] = _Lane()
        return lane

    def purge(self, now: float) -> None:
        """Drop expired leases and dead replicas' summaries, waking everyone for what that frees."""
        dead = [replica for replica, expiry in self.alive.items() if expiry <= now]
        for replica in dead:
            del self.alive[replica]
            self.summaries.pop(replica, None)
        if dead:
            self.publish(ALL_LANES)
        for name, lane in self.lanes.items():
            if lane.heap and lane.heap[0][0] <= now and lane.purge(now):
                self.publish(name)

    def waiting(self) -> bool:
        """Whether any replica has requests queued (only then does a release wake anyone)."""
        return any(summary.queued for summary in self.summaries.values())

    def queued(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for summary in self.summaries.values():
            for lane, n in summary.queued.items():
                total[lane] = total.get(lane, 0) + n
        return total

    def publish(self, lane: str) -> None:
        for member in self.members:
            member.deliver(lane)


class MemoryLedger:
    def __init__(self, hub: MemoryHub | None = None, *, ttl: float = LEASE_TTL,
                 queue_ttl: float = QUEUE_TTL, rank_tolerance: float = RANK_TOLERANCE,
                 renew: bool = True, replica: str | None = None, limit_ttl: float = LIMIT_TTL) -> None:
        """``renew=False``: no background renewal; the caller calls :meth:`renew` (virtual clocks)."""
        if not 0 < queue_ttl <= ttl:
            raise ValueError("need 0 < queue_ttl <= ttl")
        self.hub = hub or MemoryHub()
        self.replica = replica or uuid.uuid4().hex
        self.ttl = ttl
        self.queue_ttl = queue_ttl
        self.limit_ttl = limit_ttl
        self.rank_tolerance = rank_tolerance
        self._renew = renew
        self._held: dict[str, set[str]] = {}
        self._known: set[str] = set()
        self._summary = _Summary()
        self._callbacks: list[FreedCallback] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._renewer: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self not in self.hub.members:
            self.hub.members.append(self)
        self.hub.alive[self.replica] = self.hub.clock() + self.queue_ttl
        if self._renew:
            self._renewer = asyncio.create_task(self._renew_forever(), name=f"ledger-renew-{self.replica}")

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None
        for lane, leases in list(self._held.items()):
            for lease in list(leases):
                await self.release(lane, lease)
        self.hub.alive.pop(self.replica, None)
        if self.hub.summaries.pop(self.replica, None) is not None:
            self.hub.publish(ALL_LANES)
        if self in self.hub.members:
            self.hub.members.remove(self)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(min(self.ttl, self.queue_ttl) / 3)
            await self.renew()

    async def renew(self) -> None:
        """Extend every lease this replica holds and its liveness mark; purge what expired.

        A lease that expired meanwhile (the replica stalled past the TTL) is put back: its
        request still runs, and counting it is closer to the truth than not.
        """
        now = self.hub.clock()
        self.hub.alive[self.replica] = now + self.queue_ttl
        for lane, leases in self._held.items():
            store = self.hub.lane(lane)
            for lease in leases:
                store.put(self._member(lease), now + self.ttl)
        self.hub.purge(now)

    # -- the ledger -----------------------------------------------------------------------

    def _member(self, lease: str) -> str:
        return f"{self.replica}:{lease}"

    @property
    def held(self) -> dict[str, int]:
        """Leases this replica holds, per lane."""
        return {lane: len(leases) for lane, leases in self._held.items() if leases}

    async def acquire(self, lane: str, lease: str, limits: Limits, rank: float | None = None) -> SlotVerdict:
        limits.lane(lane)
        hub = self.hub
        now = hub.clock()
        hub.purge(now)
        self._known.update(other.name for other in limits.lanes)
        member = self._member(lease)
        store = hub.lane(lane)
        if member in store.expiry:
            store.put(member, now + self.ttl)
            return SlotVerdict.GRANTED
        inflight = {other.name: len(hub.lanes[other.name].expiry) for other in limits.lanes
                    if other.name in hub.lanes}
        verdict, free = limits.check(lane, inflight, hub.queued())
        if verdict and rank is not None:
            heads = [head for replica, summary in hub.summaries.items() if replica != self.replica
                     for head in (summary.heads.get(lane),) if head is not None]
            if outranked(rank, heads, self.rank_tolerance, free):
                verdict = SlotVerdict.OUTRANKED
        if verdict:
            store.put(member, now + self.ttl)
            self._held.setdefault(lane, set()).add(lease)
        return verdict

    async def release(self, lane: str, lease: str) -> None:
        leases = self._held.get(lane)
        if leases is not None:
            leases.discard(lease)
        store = self.hub.lanes.get(lane)
        freed = store is not None and store.expiry.pop(self._member(lease), None) is not None
        if freed:
            self.hub.completed[lane] = self.hub.completed.get(lane, 0) + 1
        if freed and self.hub.waiting():
            self.hub.publish(lane)

    async def publish_queue(self, queued: Mapping[str, int], heads: Mapping[str, float | None],
                            tenants: Mapping[str, Mapping[str, int]] | None = None) -> None:
        before = self._summary
        self._summary = _Summary(
            {lane: n for lane, n in queued.items() if n},
            {lane: h for lane, h in heads.items() if h is not None},
            {lane: {t: n for t, n in counts.items() if n} for lane, counts in (tenants or {}).items()},
        )
        self._known.update(queued)
        hub = self.hub
        hub.alive[self.replica] = hub.clock() + self.queue_ttl
        hub.summaries[self.replica] = self._summary
        after = self._summary
        for lane in summary_changes((before.queued, before.heads), (after.queued, after.heads)):
            hub.publish(lane)
        # As the Redis ledger does: a lane that starts queueing checks once for a slot at once.
        for lane in sorted(after.queued):
            if not before.queued.get(lane):
                self.deliver(lane)

    async def agree_limit(self, proposal: int, *, starting: bool = False) -> tuple[int, bool]:
        hub, now = self.hub, self.hub.clock()
        stored = hub.limit if hub.limit is not None and hub.limit_until > now else None
        if hub.leader is None or hub.leader[1] <= now or hub.leader[0] == self.replica:
            if starting and stored is not None and (hub.leader is None or hub.leader[0] != self.replica):
                proposal = stored  # no live leader: resume from the fleet's limit while it is fresh
            hub.leader = (self.replica, now + self.queue_ttl)
            hub.limit, hub.limit_until = proposal, now + self.limit_ttl
            return proposal, True
        return (stored if stored is not None else proposal), False

    async def view(self) -> GlobalView:
        hub = self.hub
        hub.purge(hub.clock())
        inflight = {name: len(lane.expiry) for name, lane in hub.lanes.items()}
        heads: dict[str, float] = {}
        tenants: dict[str, dict[str, int]] = {}
        for summary in hub.summaries.values():
            for lane, head in summary.heads.items():
                if head is not None and (lane not in heads or head < heads[lane]):
                    heads[lane] = head
            for lane, counts in summary.tenants.items():
                into = tenants.setdefault(lane, {})
                for tenant, n in counts.items():
                    into[tenant] = into.get(tenant, 0) + n
        return GlobalView(inflight, hub.queued(), heads, tenants, replicas=max(len(hub.alive), 1),
                          completed=dict(hub.completed))

    def alone(self, limits: Limits) -> Limits | None:
        return None  # one process's memory is never unreachable

    def on_freed(self, callback: FreedCallback) -> None:
        self._callbacks.append(callback)

    def deliver(self, lane: str) -> None:
        """Schedule this ledger's callbacks for ``lane`` (every known lane for a wake-all)."""
        wake(self._loop, self._callbacks, lane, self._known | set(self._held))

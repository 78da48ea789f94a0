"""The slot ledger: who holds which slot, and how much is queued where, across replicas.

How this works: every replica keeps its own queues and ordering (the scheduler in
``extproc.core.admission``); what replicas must share is the *ledger*. Right before a
replica lets a request start it asks the ledger for a slot (``acquire``); the ledger grants
it only if the lane's and the whole capacity's limits, counted over every replica, still
allow it — the same rule as the local scheduler, with the queued counts of all replicas —
and if no other live replica has a better-placed request waiting in that lane (by more than
a tolerance). A granted slot is a *lease*: it expires after a TTL unless the holder renews
it, so a replica that dies frees its slots on its own. ``release`` ends a lease and wakes
every replica (``on_freed``), which then retries its best waiting request.

Replicas also publish a queue summary (queued count and best rank per lane, per-tenant
counts) with a short TTL of its own, so a dead replica's queue soon stops counting.

Implementations: :class:`~extproc.state.memory.MemoryLedger` (one process; the default),
:class:`~extproc.state.redis.RedisLedger` (shared through Redis, atomic Lua scripts) and
:class:`~extproc.state.fallback.FallbackLedger` (Redis first, a local share of the limits
while Redis is unreachable). :func:`extproc.state.store.open_ledger` picks one from a store URL.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from extproc.policy.schema import Policy

#: Default lease lifetime (seconds): how long a dead replica's slots stay taken.
LEASE_TTL = 15.0
#: Default lifetime (seconds) of a replica's queue summary and liveness mark.
QUEUE_TTL = 3.0
#: Default lifetime (seconds) of the stored fleet limit (capacity.max_inflight: auto) after its leader last
#: wrote it: within it, a replica that finds no live leader (a whole-fleet restart, a scale-up from zero)
#: starts from the stored limit rather than from capacity.auto.start; past it, the engines may have changed.
LIMIT_TTL = 600.0
#: Default rank tolerance (seconds): how much better another replica's waiting request must be
#: before it blocks a grant. Ranks are epoch seconds from each replica's own clock, so this
#: covers clock skew between replicas (NTP keeps it to milliseconds); ``bench/redis_overhead.py``
#: measures what looser values cost in global order.
RANK_TOLERANCE = 0.01


class SlotVerdict(Enum):
    """What ``acquire`` answers. Only ``GRANTED`` is true, so ``if await ledger.acquire(...)`` reads well."""

    GRANTED = "granted"
    CAPACITY = "capacity"
    """All ``capacity`` slots are taken."""
    LANE_FULL = "lane_full"
    """The lane is at its ``max_inflight`` and may not borrow."""
    BORROW_LIMIT = "borrow_limit"
    """The lane already borrows ``max_borrow`` slots."""
    OWED = "owed"
    """Every free slot is owed to other lanes that have queued work (anywhere in the cluster)."""
    OUTRANKED = "outranked"
    """Other replicas have better-placed waiting requests for every slot this one could take."""
    UNAVAILABLE = "unavailable"
    """The shared store is unreachable and the ledger fails closed."""

    def __bool__(self) -> bool:
        return self is SlotVerdict.GRANTED


class LedgerUnavailable(Exception):
    """The shared store could not be reached (or answered with an error) in time."""


class StoreDown(LedgerUnavailable):
    """The store is known to be unreachable (an outage in progress, or not started): the call was not
    sent, so nothing of it ran (unlike a call that timed out, which may have)."""


class StoreScriptError(LedgerUnavailable):
    """One script failed on a store that is up (an error reply of that call alone): the call's answer
    is lost, as with an outage, but the store is not degraded and other calls go on."""

    def __init__(self, script: str, message: str) -> None:
        super().__init__(message)
        self.script = script


@dataclass(frozen=True, slots=True)
class LaneLimits:
    name: str
    max_inflight: int
    borrow: bool = False
    max_borrow: int | None = None
    """Cap on borrowed slots (None: as many as are free and not owed)."""


def fill(held: list[int], room: int) -> list[int]:
    """``held`` topped up with ``room`` more, always to the lowest first (water-filling); ties go
    to the earliest in the list. The result adds up to ``sum(held) + room``."""
    caps = list(held)
    while room > 0:
        low = min(caps)
        lows = [i for i, cap in enumerate(caps) if cap == low]
        above = min((cap for cap in caps if cap > low), default=None)
        step = room // len(lows) if above is None else min(above - low, room // len(lows))
        if step == 0:
            for i in lows[:room]:
                caps[i] += 1
            return caps
        for i in lows:
            caps[i] += step
        room -= step * len(lows)
    return caps


def _part(total: int, position: int, replicas: int) -> int:
    """``position``'s part when ``total`` is split between ``replicas``: the parts add up to ``total``."""
    return total // replicas + (1 if position < total % replicas else 0)


@dataclass(frozen=True, slots=True)
class Limits:
    """The limits a grant must respect, from the policy."""

    lanes: tuple[LaneLimits, ...]
    capacity: int

    def __post_init__(self) -> None:
        names = [lane.name for lane in self.lanes]
        if len(set(names)) != len(names):
            raise ValueError(f"lane names repeat: {names}")
        if self.capacity < 0 or any(lane.max_inflight < 0 for lane in self.lanes):
            raise ValueError("limits must not be negative")

    @classmethod
    def of(cls, policy: Policy, retired: Iterable[LaneLimits] = ()) -> Limits:
        """The policy's limits, plus lanes a reload removed that still finish their work."""
        lanes = tuple(LaneLimits(lane.name, lane.max_inflight, lane.borrow, lane.max_borrow)
                      for lane in policy.lanes)
        return cls(lanes + tuple(retired), policy.total_capacity)

    def lane(self, name: str) -> LaneLimits:
        for lane in self.lanes:
            if lane.name == name:
                return lane
        raise KeyError(name)

    def nothing(self) -> Limits:
        """The same lanes with no slot at all (a store failing closed grants nothing)."""
        return Limits(tuple(LaneLimits(lane.name, 0, lane.borrow, 0 if lane.borrow else None)
                            for lane in self.lanes), 0)

    def allotment(self, me: str, replicas: Iterable[str], held_by: Mapping[str, Mapping[str, int]]
                  ) -> Limits:
        """This replica's part of every limit when the live ``replicas`` go on without talking,
        from who held what when they last could (``held_by``: replica → lane → leases).

        Each live replica keeps what it holds, and the room left is filled up from the replica
        holding least (water-filling; ties to different replicas for different limits), so the
        parts add up to the limit — no two replicas can fill the same free slot — and a replica
        that held little is not starved by one that held much. Leases of replicas not alive (dead,
        not yet expired) still count against the limit; they get no part. A borrowing lane's
        borrowed room is split evenly.
        """
        live = sorted(set(replicas) | {me})
        n, position = len(live), live.index(me)

        def mine_of(values: Mapping[str, int], limit: int, rotate: int) -> int:
            order = live[rotate % n:] + live[:rotate % n]
            held = [values.get(replica, 0) for replica in order]
            counted = sum(values.values())  # including replicas that are not alive
            return fill(held, max(0, limit - counted))[order.index(me)]

        lanes = []
        for i, lane in enumerate(self.lanes):
            by_replica = {replica: per.get(lane.name, 0) for replica, per in held_by.items()}
            quota = mine_of(by_replica, lane.max_inflight, i)
            max_borrow = lane.max_borrow
            if lane.borrow and max_borrow is not None:
                total = sum(by_replica.values())
                ceiling = lane.max_inflight + max_borrow
                max_borrow = _part(max(0, ceiling - max(total, lane.max_inflight)), (position + i) % n, n)
            lanes.append(LaneLimits(lane.name, quota, lane.borrow, max_borrow))
        totals = {replica: sum(per.values()) for replica, per in held_by.items()}
        return Limits(tuple(lanes), mine_of(totals, self.capacity, len(self.lanes)))

    def share(self, position: int, replicas: int) -> Limits:
        """This replica's part of every limit when ``replicas`` split them without talking.

        Remainders go to different positions for different lanes, so each limit's parts add
        up to the limit exactly (a lane whose limit is smaller than the number of replicas is
        served by only some of them).
        """
        if replicas <= 1:
            return self
        lanes = tuple(
            LaneLimits(
                lane.name,
                _part(lane.max_inflight, (position + i) % replicas, replicas),
                lane.borrow,
                None if lane.max_borrow is None
                else _part(lane.max_borrow, (position + i) % replicas, replicas),
            )
            for i, lane in enumerate(self.lanes)
        )
        return Limits(lanes, _part(self.capacity, position, replicas))

    def smallest_part(self, replicas: int) -> Limits:
        """The smallest part of every limit when ``replicas`` split them (each rounded down): what a
        replica may take that does not know its place among them; the parts of any ``replicas``
        replicas, however they count, never add up to more than the limits."""
        if replicas <= 1:
            return self
        return Limits(tuple(LaneLimits(lane.name, lane.max_inflight // replicas, lane.borrow,
                                       None if lane.max_borrow is None else lane.max_borrow // replicas)
                            for lane in self.lanes), self.capacity // replicas)

    def check(self, lane: str, inflight: Mapping[str, int], queued: Mapping[str, int]
              ) -> tuple[SlotVerdict, int]:
        """Whether one more request of ``lane`` may start, and how many could (0 unless granted).

        The rule of ``Lanes.admits`` (core/lanes.py), over counts the caller supplies (the whole
        cluster's, or this replica's alone): under quota and a slot free; or, for a lane
        that may borrow (within ``max_borrow``), a slot free that no other lane with queued
        work is owed. The Lua script ``acquire.lua`` implements the same rule; the contract
        tests hold both to it.
        """
        config = self.lane(lane)
        total = sum(inflight.get(other.name, 0) for other in self.lanes)
        if total >= self.capacity:
            return SlotVerdict.CAPACITY, 0
        mine = inflight.get(lane, 0)
        if mine < config.max_inflight:
            return SlotVerdict.GRANTED, min(config.max_inflight - mine, self.capacity - total)
        if not config.borrow:
            return SlotVerdict.LANE_FULL, 0
        if config.max_borrow is not None and mine >= config.max_inflight + config.max_borrow:
            return SlotVerdict.BORROW_LIMIT, 0
        owed = 0
        for other in self.lanes:
            waiting = queued.get(other.name, 0)
            if other.name != lane and waiting:
                owed += min(waiting, max(0, other.max_inflight - inflight.get(other.name, 0)))
        free = self.capacity - total - owed
        if free <= 0:
            return SlotVerdict.OWED, 0
        if config.max_borrow is not None:
            free = min(free, config.max_inflight + config.max_borrow - mine)
        return SlotVerdict.GRANTED, free


def outranked(rank: float | None, heads: Iterable[float], tolerance: float, free: int) -> bool:
    """Whether other replicas' best waiting requests (``heads``) should have the ``free`` slots first.

    Each replica whose head ranks better than ``rank - tolerance`` claims at least one slot;
    only when they could claim all of them is the request refused. Refusing on fewer would
    leave slots idle that nobody better is waiting for.
    """
    if rank is None:
        return False
    bar = rank - tolerance
    return sum(1 for head in heads if head < bar) >= free


@dataclass(frozen=True)
class GlobalView:
    """The cluster as one replica last saw it."""

    inflight: Mapping[str, int]
    """Leases held per lane, over every replica."""
    queued: Mapping[str, int]
    """Queued requests per lane, over every live replica."""
    heads: Mapping[str, float]
    """Best rank waiting per lane, over every live replica (lanes with nothing queued are absent)."""
    tenants: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    """Queued requests per lane and tenant, over every live replica."""
    replicas: int = 1
    """Live replicas (those that renewed their liveness mark within the queue TTL)."""
    degraded: bool = False
    """The shared store is unreachable: counts are this replica's alone."""
    reason: str | None = None
    held_by: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    """Leases per replica and lane (what the outage fallback divides the limits by)."""
    completed: Mapping[str, int] = field(default_factory=dict)
    """Requests completed per lane over every replica since the store started (counters: the
    fleet's drain rate is their change over time). Empty while the store is unreachable."""


@dataclass(frozen=True, slots=True)
class BucketOp:
    """One operation on a shared tenant bucket (the arithmetic is ``extproc.core.budget.Budget``'s).

    ``op``: ``check`` (is ``amount`` there?), ``take`` (all or nothing; only checks when an earlier
    operation of the same call was refused) or ``charge`` (whatever the level; may go into debt).
    """

    key: str
    """The bucket's name in the store (``<kind>:<tenant>``)."""
    op: str
    per_second: float
    burst: float
    amount: float


@dataclass(frozen=True, slots=True)
class Level:
    """A shared bucket after one operation."""

    allowed: bool
    level: float


class BudgetStore(Protocol):
    """Fleet-wide tenant buckets and retry-budget counts. Every call raises ``LedgerUnavailable`` at
    once while the store is unreachable; the caller then decides alone (``fail_open``: with its
    part, ``1 / parts``, of each budget; otherwise refusing)."""

    @property
    def fail_open(self) -> bool: ...

    @property
    def fleet_size(self) -> int: ...

    @property
    def parts(self) -> int:
        """Into how many parts budgets are split while the store is unreachable: the same count the
        slot ledger splits its limits by (replicas seen alive, at least ``fleet_size``)."""
        ...

    async def buckets(self, ops: Sequence[BucketOp], now: float | None = None) -> list[Level]:
        """Apply ``ops`` in order, atomically; ``now`` (seconds) for tests, else the store's clock."""
        ...

    async def retry_counts(self, deposits: int, withdrawals: int, window_s: float, slots: int
                           ) -> tuple[int, int]:
        """Add this replica's new deposits and withdrawals; the *other* replicas' counts in the window."""
        ...

    async def served(self, work: Mapping[tuple[str, str], float],
                     queued: Iterable[tuple[str, str]] = ()) -> dict[tuple[str, str], float]:
        """Add the work this replica served since its last call (predicted seconds by lane and
        tenant); the work the *other* replicas served meanwhile for the ``queued`` (lane, tenant)
        pairs (those this replica has waiting: the fair queues' shared part). A pair read for the
        first time, or again after a gap, is a baseline: nothing to charge yet."""
        ...


FreedCallback = Callable[[str], None]
#: The lane name of a wake-up for every lane.
ALL_LANES = "*"


def wake(loop: asyncio.AbstractEventLoop | None, callbacks: Iterable[FreedCallback], lane: str,
         known: Iterable[str]) -> None:
    """Schedule ``callbacks`` for ``lane`` on ``loop`` (for every ``known`` lane when ``lane`` is ``*``)."""
    if loop is None or loop.is_closed():
        return
    lanes = sorted(set(known)) if lane == ALL_LANES else [lane]
    for name in lanes:
        for callback in callbacks:
            loop.call_soon(callback, name)


class Ledger(Protocol):
    """The port the controller uses; see the module docstring."""

    @property
    def replica(self) -> str:
        """Unique per process start, so a restarted replica never reuses its predecessor's leases."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None:
        """Stop renewing; give back every lease still held and withdraw the queue summary."""
        ...

    async def acquire(self, lane: str, lease: str, limits: Limits, rank: float | None = None) -> SlotVerdict:
        """Take one slot of ``lane`` for ``lease`` (atomically checked against ``limits``).

        Acquiring a lease already held renews it and grants again (it never counts twice).
        ``rank`` (the queue's rank: epoch seconds, smaller is better) enables the global-order
        check. Raises ``KeyError`` for a lane ``limits`` does not have.
        """
        ...

    async def release(self, lane: str, lease: str) -> None:
        """End a lease (idempotent) and wake every replica."""
        ...

    async def publish_queue(self, queued: Mapping[str, int], heads: Mapping[str, float | None],
                            tenants: Mapping[str, Mapping[str, int]] | None = None) -> None:
        """Replace this replica's queue summary.

        Publish only heads this replica will try to admit when woken (not a paused lane's):
        a head blocks other replicas' grants in its lane.
        """
        ...

    async def view(self) -> GlobalView: ...

    async def agree_limit(self, proposal: int, *, starting: bool = False) -> tuple[int, bool]:
        """One self-sized fleet limit for every replica: ``(the fleet limit, whether this replica leads)``.

        The leading replica's ``proposal`` becomes the fleet limit; a replica leads while it keeps
        calling within the queue TTL, and when it stops another takes over. Followers adopt the
        limit (so a new leader continues from it). ``starting``: the proposal is this replica's
        starting value, not a limit it found: taking over with no live leader, it adopts the stored
        limit if one was written within ``limit_ttl`` (a whole-fleet restart resumes where the fleet
        was), else its proposal. Raises ``LedgerUnavailable`` when the store cannot be reached (the
        fallback ledger answers from what was last agreed).
        """
        ...

    def on_freed(self, callback: FreedCallback) -> None:
        """Call ``callback(lane)`` on the event loop whenever a slot of ``lane`` may have freed."""
        ...

    def alone(self, limits: Limits) -> Limits | None:
        """While the store is unreachable: the limits this replica may fill on its own (its share
        failing open, nothing failing closed). None while the store answers."""
        ...


def summary_changes(before: tuple[Mapping[str, int], Mapping[str, float | None]],
                    after: tuple[Mapping[str, int], Mapping[str, float | None]]) -> list[str]:
    """Lanes where a new queue summary may let another replica in: fewer queued, or a worse head."""
    (queued0, heads0), (queued1, heads1) = before, after
    lanes = []
    for lane in sorted(set(queued0) | set(heads0)):
        head0, head1 = heads0.get(lane), heads1.get(lane)
        worse_head = head0 is not None and (head1 is None or head1 > head0)
        if worse_head or queued1.get(lane, 0) < queued0.get(lane, 0):
            lanes.append(lane)
    return lanes

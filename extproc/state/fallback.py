"""Redis first; this replica's share of the limits while Redis is unreachable.

How this works: every call goes to the :class:`~extproc.state.redis.RedisLedger` until one
fails (connection refused, a timeout — 50 ms by default — or a Redis error), from the
foreground or from its background heartbeat. The ledger is then *degraded*: calls no longer
touch Redis, so decisions never wait on it.

* ``fail_open``: grant within this replica's allotment of every limit (``Limits.allotment``):
  every replica alive when Redis last answered keeps what it held then and gets an equal part
  of the room that was left, so the parts add up to the limits and replicas that lose Redis
  together stay within them, whoever held more than an even share. The allotment is fixed when
  the outage begins, from the last view of who held what (refreshed every sync, ~0.2 s): only
  grants in that last fraction of a second before the outage can slip past it. A replica that
  never saw Redis splits the limits evenly.
* ``fail_closed``: refuse every new lease (``SlotVerdict.UNAVAILABLE``); held leases stay held.

Releases are recorded locally and wake this replica's own waiters. A background probe retries
Redis every ``retry_interval``; when it answers, the probe re-registers every lease this
replica still holds (fresh expiry), removes those it released or acquired in doubt meanwhile,
and repeats until no grant or release slipped in between — only then does the ledger leave
degraded mode and wake every lane. Redis then holds exactly the leases running here: nothing
leaks and nothing counts twice.

During the overlap: if every replica lost Redis, the leases they re-register add up to at
most the limits (each kept to its share). If only some did (a partition), the others kept
granting up to the full limits through Redis, so after reconciling a lane can be over its
limit by up to the degraded replicas' shares; Redis then refuses new grants in that lane until
enough of those requests end. Nothing running is cut short.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import structlog

from extproc.state import (
    ALL_LANES,
    BucketOp,
    FreedCallback,
    GlobalView,
    LedgerUnavailable,
    Level,
    Limits,
    SlotVerdict,
    StoreDown,
)
from extproc.state.redis import RedisLedger

log = structlog.get_logger("extproc")


class FailMode(Enum):
    OPEN = "fail_open"
    CLOSED = "fail_closed"


@dataclass(frozen=True, slots=True)
class Health:
    """For metrics and ``/readyz``."""

    degraded: bool
    reason: str | None
    since: float | None
    """Epoch seconds when the current outage began."""
    outages: int
    """Outages since start."""
    local_grants: int
    """Leases granted without Redis since start."""
    subscribed: bool
    """Whether the wake-up subscription is up (when not, waiters are woken every second instead)."""


class FallbackLedger:
    def __init__(self, primary: RedisLedger, *, mode: FailMode = FailMode.OPEN,
                 retry_interval: float = 0.5, fleet_size: int = 1) -> None:
        self.primary = primary
        self.mode = mode
        #: How many replicas the operator runs: while this replica has seen fewer (it started while
        #: Redis was down, or Redis restarted empty), its share is the smallest of this many parts.
        self.fleet_size = max(1, fleet_size)
        self.retry_interval = retry_interval
        self.degraded = False
        self.reason: str | None = None
        self.since: float | None = None
        self.outages = 0
        self.local_grants = 0
        self._callbacks: list[FreedCallback] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._probe: asyncio.Task[None] | None = None
        self._closing = False
        #: Until then (monotonic) grants after an outage also respect this replica's share: replicas
        #: that lost Redis too have not all put their leases back yet, so Redis alone undercounts.
        self._settling_until = 0.0
        #: When each replica was last seen alive (monotonic), for this replica's share in an outage.
        self._seen: dict[str, float] = {}
        #: Who held what (replica → lane → leases) as last read from Redis.
        self._held_by: dict[str, dict[str, int]] = {}
        #: The replicas and holdings an outage's allotment is computed from, fixed when it began.
        self._frozen: tuple[tuple[str, ...], dict[str, dict[str, int]]] | None = None
        #: The fleet limit as last agreed through Redis (capacity.max_inflight: auto).
        self._agreed: int | None = None
        primary.on_failure(self._down)

    @property
    def replica(self) -> str:
        return self.primary.replica

    def health(self) -> Health:
        return Health(self.degraded, self.reason, self.since, self.outages, self.local_grants,
                      self.primary.subscribed)

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Never fails for Redis: if it does not answer, start degraded and keep trying."""
        self._loop = asyncio.get_running_loop()
        with contextlib.suppress(LedgerUnavailable):
            await self.primary.start()

    async def close(self) -> None:
        self._closing = True
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.wait([self._probe], timeout=1.0)
            self._probe = None
        await self.primary.close()

    def _down(self, reason: str) -> None:
        self.reason = reason
        if self.degraded:
            return
        self.degraded = True
        self.since = time.time()
        self.outages += 1
        self._freeze()
        # Whatever the fleet serves meanwhile must not be charged at once when the store is back.
        self.primary.forget_served()
        log.warning("ledger_degraded", reason=reason, mode=self.mode.value, replicas=len(self.primary.alive))
        if self._loop is not None and not self._loop.is_closed() and not self._closing:
            self._probe = self._loop.create_task(self._recover(), name=f"ledger-recover-{self.replica}")

    async def _recover(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.retry_interval)
            try:
                await self.primary.restore()
            except LedgerUnavailable:
                continue  # _down has recorded the reason
            outage = time.time() - (self.since or time.time())
            self.degraded, self.reason, self.since = False, None, None
            # Every live replica heartbeats (and re-registers its leases) within the queue TTL.
            self._settling_until = time.monotonic() + self.primary.queue_ttl
            log.info("ledger_recovered", outage_s=round(outage, 3), held=sum(self.primary.held.values()))
            self.primary.deliver(ALL_LANES)
            return

    # -- the ledger -----------------------------------------------------------------------

    def _note_alive(self) -> None:
        now = time.monotonic()
        for replica in self.primary.alive:
            self._seen[replica] = now

    def _freeze(self) -> None:
        """Fix what this outage's allotment is computed from: the replicas seen alive lately and who
        held what as last seen, with this replica's own holdings as they are now (exact)."""
        horizon = time.monotonic() - 3 * self.primary.queue_ttl
        recent = {replica for replica, seen in self._seen.items() if seen >= horizon}
        replicas = tuple(sorted(set(self.primary.alive) | recent | {self.replica}))
        held_by = {replica: dict(per) for replica, per in self._held_by.items() if replica != self.replica}
        held_by[self.replica] = dict(self.primary.held)
        self._frozen = (replicas, held_by) if self._held_by else None

    def _everyone(self) -> list[str]:
        # Every replica seen alive lately, not only in the last answer: right after Redis restarts
        # empty, its liveness set lists only the replicas that have reconnected so far.
        horizon = time.monotonic() - 3 * self.primary.queue_ttl
        recent = {replica for replica, seen in self._seen.items() if seen >= horizon}
        return sorted(set(self.primary.alive) | recent | {self.replica})

    @property
    def parts(self) -> int:
        """Into how many parts the fleet's limits are split while the store is away: the replicas
        counted for the slots' share (those alive when the outage began, or seen lately), and never
        fewer than ``fleet_size``. Tenant budgets and the retry floor are split the same way, so
        that the replicas' parts add up to no more than the fleet's budget."""
        if self.degraded and self._frozen is not None:
            counted = len(self._frozen[0])
        else:
            counted = len(self._everyone())
        return max(counted, self.fleet_size)

    def _share(self, limits: Limits) -> Limits:
        if self._frozen is not None:
            replicas, held_by = self._frozen
            return limits.allotment(self.replica, replicas, held_by)
        everyone = self._everyone()
        if len(everyone) < self.fleet_size:
            # Replicas it has not seen may be running: the smallest part, so that the parts of every
            # replica, however they count, never add up to more than the limits.
            return limits.smallest_part(self.fleet_size)
        return limits.share(everyone.index(self.replica), len(everyone))

    async def acquire(self, lane: str, lease: str, limits: Limits, rank: float | None = None) -> SlotVerdict:
        if not self.degraded:
            if self._settling_until and time.monotonic() < self._settling_until \
                    and not self.primary.holds(lane, lease):
                queued, _, _ = self.primary.queue
                verdict, _ = self._share(limits).check(lane, self.primary.held, queued)
                if not verdict:
                    return verdict
            with contextlib.suppress(LedgerUnavailable):
                return await self.primary.acquire(lane, lease, limits, rank)
        limits.lane(lane)
        if self.primary.holds(lane, lease):
            return SlotVerdict.GRANTED
        if self.mode is FailMode.CLOSED:
            return SlotVerdict.UNAVAILABLE
        queued, _, _ = self.primary.queue
        verdict, _ = self._share(limits).check(lane, self.primary.held, queued)
        if verdict:
            self.primary.hold(lane, lease)
            self.local_grants += 1
        return verdict

    async def release(self, lane: str, lease: str) -> None:
        if not self.degraded:
            try:
                await self.primary.release(lane, lease)
                return
            except LedgerUnavailable:
                pass  # recorded as pending by the primary
        else:
            self.primary.drop(lane, lease)
        self._wake(lane)

    async def publish_queue(self, queued: Mapping[str, int], heads: Mapping[str, float | None],
                            tenants: Mapping[str, Mapping[str, int]] | None = None) -> None:
        if self.degraded:
            self.primary.set_queue(queued, heads, tenants)
            return
        with contextlib.suppress(LedgerUnavailable):
            await self.primary.publish_queue(queued, heads, tenants)

    async def agree_limit(self, proposal: int, *, starting: bool = False) -> tuple[int, bool]:
        """Through Redis; while it is unreachable, the last agreed limit or a smaller proposal
        (each replica may still fall on its own engines' signals, never grow past what was agreed)."""
        if not self.degraded:
            with contextlib.suppress(LedgerUnavailable):
                self._agreed, leads = await self.primary.agree_limit(proposal, starting=starting)
                return self._agreed, leads
        return (proposal if self._agreed is None else min(self._agreed, proposal)), False

    async def view(self) -> GlobalView:
        if not self.degraded:
            with contextlib.suppress(LedgerUnavailable):
                view = await self.primary.view()
                self._note_alive()
                if not (self._settling_until and time.monotonic() < self._settling_until):
                    self._held_by = {replica: dict(per) for replica, per in view.held_by.items()}
                return view
        queued, heads, tenants = self.primary.queue
        return GlobalView(self.primary.held, queued, heads, tenants, replicas=max(len(self.primary.alive), 1),
                          degraded=True, reason=self.reason)

    # -- fleet-wide budgets: through Redis, or LedgerUnavailable at once while it is away ----------

    @property
    def fail_open(self) -> bool:
        return self.mode is FailMode.OPEN

    async def buckets(self, ops: Sequence[BucketOp], now: float | None = None) -> list[Level]:
        if self.degraded:
            raise StoreDown(self.reason or "redis unavailable")
        return await self.primary.buckets(ops, now)

    async def retry_counts(self, deposits: int, withdrawals: int, window_s: float, slots: int
                           ) -> tuple[int, int]:
        if self.degraded:
            raise StoreDown(self.reason or "redis unavailable")
        return await self.primary.retry_counts(deposits, withdrawals, window_s, slots)

    async def served(self, work: Mapping[tuple[str, str], float],
                     queued: Iterable[tuple[str, str]] = ()) -> dict[tuple[str, str], float]:
        if self.degraded:
            raise StoreDown(self.reason or "redis unavailable")
        return await self.primary.served(work, queued)

    def alone(self, limits: Limits) -> Limits | None:
        if not self.degraded:
            return None
        return limits.nothing() if self.mode is FailMode.CLOSED else self._share(limits)

    def on_freed(self, callback: FreedCallback) -> None:
        self._callbacks.append(callback)
        self.primary.on_freed(callback)

    def on_script_error(self, callback: Callable[[str], None]) -> None:
        self.primary.on_script_error(callback)

    def _wake(self, lane: str) -> None:
        if self._loop is None or self._loop.is_closed():
            return
        for callback in self._callbacks:
            self._loop.call_soon(callback, lane)

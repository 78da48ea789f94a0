"""Redis first; this replica's share of the limits while Redis is unreachable.

How this works: every call goes to the :class:`~extproc.state.redis.RedisLedger` until one
fails (connection refused, a timeout — 50 ms by default — or a Redis error), from the
foreground or from its background heartbeat. The ledger is then *degraded*: calls no longer
touch Redis, so decisions never wait on it.

* ``fail_open``: grant within this replica's share of every limit — the limits split between
  the replicas that were alive when Redis last answered (``Limits.share``: the parts add up to
  the limits, so replicas that lose Redis together stay within them). The leases this replica
  already held count against its share.
* ``fail_closed``: refuse every new lease (``Verdict.UNAVAILABLE``); held leases stay held.

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
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import structlog

from extproc.state import ALL_LANES, FreedCallback, GlobalView, LedgerUnavailable, Limits, Verdict
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
                 retry_interval: float = 0.5) -> None:
        self.primary = primary
        self.mode = mode
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

    def _share(self, limits: Limits) -> Limits:
        # Every replica seen alive lately, not only in the last answer: right after Redis restarts
        # empty, its liveness set lists only the replicas that have reconnected so far.
        horizon = time.monotonic() - 3 * self.primary.queue_ttl
        recent = {replica for replica, seen in self._seen.items() if seen >= horizon}
        replicas = sorted(set(self.primary.alive) | recent | {self.replica})
        return limits.share(replicas.index(self.replica), len(replicas))

    async def acquire(self, lane: str, lease: str, limits: Limits, rank: float | None = None) -> Verdict:
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
            return Verdict.GRANTED
        if self.mode is FailMode.CLOSED:
            return Verdict.UNAVAILABLE
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

    async def view(self) -> GlobalView:
        if not self.degraded:
            with contextlib.suppress(LedgerUnavailable):
                view = await self.primary.view()
                self._note_alive()
                return view
        queued, heads, tenants = self.primary.queue
        return GlobalView(self.primary.held, queued, heads, tenants, replicas=max(len(self.primary.alive), 1),
                          degraded=True, reason=self.reason)

    def on_freed(self, callback: FreedCallback) -> None:
        self._callbacks.append(callback)
        self.primary.on_freed(callback)

    def _wake(self, lane: str) -> None:
        if self._loop is None or self._loop.is_closed():
            return
        for callback in self._callbacks:
            self._loop.call_soon(callback, lane)

"""The ledger in Redis: exact limits across replicas, leases with a TTL, wake-ups by pub/sub.

How this works: every decision is one Lua script (``acquire.lua``, ``release.lua``), so the
check and the grant are atomic on the server whatever the number of replicas. Keys, all
under one hash tag ``{prefix}`` (one Redis Cluster slot), every one declared to the scripts:

* ``{prefix}:lease:<lane>`` — sorted set, member ``<replica>:<lease>``, score = expiry (ms,
  Redis server time, so replica clocks do not matter). Expired members are purged by every
  script that counts them. The replica id in the member means a restarted replica (new id)
  never adopts or double-counts its predecessor's leases: those just expire.
* ``{prefix}:alive`` — sorted set, replica → expiry of its liveness mark (``queue_ttl``).
* ``{prefix}:queues`` — hash, ``<replica>`` → ``{"q": {lane: queued}, "h": {lane: best rank}}``,
  ``<replica>|t`` → ``{lane: {tenant: queued}}``; present only while the replica has requests
  queued, dropped with its liveness mark.
* ``{prefix}:lanes`` — set of lane names (so ``view`` knows which lease keys to read).
* ``{prefix}:budget:…``, ``{prefix}:retry``, ``{prefix}:served`` — the fleet-wide budgets
  (:mod:`extproc.state.redis_budgets`).
* channel ``{prefix}:freed`` — a lane name when a slot of it may have freed, ``*`` for all
  (:mod:`extproc.state.redis_wakeups`). A release publishes only while some replica has
  requests queued (nobody else needs it).

A background heartbeat (every ``min(ttl, queue_ttl) / 3``) renews this replica's liveness
mark, queue summary and leases, and purges what expired, so a dead replica's slots free
within ``ttl`` even when nobody acquires. The heartbeat puts back any held lease Redis lost
(Redis restarted, or the replica stalled past the TTL) and reports what it put back; a lease
released meanwhile is then removed again, so a release racing a heartbeat cannot leak.

:class:`RedisLedger` is made of parts with one job each: the connections, which share
pipelined round trips under load and fail fast during an outage (:mod:`extproc.state.redis_link`,
where the supported store URLs are too); this replica's own leases and queue summary, kept
without I/O (:class:`~extproc.state.book.LocalBook`); the budgets; the wake-ups. Errors and
timeouts (``timeout``, 50 ms by default: the decision path must not hang) raise
:class:`~extproc.state.LedgerUnavailable`, and so does every later call at once, without
waiting on Redis, until the heartbeat gets through again; ``FallbackLedger`` turns them into
degraded mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from extproc.state import (
    LEASE_TTL,
    LIMIT_TTL,
    QUEUE_TTL,
    RANK_TOLERANCE,
    BucketOp,
    FreedCallback,
    GlobalView,
    LedgerUnavailable,
    Level,
    Limits,
    SlotVerdict,
)
from extproc.state.book import LocalBook
from extproc.state.redis_budgets import RedisBudgets
from extproc.state.redis_link import RedisLink, Target, parse_url
from extproc.state.redis_wakeups import RedisWakeups

__all__ = ["RedisLedger", "Target", "parse_url"]

#: Every script the ledger and its budgets run (``<name>.lua`` beside this module).
_SCRIPTS = ("acquire", "release", "heartbeat", "queue", "view", "limit", "bucket", "retry", "served")


def _global_view(lanes: Sequence[str], replicas: int, counts: Sequence[Any], summaries: Sequence[Any],
                 tenant_summaries: Sequence[Any], holders: Sequence[Any], done: Sequence[Any]) -> GlobalView:
    """``view.lua``'s answer for ``lanes``, summed over the ``replicas`` live replicas."""
    queued: dict[str, int] = {}
    heads: dict[str, float] = {}
    tenants: dict[str, dict[str, int]] = {}
    for raw in summaries:
        if not raw:
            continue
        summary = json.loads(raw)
        for lane, n in summary.get("q", {}).items():
            queued[lane] = queued.get(lane, 0) + int(n)
        for lane, head in summary.get("h", {}).items():
            if lane not in heads or head < heads[lane]:
                heads[lane] = float(head)
    for raw in tenant_summaries:
        for lane, per in (json.loads(raw) if raw else {}).items():
            into = tenants.setdefault(lane, {})
            for tenant, n in per.items():
                into[tenant] = into.get(tenant, 0) + int(n)
    inflight = {lane: int(n) for lane, n in zip(lanes, counts, strict=True)}
    held_by: dict[str, dict[str, int]] = {}
    for lane, flat in zip(lanes, holders, strict=True):
        for replica, n in zip(flat[::2], flat[1::2], strict=True):
            held_by.setdefault(str(replica), {})[lane] = int(n)
    completed = {str(lane): int(n) for lane, n in zip(done[::2], done[1::2], strict=True)}
    return GlobalView(inflight, queued, heads, tenants, replicas=max(replicas, 1), held_by=held_by,
                      completed=completed)


class RedisLedger:
    """The slot ledger in Redis (see the module docstring), with the fleet-wide budgets beside it."""

    def __init__(self, url: str, *, prefix: str = "extproc", ttl: float = LEASE_TTL,
                 queue_ttl: float = QUEUE_TTL, rank_tolerance: float = RANK_TOLERANCE,
                 timeout: float = 0.05, connect_timeout: float | None = None, pool_size: int = 8,
                 renew: bool = True, replica: str | None = None, limit_ttl: float = LIMIT_TTL) -> None:
        """``timeout`` bounds every socket read (so a decision never hangs on Redis);
        ``connect_timeout`` (default: ``timeout``, at least 0.25 s) bounds opening a connection:
        connections are opened rarely, but a burst opens several at once on a busy event loop,
        where a too-short timer fires before the loop gets to the answer. At most ``pool_size``
        calls run at once, each on its own connection (Redis runs scripts one at a time: more
        buy nothing); the others wait their turn in order.
        ``renew=False``: no background heartbeat (the caller calls :meth:`renew`)."""
        if not 0 < queue_ttl <= ttl:
            raise ValueError("need 0 < queue_ttl <= ttl")
        if any(c in prefix for c in "{}"):
            raise ValueError(f"prefix {prefix!r}: braces are reserved for the hash tag")
        self.link = RedisLink(parse_url(url), timeout=timeout, pool_size=pool_size,
                              connect_timeout=connect_timeout if connect_timeout is not None
                              else max(timeout, 0.25))
        self.replica = replica or uuid.uuid4().hex
        self.ttl = ttl
        self.queue_ttl = queue_ttl
        self.rank_tolerance = rank_tolerance
        self._renew = renew
        tag = "{" + prefix + "}"
        self._tag = tag
        self._alive_key = f"{tag}:alive"
        self._queues_key = f"{tag}:queues"
        self._lanes_key = f"{tag}:lanes"
        self._leader_key = f"{tag}:limit:leader"
        self._limit_key = f"{tag}:limit"
        self._done_key = f"{tag}:done"
        self.channel = f"{tag}:freed"
        self._ttl_ms = str(max(int(ttl * 1000), 1))
        self._queue_ttl_ms = str(max(int(queue_ttl * 1000), 1))
        self._limit_ttl_ms = str(max(int(limit_ttl * 1000), 1))

        self.book = LocalBook()
        self.budgets = RedisBudgets(self.link, tag, self.replica)
        self.wakeups = RedisWakeups(self.link, self.channel, self.book.lanes)
        self._sent_queued: dict[str, int] = {}
        self._publish_lock = asyncio.Lock()
        self._encoded: dict[Limits, tuple[list[bytes], bytes, dict[str, bytes]]] = {}
        self.alive: tuple[str, ...] = ()
        """Live replicas as of the last heartbeat or view."""
        self.readded = 0
        """Held leases the heartbeat had to put back (Redis lost them)."""
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    # -- the parts' state, as callers read it -----------------------------------------------

    @property
    def healthy(self) -> bool:
        """False from a failed call until a call gets through again."""
        return self.link.healthy

    @property
    def script_errors(self) -> int:
        """Calls that failed with an error reply while the store was up (not outages)."""
        return self.link.script_errors

    @property
    def subscribed(self) -> bool:
        """Whether the wake-up subscription is up."""
        return self.wakeups.subscribed

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and register; raises ``LedgerUnavailable`` if Redis does not answer (the
        background tasks keep trying)."""
        self.wakeups.loop = asyncio.get_running_loop()
        self.link.start(_SCRIPTS)
        self._tasks.append(asyncio.create_task(self.wakeups.listen(), name=f"ledger-listen-{self.replica}"))
        if self._renew:
            self._tasks.append(asyncio.create_task(self._renew_forever(),
                                                   name=f"ledger-renew-{self.replica}"))
        await self.renew()

    async def close(self) -> None:
        self._closing = True
        self.wakeups.stop()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=1.0)
        self._tasks.clear()
        await self.link.flush()  # calls already queued get their answers
        if not self.link.connected:
            return
        self.book.drop_all()
        # Redis gone: the leases expire on their own within the TTL.
        with contextlib.suppress(LedgerUnavailable):
            await self.renew(leave=True)
        await self.link.close()

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` whenever a Redis call fails (foreground or background)."""
        self.link.on_failure(callback)

    def on_script_error(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(script)`` whenever a call gets an error reply from a store that is up."""
        self.link.on_script_error(callback)

    # -- heartbeat ------------------------------------------------------------------------

    async def _renew_forever(self) -> None:
        while not self._closing:
            await asyncio.sleep(min(self.ttl, self.queue_ttl) / 3)
            with contextlib.suppress(LedgerUnavailable):
                await self.renew()

    def _member(self, lease: str) -> str:
        return f"{self.replica}:{lease}"

    async def renew(self, leave: bool = False) -> None:
        """One heartbeat: see the module docstring. ``leave``: withdraw this replica instead."""
        book = self.book
        lanes = book.every_lane()
        drops = {lane: book.pending(lane) for lane in lanes}
        plan = {
            "lanes": lanes,
            "hold": [[self._member(lease) for lease in book.leases(lane)] for lane in lanes],
            "drop": [[self._member(lease) for lease in drops[lane]] for lane in lanes],
        }
        keys = [self._alive_key, self._queues_key, self._lanes_key, *map(self._lease_key, lanes)]
        replicas, readded = await self.link.run("heartbeat", keys, [
            self.replica, self._ttl_ms, self._queue_ttl_ms, self.channel, book.summary, book.tenants,
            json.dumps(plan), "1" if leave else "0"], probe=True)
        self.alive = tuple(replicas)
        book.removed(drops)
        prefix = len(self.replica) + 1
        for item in readded:
            index, _, member = item.partition(":")
            lane = lanes[int(index) - 1]
            lease = member[prefix:]
            self.readded += 1
            if not book.holds(lane, lease):
                # Released while the heartbeat was on its way: its ZREM ran first.
                try:
                    await self.link.run("release", [self._lease_key(lane), self._queues_key, self._done_key],
                                        [member, self.channel, lane, "0"], probe=True)
                except LedgerUnavailable:
                    book.doubt(lane, lease)
                    raise

    async def restore(self) -> None:
        """Put every held lease back and drop every pending one, until nothing changed meanwhile.

        The caller (the outage fallback) keeps granting locally while this runs; a heartbeat that
        went through with no grant or release in between means Redis now holds exactly this
        replica's leases. Under a steady stream of local grants that may never happen, so after
        a few rounds the rest is left to the next heartbeat (within a second), which registers
        every held lease and drops every pending one anyway.
        """
        for _ in range(3):
            version = self.book.version
            await self.renew()
            if version == self.book.version:
                return

    # -- local bookkeeping (no I/O; the fallback uses these while Redis is away) -----------

    def hold(self, lane: str, lease: str) -> None:
        """Record a lease granted without Redis; the next heartbeat registers it."""
        self.book.hold(lane, lease)

    def drop(self, lane: str, lease: str) -> None:
        """Forget a lease without telling Redis yet; the next heartbeat removes it there."""
        self.book.drop(lane, lease)

    @property
    def held(self) -> dict[str, int]:
        """Leases this replica holds, per lane."""
        return self.book.held

    def holds(self, lane: str, lease: str) -> bool:
        return self.book.holds(lane, lease)

    @property
    def queue(self) -> tuple[dict[str, int], dict[str, float], dict[str, dict[str, int]]]:
        """This replica's own queue summary as last set: queued, heads, tenants per lane."""
        return self.book.queue

    def set_queue(self, queued: Mapping[str, int], heads: Mapping[str, float | None],
                  tenants: Mapping[str, Mapping[str, int]] | None = None) -> None:
        """Record this replica's queue summary; the next publish or heartbeat sends it."""
        self.book.set_queue(queued, heads, tenants)

    # -- the ledger -----------------------------------------------------------------------

    def _lease_key(self, lane: str) -> str:
        return f"{self._tag}:lease:{lane}"

    def _encode(self, limits: Limits) -> tuple[list[bytes], bytes, dict[str, bytes]]:
        """Keys and settings of ``acquire.lua`` for these limits, encoded once (encoding the
        arguments of every call showed in the decision path's profile)."""
        encoded = self._encoded.get(limits)
        if encoded is None:
            if len(self._encoded) >= 8:
                self._encoded.clear()
            keys = [self._alive_key, self._queues_key, self._lanes_key,
                    *(self._lease_key(lane.name) for lane in limits.lanes)]
            settings = {
                "ttl": int(self._ttl_ms), "capacity": limits.capacity, "tolerance": self.rank_tolerance,
                "replica": self.replica, "channel": self.channel,
                "lanes": [[lane.name, lane.max_inflight, int(lane.borrow),
                           lane.max_borrow if lane.max_borrow is not None else -1] for lane in limits.lanes],
            }
            index = {lane.name: str(i).encode() for i, lane in enumerate(limits.lanes, start=1)}
            encoded = self._encoded[limits] = ([key.encode() for key in keys],
                                               json.dumps(settings).encode(), index)
            self.book.learn(index)
        return encoded

    async def acquire(self, lane: str, lease: str, limits: Limits, rank: float | None = None) -> SlotVerdict:
        keys, settings, index = self._encode(limits)
        if lane not in index:
            raise KeyError(lane)
        args: list[str | bytes] = [self._member(lease), index[lane], "" if rank is None else repr(rank),
                                   settings]
        try:
            verdict = SlotVerdict(await self.link.run("acquire", keys, args))
        except (LedgerUnavailable, asyncio.CancelledError):
            if not self.book.holds(lane, lease):
                # The script may have run before the answer was lost: remove it when Redis is back.
                self.book.doubt(lane, lease)
            raise
        if verdict:
            self.book.hold(lane, lease)
        return verdict

    async def release(self, lane: str, lease: str) -> None:
        self.book.forget(lane, lease)
        try:
            await self.link.run("release", [self._lease_key(lane), self._queues_key, self._done_key],
                                [self._member(lease), self.channel, lane, "1"])
        except (LedgerUnavailable, asyncio.CancelledError):
            self.book.doubt(lane, lease)
            raise

    async def publish_queue(self, queued: Mapping[str, int], heads: Mapping[str, float | None],
                            tenants: Mapping[str, Mapping[str, int]] | None = None) -> None:
        """Send the summary; concurrent calls coalesce (the latest summary wins)."""
        self.book.set_queue(queued, heads, tenants)
        async with self._publish_lock:
            taken = self.book.take_summary()
            if taken is None:
                return
            wake, queued = taken
            try:
                await self.link.run("queue", [self._alive_key, self._queues_key], [
                    self.replica, self._queue_ttl_ms, self.book.summary, self.book.tenants, self.channel,
                    *wake])
            except LedgerUnavailable:
                self.book.unsend(wake)
                raise
            # A lane that starts queueing here may have missed a release that came before its
            # summary (releases wake nobody while nobody queues): check once now.
            for lane in sorted(queued):
                if not self._sent_queued.get(lane):
                    self.deliver(lane)
            self._sent_queued = queued

    async def agree_limit(self, proposal: int, *, starting: bool = False) -> tuple[int, bool]:
        leads, limit = await self.link.run("limit", [self._leader_key, self._limit_key],
                                           [self.replica, str(proposal), self._queue_ttl_ms,
                                            "1" if starting else "0", self._limit_ttl_ms])
        return int(limit), bool(leads)

    async def view(self) -> GlobalView:
        remote = {str(name) for name in await self.link.io(lambda client: client.smembers(self._lanes_key))}
        lanes = sorted(set(remote) | self.book.lanes())
        replicas, counts, summaries, tenant_summaries, holders, done = await self.link.run(
            "view", [self._alive_key, self._queues_key, self._done_key,
                     *(self._lease_key(lane) for lane in lanes)], [])
        self.alive = tuple(replicas)
        return _global_view(lanes, len(replicas), counts, summaries, tenant_summaries, holders, done)

    # -- fleet-wide budgets (:class:`~extproc.state.redis_budgets.RedisBudgets`) -----------

    #: Bare, an outage raises (``FallbackLedger`` decides what then).
    fail_open = False
    fleet_size = 1

    @property
    def parts(self) -> int:
        """Into how many parts the fleet's budgets are split while the store is away (bare: it raises)."""
        return max(len(self.alive), self.fleet_size)

    def budget_key(self, name: str) -> str:
        """The Redis key of the bucket named ``name`` (``<kind>:<tenant>``)."""
        return self.budgets.budget_key(name)

    async def buckets(self, ops: Sequence[BucketOp], now: float | None = None) -> list[Level]:
        return await self.budgets.buckets(ops, now)

    async def retry_counts(self, deposits: int, withdrawals: int, window_s: float, slots: int,
                           now_ms: int | None = None) -> tuple[int, int]:
        return await self.budgets.retry_counts(deposits, withdrawals, window_s, slots, now_ms)

    async def served(self, work: Mapping[tuple[str, str], float],
                     queued: Iterable[tuple[str, str]] = ()) -> dict[tuple[str, str], float]:
        return await self.budgets.served(work, queued)

    def forget_served(self) -> None:
        """Read the fleet's served totals afresh next time (a baseline, nothing charged)."""
        self.budgets.forget_served()

    # -- wake-ups (:class:`~extproc.state.redis_wakeups.RedisWakeups`) ----------------------

    def on_freed(self, callback: FreedCallback) -> None:
        self.wakeups.on_freed(callback)

    def alone(self, limits: Limits) -> Limits | None:
        return None  # bare: an outage raises LedgerUnavailable (FallbackLedger decides what then)

    def deliver(self, lane: str) -> None:
        """Schedule the callbacks for ``lane`` (every known lane for ``*``)."""
        self.wakeups.deliver(lane)

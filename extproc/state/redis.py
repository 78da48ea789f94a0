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
* ``{prefix}:budget:<kind>:<tenant>`` — hash (``level``, ``at``): a tenant's bucket of the fleet
  (``bucket.lua``, the arithmetic of ``core.budget.Budget``); kept only while below full, its TTL
  the time it takes to refill.
* ``{prefix}:retry`` — hash, ``d:<slot>:<replica>`` / ``w:<slot>:<replica>`` → the retry budget's
  deposits and withdrawals per slot of the window (``retry.lua``); fields leave with the window.
* ``{prefix}:served`` — hash, ``<lane>|<tenant>`` → predicted seconds served fleet-wide (``served.lua``):
  what the fair queues share.
* channel ``{prefix}:freed`` — a lane name when a slot of it may have freed, ``*`` for all.
  A release publishes only while some replica has requests queued (nobody else needs it).

A background heartbeat (every ``min(ttl, queue_ttl) / 3``) renews this replica's liveness
mark, queue summary and leases, and purges what expired, so a dead replica's slots free
within ``ttl`` even when nobody acquires. The heartbeat puts back any held lease Redis lost
(Redis restarted, or the replica stalled past the TTL) and reports what it put back; a lease
released meanwhile is then removed again, so a release racing a heartbeat cannot leak.

Calls of the decision path go alone while a connection is free, and share pipelined round
trips once all ``pool_size`` are busy. Errors and timeouts (``timeout``, 50 ms by default: the
decision path must not hang) raise :class:`~extproc.state.LedgerUnavailable`, and so does every
later call at once, without waiting on Redis, until the heartbeat gets through again;
``FallbackLedger`` turns them into degraded mode.

Supported stores: ``redis://``, ``rediss://`` (TLS), ``unix://`` and ``redis+sentinel://``
(redis-py's Sentinel client: it finds the primary and follows failovers). Redis Cluster URLs are
refused: the scripts would run there unchanged (one slot, every key declared), but one slot is
one shard doing all the work, so a cluster buys nothing over one primary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

import structlog
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    MasterDownError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)

from extproc.state import (
    ALL_LANES,
    LEASE_TTL,
    QUEUE_TTL,
    RANK_TOLERANCE,
    BucketOp,
    FreedCallback,
    GlobalView,
    LedgerUnavailable,
    Level,
    Limits,
    SlotVerdict,
    StoreDown,
    StoreScriptError,
    summary_changes,
    wake,
)

_SENTINEL_PORT = 26379
log = structlog.get_logger("extproc")
_T = TypeVar("_T")
#: Scripts of the decision path, sent in shared pipelines (the heartbeat and the view go alone).
_BATCHED = frozenset({"acquire", "release", "queue", "bucket"})
_MAX_BATCH = 256
#: The longest a tenant bucket below full lives unused (ms): bounds what a debt-ridden tenant that
#: never comes back costs (its bucket then comes back full). Seven days.
_BUCKET_IDLE_MS = str(7 * 86_400_000)
#: The fleet's served-work totals live this long after the last replica's call (ms), and hold at
#: most this many lane/tenant fields.
_SERVED_TTL_MS = str(3_600_000)
_SERVED_MAX_FIELDS = 100_000
#: Error replies that say the store cannot serve anyone now (a read-only replica after a failover, out
#: of memory, no permission, a primary gone, a script stuck): an outage. Any other error reply is the
#: failure of that one call (a script that hit a limit or a bug): the store is up, other calls go on.
_DOWN_REPLIES = (ReadOnlyError, OutOfMemoryError, NoPermissionError, MasterDownError, TryAgainError)
_DOWN_PREFIXES = ("BUSY", "LOADING", "MASTERDOWN", "READONLY", "OOM", "NOPERM")


def _is_outage(exc: BaseException) -> bool:
    """Whether a client error means the store is unavailable (else: one call's own error reply)."""
    if not isinstance(exc, ResponseError) or isinstance(exc, _DOWN_REPLIES):
        return True
    return str(exc).lstrip().upper().startswith(_DOWN_PREFIXES)


@dataclass(slots=True)
class _Call:
    name: str
    keys: Sequence[str | bytes]
    args: Sequence[str | bytes]
    future: asyncio.Future[Any]


def _fail(batch: list[_Call], failure: LedgerUnavailable) -> None:
    for call in batch:
        if not call.future.done():
            call.future.set_exception(failure)


@dataclass(frozen=True)
class Target:
    """Where the ledger lives: one Redis server (``redis://``, ``rediss://``, ``unix://``) or a
    Sentinel-monitored primary (``redis+sentinel://[user:password@]host[:port][,host[:port]…]/service[/db]``,
    the password being the primary's; sentinels themselves without auth)."""

    kind: str
    url: str
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None

    def describe(self) -> str:
        """The target without credentials, for logs and ``/readyz``."""
        if self.kind == "sentinel":
            hosts = ",".join(f"{host}:{port}" for host, port in self.sentinels)
            return f"redis+sentinel://{hosts}/{self.service}/{self.db}"
        parts = urlsplit(self.url)
        netloc = parts.netloc.rpartition("@")[2]
        return f"{parts.scheme}://{netloc}{parts.path}"


def parse_url(url: str) -> Target:
    """Check a store URL; raise ``ValueError`` saying what is wrong."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("redis", "rediss", "unix"):
        if scheme != "unix" and not parts.hostname:
            raise ValueError(f"{url!r}: no host (expected redis://host[:port][/db])")
        return Target("redis", url)
    if scheme == "redis+sentinel":
        credentials, _, hosts = parts.netloc.rpartition("@")
        username, _, password = credentials.partition(":") if credentials else ("", "", "")
        sentinels = []
        for item in hosts.split(","):
            host, sep, port = item.rpartition(":") if "]" not in item.rpartition(":")[2] else ("", "", "")
            if not sep:
                host, port = item, str(_SENTINEL_PORT)
            if not host or not port.isdigit():
                raise ValueError(f"{url!r}: bad sentinel address {item!r} (expected host[:port])")
            sentinels.append((host.strip("[]"), int(port)))
        path = [p for p in parts.path.split("/") if p]
        if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
            raise ValueError(f"{url!r}: expected redis+sentinel://host[:port][,host[:port]...]/service[/db]")
        db = int(path[1]) if len(path) == 2 else int(parse_qs(parts.query).get("db", ["0"])[0])
        return Target("sentinel", url, tuple(sentinels), unquote(path[0]), db,
                      unquote(username) or None, unquote(password) or None)
    if scheme in ("redis+cluster", "rediss+cluster"):
        raise ValueError(f"{url!r}: Redis Cluster is not supported (the ledger lives in one hash slot, "
                         "so a cluster would not spread it; use one primary, with Sentinel for failover)")
    raise ValueError(f"{url!r}: expected redis://, rediss://, unix:// or redis+sentinel://")


def _script(name: str) -> str:
    return resources.files("extproc.state").joinpath(name).read_text(encoding="utf-8")


class RedisLedger:
    def __init__(self, url: str, *, prefix: str = "extproc", ttl: float = LEASE_TTL,
                 queue_ttl: float = QUEUE_TTL, rank_tolerance: float = RANK_TOLERANCE,
                 timeout: float = 0.05, connect_timeout: float | None = None, pool_size: int = 8,
                 renew: bool = True, replica: str | None = None) -> None:
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
        self.target = parse_url(url)
        self.replica = replica or uuid.uuid4().hex
        self.ttl = ttl
        self.queue_ttl = queue_ttl
        self.rank_tolerance = rank_tolerance
        self.timeout = timeout
        self.connect_timeout = connect_timeout if connect_timeout is not None else max(timeout, 0.25)
        self.pool_size = pool_size
        self._renew = renew
        tag = "{" + prefix + "}"
        self._tag = tag
        self._alive_key = f"{tag}:alive"
        self._queues_key = f"{tag}:queues"
        self._lanes_key = f"{tag}:lanes"
        self._leader_key = f"{tag}:limit:leader"
        self._limit_key = f"{tag}:limit"
        self._done_key = f"{tag}:done"
        self._retry_key = f"{tag}:retry"
        self._served_key = f"{tag}:served"
        #: The fleet's served totals as last read (field -> seconds), to tell the others' part.
        self._served_seen: dict[str, float] = {}
        self.channel = f"{tag}:freed"
        self._ttl_ms = str(max(int(ttl * 1000), 1))
        self._queue_ttl_ms = str(max(int(queue_ttl * 1000), 1))

        self._held: dict[str, set[str]] = {}
        self._pending: dict[str, set[str]] = {}
        """Leases to remove from Redis when it answers again (released, or acquired in doubt)."""
        self._version = 0
        self._known: set[str] = set()
        self._queued: dict[str, int] = {}
        self._heads: dict[str, float] = {}
        self._summary = ""
        self._tenants = ""
        self._tenant_counts: dict[str, dict[str, int]] = {}
        self._sent_queued: dict[str, int] = {}
        self._dirty = False
        self._wake: set[str] = set()
        self._publish_lock = asyncio.Lock()
        self._encoded: dict[Limits, tuple[list[bytes], bytes, dict[str, bytes]]] = {}

        self.alive: tuple[str, ...] = ()
        """Live replicas as of the last heartbeat or view."""
        self.subscribed = False
        self.readded = 0
        """Held leases the heartbeat had to put back (Redis lost them)."""
        self._callbacks: list[FreedCallback] = []
        self._failure_callbacks: list[Callable[[str], None]] = []
        self._script_error_callbacks: list[Callable[[str], None]] = []
        self.script_errors = 0
        """Calls that failed with an error reply while the store was up (not outages)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Redis | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._gate = asyncio.Semaphore(pool_size)
        self._queue: list[_Call] = []
        self._sender_waiting = False
        self._senders: set[asyncio.Task[None]] = set()
        self.healthy = True
        """False from a failed call until a call gets through again."""
        self.failure: str | None = None
        self._scripts: dict[str, Any] = {}

    # -- connections ----------------------------------------------------------------------

    def _connect(self, timeout: float | None, pool_size: int, health_check: int = 0) -> Redis:
        common: dict[str, Any] = {
            "socket_timeout": timeout,
            "health_check_interval": health_check,
            "socket_connect_timeout": self.connect_timeout,
            # One immediate retry, on a dropped connection only: a pooled connection goes stale when
            # Redis restarts or fails over, and the first command on it should not look like an
            # outage. Every script is idempotent, so running one twice is harmless. No retry on
            # timeouts: those must not stretch a decision.
            "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            "decode_responses": True,
        }
        target = self.target
        if target.kind == "sentinel":
            sentinel = Sentinel(list(target.sentinels), sentinel_kwargs={  # type: ignore[no-untyped-call, unused-ignore]
                "socket_timeout": self.connect_timeout, "socket_connect_timeout": self.connect_timeout})
            client: Redis = sentinel.master_for(target.service, db=target.db, username=target.username,
                                                password=target.password, **common)
            return client
        # Callers queue at self._gate, not in the pool: redis-py's blocking pool lets a task that
        # just gave a connection back take it again ahead of those waiting, which starves them
        # under a closed loop of calls until they time out.
        pool = ConnectionPool.from_url(target.url, max_connections=pool_size, **common)
        return Redis.from_pool(pool)

    async def _io(self, call: Callable[[Redis], Awaitable[_T]], probe: bool = False, name: str = "") -> _T:
        """One round trip, in turn. Once one has failed, the others fail at once (a decision must not
        pay a timeout per call during an outage) until a ``probe`` — the heartbeat — gets through.
        An error reply of this call alone (``_is_outage``) raises ``StoreScriptError`` and leaves the
        ledger's health as it was."""
        client = self._client
        if client is None:
            raise StoreDown("ledger not started, or closed")
        async with self._gate:
            if not (self.healthy or probe):
                raise StoreDown(self.failure or "redis unavailable")
            try:
                result = await call(client)
            except (RedisError, OSError) as exc:
                if not _is_outage(exc):
                    raise self._script_error(name or "command", exc) from exc
                raise self._unavailable(exc) from exc
        self.healthy, self.failure = True, None
        return result

    async def _run(self, name: str, keys: Sequence[str | bytes], args: Sequence[str | bytes],
                   probe: bool = False) -> Any:
        script = self._scripts[name]
        if name in _BATCHED and not probe and (self._queue or self._gate.locked()):
            return await self._batched(name, keys, args)
        return await self._io(lambda client: script(keys=keys, args=args, client=client), probe, name)

    # -- batching: the calls of the decision path share round trips --------------------------

    async def _batched(self, name: str, keys: Sequence[str | bytes], args: Sequence[str | bytes]) -> Any:
        """Queue one script call for the next pipeline and wait for its answer.

        Only when every connection is busy: a call that finds one free goes at once, alone (the
        lowest latency). A sender takes a connection first and only then everything queued
        meanwhile, so under load each round trip carries many decisions (a system call per call
        was most of the CPU a decision cost). If the caller is cancelled its call still runs;
        callers treat that like any call whose answer was lost.
        """
        if self._client is None:
            raise StoreDown("ledger not started, or closed")
        if not self.healthy:
            raise StoreDown(self.failure or "redis unavailable")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append(_Call(name, keys, args, future))
        if not self._sender_waiting:
            self._sender_waiting = True
            sender = loop.create_task(self._send())
            self._senders.add(sender)
            sender.add_done_callback(self._senders.discard)
        return await future

    async def _send(self) -> None:
        async with self._gate:
            self._sender_waiting = False
            batch, self._queue = self._queue[:_MAX_BATCH], self._queue[_MAX_BATCH:]
            if self._queue:  # more than one pipeline's worth: the rest goes in the next
                self._sender_waiting = True
                sender = asyncio.get_running_loop().create_task(self._send())
                self._senders.add(sender)
                sender.add_done_callback(self._senders.discard)
            client = self._client
            if not batch:
                return
            if client is None:
                _fail(batch, LedgerUnavailable("ledger closed"))
                return
            try:
                results = await self._pipeline(client, batch)
            except asyncio.CancelledError:
                _fail(batch, LedgerUnavailable("ledger closed"))
                raise
            except (RedisError, OSError) as exc:
                self._fail_batch(batch, exc)
                return
            # An error reply that says the store serves nobody now (READONLY after a failover, OOM,
            # BUSY…) is an outage, as it is for a call alone (``_io``): not one script's failure.
            outage = next((result for result in results
                           if isinstance(result, Exception) and _is_outage(result)), None)
            if outage is not None:
                self._fail_batch(batch, outage)
                return
        self.healthy, self.failure = True, None
        for call, result in zip(batch, results, strict=True):
            if isinstance(result, Exception):
                failure = self._script_error(call.name, result)
                if not call.future.done():
                    call.future.set_exception(failure)
            elif not call.future.done():
                call.future.set_result(result)

    def _fail_batch(self, batch: list[_Call], exc: Exception) -> None:
        """The batch's round trip met an outage (``_unavailable``): every call of it fails."""
        failure = self._unavailable(exc)
        _fail(batch, failure if isinstance(failure, LedgerUnavailable)
              else LedgerUnavailable("ledger closed"))

    async def _pipeline(self, client: Redis, batch: list[_Call]) -> list[Any]:
        """Run the batch's scripts in one round trip; load them and run again those Redis lacked
        (a restarted Redis has an empty script cache)."""
        results = await self._pipe(client, batch)
        missing = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
        if missing:
            for name in {batch[i].name for i in missing}:
                await client.script_load(self._scripts[name].script)
            for i, result in zip(missing, await self._pipe(client, [batch[i] for i in missing]), strict=True):
                results[i] = result
        return results

    async def _pipe(self, client: Redis, batch: list[_Call]) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for call in batch:
            pipe.evalsha(self._scripts[call.name].sha, len(call.keys), *call.keys, *call.args)
        return list(await pipe.execute(raise_on_error=False))

    def _unavailable(self, exc: Exception) -> BaseException:
        """What a client error means: an outage (reported to the failure callbacks), or a cancellation."""
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # A cancellation the client library turned into a timeout or a dropped connection
            # (it disconnects on any interruption): the caller was cancelled, Redis is fine.
            return asyncio.CancelledError()
        reason = f"redis {self.target.describe()}: {type(exc).__name__}: {exc}"
        self.healthy, self.failure = False, reason
        for callback in self._failure_callbacks:
            callback(reason)
        return LedgerUnavailable(reason)

    def _script_error(self, name: str, exc: BaseException) -> StoreScriptError:
        """One call's error reply: logged and counted; the store stays healthy."""
        self.script_errors += 1
        log.warning("store_script_error", script=name, error=str(exc)[:300])
        for callback in self._script_error_callbacks:
            callback(name)
        return StoreScriptError(name, f"redis {self.target.describe()}: script {name}: {exc}")

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and register; raises ``LedgerUnavailable`` if Redis does not answer (the
        background tasks keep trying)."""
        self._loop = asyncio.get_running_loop()
        self._client = self._connect(self.timeout, self.pool_size)
        for name in ("acquire", "release", "heartbeat", "queue", "view", "limit", "bucket", "retry",
                     "served"):
            self._scripts[name] = self._client.register_script(_script(f"{name}.lua"))
        self._tasks.append(asyncio.create_task(self._listen(), name=f"ledger-listen-{self.replica}"))
        if self._renew:
            self._tasks.append(asyncio.create_task(self._renew_forever(),
                                                   name=f"ledger-renew-{self.replica}"))
        await self.renew()

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=1.0)
        self._tasks.clear()
        if self._senders:  # calls already queued get their answers (each bounded by the timeouts)
            await asyncio.wait(set(self._senders), timeout=1.0)
        if self._client is None:
            return
        for lane, leases in self._held.items():
            self._pending.setdefault(lane, set()).update(leases)
        self._held.clear()
        # Redis gone: the leases expire on their own within the TTL.
        with contextlib.suppress(LedgerUnavailable):
            await self.renew(leave=True)
        await self._client.aclose()
        self._client = None

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` whenever a Redis call fails (foreground or background)."""
        self._failure_callbacks.append(callback)

    def on_script_error(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(script)`` whenever a call gets an error reply from a store that is up."""
        self._script_error_callbacks.append(callback)

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
        lanes = sorted(self._known | set(self._held) | set(self._pending))
        drops = {lane: set(self._pending.get(lane, ())) for lane in lanes}
        plan = {
            "lanes": lanes,
            "hold": [[self._member(lease) for lease in self._held.get(lane, ())] for lane in lanes],
            "drop": [[self._member(lease) for lease in drops[lane]] for lane in lanes],
        }
        keys = [self._alive_key, self._queues_key, self._lanes_key, *map(self._lease_key, lanes)]
        replicas, readded = await self._run("heartbeat", keys, [
            self.replica, self._ttl_ms, self._queue_ttl_ms, self.channel, self._summary, self._tenants,
            json.dumps(plan), "1" if leave else "0"], probe=True)
        self.alive = tuple(replicas)
        for lane, dropped in drops.items():
            pending = self._pending.get(lane)
            if pending is not None:
                pending -= dropped
                if not pending:
                    del self._pending[lane]
        prefix = len(self.replica) + 1
        for item in readded:
            index, _, member = item.partition(":")
            lane = lanes[int(index) - 1]
            lease = member[prefix:]
            self.readded += 1
            if lease not in self._held.get(lane, ()):
                # Released while the heartbeat was on its way: its ZREM ran first.
                try:
                    await self._run("release", [self._lease_key(lane), self._queues_key, self._done_key],
                                    [member, self.channel, lane, "0"], probe=True)
                except LedgerUnavailable:
                    self._pending.setdefault(lane, set()).add(lease)
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
            version = self._version
            await self.renew()
            if version == self._version:
                return

    # -- local bookkeeping (no I/O; the fallback uses these while Redis is away) -----------

    def hold(self, lane: str, lease: str) -> None:
        """Record a lease granted without Redis; the next heartbeat registers it."""
        self._held.setdefault(lane, set()).add(lease)
        pending = self._pending.get(lane)
        if pending is not None:
            pending.discard(lease)
        self._version += 1

    def drop(self, lane: str, lease: str) -> None:
        """Forget a lease without telling Redis yet; the next heartbeat removes it there."""
        leases = self._held.get(lane)
        if leases is None or lease not in leases:
            return
        leases.discard(lease)
        if not leases:
            del self._held[lane]
        self._pending.setdefault(lane, set()).add(lease)
        self._version += 1

    @property
    def held(self) -> dict[str, int]:
        """Leases this replica holds, per lane."""
        return {lane: len(leases) for lane, leases in self._held.items() if leases}

    def holds(self, lane: str, lease: str) -> bool:
        return lease in self._held.get(lane, ())

    @property
    def queue(self) -> tuple[dict[str, int], dict[str, float], dict[str, dict[str, int]]]:
        """This replica's own queue summary as last set: queued, heads, tenants per lane."""
        tenants = {lane: dict(per) for lane, per in self._tenant_counts.items()}
        return dict(self._queued), dict(self._heads), tenants

    def set_queue(self, queued: Mapping[str, int], heads: Mapping[str, float | None],
                  tenants: Mapping[str, Mapping[str, int]] | None = None) -> None:
        """Record this replica's queue summary; the next publish or heartbeat sends it."""
        new_queued = {lane: n for lane, n in queued.items() if n}
        new_heads = {lane: h for lane, h in heads.items() if h is not None}
        self._wake.update(summary_changes((self._queued, self._heads), (new_queued, new_heads)))
        self._queued, self._heads = new_queued, new_heads
        self._known.update(queued)
        # No summary while nothing is queued: then releases need not wake anyone (release.lua).
        summary = {"q": new_queued, "h": new_heads}
        self._summary = json.dumps(summary, separators=(",", ":")) if new_queued else ""
        counts = {lane: {t: n for t, n in per.items() if n} for lane, per in (tenants or {}).items()}
        counts = {lane: per for lane, per in counts.items() if per}
        self._tenant_counts = counts
        self._tenants = json.dumps(counts, separators=(",", ":")) if counts else ""
        self._dirty = True

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
            self._known.update(index)
        return encoded

    async def acquire(self, lane: str, lease: str, limits: Limits, rank: float | None = None) -> SlotVerdict:
        keys, settings, index = self._encode(limits)
        if lane not in index:
            raise KeyError(lane)
        args: list[str | bytes] = [self._member(lease), index[lane], "" if rank is None else repr(rank),
                                   settings]
        try:
            verdict = SlotVerdict(await self._run("acquire", keys, args))
        except (LedgerUnavailable, asyncio.CancelledError):
            if not self.holds(lane, lease):
                # The script may have run before the answer was lost: remove it when Redis is back.
                self._pending.setdefault(lane, set()).add(lease)
            raise
        if verdict:
            self.hold(lane, lease)
        return verdict

    async def release(self, lane: str, lease: str) -> None:
        leases = self._held.get(lane)
        if leases is not None:
            leases.discard(lease)
            if not leases:
                del self._held[lane]
        self._version += 1
        try:
            await self._run("release", [self._lease_key(lane), self._queues_key, self._done_key],
                            [self._member(lease), self.channel, lane, "1"])
        except (LedgerUnavailable, asyncio.CancelledError):
            self._pending.setdefault(lane, set()).add(lease)
            raise

    async def publish_queue(self, queued: Mapping[str, int], heads: Mapping[str, float | None],
                            tenants: Mapping[str, Mapping[str, int]] | None = None) -> None:
        """Send the summary; concurrent calls coalesce (the latest summary wins)."""
        self.set_queue(queued, heads, tenants)
        async with self._publish_lock:
            if not self._dirty:
                return
            wake, self._wake, self._dirty = sorted(self._wake), set(), False
            queued = dict(self._queued)
            try:
                await self._run("queue", [self._alive_key, self._queues_key], [
                    self.replica, self._queue_ttl_ms, self._summary, self._tenants, self.channel, *wake])
            except LedgerUnavailable:
                self._wake.update(wake)
                self._dirty = True
                raise
            # A lane that starts queueing here may have missed a release that came before its
            # summary (releases wake nobody while nobody queues): check once now.
            for lane in sorted(queued):
                if not self._sent_queued.get(lane):
                    self.deliver(lane)
            self._sent_queued = queued

    async def agree_limit(self, proposal: int) -> tuple[int, bool]:
        leads, limit = await self._run("limit", [self._leader_key, self._limit_key],
                                       [self.replica, str(proposal), self._queue_ttl_ms])
        return int(limit), bool(leads)

    # -- fleet-wide budgets -------------------------------------------------------------------

    #: Bare, an outage raises (``FallbackLedger`` decides what then).
    fail_open = False
    fleet_size = 1

    @property
    def parts(self) -> int:
        """Into how many parts the fleet's budgets are split while the store is away (bare: it raises)."""
        return max(len(self.alive), self.fleet_size)


    def budget_key(self, name: str) -> str:
        """The Redis key of the bucket named ``name`` (``<kind>:<tenant>``)."""
        return f"{self._tag}:budget:{name}"

    async def buckets(self, ops: Sequence[BucketOp], now: float | None = None) -> list[Level]:
        """``bucket.lua``: the operations in order, in one atomic script (one round trip, shared
        with other decisions when every connection is busy)."""
        if not ops:
            return []
        args: list[str | bytes] = ["" if now is None else repr(now)]
        for item in ops:
            args += [item.op, repr(item.per_second), repr(item.burst), repr(item.amount), _BUCKET_IDLE_MS]
        answer = await self._run("bucket", [self.budget_key(item.key) for item in ops], args)
        try:
            return [Level(bool(int(allowed)), float(level)) for allowed, level in answer]
        except (TypeError, ValueError) as exc:
            raise LedgerUnavailable(f"redis {self.target.describe()}: bad bucket answer {answer!r}") from exc

    async def retry_counts(self, deposits: int, withdrawals: int, window_s: float, slots: int,
                           now_ms: int | None = None) -> tuple[int, int]:
        width = max(int(window_s * 1000 / slots), 1)
        answer = await self._run("retry", [self._retry_key], [
            self.replica, str(width), str(slots), str(deposits), str(withdrawals),
            "" if now_ms is None else str(now_ms)])
        return int(answer[0]), int(answer[1])

    async def served(self, work: Mapping[tuple[str, str], float],
                     queued: Iterable[tuple[str, str]] = ()) -> dict[tuple[str, str], float]:
        fields = {f"{lane}|{tenant}": seconds for (lane, tenant), seconds in work.items()
                  if seconds > 0}
        wanted = sorted({f"{lane}|{tenant}" for lane, tenant in queued})
        args: list[str | bytes] = [_SERVED_TTL_MS, str(_SERVED_MAX_FIELDS), str(len(fields))]
        for field, seconds in fields.items():
            args += [field, repr(seconds)]
        args += wanted
        try:
            values = await self._run("served", [self._served_key], args)
            totals: dict[str, float] = {}
            for field, value in zip(wanted, values, strict=True):
                with contextlib.suppress(TypeError, ValueError):
                    totals[field] = float(value)
        except BaseException:
            # The script may have run and added this replica's work before the answer was lost: the
            # totals read next would show that work as the others'. Start from a baseline instead.
            self.forget_served()
            raise
        seen, self._served_seen = self._served_seen, totals
        others: dict[tuple[str, str], float] = {}
        for field, total in totals.items():
            if field not in seen:
                continue  # newly read: a baseline, not work to charge
            delta = total - seen[field] - fields.get(field, 0.0)
            lane, sep, tenant = field.partition("|")
            if delta > 1e-9 and sep:
                others[(lane, tenant)] = delta
        return others

    def forget_served(self) -> None:
        """Read the fleet's served totals afresh next time (a baseline, nothing charged)."""
        self._served_seen = {}

    async def view(self) -> GlobalView:
        remote = {str(name) for name in await self._io(lambda client: client.smembers(self._lanes_key))}
        lanes = sorted(set(remote) | self._known | set(self._held))
        replicas, counts, summaries, tenant_summaries, holders, done = await self._run(
            "view", [self._alive_key, self._queues_key, self._done_key,
                     *(self._lease_key(lane) for lane in lanes)], [])
        self.alive = tuple(replicas)
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
        return GlobalView(inflight, queued, heads, tenants, replicas=max(len(replicas), 1), held_by=held_by,
                          completed=completed)

    # -- wake-ups -------------------------------------------------------------------------

    def on_freed(self, callback: FreedCallback) -> None:
        self._callbacks.append(callback)

    def alone(self, limits: Limits) -> Limits | None:
        return None  # bare: an outage raises LedgerUnavailable (FallbackLedger decides what then)

    def deliver(self, lane: str) -> None:
        """Schedule the callbacks for ``lane`` (every known lane for ``*``)."""
        wake(self._loop, self._callbacks, lane, self._known | set(self._held))

    async def _listen(self) -> None:
        """Keep one subscription open; while it is down, wake every lane at each retry instead."""
        delay = 0.05
        # No read timeout: the subscription idles between messages; health checks find a dead peer.
        client = self._connect(None, 2, health_check=5)
        try:
            while not self._closing:
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                try:
                    await pubsub.subscribe(self.channel)
                    if not self.subscribed:
                        self.subscribed = True
                        self.deliver(ALL_LANES)  # whatever was published while we were away is lost
                    delay = 0.05
                    while not self._closing:
                        message = await pubsub.get_message(timeout=1.0)
                        if message is not None and message.get("type") == "message":
                            self.deliver(str(message["data"]))
                except (RedisError, OSError):
                    self.subscribed = False
                    self.deliver(ALL_LANES)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
                finally:
                    with contextlib.suppress(RedisError, OSError):
                        await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
        finally:
            self.subscribed = False
            await client.aclose()

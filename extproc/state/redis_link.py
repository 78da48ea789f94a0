"""The ledger's connections to Redis: where it lives, calls in turn, pipelines under load.

How this works: at most ``pool_size`` calls run at once, each on its own connection (Redis runs
scripts one at a time: more buy nothing); the others wait their turn in order, at one gate. Calls
of the decision path (``_BATCHED``) go alone while a connection is free, and share pipelined round
trips once all ``pool_size`` are busy. Errors and timeouts (``timeout``, 50 ms by default: the
decision path must not hang) raise :class:`~extproc.state.LedgerUnavailable` and are reported to
the ``on_failure`` callbacks; so does every later call at once, without waiting on Redis, until a
``probe`` call (the heartbeat) gets through again. An error reply of one call alone (a script
that hit a limit or a bug) raises :class:`~extproc.state.StoreScriptError` and leaves the health
as it was. A script Redis lacks (a restarted Redis has an empty script cache) is loaded and run
again.

Supported stores: ``redis://``, ``rediss://`` (TLS), ``unix://`` and ``redis+sentinel://``
(redis-py's Sentinel client: it finds the primary and follows failovers). Redis Cluster URLs are
refused: the scripts would run there unchanged (one slot, every key declared), but one slot is
one shard doing all the work, so a cluster buys nothing over one primary.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
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

from extproc.state import LedgerUnavailable, StoreDown, StoreScriptError

_SENTINEL_PORT = 26379
log = structlog.get_logger("extproc")
_T = TypeVar("_T")
#: Scripts of the decision path, sent in shared pipelines (the heartbeat and the view go alone).
_BATCHED = frozenset({"acquire", "release", "queue", "bucket"})
_MAX_BATCH = 256
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


class RedisLink:
    """One store's connections, shared by every part of the Redis ledger."""

    def __init__(self, target: Target, *, timeout: float, connect_timeout: float, pool_size: int) -> None:
        self.target = target
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.pool_size = pool_size
        self.healthy = True
        """False from a failed call until a call gets through again."""
        self.failure: str | None = None
        self.script_errors = 0
        """Calls that failed with an error reply while the store was up (not outages)."""
        self._failure_callbacks: list[Callable[[str], None]] = []
        self._script_error_callbacks: list[Callable[[str], None]] = []
        self._client: Redis | None = None
        self._scripts: dict[str, Any] = {}
        self._gate = asyncio.Semaphore(pool_size)
        self._queue: list[_Call] = []
        self._sender_waiting = False
        self._senders: set[asyncio.Task[None]] = set()

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Between :meth:`start` and :meth:`close`."""
        return self._client is not None

    def start(self, scripts: Iterable[str]) -> None:
        """Open the pool (connections open as calls need them) and register the named scripts
        (``<name>.lua`` beside this module)."""
        self._client = self.connect(self.timeout, self.pool_size)
        for name in scripts:
            self._scripts[name] = self._client.register_script(_script(f"{name}.lua"))

    async def flush(self) -> None:
        """Let the calls already queued get their answers (each bounded by the timeouts)."""
        if self._senders:
            await asyncio.wait(set(self._senders), timeout=1.0)

    async def close(self) -> None:
        if self._client is None:
            return
        await self._client.aclose()
        self._client = None

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` whenever a Redis call fails (foreground or background)."""
        self._failure_callbacks.append(callback)

    def on_script_error(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(script)`` whenever a call gets an error reply from a store that is up."""
        self._script_error_callbacks.append(callback)

    # -- connections ----------------------------------------------------------------------

    def connect(self, timeout: float | None, pool_size: int, health_check: int = 0) -> Redis:
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

    async def io(self, call: Callable[[Redis], Awaitable[_T]], probe: bool = False, name: str = "") -> _T:
        """One round trip, in turn. Once one has failed, the others fail at once (a decision must not
        pay a timeout per call during an outage) until a ``probe`` — the heartbeat — gets through.
        An error reply of this call alone (``_is_outage``) raises ``StoreScriptError`` and leaves the
        health as it was."""
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

    async def run(self, name: str, keys: Sequence[str | bytes], args: Sequence[str | bytes],
                  probe: bool = False) -> Any:
        """Run the script ``name``: alone while a connection is free (or as a ``probe``, see
        :meth:`io`), else in the next shared pipeline if it is of the decision path."""
        script = self._scripts[name]
        if name in _BATCHED and not probe and (self._queue or self._gate.locked()):
            return await self._batched(name, keys, args)
        return await self.io(lambda client: script(keys=keys, args=args, client=client), probe, name)

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
            # BUSY…) is an outage, as it is for a call alone (``io``): not one script's failure.
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

"""The Redis ledger against a real ``redis-server`` on loopback: the shared contract, dead replicas,
outages (server stopped, server paused) with the fallback, and reconciliation."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from extproc.localstack import free_port
from extproc.state import LaneLimits, LedgerUnavailable, Limits, SlotVerdict
from extproc.state.fallback import FailMode, FallbackLedger
from extproc.state.redis import RedisLedger, parse_url
from tests.state_contract import LedgerContract, Woken, eventually

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs Debian's redis-server")

LIMITS = Limits((LaneLimits("interactive", 4), LaneLimits("batch", 4)), capacity=8)


class RedisServer:
    """One ``redis-server`` on 127.0.0.1, no persistence, in a scratch directory; can stop and start again."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=self.port, socket_timeout=1).ping()
                return
            except redis.ConnectionError as exc:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.workdir / "redis.log").read_text()
                    raise RuntimeError(f"redis-server did not start: {log}") from exc
                time.sleep(0.02)

    def kill(self) -> None:
        """Stop at once (SIGKILL): nothing is saved, connections drop."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5, decode_responses=True)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.kill()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of the test's own, to stop and start."""
    s = RedisServer(tmp_path)
    s.start()
    yield s
    s.kill()


class Backend:
    def __init__(self, url: str, wrap: bool, **defaults: Any) -> None:
        self.url = url
        self.prefix = f"test-{uuid.uuid4().hex[:8]}"
        self.wrap = wrap
        self.defaults = defaults
        self.ledgers: list[Any] = []

    async def make(self, **options: Any) -> Any:
        primary = RedisLedger(self.url, prefix=self.prefix, **{**self.defaults, **options})
        ledger = FallbackLedger(primary) if self.wrap else primary
        await ledger.start()
        self.ledgers.append(ledger)
        return ledger

    async def close(self) -> None:
        for ledger in self.ledgers:
            await ledger.close()


class TestRedisLedger(LedgerContract):
    @pytest.fixture
    async def backend(self, shared_server: RedisServer) -> AsyncIterator[Backend]:
        backend = Backend(shared_server.url, wrap=False)
        yield backend
        await backend.close()


class TestFallbackLedgerWhileRedisAnswers(LedgerContract):
    @pytest.fixture
    async def backend(self, shared_server: RedisServer) -> AsyncIterator[Backend]:
        # While Redis answers: a read slower than the shipped 50 ms on a saturated test machine would be
        # an outage, and the fallback's local share would then grant past the fleet's limits (as it
        # should in an outage). The outage paths have tests of their own.
        backend = Backend(shared_server.url, wrap=True, timeout=1.0)
        yield backend
        await backend.close()

    async def test_it_is_not_degraded(self, backend: Backend) -> None:
        ledger = await backend.make()
        health = ledger.health()
        assert (health.degraded, health.reason, health.outages) == (False, None, 0)
        await eventually(lambda: _true(ledger.health().subscribed))


async def _true(value: bool) -> bool:
    return value


# -- keys ---------------------------------------------------------------------------------------


async def test_every_key_shares_one_hash_tag_and_prefixes_keep_deployments_apart(
        shared_server: RedisServer) -> None:
    one, two = Backend(shared_server.url, wrap=False), Backend(shared_server.url, wrap=False)
    try:
        a, b = await one.make(), await two.make()
        assert await a.acquire("batch", "1", LIMITS)
        await a.publish_queue({"batch": 1}, {"batch": 3.0}, {"batch": {"acme": 1}})
        assert (await b.view()).inflight.get("batch", 0) == 0
        assert (await b.view()).queued == {}
        keys = shared_server.client().keys(f"*{one.prefix}*")
        assert keys
        assert all(key.startswith("{" + one.prefix + "}:") for key in keys)
    finally:
        await one.close()
        await two.close()


async def test_a_release_publishes_a_wake_up_only_while_some_replica_queues(
        shared_server: RedisServer) -> None:
    backend = Backend(shared_server.url, wrap=False)
    listener = shared_server.client().pubsub(ignore_subscribe_messages=True)
    try:
        a, b = await backend.make(), await backend.make()
        channel = a.channel
        listener.subscribe(channel)

        async def messages_until(marker: str) -> list[str]:
            # Pub/sub keeps the server's order: everything published before the marker arrives first.
            shared_server.client().publish(channel, marker)
            seen: list[str] = []
            async with asyncio.timeout(10):
                while True:
                    message = listener.get_message(timeout=0.01)
                    if message is None:
                        await asyncio.sleep(0.01)
                    elif message["data"] == marker:
                        return seen
                    else:
                        seen.append(message["data"])

        await a.acquire("batch", "1", LIMITS)
        await a.release("batch", "1")
        assert await messages_until("m1") == []
        await b.publish_queue({"interactive": 2}, {"interactive": 1.0})
        await a.acquire("batch", "2", LIMITS)
        await a.release("batch", "2")
        await a.release("batch", "2")  # already gone: no second wake-up
        assert await messages_until("m2") == ["batch"]
    finally:
        listener.close()
        await backend.close()


# -- a replica killed with SIGKILL --------------------------------------------------------------

CHILD = """
import asyncio, sys
from extproc.state import LaneLimits, Limits
from extproc.state.redis import RedisLedger

async def main():
    ledger = RedisLedger(sys.argv[1], prefix=sys.argv[2], ttl=float(sys.argv[3]), queue_ttl=0.5)
    await ledger.start()
    limits = Limits((LaneLimits("batch", 2),), 2)
    for lease in ("a", "b"):
        assert await ledger.acquire("batch", lease, limits)
    await ledger.publish_queue({"batch": 3}, {"batch": 1.0})
    print("ready", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_a_sigkilled_replica_loses_its_slots_within_the_ttl(shared_server: RedisServer) -> None:
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    limits = Limits((LaneLimits("batch", 2),), 2)
    ttl = 1.0
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", CHILD, shared_server.url, prefix,
                                                 str(ttl), stdout=subprocess.PIPE)
    live = RedisLedger(shared_server.url, prefix=prefix, ttl=ttl, queue_ttl=0.5)
    try:
        assert child.stdout is not None
        async with asyncio.timeout(30):
            assert await child.stdout.readline() == b"ready\n"
        await live.start()
        woken = Woken(live)
        assert await live.acquire("batch", "x", limits) is SlotVerdict.CAPACITY
        await asyncio.sleep(1.5 * ttl)  # longer than the TTL: the child's heartbeat keeps its leases
        view = await live.view()
        assert (view.inflight["batch"], view.queued, view.replicas) == (2, {"batch": 3}, 2)

        os.kill(child.pid, signal.SIGKILL)
        await child.wait()
        killed = time.monotonic()
        attempts = 0
        async with asyncio.timeout(10 * ttl):
            while not await live.acquire("batch", "x", limits):  # woken, not polling
                attempts += 1
                await woken.wait_for("batch")
                woken.lanes.clear()
        # Freed by the TTL (plus a heartbeat), not by some slower sweep: a margin that scales with
        # the TTL rather than a fixed second a busy machine can use up. Woken, not polling: two
        # attempts here (the dead replica's mark expires, then its leases), not one per poll.
        assert time.monotonic() - killed < 4 * ttl
        assert attempts <= 5
        view = await live.view()
        assert (view.inflight["batch"], view.queued, view.replicas) == (1, {}, 1)
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
        await live.close()


# -- outages --------------------------------------------------------------------------------------


async def fallback(server: RedisServer, mode: FailMode = FailMode.OPEN, fleet_size: int = 1,
                   **options: Any) -> FallbackLedger:
    options = {"ttl": 3.0, "queue_ttl": 1.0, "timeout": 0.05, **options}
    primary = RedisLedger(server.url, prefix="outage", **options)
    ledger = FallbackLedger(primary, mode=mode, retry_interval=0.1, fleet_size=fleet_size)
    await ledger.start()
    return ledger


async def recovered(*ledgers: FallbackLedger) -> None:
    async def check() -> bool:
        return not any(ledger.degraded for ledger in ledgers)
    await eventually(check, within=10.0)


async def test_while_redis_is_down_each_replica_keeps_to_its_share_then_counts_reconcile(
        server: RedisServer) -> None:
    a, b = await fallback(server), await fallback(server)
    try:
        assert await a.acquire("batch", "a1", LIMITS)
        assert await b.acquire("batch", "b1", LIMITS)
        await a.view()  # both now know there are two replicas
        await b.view()

        server.kill()
        # No exception escapes; each replica takes at most half of every limit, counting what it holds.
        assert await a.acquire("batch", "a2", LIMITS)
        assert await a.acquire("batch", "a3", LIMITS) is SlotVerdict.LANE_FULL
        assert a.degraded
        assert a.reason is not None
        assert "redis redis://127.0.0.1" in a.reason
        assert await a.acquire("interactive", "a4", LIMITS)
        assert await b.acquire("batch", "b2", LIMITS)
        assert await b.acquire("batch", "b3", LIMITS) is SlotVerdict.LANE_FULL
        await a.release("batch", "a1")  # a release during the outage frees the local share at once
        assert await a.acquire("batch", "a3", LIMITS)
        await a.publish_queue({"batch": 2}, {"batch": 10.0})
        view = await a.view()
        assert (view.degraded, view.inflight, view.replicas) == (True, {"batch": 2, "interactive": 1}, 2)
        assert view.queued == {"batch": 2}
        health = a.health()
        assert (health.degraded, health.outages, health.local_grants) == (True, 1, 3)

        server.start()  # empty: every lease must come back from the replicas
        await recovered(a, b)
        view = await a.view()
        assert not view.degraded
        assert view.inflight == {"batch": 4, "interactive": 1}  # a2, a3, a4, b1, b2: exactly what runs
        assert view.queued == {"batch": 2}
        assert await b.acquire("batch", "b3", LIMITS) is SlotVerdict.LANE_FULL  # exact global limit again

        for lane, lease in [("batch", "a2"), ("batch", "a3"), ("interactive", "a4")]:
            await a.release(lane, lease)
        for lease in ("b1", "b2"):
            await b.release("batch", lease)
        assert (await b.view()).inflight == {"batch": 0, "interactive": 0}
    finally:
        await a.close()
        await b.close()


async def test_while_redis_is_down_the_fleet_limit_may_fall_but_not_grow(server: RedisServer) -> None:
    a, b = await fallback(server), await fallback(server)
    try:
        assert await a.agree_limit(40) == (40, True)
        assert await b.agree_limit(60) == (40, False)
        server.kill()
        await a.acquire("batch", "a1", LIMITS)  # notices the outage
        await b.acquire("batch", "b1", LIMITS)
        assert a.degraded
        assert b.degraded
        # Each replica may still fall on its own engines' signals; none grows past what was agreed.
        assert await a.agree_limit(30) == (30, False)
        assert await b.agree_limit(60) == (40, False)
        server.start()
        await recovered(a, b)
        assert (await a.agree_limit(30))[0] == 30
    finally:
        await a.close()
        await b.close()


async def test_while_redis_is_unreachable_but_keeps_its_data_releases_and_grants_reconcile(
        server: RedisServer) -> None:
    a = await fallback(server)
    try:
        for lease in ("x1", "x2"):
            assert await a.acquire("batch", lease, LIMITS)
        server.client().execute_command("CLIENT", "PAUSE", "1500", "ALL")
        await a.release("batch", "x1")  # times out: Redis still has x1
        assert a.degraded
        assert await a.acquire("batch", "y1", LIMITS)  # granted locally; Redis does not know it
        await recovered(a)
        view = await a.view()
        assert view.inflight == {"batch": 2, "interactive": 0}  # x2 and y1: x1 removed, y1 added
        for lease in ("x2", "y1"):
            await a.release("batch", lease)
        assert (await a.view()).inflight == {"batch": 0, "interactive": 0}
    finally:
        await a.close()


async def test_an_acquire_whose_answer_was_lost_is_undone(server: RedisServer) -> None:
    a = await fallback(server, FailMode.CLOSED)
    try:
        server.client().execute_command("CLIENT", "PAUSE", "800", "ALL")
        # The script may or may not run once the pause ends; either way it must not count.
        assert await a.acquire("batch", "lost", LIMITS) is SlotVerdict.UNAVAILABLE
        await recovered(a)
        assert (await a.view()).inflight == {"batch": 0, "interactive": 0}
        assert await a.acquire("batch", "lost", LIMITS)
        assert (await a.view()).inflight == {"batch": 1, "interactive": 0}
    finally:
        await a.close()


async def test_failing_closed_refuses_new_leases_but_keeps_held_ones(server: RedisServer) -> None:
    a = await fallback(server, FailMode.CLOSED)
    try:
        assert await a.acquire("batch", "held", LIMITS)
        server.kill()
        assert await a.acquire("batch", "new", LIMITS) is SlotVerdict.UNAVAILABLE
        assert await a.acquire("batch", "held", LIMITS)
        assert (await a.view()).inflight == {"batch": 1}
        await a.release("batch", "held")
        await a.publish_queue({"batch": 1}, {"batch": 1.0})
        assert (await a.view()).degraded
        server.start()
        await recovered(a)
        assert (await a.view()).inflight == {"batch": 0, "interactive": 0}
        assert await a.acquire("batch", "new", LIMITS)
    finally:
        await a.close()


async def test_a_replica_that_starts_while_redis_is_down_starts_degraded_and_recovers(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    a = await fallback(server)
    try:
        assert a.degraded
        assert await a.acquire("batch", "early", LIMITS)  # alone, as far as it knows: full limits
        server.start()
        await recovered(a)
        assert (await a.view()).inflight == {"batch": 1}  # lanes it has not used through Redis are unknown
    finally:
        await a.close()
        server.kill()


async def test_a_replica_started_while_redis_is_down_takes_its_part_of_the_configured_fleet(
        tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    a = await fallback(server, fleet_size=3)
    try:
        assert a.degraded
        granted = [await a.acquire("interactive", f"i{n}", LIMITS) for n in range(LIMITS.capacity)]
        allowed = LIMITS.smallest_part(3)
        assert sum(1 for verdict in granted if verdict) == allowed.lane("interactive").max_inflight == 4 // 3
        assert allowed.capacity == LIMITS.capacity // 3  # the smallest of three parts, not the whole
        # Every lane and the capacity rounded down: three such replicas stay within every limit.
        assert all(3 * lane.max_inflight <= LIMITS.lane(lane.name).max_inflight for lane in allowed.lanes)
        server.start()
        await recovered(a)
        assert (await a.view()).inflight == {"interactive": allowed.lane("interactive").max_inflight}
    finally:
        await a.close()
        server.kill()


async def test_after_a_restart_the_subscription_comes_back_and_wakes_again(server: RedisServer) -> None:
    a, b = await fallback(server), await fallback(server)
    try:
        woken = Woken(a)
        await a.publish_queue({"interactive": 1}, {"interactive": 1.0})  # so that releases wake
        server.kill()
        server.start()
        await recovered(a, b)

        async def resubscribed() -> bool:
            [(_, subscribers)] = server.client().pubsub_numsub(a.primary.channel)
            return bool(subscribers == 2 and (await b.view()).queued == {"interactive": 1})
        await eventually(resubscribed, within=10.0)  # and a's queue summary is back in the new Redis
        assert a.primary.subscribed
        assert await b.acquire("interactive", "i", LIMITS)
        woken.lanes.clear()
        await b.release("interactive", "i")
        await woken.wait_for("interactive")
    finally:
        await a.close()
        await b.close()


async def test_without_the_fallback_an_outage_is_ledger_unavailable(server: RedisServer) -> None:
    ledger = RedisLedger(server.url, prefix="bare", timeout=0.05)
    reasons: list[str] = []
    ledger.on_failure(reasons.append)
    await ledger.start()
    try:
        assert await ledger.acquire("batch", "1", LIMITS)
        server.kill()
        with pytest.raises(LedgerUnavailable, match="redis"):
            await ledger.acquire("batch", "2", LIMITS)
        with pytest.raises(LedgerUnavailable):
            await ledger.release("batch", "1")
        with pytest.raises(LedgerUnavailable):
            await ledger.view()
        assert reasons
        server.start()
        await ledger.restore()  # empty server: the pending release and the doubtful "2" stay out
        assert (await ledger.view()).inflight == {"batch": 0, "interactive": 0}
    finally:
        await ledger.close()


async def test_a_release_racing_a_heartbeat_that_restores_leases_does_not_leak(server: RedisServer) -> None:
    ledger = RedisLedger(server.url, prefix="race", renew=False)
    await ledger.start()
    try:
        for lease in ("keep", "gone"):
            assert await ledger.acquire("batch", lease, LIMITS)
        server.client().flushall()  # as after a restart: the heartbeat must put both back...
        await asyncio.gather(ledger.renew(), ledger.release("batch", "gone"))  # ...but "gone" ends meanwhile
        assert (await ledger.view()).inflight == {"batch": 1, "interactive": 0}
    finally:
        await ledger.close()


async def test_a_cancelled_acquire_is_not_an_outage_and_leaves_nothing_behind(server: RedisServer) -> None:
    ledger = RedisLedger(server.url, prefix="cancel", renew=False, pool_size=1)
    reasons: list[str] = []
    ledger.on_failure(reasons.append)
    await ledger.start()
    try:
        # The only connection is busy with the first call, so the second queues for a pipeline;
        # cancelling its caller does not stop the call, which may take the slot for nobody.
        first = asyncio.create_task(ledger.acquire("batch", "first", LIMITS))
        second = asyncio.create_task(ledger.acquire("batch", "orphan", LIMITS))
        await asyncio.sleep(0)
        second.cancel()
        assert await first
        with pytest.raises(asyncio.CancelledError):
            await second
        await ledger.renew()  # the next heartbeat removes the orphan, if it was granted
        assert (await ledger.view()).inflight == {"batch": 1, "interactive": 0}
        assert reasons == []
        assert ledger.healthy
    finally:
        await ledger.close()


async def test_scripts_are_loaded_again_when_redis_forgot_them(server: RedisServer) -> None:
    ledger = RedisLedger(server.url, prefix="flush", pool_size=1)
    await ledger.start()
    try:
        server.client().script_flush()
        heartbeat = asyncio.create_task(ledger.renew())  # takes the only connection
        acquire = asyncio.create_task(ledger.acquire("batch", "1", LIMITS))  # so this goes in a pipeline
        await heartbeat
        assert await acquire
        assert (await ledger.view()).inflight["batch"] == 1
    finally:
        await ledger.close()


# -- URLs -----------------------------------------------------------------------------------------


def test_plain_urls_pass_through() -> None:
    for url in ("redis://127.0.0.1:6379/0", "rediss://user:pw@cache.example:6380/2", "unix:///run/redis.sock"):
        target = parse_url(url)
        assert (target.kind, target.url) == ("redis", url)
    assert parse_url("rediss://user:pw@cache.example:6380/2").describe() == "rediss://cache.example:6380/2"


def test_sentinel_urls_name_the_sentinels_the_service_and_the_db() -> None:
    target = parse_url("redis+sentinel://:s3cret@sentinel-0:26380,sentinel-1,[::1]:26381/mymaster/3")
    assert target.kind == "sentinel"
    assert target.sentinels == (("sentinel-0", 26380), ("sentinel-1", 26379), ("::1", 26381))
    assert (target.service, target.db, target.username, target.password) == ("mymaster", 3, None, "s3cret")
    assert "s3cret" not in target.describe()
    assert parse_url("redis+sentinel://s0/main").db == 0


@pytest.mark.parametrize(("url", "message"), [
    ("redis+cluster://node-0:7000", "Cluster is not supported"),
    ("memcached://x", "expected redis://"),
    ("redis://", "no host"),
    ("redis+sentinel://s0:port/main", "bad sentinel address"),
    ("redis+sentinel://s0", "service"),
    ("redis+sentinel://s0/main/db/extra", "service"),
])
def test_bad_urls_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_url(url)


def test_a_prefix_with_braces_is_refused() -> None:
    with pytest.raises(ValueError, match="braces"):
        RedisLedger("redis://127.0.0.1:1", prefix="a{b}")


def test_a_fleet_size_that_is_not_a_count_is_a_usage_error() -> None:
    for bad in ("0", "three"):
        command = [sys.executable, "-m", "extproc", "serve", "--policy", "examples/demo-policy.yaml",
                   "--store-fleet-size", bad]
        result = subprocess.run(command, capture_output=True, text=True, timeout=60,
                                cwd=Path(__file__).resolve().parents[2])
        assert result.returncode == 2
        assert f"--store-fleet-size: expected a whole number above 0, got '{bad}'" in result.stderr

"""Fleet-wide budgets against a real ``redis-server``: the tenant buckets of ``bucket.lua`` do the
arithmetic of the pure ``Budget`` (same levels over random operations), replicas share one bucket
per tenant, garbage in the keys is survived, and the retry window of ``retry.lua`` counts the
other replicas' deposits and withdrawals within the window only."""

from __future__ import annotations

import asyncio
import copy
import math
import random
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from extproc.core.budget import Budget, Refill, _Bucket
from extproc.localstack import free_port
from extproc.state import BucketOp, LedgerUnavailable, Level, StoreScriptError
from extproc.state.fallback import FailMode, FallbackLedger
from extproc.state.redis import RedisLedger
from tests.integration.test_state_redis import RedisServer, server, shared_server  # noqa: F401

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs Debian's redis-server")


@pytest.fixture
async def ledgers(shared_server: RedisServer) -> AsyncIterator[list[RedisLedger]]:  # noqa: F811
    prefix = f"t{uuid.uuid4().hex[:8]}"
    made = [RedisLedger(shared_server.url, prefix=prefix, renew=False, timeout=1.0) for _ in range(2)]
    for ledger in made:
        await ledger.start()
    yield made
    for ledger in made:
        await ledger.close()


async def test_the_lua_buckets_do_the_pure_budgets_arithmetic(ledgers: list[RedisLedger]) -> None:
    """Random check/take/charge sequences on a few tenants, at random (increasing) times: every
    answer's allowed and level equal the pure Budget's, to the last bit."""
    rng = random.Random(18)
    store = ledgers[0]
    for round_ in range(6):
        budget = Budget(100)
        rates = {f"r{round_}-{i}": Refill(rng.choice([0.5, 2.0, 1 / 60, 30.0]),
                                        rng.choice([1.0, 3.0, 10.0, 2.5])) for i in range(3)}
        now = 1_000.0 + rng.random()
        for _ in range(80):
            now += rng.choice([0.0, 0.01, 0.3, 1.7, 40.0]) * rng.random()
            ops = []
            for _ in range(rng.choice([1, 1, 2])):
                tenant = rng.choice(sorted(rates))
                op = rng.choice(["check", "take", "take", "charge"])
                amount = (float(rng.randint(0, 9)) if op == "charge"
                          else rng.choice([1.0, 1.0, 2.0, 0.5, 7.0, 0.0]))
                ops.append(BucketOp(tenant, op, rates[tenant].per_second, rates[tenant].burst, amount))
            levels = await store.buckets(ops, now)
            refused = False
            for op, level in zip(ops, levels, strict=True):
                name = "check" if op.op == "take" and refused else op.op
                verdict = budget.apply(name, op.key, rates[op.key], op.amount, now)
                refused = refused or not verdict.allowed
                assert (level.allowed, level.level) == (verdict.allowed, verdict.remaining), (op, now)


async def test_replicas_share_one_bucket_per_tenant(ledgers: list[RedisLedger]) -> None:
    one, two = ledgers
    rate = Refill(1 / 3600, 10.0)  # no refill to speak of within the test
    op = BucketOp("requests:acme", "take", rate.per_second, rate.burst, 1.0)
    taken = 0
    for i in range(30):
        [level] = await (one if i % 3 else two).buckets([op])
        taken += level.allowed
    assert taken == 10
    [level] = await two.buckets([BucketOp("requests:other", "take", rate.per_second, rate.burst, 1.0)])
    assert level.allowed  # another tenant's bucket is its own


async def test_a_full_bucket_costs_no_key_and_a_debt_expires(ledgers: list[RedisLedger],
                                                            shared_server: RedisServer) -> None:  # noqa: F811
    store = ledgers[0]
    client = shared_server.client()
    await store.buckets([BucketOp("tokens:idle", "check", 1.0, 5.0, 1.0)])
    assert client.exists(store.budget_key("tokens:idle")) == 0  # a look stores nothing
    await store.buckets([BucketOp("tokens:debt", "charge", 100.0, 5.0, 105.0)])
    ttl = client.pttl(store.budget_key("tokens:debt"))
    assert 0 < ttl <= math.ceil(105 / 100 * 1000) + 1000  # full again by then: the key goes


async def test_garbage_in_the_keys_is_a_full_bucket(ledgers: list[RedisLedger],
                                                    shared_server: RedisServer) -> None:  # noqa: F811
    store = ledgers[0]
    client = shared_server.client()
    client.set(store.budget_key("requests:a"), "not a hash")
    client.hset(store.budget_key("requests:b"), mapping={"level": "nan", "at": "x"})
    client.set(store.budgets.retry_key, "junk")
    levels = await store.buckets([BucketOp("requests:a", "take", 1.0, 2.0, 1.0),
                                  BucketOp("requests:b", "take", 1.0, 2.0, 1.0)])
    assert [(level.allowed, level.level) for level in levels] == [(True, 1.0), (True, 1.0)]
    assert await store.retry_counts(1, 0, 10.0, 10) == (0, 0)
    client.hset(store.budgets.retry_key, mapping={"d:zz:x": "1", "w:5:y": "nope"})
    assert await store.retry_counts(0, 0, 10.0, 10) == (0, 0)


async def test_the_retry_window_counts_the_others_within_the_window(ledgers: list[RedisLedger]) -> None:
    one, two = ledgers
    t = 5_000_000  # ms: slots of 1 s, a window of 10 s
    assert await one.retry_counts(10, 2, 10.0, 10, now_ms=t) == (0, 0)
    assert await two.retry_counts(4, 1, 10.0, 10, now_ms=t + 500) == (10, 2)  # not its own
    assert await one.retry_counts(0, 0, 10.0, 10, now_ms=t + 3000) == (4, 1)
    assert await two.retry_counts(0, 0, 10.0, 10, now_ms=t + 10_500) == (0, 0)  # left the window


async def test_each_replica_learns_the_work_the_others_served(ledgers: list[RedisLedger],
                                                              shared_server: RedisServer) -> None:  # noqa: F811
    one, two = ledgers
    acme, globex = ("chat", "acme"), ("chat", "globex")
    assert await one.served({acme: 1.0}, [acme]) == {}  # read for the first time: a baseline
    assert await two.served({}, [acme]) == {}
    assert await one.served({acme: 2.0, globex: 0.5}, [acme, globex]) == {}  # its own work
    assert await two.served({acme: 0.25}, [acme]) == {acme: 2.0}
    assert await one.served({}, [acme, globex]) == {acme: 0.25}
    assert await one.served({}, []) == {}  # nothing queued here: nothing read
    assert await two.served({acme: 1.0}, [acme]) == {}  # its own
    assert await one.served({}, [acme]) == {}  # after a gap: a baseline again
    client = shared_server.client()
    client.hset(one.budgets.served_key, "chat|acme", "garbage")
    assert await two.served({acme: 1.0}, [acme]) == {}  # garbage replaced, never a crash
    client.set(one.budgets.served_key, "not a hash")
    assert await one.served({}, [acme]) == {}


async def test_the_fallback_refuses_at_once_while_redis_is_away(server: RedisServer) -> None:  # noqa: F811
    primary = RedisLedger(server.url, prefix="fb", timeout=0.2)
    ledger = FallbackLedger(primary, mode=FailMode.OPEN, retry_interval=0.1, fleet_size=3)
    await ledger.start()
    try:
        op = BucketOp("requests:t", "take", 1.0, 5.0, 1.0)
        assert (await ledger.buckets([op]))[0].allowed
        server.kill()
        with pytest.raises(LedgerUnavailable):
            await ledger.buckets([op])
        assert ledger.degraded
        # No wait on Redis while it is away: refused without a call to it (counted, not timed: a
        # call to a dead port fails about as fast as no call).
        calls = 0
        ask_redis = primary.buckets

        async def counted(ops: Sequence[BucketOp], now: float | None = None) -> list[Level]:
            nonlocal calls
            calls += 1
            return await ask_redis(ops, now)

        primary.buckets = counted  # type: ignore[method-assign]
        with pytest.raises(LedgerUnavailable):
            await ledger.buckets([op])
        assert calls == 0
        primary.buckets = ask_redis  # type: ignore[method-assign]
        assert ledger.fail_open
        assert ledger.fleet_size == 3
        with pytest.raises(LedgerUnavailable):
            await ledger.retry_counts(1, 0, 10.0, 10)
        server.start()
        for _ in range(100):
            if not ledger.degraded:
                break
            await asyncio.sleep(0.05)
        assert not ledger.degraded
        assert (await ledger.buckets([op]))[0].allowed  # Redis came back empty: full again
    finally:
        await ledger.close()



async def test_thousands_of_queued_pairs_are_read_and_an_error_reply_is_not_an_outage(
        shared_server: RedisServer) -> None:  # noqa: F811
    primary = RedisLedger(shared_server.url, prefix=f"t{uuid.uuid4().hex[:8]}", renew=False, timeout=1.0)
    ledger = FallbackLedger(primary, mode=FailMode.OPEN, retry_interval=0.1)
    errors: list[str] = []
    ledger.on_script_error(errors.append)
    await ledger.start()
    try:
        pairs = [("chat", f"tenant-{i}") for i in range(9000)]  # more than Lua's unpack can take
        assert await ledger.served({pair: 1.0 for pair in pairs}, pairs) == {}
        assert await ledger.served({}, pairs) == {}
        assert len(primary.budgets._served_seen) == 9000
        assert (ledger.degraded, primary.healthy) == (False, True)
        # An error reply of one call (here an unknown command) is that call's failure, not an outage.
        with pytest.raises(StoreScriptError):
            await primary.link.io(lambda client: client.execute_command("NO-SUCH-COMMAND"), name="bogus")
        assert (ledger.degraded, primary.healthy) == (False, True)
        assert (primary.script_errors, errors) == (1, ["bogus"])
        assert (await ledger.buckets([BucketOp("requests:t", "take", 1.0, 5.0, 1.0)]))[0].allowed
    finally:
        await ledger.close()


@pytest.mark.parametrize(("level", "at"), [("-inf", "0"), ("inf", "0"), ("1", "inf"), ("1", "-inf"),
                                           ("nan", "0"), ("-inf", "inf")])
async def test_non_finite_values_in_a_bucket_are_garbage_a_full_bucket(
        ledgers: list[RedisLedger], shared_server: RedisServer, level: str, at: str) -> None:  # noqa: F811
    store = ledgers[0]
    client = shared_server.client()
    client.hset(store.budget_key("requests:x"), mapping={"level": level, "at": at})
    for now in (None, 1_000.0):  # Redis TIME, and a time given
        [answer] = await store.buckets([BucketOp("requests:x", "take", 1.0, 5.0, 1.0)], now)
        assert (answer.allowed, answer.level) == (True, 4.0)
        client.hset(store.budget_key("requests:x"), mapping={"level": level, "at": at})


async def test_a_stored_time_ahead_of_the_stores_clock_does_not_freeze_the_refill(
        ledgers: list[RedisLedger], shared_server: RedisServer) -> None:  # noqa: F811
    store = ledgers[0]
    client = shared_server.client()
    ahead = repr(time.time() + 86_400.0)  # written by a primary whose clock was a day ahead
    client.hset(store.budget_key("requests:y"), mapping={"level": "0", "at": ahead})
    op = BucketOp("requests:y", "take", 100.0, 5.0, 1.0)  # 100 a second: one back in 10 ms
    await store.buckets([op])  # on Redis TIME
    await asyncio.sleep(0.05)
    [answer] = await store.buckets([op])
    assert answer.allowed
    # The same with the time given: a step back of 500 s, then 0.2 s later.
    client.hset(store.budget_key("requests:y"), mapping={"level": "0", "at": "1500"})
    [answer] = await store.buckets([op], 1_000.0)
    assert not answer.allowed
    [answer] = await store.buckets([op], 1_000.2)
    assert answer.allowed


async def test_non_counts_in_the_retry_window_are_garbage(ledgers: list[RedisLedger],
                                                         shared_server: RedisServer) -> None:  # noqa: F811
    one, two = ledgers
    client = shared_server.client()
    t = 7_000_000  # ms: slots of 1 s
    slot = t // 1000
    client.hset(one.budgets.retry_key, mapping={f"d:{slot}:other": "inf", f"w:{slot}:other": "-inf",
                                                f"d:{slot}:third": "nan", f"w:{slot}:third": "1.5",
                                                f"w:{slot}:{one.replica}": "0.5", f"d:{slot}:fourth": "3"})
    assert await one.retry_counts(2, 1, 10.0, 10, now_ms=t) == (3, 0)  # its own garbage replaced too
    assert await two.retry_counts(0, 0, 10.0, 10, now_ms=t) == (5, 1)


async def test_a_served_answer_lost_after_the_script_ran_is_not_charged_as_the_others_work(
        ledgers: list[RedisLedger]) -> None:
    one, _ = ledgers
    acme = ("chat", "acme")
    assert await one.served({acme: 1.0}, [acme]) == {}  # a baseline
    real = one.link.run

    async def lost(name: str, keys: Any, args: Any, probe: bool = False) -> Any:
        await real(name, keys, args, probe)  # the script runs; its answer never arrives
        raise LedgerUnavailable("timeout")

    one.link.run = lost  # type: ignore[method-assign]
    with pytest.raises(LedgerUnavailable):
        await one.served({acme: 2.0}, [acme])
    one.link.run = real  # type: ignore[method-assign]
    assert await one.served({}, [acme]) == {}  # a baseline again: its own 2.0 is not the others'


async def test_the_served_baseline_starts_over_when_the_store_degrades(server: RedisServer) -> None:  # noqa: F811
    primary = RedisLedger(server.url, prefix="sv", renew=False, timeout=0.2)
    ledger = FallbackLedger(primary, mode=FailMode.OPEN, retry_interval=0.1)
    await ledger.start()
    try:
        acme = ("chat", "acme")
        assert await ledger.served({acme: 1.0}, [acme]) == {}
        assert primary.budgets._served_seen
        server.kill()
        with pytest.raises(LedgerUnavailable):
            await ledger.buckets([BucketOp("requests:t", "take", 1.0, 5.0, 1.0)])
        assert ledger.degraded
        assert primary.budgets._served_seen == {}
    finally:
        await ledger.close()


async def test_on_the_stores_own_clock_the_lua_buckets_do_the_pure_budgets_arithmetic(
        ledgers: list[RedisLedger], shared_server: RedisServer) -> None:  # noqa: F811
    """The Redis TIME path (no ``now`` given): each answer is the pure Budget's answer at the time the
    script read (the ``at`` it stores), and that time is the store's clock, read between the
    client's TIME just before and just after the call.

    The arithmetic is checked exactly, at the script's own time; the clock only loosely (``step``):
    CI runs saw the script's TIME 0.26 ms and then 5.2 ms before the TIME the client had read just
    before the call, this VM's wall clock stepping back. The script counts a stored time ahead of now
    from now (bucket.lua), which the pure Budget's "keep the latest time" matches: both refill
    nothing."""
    store = ledgers[0]
    client = shared_server.client()
    key = store.budget_key("clock")

    def store_now() -> float:
        seconds, micros = client.time()
        return float(seconds) + micros / 1_000_000

    rng = random.Random(11)
    step = 0.1  # s: how far the store's wall clock may step between two reads (20 times what CI saw)
    rate = Refill(20.0, 5.0)
    budget = Budget(10)
    seen = {"stored": 0, "full": 0}
    for i in range(42):
        op = rng.choice(["check", "take", "take", "charge"])
        amount = float(rng.randint(0, 3)) if op == "charge" else rng.choice([1.0, 2.0, 0.5])
        if i >= 40:  # then refilled to full: a check keeps no key, a charge of 0 deletes it
            op, amount = ("check", 1.0) if i == 40 else ("charge", 0.0)
            low = min((b.level for b in budget._buckets.values()), default=rate.burst)
            await asyncio.sleep((rate.burst - low) / rate.per_second + 0.05)
        before = store_now()
        [level] = await store.buckets([BucketOp("clock", op, rate.per_second, rate.burst, amount)])
        after = store_now()
        stored = client.hgetall(key)
        if stored:  # the script wrote the time it read: the pure arithmetic at that very time
            assert i < 40, "refilled to full, yet the bucket keeps a key"
            seen["stored"] += 1
            at = float(stored["at"])
            assert before - step <= at <= after + step
            pure = budget.apply(op, "clock", rate, amount, at)
            assert level.level == pytest.approx(pure.remaining, abs=1e-9)
            assert float(stored["level"]) == pytest.approx(level.level, abs=1e-9)
            assert level.allowed == pure.allowed
            budget._buckets["clock"] = _Bucket(float(stored["level"]), at)
        else:  # full: no key, as the pure Budget is full once it has refilled to the call
            seen["full"] += 1
            pure = copy.deepcopy(budget).apply(op, "clock", rate, amount, after + step)
            assert level.level == rate.burst == pure.remaining
            assert level.allowed == pure.allowed
            budget._buckets.pop("clock", None)
        await asyncio.sleep(rng.choice([0.0, 0.0, 0.01, 0.05]))
    # (Which calls find the bucket full depends on the pauses between them; the last two always do.)
    assert seen["stored"] >= 20
    assert seen["full"] >= 2


@pytest.mark.parametrize("refusal", ["readonly", "oom"])
async def test_an_outage_reply_in_a_shared_pipeline_is_an_outage(
        server: RedisServer, refusal: str) -> None:  # noqa: F811
    """Calls that share a pipeline (every connection busy) get Redis's replies one by one; a reply
    that says the store serves nobody (READONLY after a failover, OOM) fails the batch as an outage,
    as it does a call alone, instead of counting as one script's error on a healthy store."""
    primary = RedisLedger(server.url, prefix=f"t{uuid.uuid4().hex[:8]}", renew=False, timeout=1.0,
                          pool_size=1)
    failures: list[str] = []
    primary.on_failure(failures.append)
    await primary.start()
    client = server.client()
    try:
        if refusal == "readonly":
            client.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # a primary never there
        else:
            client.config_set("maxmemory", "1")
        op = BucketOp("requests:t", "take", 1.0, 5.0, 1.0)
        async with primary.link._gate:  # every connection busy: the calls queue for one pipeline
            calls = [asyncio.ensure_future(primary.buckets([op])) for _ in range(3)]
            await asyncio.sleep(0)
            assert len(primary.link._queue) == 3
        answers = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(a, LedgerUnavailable) and not isinstance(a, StoreScriptError)
                   for a in answers), answers
        assert not primary.healthy
        assert primary.script_errors == 0
        assert failures
    finally:
        if refusal == "readonly":
            client.execute_command("REPLICAOF", "NO", "ONE")
        else:
            client.config_set("maxmemory", "0")
        await primary.close()

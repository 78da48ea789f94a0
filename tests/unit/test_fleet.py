"""Fleet-wide budgets and fair shares, without sockets: the rate limit service over a store (a fake
with the pure Budget inside) answers as it does alone, decides alone with its part of each budget
(or refuses) while the store is away, and sends usage charges to the store; the retry budget
decides on the fleet's counts; a fair queue counts what other replicas served."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from extproc.controller import Controller
from extproc.core.budget import Budget, Refill, part
from extproc.core.decision import Outcome
from extproc.core.estimate import Job
from extproc.core.queue import Entry, LaneQueue
from extproc.core.retry_budget import RetryBudget
from extproc.metrics import Metrics
from extproc.policy.ratelimit import RateLimit
from extproc.servers.ratelimit import REPLAY_CHUNK, RateLimitService
from extproc.state import BucketOp, LedgerUnavailable, Level, StoreDown
from extproc.state.fallback import FailMode, FallbackLedger
from extproc.state.redis import RedisLedger
from tests.unit.test_ratelimit_service import OK, OVER, Clock, Rig, make_policy, request


class FakeStore:
    """A fleet's store: one pure Budget for every replica, the operations' rule of bucket.lua."""

    def __init__(self, clock: Any, *, fail_open: bool = True, fleet_size: int = 3,
                 fleet: dict[tuple[str, str], float] | None = None) -> None:
        #: The fleet's served totals by lane and tenant (share one dict between replicas' stores).
        self.fleet = {} if fleet is None else fleet
        self.seen: dict[tuple[str, str], float] = {}
        self.budget = Budget(100)
        self.clock = clock
        self.fail_open = fail_open
        self.fleet_size = fleet_size
        self.down = False
        self.delay = 0.0
        self.lose_answers = False
        """Seconds each bucket call takes (a slow store)."""
        self.calls: list[list[BucketOp]] = []
        self.retry = (0, 0)
        self.sent: list[tuple[int, int]] = []

    @property
    def parts(self) -> int:
        return self.fleet_size

    async def buckets(self, ops: Sequence[BucketOp], now: float | None = None) -> list[Level]:
        if self.down:
            raise StoreDown("down")
        if self.delay:
            await asyncio.sleep(self.delay)
        self.calls.append(list(ops))
        if self.lose_answers:
            self._apply(ops)
            raise LedgerUnavailable("timeout")  # the script ran; its answer was lost
        return self._apply(ops)

    def _apply(self, ops: Sequence[BucketOp]) -> list[Level]:
        out, refused = [], False
        for op in ops:
            name = "check" if op.op == "take" and refused else op.op
            refill = Refill(op.per_second, op.burst)
            verdict = self.budget.apply(name, op.key, refill, op.amount, self.clock())
            refused = refused or not verdict.allowed
            out.append(Level(verdict.allowed, verdict.remaining))
        return out

    async def retry_counts(self, deposits: int, withdrawals: int, window_s: float, slots: int
                           ) -> tuple[int, int]:
        if self.down:
            raise StoreDown("down")
        self.sent.append((deposits, withdrawals))
        return self.retry

    async def served(self, work: Mapping[tuple[str, str], float],
                     queued: Iterable[tuple[str, str]] = ()) -> dict[tuple[str, str], float]:
        """served.lua and RedisLedger.served: add this replica's work, read the queued pairs' totals;
        the others' part is what changed that it did not add (a pair read for the first time: none)."""
        if self.down:
            self.seen = {}
            raise StoreDown("down")
        for pair, seconds in work.items():
            if seconds > 0:
                self.fleet[pair] = self.fleet.get(pair, 0.0) + seconds
        totals = {pair: self.fleet[pair] for pair in set(queued) if pair in self.fleet}
        seen, self.seen = self.seen, totals
        others = {pair: total - seen[pair] - work.get(pair, 0.0)
                  for pair, total in totals.items() if pair in seen}
        return {pair: seconds for pair, seconds in others.items() if seconds > 1e-9}


def shared(rig: Rig, **store: Any) -> FakeStore:
    fake = FakeStore(rig.clock, **store)
    # The fake answers in-process at once; a busy machine (a parallel test run) must not turn that into
    # the 20 ms timeout. The tests of the timeout set their own.
    rig.service = RateLimitService(rig.machine(), rig.metrics, lambda: rig.config, clock=rig.clock,
                                   store=fake, store_timeout=30.0)
    return fake


def budgets(**default: Any) -> RateLimit:
    return RateLimit.model_validate({"budgets": {"default": default}})


async def test_over_a_store_the_service_answers_as_it_does_alone() -> None:
    config = RateLimit.model_validate({"budgets": {"default": {"requests": 3, "tokens": 50, "per": "minute"},
                                                   "tenants": {"b": {"requests": 1, "per": "second"}}}})
    alone, fleet = Rig(config), Rig(config)
    store = shared(fleet)
    rng = random.Random(7)
    for _ in range(200):
        step = rng.choice([0.0, 0.2, 3.0, 20.0])
        alone.clock.now += step
        fleet.clock.now += step
        tenant = rng.choice(["a", "b", "c"])
        if rng.random() < 0.3:
            usage = request(({"generic_key": "gpu_inference_tokens", "x-tenant-id": tenant},
                             rng.randint(1, 40)))
            alone.service.decide(usage)
            await fleet.service.decide_shared(usage)
            for task in list(fleet.service._flushing):
                await task
            continue
        arrival = request({"generic_key": "gpu_inference", "x-tenant-id": tenant, "path": "/x"})
        mine = alone.service.decide(arrival)
        theirs = await fleet.service.decide_shared(arrival)
        assert theirs == mine
    assert store.calls
    # The store kept the buckets, not the replica.
    assert fleet.service.machine.budget_sizes()["requests"] == 0


async def test_usage_is_charged_to_the_store_off_the_requests_path() -> None:
    rig = Rig(budgets(tokens=100))
    store = shared(rig)
    usage = request(({"generic_key": "gpu_inference_tokens", "x-tenant-id": "t"}, 150))
    await rig.service.decide_shared(usage)
    for task in list(rig.service._flushing):
        await task
    sent = [(op.key, op.op, op.amount) for call in store.calls for op in call]
    assert sent == [("tokens:t", "charge", 150.0)]
    answer = await rig.service.decide_shared(request({"generic_key": "gpu_inference", "x-tenant-id": "t"}))
    assert answer.overall_code == OVER  # in debt, fleet-wide


async def test_store_away_failing_open_each_replica_takes_its_part() -> None:
    rig = Rig(budgets(requests=6, per="minute"))
    store = shared(rig, fleet_size=3)
    store.down = True
    arrival = request({"generic_key": "gpu_inference", "x-tenant-id": "t"})
    codes = [(await rig.service.decide_shared(arrival)).overall_code for _ in range(4)]
    assert codes == [OK, OK, OVER, OVER]  # 6 a minute / 3 replicas
    assert rig.sample("extproc_ratelimit_budget_alone_total") == 4
    store.down = False
    assert (await rig.service.decide_shared(arrival)).overall_code == OK  # the fleet's bucket again
    assert not rig.service.alone


async def test_store_away_failing_closed_refuses_budgeted_requests_only() -> None:
    rig = Rig(budgets(requests=6, per="minute"))
    rig.config = RateLimit.model_validate({"budgets": {"default": {"requests": 6}, "tenants": {"free": {}}}})
    store = shared(rig, fail_open=False)
    store.down = True
    budgeted = await rig.service.decide_shared(request({"generic_key": "gpu_inference", "x-tenant-id": "t"}))
    assert budgeted.overall_code == OVER
    free = request({"generic_key": "gpu_inference", "x-tenant-id": "free"})
    unbudgeted = await rig.service.decide_shared(free)
    assert unbudgeted.overall_code == OK


def test_a_replicas_part_of_a_budget() -> None:
    assert part(Refill(6.0, 12.0), 3) == Refill(2.0, 4.0)
    assert part(Refill(1.0, 2.0), 4) == Refill(0.25, 1.0)  # a request must still fit
    assert part(Refill(1.0, 2.0), 1) == Refill(1.0, 2.0)


def test_the_retry_budget_decides_on_the_fleets_counts() -> None:
    budget = RetryBudget(ratio=0.1, min_per_second=0.0, window_s=10.0)
    for _ in range(10):
        budget.deposit(1.0)
    assert budget.balance(1.0) == 1.0
    budget.fleet(deposits=90, withdrawals=0)  # the others admitted 90 originals
    assert budget.balance(1.0) == 10.0
    budget.fleet(deposits=90, withdrawals=10)  # ... and let 10 retries through
    assert budget.balance(1.0) == 0.0
    assert not budget.try_withdraw(1.0)
    assert budget.unsent() == (10, 0)
    assert budget.unsent() == (0, 0)


def test_the_retry_budget_alone_splits_the_floor_and_closed_lets_nothing_through() -> None:
    budget = RetryBudget(ratio=0.0, min_per_second=3.0, window_s=10.0)
    budget.alone(3)
    assert budget.balance(0.0) == 10.0  # a third of the fleet's 30
    budget.alone(3, closed=True)
    assert not budget.try_withdraw(0.0)
    budget.fleet(0, 0)
    assert budget.balance(0.0) == 30.0


def _entry(i: int, tenant: str) -> Entry:
    return Entry(i, tenant, arrival=float(i), deadline=100.0, predicted=1.0, rank=float(i))


def test_a_fair_queue_counts_what_other_replicas_served() -> None:
    weights = {"acme": 3.0, "globex": 1.0}
    queue = LaneQueue(lambda t: weights[t])
    for i in range(20):
        queue.push(_entry(i, "acme" if i % 2 else "globex"))
    alone = [queue.pop().tenant for _ in range(8)]  # type: ignore[union-attr]
    assert alone.count("acme") == 6
    # The rest of the fleet served globex a lot: here acme goes first until globex is behind again.
    queue.charge("globex", 4.0)
    assert [queue.pop().tenant for _ in range(4)] == ["acme"] * 4  # type: ignore[union-attr]
    queue.charge("nobody", 5.0)  # a tenant that queues nothing here: nothing to charge


def test_a_refused_slot_gives_its_tenants_charge_back() -> None:
    queue = LaneQueue(lambda t: 1.0)
    a, b = _entry(1, "a"), _entry(2, "b")
    queue.push(a)
    queue.push(b)
    served = queue.pop()
    assert served is a
    back = Entry(a.id, a.tenant, a.arrival, a.deadline, a.predicted, a.rank)
    queue.refund(back)
    queue.push(back)
    assert queue.pop() is back  # as if never served: a is still first


async def test_the_controller_syncs_the_retry_budget_with_the_fleet_and_goes_alone_without_it() -> None:
    clock = Clock()
    store = FakeStore(clock, fleet_size=3)
    policy = make_policy(retry_budget={"ratio": 0.0, "min_per_second": 3.0, "window": "10s"})
    controller = Controller(policy, Metrics(CollectorRegistry()), clock=clock, budgets=store)
    budget = controller.machine._retry_budget
    assert budget.try_withdraw(clock.now)
    store.retry = (0, 20)  # the other replicas let 20 retries through
    await controller.fleet.sync_retry_budget()
    assert store.sent == [(0, 1)]  # this replica's own withdrawal, told once
    assert budget.balance(clock.now) == 30 - 20 - 1
    store.down = True
    await controller.fleet.sync_retry_budget()
    assert budget.balance(clock.now) == 10 - 1  # its third of the floor, on its own counts


def _outage(replicas: Sequence[str], fleet_size: int = 1) -> FallbackLedger:
    """A fallback ledger (never connected) that saw ``replicas`` alive, then lost its store."""
    primary = RedisLedger("redis://127.0.0.1:1/0", replica=replicas[0])
    ledger = FallbackLedger(primary, mode=FailMode.OPEN, fleet_size=fleet_size)
    primary.alive = tuple(replicas)
    ledger._note_alive()
    ledger._down("gone")
    return ledger


async def test_in_an_outage_budgets_split_by_the_replicas_the_slot_ledger_counts() -> None:
    ledger = _outage(["r0", "r1", "r2", "r3"])  # default flags: fleet size 1, but four replicas seen
    assert ledger.degraded
    assert ledger.parts == 4
    assert _outage(["r0", "r1"], fleet_size=3).parts == 3  # never fewer than the fleet size
    rig = Rig(budgets(requests=8, per="minute"))
    rig.service = RateLimitService(rig.machine(), rig.metrics, lambda: rig.config, clock=rig.clock,
                                   store=ledger)
    arrival = request({"generic_key": "gpu_inference", "x-tenant-id": "t"})
    codes = [(await rig.service.decide_shared(arrival)).overall_code for _ in range(3)]
    assert codes == [OK, OK, OVER]  # 8 a minute / 4 replicas, not the whole budget


async def test_in_an_outage_the_retry_floor_splits_by_the_replicas_the_slot_ledger_counts() -> None:
    clock = Clock()
    policy = make_policy(retry_budget={"ratio": 0.0, "min_per_second": 4.0, "window": "10s"})
    controller = Controller(policy, Metrics(CollectorRegistry()), clock=clock,
                            budgets=_outage(["r0", "r1", "r2", "r3"]))
    await controller.fleet.sync_retry_budget()
    assert controller.machine._retry_budget.balance(clock.now) == 10  # a quarter of the fleet's 40


async def test_a_slow_store_is_waited_for_only_briefly_then_the_replica_decides_alone() -> None:
    rig = Rig(budgets(requests=6, per="minute"))
    store = shared(rig, fleet_size=3)
    rig.service.store_timeout = 0.02
    # Alive, but slower than Envoy's ratelimit timeout (50 ms shipped): each call takes a hundred
    # times the service's own wait for it (the calls go on, shielded), so that waiting for even one
    # answer would show.
    store.delay = 100 * rig.service.store_timeout
    arrival = request({"generic_key": "gpu_inference", "x-tenant-id": "t"})
    started = time.perf_counter()
    codes = [(await rig.service.decide_shared(arrival)).overall_code for _ in range(3)]
    # Three decisions in less time than one store call takes: each gave up at the service's timeout.
    assert time.perf_counter() - started < store.delay
    assert codes == [OK, OK, OVER]  # its part: 6 a minute / 3 replicas
    assert rig.sample("extproc_ratelimit_budget_timeouts_total") == 3
    store.delay = 0.0
    assert (await rig.service.decide_shared(arrival)).overall_code == OK  # the fleet's bucket again


def _charges(store: FakeStore) -> list[tuple[str, float]]:
    return [(op.key, op.amount) for call in store.calls for op in call if op.op == "charge"]


async def _settled(service: RateLimitService) -> None:
    while service._flushing:
        await asyncio.gather(*list(service._flushing))


def _usage(tenant: str, tokens: int) -> Any:
    return request(({"generic_key": "gpu_inference_tokens", "x-tenant-id": tenant}, tokens))


@pytest.mark.parametrize("fail_open", [True, False])
async def test_usage_charged_while_the_store_is_away_is_accounted_once(fail_open: bool) -> None:
    """Failing open, the outage's usage is charged to this replica's part, which it enforced
    meanwhile, and not replayed (the fleet's bucket would lock the tenant out as long again);
    failing closed nothing took it, so it is kept and reaches the fleet when the store is back."""
    rig = Rig(budgets(tokens=100, per="minute"))
    store = shared(rig, fail_open=fail_open)
    store.down = True
    for tokens in (150, 50):
        await rig.service.decide_shared(_usage("t", tokens))
        await _settled(rig.service)
    assert len(rig.service.backlog) == (0 if fail_open else 1)  # closed: merged per tenant
    # Open: its part is charged meanwhile.
    assert rig.service.machine.budget_sizes()["tokens"] == (1 if fail_open else 0)
    store.down = False
    arrival = request({"generic_key": "gpu_inference", "x-tenant-id": "t"})
    await rig.service.decide_shared(arrival)  # the store answers again: the backlog goes
    await _settled(rig.service)
    assert _charges(store) == ([] if fail_open else [("tokens:t", 200.0)])
    assert not rig.service.backlog
    # Open: the tenant was held to its part during the outage, the fleet's bucket is its own again.
    assert (await rig.service.decide_shared(arrival)).overall_code == (OK if fail_open else OVER)


async def test_the_backlog_keeps_a_bounded_number_of_tenants_oldest_dropped_first() -> None:
    rig = Rig(RateLimit.model_validate({"budgets": {"default": {"tokens": 100}, "max_tenants": 2}}))
    store = FakeStore(rig.clock, fail_open=False)  # failing open, the replica's part takes the usage
    rig.service = RateLimitService(rig.machine(), rig.metrics, lambda: rig.config, clock=rig.clock,
                                   store=store)
    store.down = True
    for tenant in ("a", "b", "c"):
        await rig.service.decide_shared(_usage(tenant, 10))
        await _settled(rig.service)
    assert rig.sample("extproc_ratelimit_charges_dropped_total") == 1
    store.down = False
    await rig.service.decide_shared(_usage("c", 5))
    await _settled(rig.service)
    assert _charges(store) == [("tokens:b", 10.0), ("tokens:c", 10.0), ("tokens:c", 5.0)]  # a: dropped


async def test_usage_whose_answer_was_lost_is_not_replayed() -> None:
    rig = Rig(budgets(tokens=100, per="minute"))
    store = shared(rig)
    store.lose_answers = True
    await rig.service.decide_shared(_usage("t", 30))
    await _settled(rig.service)
    store.lose_answers = False
    await rig.service.decide_shared(_usage("t", 1))
    await _settled(rig.service)
    assert _charges(store) == [("tokens:t", 30.0), ("tokens:t", 1.0)]  # the 30 once, not again
    assert store.budget.check("tokens:t", Refill(100 / 60, 100.0), 1, rig.clock()).remaining == 69.0


async def test_closing_waits_for_the_charges_on_their_way() -> None:
    rig = Rig(budgets(tokens=100))
    store = shared(rig)
    store.delay = 0.05
    await rig.service.decide_shared(_usage("t", 30))
    await rig.service.close()
    assert _charges(store) == [("tokens:t", 30.0)]


async def test_the_controller_charges_its_fair_queues_what_the_other_replicas_served() -> None:
    """Two replicas' stores over one fleet: what the other served for a tenant queued here puts that
    tenant behind in this replica's fair queue; what this replica served itself is not charged again."""
    clock = Clock()
    fleet: dict[tuple[str, str], float] = {}
    here, there = FakeStore(clock, fleet=fleet), FakeStore(clock, fleet=fleet)

    controller = Controller(make_policy(), Metrics(CollectorRegistry()), clock=clock, budgets=here)
    running = [controller.submit("interactive", "x", Job(None, 10, 10)).ticket for _ in range(2)]
    waiting = {}
    for tenant in ("globex", "acme"):
        decision = controller.submit("interactive", tenant, Job(None, 10, 10))
        assert decision.outcome is Outcome.QUEUED
        waiting[tenant] = controller._waiters[decision.ticket.id]
    queued = [("interactive", "globex"), ("interactive", "acme")]
    await there.served({pair: 1.0 for pair in queued}, [])
    await controller.fleet.sync_served(queued)  # a baseline
    controller.fleet._served[("interactive", "acme")] = 50.0  # its own work: sent, never charged back
    await there.served({("interactive", "globex"): 100.0}, [])  # the other replica served globex
    await controller.fleet.sync_served(queued)
    assert fleet == {("interactive", "globex"): 101.0, ("interactive", "acme"): 51.0}
    assert controller.fleet._served == {}
    controller.release(running[0])
    answered = {tenant: future.result().outcome for tenant, future in waiting.items() if future.done()}
    assert answered == {"acme": Outcome.ADMITTED}  # globex waits: the fleet served it elsewhere


async def test_a_large_backlog_is_replayed_in_chunks_and_what_was_not_sent_is_kept() -> None:
    """Thousands of tenants' usage missed in an outage: one script with all of them would hold the
    store past its timeout (every replica waits meanwhile); chunks go one after another, and a
    chunk the store refuses (down again) goes back to the backlog with the ones after it."""
    rig = Rig(RateLimit.model_validate({"budgets": {"default": {"tokens": 100}, "max_tenants": 5000}}))
    store = shared(rig, fail_open=False)
    store.down = True
    for i in range(1000):
        await rig.service.decide_shared(_usage(f"t{i}", 10))
    await _settled(rig.service)
    assert len(rig.service.backlog) == 1000
    store.down = False
    sent = 0
    real = store.buckets

    async def down_after_two(ops: Sequence[BucketOp], now: float | None = None) -> list[Level]:
        nonlocal sent
        if sent == 2:
            store.down = True
        sent += 1
        return await real(ops, now)

    store.buckets = down_after_two  # type: ignore[method-assign]
    await rig.service._flush()
    assert [len(call) for call in store.calls] == [REPLAY_CHUNK, REPLAY_CHUNK]
    assert len(rig.service.backlog) == 1000 - 2 * REPLAY_CHUNK  # the unsent chunks, kept
    store.down = False
    await rig.service._flush()
    assert all(len(call) <= REPLAY_CHUNK for call in store.calls)
    assert sorted(key for key, _ in _charges(store)) == sorted(f"tokens:t{i}" for i in range(1000))
    assert not rig.service.backlog


async def test_closing_past_its_grace_keeps_and_logs_what_was_not_sent_and_lets_the_call_finish() -> None:
    rig = Rig(RateLimit.model_validate({"budgets": {"default": {"tokens": 100}, "max_tenants": 5000}}))
    store = shared(rig, fail_open=False)
    store.down = True
    for i in range(2 * REPLAY_CHUNK + 50):
        await rig.service.decide_shared(_usage(f"t{i}", 10))
    await _settled(rig.service)
    store.down, store.delay = False, 0.2
    # The service's own logger, recorded (capture_logs misses a logger cached by earlier tests).
    logs: list[dict[str, Any]] = []
    rig.service.log = _Recorder(logs)  # type: ignore[assignment]
    await rig.service.close(grace_s=0.05)
    # The chunk on its way was not cut short: it reaches the store; the rest is kept and logged.
    assert len(rig.service.backlog) == REPLAY_CHUNK + 50
    assert any(entry["event"].startswith("shutdown: token usage not sent")
               and (entry["charges"], entry["in_doubt"]) == (REPLAY_CHUNK + 50, REPLAY_CHUNK)
               for entry in logs), logs
    async with asyncio.timeout(10):  # the store answers after its delay (0.2 s): waited for, not slept
        while not store.calls:  # noqa: ASYNC110 (a fake store: polled, as test_fuzz_ext_proc does)
            await asyncio.sleep(0.01)
    assert [len(call) for call in store.calls] == [REPLAY_CHUNK]


async def test_closing_waits_for_an_arrivals_call_that_outlived_its_timeout() -> None:
    rig = Rig(budgets(requests=6, per="minute"))
    store = shared(rig)
    rig.service.store_timeout = 0.01
    store.delay = 0.1
    await rig.service.decide_shared(request({"generic_key": "gpu_inference", "x-tenant-id": "t"}))
    assert rig.sample("extproc_ratelimit_budget_timeouts_total") == 1
    assert not store.calls  # still on its way, shielded
    await rig.service.close(grace_s=1.0)
    assert len(store.calls) == 1  # close waited for it


class _Recorder:
    """Stands in for a structlog logger: every call is kept as its event and fields."""

    def __init__(self, logs: list[dict[str, Any]]) -> None:
        self._logs = logs

    def __getattr__(self, level: str) -> Any:
        def record(event: str, *args: object, **fields: Any) -> None:
            self._logs.append({"event": event, "log_level": level, **fields})
        return record

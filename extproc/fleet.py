"""The fleet-sync client: one replica's side of the shared store (slots, queues, budgets, the limit).

How this works: with several replicas, the decision machine admits on the counts it last saw;
the shared :class:`~extproc.state.Ledger` has the last word. :meth:`Fleet.confirm` takes an
admitted request's slot in the store before Envoy hears "admit" (refused: the request goes back
to its place in the queue, and its lane waits for a slot to free anywhere, or its backoff). A
background task (:meth:`Fleet.run`) publishes this replica's queues on every change and every
0.2 s, reads the cluster's counts, agrees the self-sized fleet limit, swaps retry-budget counts
and served work (fair shares) with the other replicas, and feeds each answer to the machine as
an event. Slots are given back in the background; a failed give-back is left to the lease's TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import structlog

from extproc.core.decision import Decision, State, Ticket
from extproc.core.machine import RETRY_BUDGET_SLOTS, Machine
from extproc.metrics import Metrics
from extproc.state import BudgetStore, GlobalView, LaneLimits, Ledger, LedgerUnavailable, Limits
from extproc.state.cluster import RefusalBackoff, others

log = structlog.get_logger("extproc")


class Fleet:
    """This replica's client of the shared store.

    ``settle``: the driver's answer to decisions that come out of the store's events; ``record``:
    how the driver records an admission once its slot is granted.
    """

    def __init__(self, machine: Machine, ledger: Ledger | None, budgets: BudgetStore | None,
                 metrics: Metrics, *,
                 clock: Callable[[], float], settle: Callable[[Iterable[Decision]], None],
                 record: Callable[[Decision], None], changed: Callable[[], None],
                 rng: random.Random | None = None) -> None:
        self.machine = machine
        #: The shared slot ledger (None: only the budgets are shared).
        self.ledger = ledger
        #: Where the fleet's retry budget and served work are counted (None: each replica's own).
        self.budgets = budgets
        self.metrics = metrics
        self.now = clock
        self._settle = settle
        self._record = record
        self._changed = changed
        self.leader = False
        self.view: GlobalView | None = None
        #: Work (predicted seconds) this replica served since it last told the store, by lane and tenant.
        self._served: dict[tuple[str, str], float] = {}
        self.limits = Limits.of(machine.policy)
        self._leased: dict[int, Ticket] = {}
        #: Slots the ledger granted, per lane (what in flight means with a shared ledger).
        self.leased_by_lane: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.wake = asyncio.Event()
        self._freed: set[str] = set()
        #: Lanes the ledger refused, and when each may ask again.
        self._backoff = RefusalBackoff(rng)
        #: Converts machine ranks (this clock) to epoch seconds, comparable across replicas.
        self._epoch_offset = time.time() - clock()

    # -- a request's slot -----------------------------------------------------------------------

    async def confirm(self, decision: Decision) -> Decision:
        """Take an admitted request's slot in the ledger (returned as it is), or put the request back
        in its queue (answered QUEUED: wait again)."""
        ticket = decision.ticket
        lane = ticket.lane
        rank = self.machine.rank(ticket) + self._epoch_offset
        assert self.ledger is not None
        verdict = await self.ledger.acquire(lane, self._lease(ticket), self.limits, rank)
        if ticket.state is not State.INFLIGHT:
            # The client left while the ledger answered: release() has run; give the slot back.
            if verdict:
                self._spawn(self._give_back(ticket))
            return decision
        if verdict:
            if self.budgets is not None:
                key = (lane, ticket.tenant)
                self._served[key] = self._served.get(key, 0.0) + ticket.predicted
            self._leased[ticket.id] = ticket
            self._count_lease(lane, 1)
            self._backoff.granted(lane)
            self._record(decision)
            return decision
        self.metrics.ledger_refusals.labels(lane, verdict.value).inc()
        # The lane asks again when a slot frees (a wake-up), or after its backoff.
        self._backoff.refused(lane, self.now())
        requeued = self.machine.requeue(ticket, self.now())
        self.wake.set()
        return requeued

    def released(self, ticket: Ticket) -> None:
        """A request ended: its slot (if it had one) goes back to the store."""
        if self._leased.pop(ticket.id, None) is not None:
            self._count_lease(ticket.lane, -1)
            self._spawn(self._give_back(ticket))
        self.wake.set()

    def _count_lease(self, lane: str, delta: int) -> None:
        left = self.leased_by_lane.get(lane, 0) + delta
        if left:
            self.leased_by_lane[lane] = left
        else:
            self.leased_by_lane.pop(lane, None)

    def _lease(self, ticket: Ticket) -> str:
        assert self.ledger is not None
        return f"{self.ledger.replica}:{ticket.id}"

    def update_limits(self, retired: Iterable[LaneLimits]) -> None:
        """The policy or the fleet limit changed: the limits the store enforces."""
        self.limits = Limits.of(self.machine.policy, list(retired))

    async def _give_back(self, ticket: Ticket) -> None:
        assert self.ledger is not None
        try:
            await self.ledger.release(ticket.lane, self._lease(ticket))
        except Exception:
            # The lease's TTL frees the slot anyway; a release must never fail a request.
            log.warning("could not release a slot in the shared store; its lease will expire",
                        lane=ticket.lane, exc_info=True)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settled(self) -> None:
        """Wait for the slots on their way back."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- the sync loop --------------------------------------------------------------------------

    def on_freed(self, lane: str) -> None:
        self._freed.add(lane)
        self.wake.set()

    async def run(self, interval: float = 0.2) -> None:
        """Publish this replica's queues and read the cluster's counts, on changes and every ``interval``."""
        while True:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that races
            # with the event (stop() would then wait forever).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self.wake.wait()
            self.wake.clear()
            try:
                await self.sync_once()
            except Exception:
                log.warning("shared store sync failed", exc_info=True)
                await asyncio.sleep(interval)

    async def sync_once(self) -> None:
        machine, ledger = self.machine, self.ledger
        assert ledger is not None
        views = machine.snapshot(self.now())
        queued = {name: view.queued for name, view in views.items()}
        heads = {name: rank + self._epoch_offset for name, rank in machine.heads().items()}
        tenants = {name: dict(view.tenants) for name, view in views.items() if view.tenants}
        await ledger.publish_queue(queued, heads, tenants)
        auto = machine.auto
        if auto is not None:
            limit, self.leader = await ledger.agree_limit(auto.limit, starting=auto.starting)
            self._settle(machine.set_limit(limit, self.now()))
            self._changed()
        view = await ledger.view()
        self.view = view
        await self.sync_retry_budget()
        await self.sync_served([(lane, tenant) for lane, per in tenants.items() for tenant in per])
        mine: dict[str, int] = {}
        for ticket in self._leased.values():
            mine[ticket.lane] = mine.get(ticket.lane, 0) + 1
        alone = ledger.alone(self.limits) if view.degraded else None
        # Queue counts are read after publishing ours: the rest is the other replicas'.
        queued_here = {name: v.queued for name, v in machine.snapshot(self.now()).items()}
        rest = others(view, mine, queued_here, self.limits, alone)
        now = self.now()
        freed, self._freed = self._freed, set()
        self._settle(machine.set_others(rest.inflight, rest.queued, now, rest.total))
        machine.fleet_completions(view.completed, view.replicas, now)
        blocked = machine.blocked
        if freed or blocked:
            # Lanes refused before may try again where a slot freed (any lane's slot may be lent),
            # or once their backoff is over.
            due = blocked if freed else self._backoff.due(blocked, now)
            if due:
                self._settle(machine.unblock(now, due))

    async def sync_served(self, queued: list[tuple[str, str]]) -> None:
        """Tell the fleet's store the work this replica served; charge the fair queues what the other
        replicas served (so tenants' shares follow their weights fleet-wide)."""
        store = self.budgets
        if store is None:
            return
        served, self._served = self._served, {}
        try:
            others_served = await store.served(served, queued)
        except LedgerUnavailable:
            return  # each replica is fair on its own meanwhile
        self.machine.charge_others(others_served)

    async def sync_retry_budget(self) -> None:
        """Tell the fleet's store this replica's new retry-budget counts; read the others'."""
        store = self.budgets
        machine = self.machine
        if store is None or not machine.policy.retry_budget.enabled:
            return
        deposits, withdrawals = machine.retry_budget_unsent()
        try:
            counts = await store.retry_counts(deposits, withdrawals, machine.retry_window_s,
                                              RETRY_BUDGET_SLOTS)
        except LedgerUnavailable:
            machine.retry_budget_alone(store.parts, closed=not store.fail_open)
            return
        machine.retry_budget_fleet(*counts)


"""The live driver of the pure core: wall clock, futures for held requests, timers, the store.

How this works: every decision is the core's (:class:`~extproc.core.gatekeeper.Gatekeeper`);
this module only runs it live. Every call into it happens on the event loop's thread, so
it needs no locks. Decisions that concern *other* requests (a queued request admitted
because a slot freed, one rejected because its deadline passed or it was evicted) resolve
that request's future; the handler holding it wakes and answers Envoy. One background task
sleeps until the scheduler's next deadline and calls ``expire``; with a shared store, another
publishes this replica's queues and reads the cluster's counts, and ``confirm`` takes each
admitted request's slot in the store before Envoy hears "admit". Metrics are recorded here,
from the decisions.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import replace
from typing import Any

import structlog

from extproc.core.admission import LaneView
from extproc.core.decision import Decision, Outcome, Reason, State, Ticket
from extproc.core.drain import FleetRate
from extproc.core.estimate import Job
from extproc.core.gatekeeper import Gatekeeper
from extproc.core.recent import ADMIT, REJECT, SHADOW, Recent
from extproc.core.retry_budget import SLOTS
from extproc.core.saturation import Effect, Reading
from extproc.metrics import Metrics
from extproc.policy.schema import Policy
from extproc.state import BudgetStore, GlobalView, LaneLimits, Ledger, LedgerUnavailable, Limits
from extproc.state.cluster import RefusalBackoff, others

log = structlog.get_logger("extproc")


class Controller:
    def __init__(self, policy: Policy, metrics: Metrics, *, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None, ledger: Ledger | None = None,
                 budgets: BudgetStore | None = None) -> None:
        self.gate = Gatekeeper(policy, rng, clock())
        self.scheduler = self.gate.scheduler
        #: With a shared store the fleet limit (auto) is agreed there; this replica sets it while it leads.
        self.gate.fleet_managed = ledger is not None
        self.fleet_leader = False
        self._fleet_rate = FleetRate()
        self.metrics = metrics
        #: The current time in seconds: the clock itself, not a method wrapping it (read several
        #: times per request).
        self.now: Callable[[], float] = clock
        self._waiters: dict[int, asyncio.Future[Decision]] = {}
        self._wake = asyncio.Event()
        # Set while nothing is in flight or queued. Made by the first wait_idle (only shutdown
        # waits for idleness): until then submit and release skip keeping it up to date.
        self._idle: asyncio.Event | None = None
        self._timer: asyncio.Task[None] | None = None
        #: The last minute's decisions, for the live view.
        self.recent = Recent()
        #: Called after every policy swap (the classifier is rebuilt there).
        self.on_reconfigure: list[Callable[[Policy], None]] = []
        #: Saturation rules over cluster signals; readings arrive through ``on_signals``.
        self.saturation = self.gate.saturation
        #: Retries may only be a share of admitted originals (checked in ``submit``).
        self.retry_budget = self.gate.retry_budget
        #: The shared slot ledger when several replicas enforce one set of limits (None: alone).
        self.ledger = ledger
        #: Where the fleet's retry budget is counted (None: this replica's budget is its own).
        self.budgets = budgets
        #: Work (predicted seconds) this replica served since it last told the store, by lane and tenant.
        self._served: dict[tuple[str, str], float] = {}
        self._limits = Limits.of(self.gate.policy)
        self._leased: dict[int, Ticket] = {}
        self._lease_tasks: set[asyncio.Task[None]] = set()
        self._sync_wake = asyncio.Event()
        self._sync_task: asyncio.Task[None] | None = None
        self._freed: set[str] = set()
        #: Lanes the ledger refused, and when each may ask again.
        self._backoff = RefusalBackoff(rng)
        #: Slots the ledger granted, per lane (what in flight means with a shared ledger).
        self._leased_by_lane: dict[str, int] = {}
        #: Converts scheduler ranks (this clock) to epoch seconds, comparable across replicas.
        self._epoch_offset = time.time() - clock()
        self.view: GlobalView | None = None
        metrics.watch(self.lanes, lambda: self.scheduler.draining, lambda: self.view,
                      lambda: self.scheduler.drain_rates(self.now()), self._bookings)

    @property
    def policy(self) -> Policy:
        return self.scheduler.policy

    def _bookings(self) -> int:
        self.scheduler.expire_bookings(self.now())
        return self.scheduler.bookings

    def lanes(self) -> dict[str, LaneView]:
        """Every lane's view. With a shared ledger a request counts in flight once the ledger granted
        its slot, not while it waits for the verdict (which may refuse it): the gauges then never
        show more than the ledger holds."""
        views = self.scheduler.snapshot(self.now())
        if self.ledger is None:
            return views
        leased = self._leased_by_lane
        return {name: view if view.shadow else replace(view, inflight=leased.get(name, 0))
                for name, view in views.items()}

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._timer is None:
            self._timer = loop.create_task(self._run_timers(), name="extproc-timers")
        if self.ledger is not None and self._sync_task is None:
            self.ledger.on_freed(self._on_freed)
            self._sync_task = loop.create_task(self._sync(), name="extproc-ledger-sync")

    async def stop(self) -> None:
        for task in (self._timer, self._sync_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._timer = self._sync_task = None
        if self._lease_tasks:
            await asyncio.gather(*self._lease_tasks, return_exceptions=True)

    def drain(self) -> None:
        """Stop admitting; queued requests are answered at once (503 draining)."""
        self._settle(self.scheduler.drain(self.now()))
        self._update_idle()

    def undrain(self) -> None:
        self._settle(self.scheduler.undrain(self.now()))

    def pause(self, lane: str) -> None:
        """Admit nothing more from ``lane`` (KeyError if unknown); its requests queue until resumed."""
        self.scheduler.pause(lane)

    def resume(self, lane: str) -> None:
        self._settle(self.scheduler.resume(lane, self.now()))

    def apply_saturation(self, effects: Mapping[str, Effect]) -> None:
        """Swap in what saturation does to each lane (tests and tools; signals go through on_signals)."""
        self._settle(self.scheduler.apply_saturation(effects, self.now()))
        self._update_idle()

    def on_signals(self, readings: Mapping[str, Reading], now: float) -> None:
        """New signal readings (``now`` on this controller's clock): re-evaluate saturation rules
        and move the self-sized limit."""
        view = self.view if self.ledger is not None else None
        fleet = sum(view.inflight.values()) if view is not None else None
        result = self.gate.on_signals(readings, now, fleet_inflight=fleet)
        for change in result.changes:
            log.warning("saturation rule active" if change.active else "saturation rule released",
                        rule=change.rule, signal=change.signal, value=change.value, stale=change.stale,
                        why=change.why)
        self._settle(result.decisions)
        move = result.move
        if move is not None and (self.ledger is None or self.fleet_leader):
            log.info("capacity limit moved", limit=move.limit, previous=move.previous, reason=move.reason,
                     why=move.why, shadow=not self.policy_base.auto_capacity)
            self.metrics.capacity_moves.labels(move.reason).inc()
        if self.ledger is not None and self.gate.auto is not None:
            self._sync_wake.set()  # the leader's proposal goes to the store, the fleet limit comes back
        self._capacity_changed()
        self._update_idle()

    @property
    def policy_base(self) -> Policy:
        """The policy as loaded (``policy`` is it sized at the fleet limit, with auto)."""
        return self.gate.base

    def _capacity_changed(self) -> None:
        auto = self.gate.auto
        if auto is None:
            return
        self._limits = self._limits_now()
        state = auto.state()
        mode = "enforce" if self.gate.base.auto_capacity else "shadow"
        self.metrics.capacity_limit.labels(mode).set(state.limit)
        self.metrics.capacity_stale.set(1 if state.stale else 0)
        self.metrics.capacity_unreachable.set(1 if state.unreachable else 0)

    def reconfigure(self, policy: Policy) -> None:
        """Swap in a new policy at once; queued work it lets start is admitted."""
        self._settle(self.gate.reconfigure(policy, self.now()))
        self._limits = self._limits_now()
        for listener in self.on_reconfigure:
            listener(policy)
        self._wake.set()
        self._update_idle()

    async def wait_idle(self, grace_s: float) -> bool:
        """Wait until nothing is in flight; False if the grace period passed first."""
        if self._idle is None:
            self._idle = asyncio.Event()
            self._update_idle()
        try:
            async with asyncio.timeout(grace_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    # -- requests ---------------------------------------------------------------------

    def submit(self, lane: str, tenant: str, job: Job, *, retry: bool = False) -> Decision:
        """Decide a new request; ``retry``: its client says it is a retry (it spends retry budget)."""
        submitted = self.gate.submit(lane, tenant, job, self.now(), retry=retry)
        if submitted.budget_shadow:
            self.metrics.shadow_of(lane, Outcome.REJECTED.value, Reason.RETRY_BUDGET.value).inc()
        decision = submitted.decision
        self._record(decision)
        if decision.outcome is Outcome.QUEUED:
            self._waiters[decision.ticket.id] = asyncio.get_running_loop().create_future()
            self._wake.set()
        self._settle(submitted.evicted)
        if self._idle is not None:
            self._update_idle()
        return decision

    def permit_retry(self) -> bool:
        """A rejection may tell its client to retry: reserve that retry in the budget, if there is room."""
        return self.gate.permit_retry(self.now())

    async def wait(self, ticket: Ticket) -> Decision:
        """Wait until a queued ticket is admitted or rejected."""
        future = self._waiters[ticket.id]
        try:
            return await asyncio.shield(future)
        finally:
            # Kept until now (not dropped when answered): the answer may come before the wait.
            if self._waiters.get(ticket.id) is future:
                del self._waiters[ticket.id]

    def release(self, ticket: Ticket, *, learn: bool = True) -> None:
        """Idempotent end of a request, however it ended."""
        self._waiters.pop(ticket.id, None)
        if ticket.state is State.DONE:
            return
        was_inflight = ticket.state is State.INFLIGHT
        now = self.now()
        if was_inflight and ticket.admitted_at is not None:
            self.metrics.service_time_of(ticket.lane).observe(now - ticket.admitted_at)
        elif ticket.state is State.QUEUED:
            self.metrics.decisions_of(ticket.lane, Outcome.CANCELLED.value).inc()
        self._settle(self.scheduler.release(ticket, now, learn=learn))
        if self._leased.pop(ticket.id, None) is not None:
            self._count_lease(ticket.lane, -1)
            self._spawn(self._give_back(ticket))
        if self.ledger is not None:
            self._sync_wake.set()
        if self._idle is not None:
            self._update_idle()

    # -- several replicas: the shared slot ledger -------------------------------------------------

    async def confirm(self, decision: Decision) -> Decision:
        """Take the admitted request's slot in the shared ledger, or put it back in its queue.

        Alone (no ledger) this returns ``decision`` as it is. With one, the scheduler's
        admission was made on counts as last seen; the ledger checks the cluster-wide limits
        atomically. Refused, the request goes back to its place in the queue (answered QUEUED:
        wait again) and its lane waits until a slot frees somewhere.
        """
        ledger = self.ledger
        if ledger is None or decision.outcome is not Outcome.ADMITTED:
            return decision
        ticket = decision.ticket
        if decision.shadow is not None or self.scheduler.shadowed(ticket.lane):
            # Shadow lanes observe only: they never wait for the ledger, nor take its slots.
            self._record_now(decision)
            return decision
        rank = self.scheduler.rank(ticket) + self._epoch_offset
        lane = ticket.lane
        verdict = await ledger.acquire(lane, self._lease(ticket), self._limits, rank)
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
            self._record_now(decision)
            return decision
        self.metrics.ledger_refusals.labels(ticket.lane, verdict.value).inc()
        # The lane asks again when a slot frees (a wake-up), or after its backoff.
        self._backoff.refused(lane, self.now())
        requeued = self.scheduler.requeue(ticket, self.now())
        self._waiters[ticket.id] = asyncio.get_running_loop().create_future()
        self._sync_wake.set()
        self._wake.set()
        return requeued

    def _count_lease(self, lane: str, delta: int) -> None:
        left = self._leased_by_lane.get(lane, 0) + delta
        if left:
            self._leased_by_lane[lane] = left
        else:
            self._leased_by_lane.pop(lane, None)

    def _lease(self, ticket: Ticket) -> str:
        assert self.ledger is not None
        return f"{self.ledger.replica}:{ticket.id}"

    def _limits_now(self) -> Limits:
        retired = [LaneLimits(name, view.limit or view.inflight) for name, view in self.lanes().items()
                   if view.retired]
        return Limits.of(self.policy, retired)

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
        self._lease_tasks.add(task)
        task.add_done_callback(self._lease_tasks.discard)

    def _on_freed(self, lane: str) -> None:
        self._freed.add(lane)
        self._sync_wake.set()

    async def _sync(self, interval: float = 0.2) -> None:
        """Publish this replica's queues and read the cluster's counts, on changes and every ``interval``."""
        ledger = self.ledger
        assert ledger is not None
        while True:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that races
            # with the event (stop() would then wait forever).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._sync_wake.wait()
            self._sync_wake.clear()
            try:
                await self._sync_once(ledger)
            except Exception:
                log.warning("shared store sync failed", exc_info=True)
                await asyncio.sleep(interval)

    async def _sync_once(self, ledger: Ledger) -> None:
        scheduler = self.scheduler
        views = scheduler.snapshot(self.now())
        queued = {name: view.queued for name, view in views.items()}
        heads = {name: rank + self._epoch_offset for name, rank in scheduler.heads().items()}
        tenants = {name: dict(view.tenants) for name, view in views.items() if view.tenants}
        await ledger.publish_queue(queued, heads, tenants)
        auto = self.gate.auto
        if auto is not None:
            limit, self.fleet_leader = await ledger.agree_limit(auto.limit)
            self._settle(self.gate.set_limit(limit, self.now()))
            self._capacity_changed()
        view = await ledger.view()
        self.view = view
        await self._sync_retry_budget()
        await self._sync_served([(lane, tenant) for lane, per in tenants.items() for tenant in per])
        mine: dict[str, int] = {}
        for ticket in self._leased.values():
            mine[ticket.lane] = mine.get(ticket.lane, 0) + 1
        alone = ledger.alone(self._limits) if view.degraded else None
        # Queue counts are read after publishing ours: the rest is the other replicas'.
        queued_here = {name: v.queued for name, v in scheduler.snapshot(self.now()).items()}
        rest = others(view, mine, queued_here, self._limits, alone)
        now = self.now()
        freed, self._freed = self._freed, set()
        self._settle(scheduler.set_others(rest.inflight, rest.queued, now, rest.total))
        # The fleet's drain per lane, for Retry-After; while the store is unreachable (no counters)
        # each replica measures its own again.
        self._fleet_rate.update(view.completed, now)
        scheduler.set_drain_rates(self._fleet_rate.rates(now) if view.completed else {}, view.replicas)
        if freed or scheduler.blocked:
            # Lanes refused before may try again where a slot freed (any lane's slot may be lent),
            # or once their backoff is over.
            due = set(scheduler.blocked) if freed else self._backoff.due(scheduler.blocked, now)
            if due:
                self._settle(scheduler.unblock(now, due))
        self._update_idle()

    async def _sync_served(self, queued: list[tuple[str, str]]) -> None:
        """Tell the fleet's store the work this replica served; charge the fair queues what the other
        replicas served (so tenants' shares follow their weights fleet-wide)."""
        store = self.budgets
        if store is None:
            return
        served, self._served = self._served, {}
        try:
            others = await store.served(served, queued)
        except LedgerUnavailable:
            return  # each replica is fair on its own meanwhile
        self.scheduler.charge_others(others)

    async def _sync_retry_budget(self) -> None:
        """Tell the fleet's store this replica's new retry-budget counts; read the others'."""
        store = self.budgets
        if store is None or not self.policy.retry_budget.enabled:
            return
        budget = self.gate.retry_budget
        deposits, withdrawals = budget.unsent()
        try:
            others = await store.retry_counts(deposits, withdrawals, budget.window_s, SLOTS)
        except LedgerUnavailable:
            budget.alone(store.parts, closed=not store.fail_open)
            return
        budget.fleet(*others)

    # -- internals --------------------------------------------------------------------

    def _record(self, decision: Decision) -> None:
        if decision.outcome is Outcome.ADMITTED and self.ledger is not None:
            return  # recorded once the ledger granted its slot (confirm)
        self._record_now(decision)

    def _record_now(self, decision: Decision) -> None:
        ticket = decision.ticket
        lane = ticket.lane
        metrics = self.metrics
        metrics.decisions_of(lane, decision.outcome.value).inc()
        if decision.outcome is Outcome.ADMITTED:
            self.gate.admitted(decision)
            wait = ticket.queue_wait
            metrics.queue_wait_of(lane).observe(wait)
            shadow = decision.shadow
            if shadow is not None:
                metrics.shadow_of(lane, shadow.value, decision.reason.value if decision.reason else "").inc()
            self.recent.add(lane, SHADOW if shadow is Outcome.REJECTED else ADMIT, ticket.admitted_at or 0.0,
                            wait)
        elif decision.outcome is Outcome.REJECTED:
            if decision.reason is not None:
                metrics.rejections_of(lane, decision.reason.value).inc()
            effect = decision.saturation
            if effect is not None:
                metrics.saturation_rejections.labels(lane, effect.shed_by or "", effect.signal or "").inc()
            self.recent.add(lane, REJECT, self.now())

    def _settle(self, decisions: Iterable[Decision]) -> None:
        for decision in decisions:
            self._record(decision)
            future = self._waiters.get(decision.ticket.id)
            if future is not None and not future.done():
                future.set_result(decision)

    def _update_idle(self) -> None:
        if self._idle is None:
            return
        if self.scheduler.total_inflight == 0 and self.scheduler.total_queued == 0:
            self._idle.set()
        else:
            self._idle.clear()

    async def _run_timers(self) -> None:
        while True:
            due = self.scheduler.next_timer()
            self._wake.clear()
            timeout = None if due is None else max(due - self.now(), 0.0)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            before = self.scheduler.reclaimed
            self._settle(self.scheduler.expire(self.now()))
            if self.scheduler.reclaimed > before:
                self.metrics.slots_reclaimed.inc(self.scheduler.reclaimed - before)
            self._update_idle()

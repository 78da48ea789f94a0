"""The live driver of the decision machine: wall clock, futures for held requests, timers, the store.

How this works: every decision is the machine's (:class:`~extproc.core.machine.Machine`); this
module only runs it live. Every call into it happens on the event loop's thread, so it needs no
locks. Decisions that concern *other* requests (a queued request admitted because a slot freed,
one rejected because its deadline passed or it was evicted) resolve that request's future; the
handler holding it wakes and answers Envoy. One background task sleeps until the machine's next
deadline and calls ``expire``; with a shared store, the fleet client (``fleet.py``) takes each
admitted request's slot in the store before Envoy hears "admit" and keeps the machine told of the
cluster. Metrics are recorded here, from the decisions.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

import structlog

from extproc.core.decision import Decision, Outcome, Reason, State, Ticket
from extproc.core.estimate import Job
from extproc.core.machine import LaneView, Machine
from extproc.core.recent import ADMIT, REJECT, SHADOW, Recent
from extproc.core.saturation import Effect, Reading
from extproc.fleet import Fleet
from extproc.metrics import Metrics
from extproc.policy.schema import Policy
from extproc.state import BudgetStore, GlobalView, LaneLimits, Ledger

log = structlog.get_logger("extproc")


class Controller:
    def __init__(self, policy: Policy, metrics: Metrics, *, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None, ledger: Ledger | None = None,
                 budgets: BudgetStore | None = None, edge_rng: random.Random | None = None) -> None:
        #: With a shared store the fleet limit (auto) is agreed there; this replica sets it while it leads.
        self.machine = Machine(policy, rng, clock(), edge_rng=edge_rng, fleet_managed=ledger is not None)
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
        self._sync_task: asyncio.Task[None] | None = None
        #: The last minute's decisions, for the live view.
        self.recent = Recent()
        #: Called after every policy swap.
        self.on_reconfigure: list[Callable[[Policy], None]] = []
        #: Called with the sources that feed the self-sized limit when it wants a reading soon
        #: (``Machine.reading_wanted``): the signal hub reads them again (``SignalHub.hurry``).
        self.want_reading: Callable[[frozenset[str]], None] | None = None
        #: The shared slot ledger when several replicas enforce one set of limits (None: alone).
        self.ledger = ledger
        #: The client of the shared store (None: alone): the ledger's, and the fleet's budgets'.
        self.fleet = Fleet(self.machine, ledger, budgets, metrics, clock=clock, settle=self._settle,
                           record=self._record_now, changed=self._capacity_changed, rng=rng) \
            if ledger is not None or budgets is not None else None
        self._capacity_mode: set[str] = set()
        #: The signal sources that feed the self-sized limit (after every policy swap).
        self._sources: frozenset[str] = frozenset()
        metrics.named_tenants = named_tenants(policy)
        metrics.watch(self.lanes, lambda: self.machine.draining, lambda: self.view,
                      lambda: self.machine.drain_rates(self.now()), lambda: self.machine.bookings(self.now()))
        self._capacity_changed()
        self._capacity_sources()

    @property
    def policy(self) -> Policy:
        return self.machine.policy

    @property
    def policy_base(self) -> Policy:
        """The policy as loaded (``policy`` is it sized at the fleet limit, with auto)."""
        return self.machine.base

    @property
    def view(self) -> GlobalView | None:
        """The cluster as the shared store last showed it (None: alone, or not read yet)."""
        return self.fleet.view if self.fleet is not None else None

    @property
    def fleet_leader(self) -> bool:
        return self.fleet is not None and self.fleet.leader

    def lanes(self) -> dict[str, LaneView]:
        """Every lane's view. With a shared ledger a request counts in flight once the ledger granted
        its slot, not while it waits for the verdict (which may refuse it): the gauges then never
        show more than the ledger holds."""
        views = self.machine.snapshot(self.now())
        if self.fleet is None or self.ledger is None:
            return views
        leased = self.fleet.leased_by_lane
        return {name: view if view.shadow else replace(view, inflight=leased.get(name, 0))
                for name, view in views.items()}

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._timer is None:
            self._timer = loop.create_task(self._run_timers(), name="extproc-timers")
        if self.fleet is not None and self.ledger is not None and self._sync_task is None:
            self.ledger.on_freed(self.fleet.on_freed)
            self._sync_task = loop.create_task(self.fleet.run(), name="extproc-ledger-sync")

    async def stop(self) -> None:
        for task in (self._timer, self._sync_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._timer = self._sync_task = None
        if self.fleet is not None:
            await self.fleet.settled()

    def drain(self) -> None:
        """Stop admitting; queued requests are answered at once (503 draining)."""
        self._settle(self.machine.drain(self.now()))

    def undrain(self) -> None:
        self._settle(self.machine.undrain(self.now()))

    def pause(self, lane: str) -> None:
        """Admit nothing more from ``lane`` (KeyError if unknown); its requests queue until resumed."""
        self.machine.pause(lane)

    def resume(self, lane: str) -> None:
        self._settle(self.machine.resume(lane, self.now()))

    def apply_saturation(self, effects: Mapping[str, Effect]) -> None:
        """Swap in what saturation does to each lane (tests and tools; signals go through on_signals)."""
        self._settle(self.machine.apply_saturation(effects, self.now()))

    def on_signals(self, readings: Mapping[str, Reading], now: float) -> None:
        """New signal readings (``now`` on this controller's clock): re-evaluate saturation rules
        and move the self-sized limit."""
        view = self.view
        fleet = sum(view.inflight.values()) if view is not None else None
        result = self.machine.on_signals(readings, now, fleet_inflight=fleet)
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
        if self.fleet is not None and self.ledger is not None and self.machine.auto is not None:
            self.fleet.wake.set()  # the leader's proposal goes to the store, the fleet limit comes back
        self._capacity_changed()
        self._reading_wanted(now)  # (still held back at a few slots per lane: the next round soon)

    def _capacity_changed(self) -> None:
        auto = self.machine.auto
        metrics = self.metrics
        if auto is None:
            metrics.capacity_bounds.clear()
            metrics.capacity_sources.clear()
            return
        self._limits_changed()
        state = auto.state()
        mode = "enforce" if self.machine.base.auto_capacity else "shadow"
        if mode not in self._capacity_mode:
            metrics.capacity_limit.clear()  # (a reload between enforce and shadow: no frozen series left)
            self._capacity_mode = {mode}
        metrics.capacity_limit.labels(mode).set(state.limit)
        metrics.capacity_stale.set(1 if state.stale else 0)
        metrics.capacity_unreachable.set(1 if state.unreachable else 0)
        metrics.capacity_bounds.labels("min").set(state.min)
        metrics.capacity_bounds.labels("max").set(state.max)

    def _capacity_sources(self) -> None:
        """Which signal sources feed the self-sized limit (after every policy swap)."""
        metrics = self.metrics
        metrics.capacity_sources.clear()
        self._sources = self.machine.base.capacity_sources
        for source in self._sources:
            metrics.capacity_sources.labels(source).set(1)

    def _limits_changed(self) -> None:
        if self.fleet is not None:
            self.fleet.update_limits(LaneLimits(name, view.limit or view.inflight)
                                     for name, view in self.lanes().items() if view.retired)

    def reconfigure(self, policy: Policy) -> None:
        """Swap in a new policy at once; queued work it lets start is admitted."""
        self.metrics.named_tenants = named_tenants(policy)
        self._settle(self.machine.reconfigure(policy, self.now()))
        self._limits_changed()
        self._capacity_changed()
        self._capacity_sources()
        for listener in self.on_reconfigure:
            listener(policy)
        self._wake.set()

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
        now = self.now()
        submitted = self.machine.submit(lane, tenant, job, now, retry=retry)
        metrics = self.metrics
        metrics.tenant_requests_of(metrics.tenant(tenant)).inc()
        if submitted.budget_shadow:
            self.metrics.shadow_of(lane, Outcome.REJECTED.value, Reason.RETRY_BUDGET.value).inc()
        decision = submitted.decision
        self._record(decision)
        if decision.outcome is Outcome.QUEUED:
            self._waiters[decision.ticket.id] = asyncio.get_running_loop().create_future()
            self._wake.set()
        self._settle(submitted.evicted)  # (and the idle state: something is queued or running now)
        if decision.outcome is not Outcome.ADMITTED:
            self._reading_wanted(now)
        return decision

    def refused(self, lane: str, reason: Reason, tenant: str | None) -> None:
        """A request refused before the scheduler saw it (by the edge, or at intake: a repeated header,
        a late body, extproc overloaded), counted as every refusal is (``Metrics.refused``); ``lane``:
        ``core.decision.ANY_LANE`` when no single lane owns it, ``tenant`` None when not known."""
        metrics = self.metrics
        metrics.tenant_requests_of(metrics.tenant(tenant)).inc()
        metrics.refused(lane, reason.value, tenant)
        now = self.now()
        self.recent.add(lane, REJECT, now)
        self._reading_wanted(now)

    def _reading_wanted(self, now: float) -> None:
        """A request held or refused: a self-sized limit in its start may want a reading soon (with a
        store, only the leader's: its limit is the fleet's)."""
        if self.want_reading is not None and self.machine.reading_wanted(now) \
                and (self.ledger is None or self.fleet_leader):
            self.want_reading(self._sources)

    def permit_retry(self) -> bool:
        """A rejection may tell its client to retry: reserve that retry in the budget, if there is room."""
        return self.machine.permit_retry(self.now())

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
        now = self.now()
        if ticket.state is State.INFLIGHT and ticket.admitted_at is not None:
            self.metrics.service_time_of(ticket.lane).observe(now - ticket.admitted_at)
        elif ticket.state is State.QUEUED:
            self.metrics.decisions_of(ticket.lane, Outcome.CANCELLED.value).inc()
        self._settle(self.machine.release(ticket, now, learn=learn))
        if self.fleet is not None:
            self.fleet.released(ticket)

    async def confirm(self, decision: Decision) -> Decision:
        """Take the admitted request's slot in the shared ledger, or put it back in its queue.

        Alone (no ledger) this returns ``decision`` as it is. With one, the machine's admission was
        made on counts as last seen; the ledger checks the cluster-wide limits atomically. Refused,
        the request goes back to its place in the queue (answered QUEUED: wait again) and its lane
        waits until a slot frees somewhere.
        """
        fleet = self.fleet
        if fleet is None or self.ledger is None or decision.outcome is not Outcome.ADMITTED:
            return decision
        if decision.shadow is not None or self.machine.shadowed(decision.ticket.lane):
            # Shadow lanes observe only: they never wait for the ledger, nor take its slots.
            self._record_now(decision)
            return decision
        confirmed = await fleet.confirm(decision)
        if confirmed.outcome is Outcome.QUEUED:
            self._waiters[confirmed.ticket.id] = asyncio.get_running_loop().create_future()
            self._wake.set()
        return confirmed

    # -- internals --------------------------------------------------------------------

    def _record(self, decision: Decision) -> None:
        if decision.outcome is Outcome.ADMITTED and self.ledger is not None:
            return  # recorded once the ledger granted its slot (confirm)
        self._record_now(decision)

    def _record_now(self, decision: Decision) -> None:
        ticket = decision.ticket
        lane = ticket.lane
        metrics = self.metrics
        if decision.outcome is Outcome.REJECTED and decision.reason is not None:
            metrics.refused(lane, decision.reason.value, ticket.tenant)
        else:
            metrics.decisions_of(lane, decision.outcome.value).inc()
        if decision.outcome is Outcome.ADMITTED:
            self.machine.admitted(decision)
            wait = ticket.queue_wait
            metrics.queue_wait_of(lane).observe(wait)
            shadow = decision.shadow
            if shadow is not None:
                metrics.shadow_of(lane, shadow.value, decision.reason.value if decision.reason else "").inc()
            self.recent.add(lane, SHADOW if shadow is Outcome.REJECTED else ADMIT, ticket.admitted_at or 0.0,
                            wait)
        elif decision.outcome is Outcome.REJECTED:
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
        self._update_idle()  # (every event that changes what runs or waits settles here)

    def _update_idle(self) -> None:
        if self._idle is None:
            return
        machine = self.machine
        if machine.total_inflight == 0 and machine.total_queued == 0:
            self._idle.set()
        else:
            self._idle.clear()

    async def _run_timers(self) -> None:
        machine = self.machine
        while True:
            due = machine.next_timer()
            self._wake.clear()
            timeout = None if due is None else max(due - self.now(), 0.0)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            before = machine.reclaimed
            self._settle(machine.expire(self.now()))
            if machine.reclaimed > before:
                self.metrics.slots_reclaimed.inc(machine.reclaimed - before)


def named_tenants(policy: Policy) -> frozenset[str]:
    """The tenants a policy names (its weights, its default, its budgets, its rules' matches): counted
    by name in ``extproc_tenant_*``; the policy file names them already, so a label shows no secret."""
    names = {policy.tenants.default, *policy.tenants.weights, *policy.ratelimit.budgets.tenants}
    for rule in policy.classification.rules:
        names.update(rule.match.tenants)
    return frozenset(names)

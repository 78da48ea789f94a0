"""The live driver of the pure scheduler: wall clock, futures for held requests, timers.

How this works: every call into the scheduler happens on the event loop's
thread, so the scheduler needs no locks. Decisions that concern *other*
requests (a queued request admitted because a slot freed, one rejected because
its deadline passed or it was evicted) resolve that request's future; the
handler holding it wakes and answers Envoy. One background task sleeps until
the scheduler's next deadline and calls ``expire``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Iterable, Mapping

import structlog

from extproc.core.admission import Decision, LaneView, Scheduler, State, Ticket
from extproc.core.decision import Outcome, Reason
from extproc.core.estimate import Job
from extproc.core.recent import ADMIT, REJECT, SHADOW, Recent
from extproc.core.retry_budget import RetryBudget
from extproc.core.saturation import Effect, Reading, Saturation
from extproc.metrics import Metrics
from extproc.policy.schema import Policy

log = structlog.get_logger("extproc")


class Controller:
    def __init__(self, policy: Policy, metrics: Metrics, *, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.scheduler = Scheduler(policy, rng)
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
        self.saturation = Saturation(policy.signals)
        #: Retries may only be a share of admitted originals (checked in ``submit``).
        self.retry_budget = RetryBudget.of(policy.retry_budget)
        metrics.watch(self.lanes, lambda: self.scheduler.draining)

    @property
    def policy(self) -> Policy:
        return self.scheduler.policy

    def lanes(self) -> dict[str, LaneView]:
        return self.scheduler.snapshot(self.now())

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().create_task(self._run_timers(), name="extproc-timers")

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
            self._timer = None

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
        """What cluster signals say now; shed lanes' queued requests are answered at once."""
        self._settle(self.scheduler.apply_saturation(effects, self.now()))
        self._update_idle()

    def on_signals(self, readings: Mapping[str, Reading], now: float) -> None:
        """New signal readings (``now`` on this controller's clock): re-evaluate saturation rules."""
        changes = self.saturation.update(readings, now)
        for change in changes:
            log.warning("saturation rule active" if change.active else "saturation rule released",
                        rule=change.rule, signal=change.signal, value=change.value, stale=change.stale,
                        why=change.why)
        if changes:
            self._apply_effects()

    def _apply_effects(self) -> None:
        saturation = self.saturation
        self.apply_saturation({lane: saturation.effect(lane) for lane in saturation.lanes()})

    def reconfigure(self, policy: Policy) -> None:
        """Swap in a new policy at once; queued work it lets start is admitted."""
        self._settle(self.scheduler.reconfigure(policy, self.now()))
        self.retry_budget.reconfigure(policy.retry_budget)
        # Rules may have been added, removed or retargeted: re-derive every lane's effect.
        self.saturation.reconfigure(policy.signals)
        self._apply_effects()
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
        now = self.now()
        if retry and self.policy.retry_budget.enabled and not self.retry_budget.try_withdraw(now):
            decision = self.scheduler.refuse(lane, tenant, job, Reason.RETRY_BUDGET, now)
            self._record(decision)
            return decision
        decision, evicted = self.scheduler.submit(lane, tenant, job, now, retry=retry)
        self._record(decision)
        if decision.outcome is Outcome.QUEUED:
            self._waiters[decision.ticket.id] = asyncio.get_running_loop().create_future()
            self._wake.set()
        self._settle(evicted)
        if self._idle is not None:
            self._update_idle()
        return decision

    async def wait(self, ticket: Ticket) -> Decision:
        """Wait until a queued ticket is admitted or rejected."""
        future = self._waiters[ticket.id]
        return await asyncio.shield(future)

    def release(self, ticket: Ticket, *, learn: bool = True) -> None:
        """Idempotent end of a request, however it ended."""
        if ticket.state is State.DONE:
            return
        was_inflight = ticket.state is State.INFLIGHT
        now = self.now()
        if was_inflight and ticket.admitted_at is not None:
            self.metrics.service_time_of(ticket.lane).observe(now - ticket.admitted_at)
        elif ticket.state is State.QUEUED:
            self.metrics.decisions_of(ticket.lane, Outcome.CANCELLED.value).inc()
            self._waiters.pop(ticket.id, None)
        self._settle(self.scheduler.release(ticket, now, learn=learn))
        if self._idle is not None:
            self._update_idle()

    # -- internals --------------------------------------------------------------------

    def _record(self, decision: Decision) -> None:
        ticket = decision.ticket
        lane = ticket.lane
        metrics = self.metrics
        metrics.decisions_of(lane, decision.outcome.value).inc()
        if decision.outcome is Outcome.ADMITTED:
            if not ticket.retry:
                self.retry_budget.deposit(ticket.admitted_at or 0.0)
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
            future = self._waiters.pop(decision.ticket.id, None)
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
                await asyncio.wait_for(self._wake.wait(), timeout)
            before = self.scheduler.reclaimed
            self._settle(self.scheduler.expire(self.now()))
            if self.scheduler.reclaimed > before:
                self.metrics.slots_reclaimed.inc(self.scheduler.reclaimed - before)
            self._update_idle()

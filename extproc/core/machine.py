"""The one face of the decision core: a sans-I/O admission machine.

How this works: in the spirit of h11's ``Connection``, every decision of one running policy is
taken by one object that does no I/O and reads no clock. Events go in, each with an explicit
``now``; decisions come out, and a read-only view answers what the state is:

* a request: :meth:`body_refusal` before its body is awaited (too many of its client's bodies
  late), :meth:`body_timeout` once it did not come, :meth:`body_verdict` once it was read (a
  body extproc cannot decode, or a token limit the model servers refuse), :meth:`submit` once it
  is classified (the one intake, :attr:`intake`) — a retry over the retry budget is refused,
  anything else is admitted, queued or rejected by the scheduler — :meth:`admitted` once an
  admission is final, :meth:`release` once it ended however it ended;
* the edge, which sees a request's arrival before ext_proc and its token usage after:
  :meth:`judge` (or :meth:`assess`, the store's answer, :meth:`conclude`), :meth:`shed`,
  :meth:`charge`;
* time: :meth:`expire` at :meth:`next_timer`; the cluster's signals: :meth:`on_signals`;
* an operator: :meth:`drain`, :meth:`undrain`, :meth:`pause`, :meth:`resume`,
  :meth:`reconfigure`, :meth:`set_limit`;
* a shared store's answers: :meth:`requeue` (a slot refused), :meth:`set_others`,
  :meth:`unblock`, :meth:`charge_others`, :meth:`set_drain_rates`, and the retry budget's fleet
  counts (:meth:`retry_budget_fleet`, :meth:`retry_budget_alone`).

Decisions that concern other requests (a queued one admitted because a slot freed, one evicted)
come out of whichever event caused them; the driver answers them. The live service drives the
machine with the wall clock, futures and a store (``controller.py``, ``servers/``); the simulator,
``simulate --verify`` and ``policy explain`` with a virtual clock (``sim/driver.py``). Nothing
outside ``core/`` reaches past this face (``tests/unit/test_layout.py``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from extproc.core.admission import Scheduler, held_queued
from extproc.core.body import BodyFacts, SlowBodies
from extproc.core.budget import BucketVerdict, part, verdict
from extproc.core.capacity import AutoLimit, Move, size
from extproc.core.decision import Decision, Outcome, Reason, Ticket
from extproc.core.drain import FleetRate
from extproc.core.edge import (
    REQUEST_ID,
    UNLIMITED,
    Assessment,
    BudgetAsk,
    Check,
    Edge,
    Judgement,
    Pressure,
    SchedulerPressure,
    Shed,
)
from extproc.core.estimate import Job
from extproc.core.intake import Intake, Refusal
from extproc.core.lanes import LaneView
from extproc.core.retry_budget import SLOTS as RETRY_BUDGET_SLOTS
from extproc.core.retry_budget import RetryBudget
from extproc.core.saturation import Change, Effect, Reading, Saturation
from extproc.policy.ratelimit import RateLimit
from extproc.policy.schema import Policy

__all__ = ["REQUEST_ID", "RETRY_BUDGET_SLOTS", "UNLIMITED", "Assessment", "BucketVerdict", "BudgetAsk",
           "Check", "Judgement", "LaneView", "Machine", "Refusal", "Shed", "Signalled", "Submitted"]


@dataclass(frozen=True, slots=True)
class Submitted:
    """What a new request got, and what it cost others."""

    decision: Decision
    evicted: tuple[Decision, ...] = ()
    """Queued requests it pushed out (rejected)."""
    budget_shadow: bool = False
    """Shadow mode: a retry the retry budget would have refused, let through."""


@dataclass(frozen=True, slots=True)
class Signalled:
    """What new signal readings did."""

    changes: list[Change]
    """Saturation rules that became active or inactive."""
    decisions: list[Decision]
    """Requests they answered or let start."""
    move: Move | None = None
    """The self-sizing limit moved (its proposal, with a shared store)."""


class Machine:
    """Every admission decision of one running policy.

    ``fleet_managed``: a shared store decides the fleet limit (``capacity.max_inflight: auto``): the
    limit's moves are proposals, and :meth:`set_limit` applies what the store agreed. ``pressure``:
    what the edge reads of the lanes (default: this machine's own scheduler; tests give their own).
    """

    def __init__(self, policy: Policy, rng: random.Random | None = None, now: float = 0.0, *,
                 edge_rng: random.Random | None = None, fleet_managed: bool = False,
                 pressure: Pressure | None = None) -> None:
        self.now = now
        """The time of the last event (what the edge's view of the lanes is read at)."""
        self.base = policy
        auto = policy.capacity.auto
        self.auto = None if auto is None else AutoLimit(auto, policy.signals, now, lanes=len(policy.lanes))
        self.fleet_managed = fleet_managed
        #: With a shared store, the limit moves only once the store has answered with the fleet's: a
        #: starting replica takes the fleet's limit first (a restart resumes where the fleet was).
        self._agreed = not fleet_managed
        self._scheduler = Scheduler(self._sized(), rng, permit=self.permit_retry)
        #: The policy in force: with ``max_inflight: auto``, sized at the current fleet limit (an
        #: attribute, as the scheduler's: read several times per request).
        self.policy = self._scheduler.policy
        self._retry_budget = RetryBudget.of(policy.retry_budget)
        self.saturation = Saturation(policy.signals)
        self.intake = Intake(policy, self._scheduler.estimator)
        """The one intake of the policy in force (rebuilt by :meth:`reconfigure`)."""
        self._edge = Edge(pressure or SchedulerPressure(self._scheduler, lambda: self.now), edge_rng,
                          policy.ratelimit.budgets.max_tenants)
        self._slow = SlowBodies()
        self._fleet_rate = FleetRate()

    # -- the policy in force ------------------------------------------------------------------

    def _sized(self) -> Policy:
        if self.auto is None or not self.base.auto_capacity:
            return self.base
        return size(self.base, self.auto.limit)

    def reconfigure(self, policy: Policy, now: float) -> list[Decision]:
        """Swap in a new policy at once; returns the queued work it lets start (or sheds)."""
        self.now = now
        self.base = policy
        auto = policy.capacity.auto
        if auto is None:
            self.auto = None
        elif self.auto is None:
            self.auto = AutoLimit(auto, policy.signals, now, lanes=len(policy.lanes))
        else:
            self.auto.reconfigure(auto, policy.signals, now, lanes=len(policy.lanes))
        out = self._scheduler.reconfigure(self._sized(), now)
        self.policy = self._scheduler.policy
        self._retry_budget.reconfigure(policy.retry_budget)
        # Rules may have been added, removed or retargeted: re-derive every lane's effect.
        self.saturation.reconfigure(policy.signals)
        out.extend(self._apply_effects(now))
        self.intake = Intake(policy, self._scheduler.estimator)
        return out

    def set_limit(self, limit: int, now: float) -> list[Decision]:
        """Enforce ``limit`` as the fleet limit (auto only); returns the queued work it lets start.

        A smaller limit takes effect as slots free: nothing running is cut short.
        """
        self.now = now
        if self.auto is None:
            return []
        self._agreed = True
        self.auto.adopt(limit)
        if not self.base.auto_capacity or self.policy.total_capacity == self.auto.limit:
            return []
        out = self._scheduler.reconfigure(self._sized(), now)
        self.policy = self._scheduler.policy
        return out

    # -- a request ------------------------------------------------------------------------------

    def body_refusal(self, client: str | None, key: int, now: float) -> Reason | None:
        """A request's body is to be awaited: SLOW_BODIES if its client already holds too many late
        ones (the request is refused), else None (it is counted as waiting until :meth:`body_came`)."""
        self.now = now
        if self._slow.too_many(client, self.policy.estimation.max_slow_bodies, now):
            return Reason.SLOW_BODIES
        self._slow.enter(client, key, now)
        return None

    def body_came(self, client: str | None, key: int) -> None:
        """The awaited body came, or its request ended without it."""
        self._slow.leave(client, key)

    @property
    def body_timeout_s(self) -> float:
        """How long a body is awaited before the request is refused (:meth:`body_timeout`)."""
        return self.policy.estimation.body_timeout

    def body_timeout(self, client: str | None, key: int) -> Reason:
        """The awaited body did not come within :attr:`body_timeout_s`: the request is refused."""
        self._slow.leave(client, key)
        return Reason.BODY_TIMEOUT

    def body_verdict(self, body: BodyFacts) -> Refusal | None:
        """The request's body was read: refused (UNSUPPORTED_ENCODING, BAD_REQUEST) before it takes a
        ticket, or None (it is classified and submitted). See ``Intake.refusal``."""
        return self.intake.refusal(body)

    def submit(self, lane: str, tenant: str, job: Job, now: float, *, retry: bool = False) -> Submitted:
        """Decide a new request; ``retry``: its client says it is a retry (it spends retry budget)."""
        self.now = now
        scheduler = self._scheduler
        shadowed = False
        # A retry holding a booked return had its retry reserved when it was told to come back: it
        # goes through even if that reservation lapsed with the budget's window meanwhile. A replica
        # shutting down refuses every request as draining, a retry too, before the budget is asked:
        # it spends nothing, and is never told to give up when another replica would take it.
        if (retry and not scheduler.draining and self.policy.retry_budget.enabled
                and not self._retry_budget.try_withdraw(now)
                and not scheduler.holds_booking(lane, tenant, now)):
            if not scheduler.shadowed(lane):
                return Submitted(scheduler.refuse(lane, tenant, job, Reason.RETRY_BUDGET, now))
            shadowed = True  # counted as what enforcing would have done, then decided as usual
        decision, evicted = scheduler.submit(lane, tenant, job, now, retry=retry)
        return Submitted(decision, tuple(evicted), shadowed)

    def admitted(self, decision: Decision) -> None:
        """An admission is final: an original (not a retry) deposits into the retry budget."""
        ticket = decision.ticket
        if decision.outcome is Outcome.ADMITTED and not ticket.retry:
            self._retry_budget.deposit(ticket.admitted_at or 0.0)

    def permit_retry(self, now: float) -> bool:
        """A rejection may tell its client to retry: reserve that retry, if the budget has room.

        False: no room, and the rejection should say ``x-should-retry: false``.
        """
        return not self.policy.retry_budget.enabled or self._retry_budget.reserve(now)

    def release(self, ticket: Ticket, now: float, learn: bool = True) -> list[Decision]:
        """End a request however it ended (idempotent); returns requests admitted in its place."""
        self.now = now
        return self._scheduler.release(ticket, now, learn)

    def expire(self, now: float) -> list[Decision]:
        """Reject queued requests past their deadline; reclaim slots held past the backstop."""
        self.now = now
        return self._scheduler.expire(now)

    def next_timer(self) -> float | None:
        """When :meth:`expire` next has something to do."""
        return self._scheduler.next_timer()

    @property
    def reclaimed(self) -> int:
        """Slots reclaimed from requests held past ``max_request_duration``, ever."""
        return self._scheduler.reclaimed

    # -- the edge -------------------------------------------------------------------------------

    def judge(self, config: RateLimit, entries: Mapping[str, str], hits: int, now: float) -> Judgement:
        """The edge's decision on one arrival descriptor, with this machine's tenant budgets."""
        self.now = now
        return self._edge.judge(config, entries, hits, now)

    def assess(self, config: RateLimit, entries: Mapping[str, str], hits: int, now: float) -> Assessment:
        """An arrival judged but for its tenant's budgets (for a shared store to answer its asks)."""
        self.now = now
        return self._edge.assess(config, entries, hits, now)

    def conclude(self, assessment: Assessment, verdicts: Sequence[BucketVerdict]) -> Judgement:
        return self._edge.conclude(assessment, verdicts)

    def budgets_answered(self, asks: Sequence[BudgetAsk], levels: Sequence[tuple[bool, float]]
                         ) -> list[BucketVerdict]:
        """A shared store's answer to ``asks`` (whether each was allowed, and the level it left), as
        verdicts."""
        return [verdict(allowed, level, 1.0 if ask.op == "charge" else ask.amount, ask.rate)
                for ask, (allowed, level) in zip(asks, levels, strict=True)]

    def budgets_alone(self, asks: Sequence[BudgetAsk], now: float, *, parts: int, fail_open: bool
                      ) -> list[BucketVerdict]:
        """``asks`` while the fleet's store is unreachable: failing open, against this replica's part of
        each budget (``1 / parts``), kept here; failing closed, every take refused (nothing is known of
        what the fleet spent), with a second before looking again."""
        if not fail_open:
            return [BucketVerdict(ask.op == "charge", 0.0, 1.0, 0.0) for ask in asks]
        mine = [BudgetAsk(ask.kind, ask.tenant, part(ask.rate, parts), ask.amount, ask.op, ask.limit,
                          ask.tenant_limit) for ask in asks]
        return self._edge.settle(mine, now)

    def shed(self, judgements: list[Judgement], now: float) -> Shed:
        """The answer to an arrival some of whose descriptors are over their limits."""
        self.now = now
        for judgement in judgements:  # a lane full at the edge: work a larger limit would start
            if not judgement.shadow and any(check.reason is Reason.QUEUE_FULL for check in judgement.over):
                self._scheduler.turned_away(judgement.lane, now)
        return self._edge.shed(judgements, lambda: self.permit_retry(now))

    def charge(self, config: RateLimit, entries: Mapping[str, str], tokens: int, now: float) -> str:
        """Charge a finished response's tokens to its tenant (queued with ``budgets_shared``)."""
        return self._edge.charge(config, entries, tokens, now)

    @property
    def budgets_shared(self) -> bool:
        """True when a fleet's store keeps the tenant budgets: charges queue for :meth:`take_charges`."""
        return self._edge.shared

    @budgets_shared.setter
    def budgets_shared(self, value: bool) -> None:
        self._edge.shared = value

    def take_charges(self) -> list[BudgetAsk]:
        charges, self._edge.charges = self._edge.charges, []
        return charges

    @property
    def pending_charges(self) -> bool:
        return bool(self._edge.charges)

    def budget_sizes(self) -> dict[str, int]:
        """Tenants with a bucket, per budget kind (``requests``, ``tokens``)."""
        return {"requests": len(self._edge.requests), "tokens": len(self._edge.tokens)}

    # -- time and signals -----------------------------------------------------------------------

    def on_signals(self, readings: Mapping[str, Reading], now: float, *, fleet_inflight: int | None = None
                   ) -> Signalled:
        """New signal readings: the rule changes they cause, the limit's move, and the decisions.

        ``fleet_inflight``: requests running fleet-wide (with a shared store; default: this one's).
        What waits for a slot is the scheduler's count, with the other replicas' as last synced.
        """
        self.now = now
        changes = self.saturation.update(readings, now)
        decisions = self._apply_effects(now) if changes else []
        move = None
        if self.auto is not None and self._agreed:
            scheduler = self._scheduler
            inflight = fleet_inflight if fleet_inflight is not None else scheduler.total_inflight
            move = self.auto.update(readings, inflight, self._held(self.auto, now), now,
                                    queued=held_queued(scheduler))
            if move is not None and not self.fleet_managed:
                decisions.extend(self.set_limit(move.limit, now))
        return Signalled(changes, decisions, move)

    def reading_wanted(self, now: float) -> bool:
        """Whether the self-sized limit wants its next signal reading soon (``AutoLimit.reading_soon``,
        while requests are held back for want of a slot): a scrape source then reads its targets
        again after a quarter of its interval. Cheap: asked after every request held or refused."""
        auto = self.auto
        return auto is not None and auto.reading_soon and self._agreed and self._held(auto, now)

    def _held(self, auto: AutoLimit, now: float) -> bool:
        # Held back: requests wait for want of a slot now, or one was refused for want of one (a
        # queue full, a deadline out of reach behind it) since the limit last moved and within its
        # interval: a refusal at the limit before says nothing of this one.
        scheduler = self._scheduler
        away = scheduler.turned_away_at
        return scheduler.held_back or (away is not None and away > auto.since
                                       and now - away <= auto.auto.interval)

    def _apply_effects(self, now: float) -> list[Decision]:
        saturation = self.saturation
        effects = {lane: saturation.effect(lane) for lane in saturation.lanes()}
        return self._scheduler.apply_saturation(effects, now)

    def apply_saturation(self, effects: Mapping[str, Effect], now: float) -> list[Decision]:
        """Swap in what saturation does to each lane directly (tests and tools)."""
        self.now = now
        return self._scheduler.apply_saturation(effects, now)

    # -- an operator ----------------------------------------------------------------------------

    def drain(self, now: float) -> list[Decision]:
        """Stop admitting; every queued request is rejected as draining."""
        self.now = now
        return self._scheduler.drain(now)

    def undrain(self, now: float) -> list[Decision]:
        self.now = now
        return self._scheduler.undrain(now)

    def pause(self, lane: str) -> None:
        """Admit nothing more from ``lane`` (KeyError if unknown); its requests queue until resumed."""
        self._scheduler.pause(lane)

    def resume(self, lane: str, now: float) -> list[Decision]:
        self.now = now
        return self._scheduler.resume(lane, now)

    # -- a shared store's answers ---------------------------------------------------------------

    def requeue(self, ticket: Ticket, now: float) -> Decision:
        """The store refused an admitted request its slot: back to its place in the queue."""
        self.now = now
        return self._scheduler.requeue(ticket, now)

    def set_others(self, inflight: Mapping[str, int], queued: Mapping[str, int], now: float,
                   total: int | None = None) -> list[Decision]:
        """What the other replicas hold and queue per lane; admits what fits."""
        self.now = now
        return self._scheduler.set_others(inflight, queued, now, total)

    def unblock(self, now: float, lanes: set[str] | None = None) -> list[Decision]:
        """Slots may have freed somewhere: lanes the store refused may try again."""
        self.now = now
        return self._scheduler.unblock(now, lanes)

    @property
    def blocked(self) -> set[str]:
        """Lanes the store refused, waiting for a slot to free (read-only)."""
        return set(self._scheduler.blocked)

    def charge_others(self, served: Mapping[tuple[str, str], float]) -> None:
        """Work other replicas served (predicted seconds by lane and tenant), for fair shares."""
        self._scheduler.charge_others(served)

    def fleet_completions(self, completed: Mapping[str, int], replicas: int, now: float) -> None:
        """The fleet's completion counters per lane (from the shared store; empty while it is
        unreachable, when each replica measures its own drain again), and how many replicas there are:
        the drain rates Retry-After paces returns by."""
        self._fleet_rate.update(completed, now)
        self._scheduler.set_drain_rates(self._fleet_rate.rates(now) if completed else {}, replicas)

    def retry_budget_unsent(self) -> tuple[int, int]:
        """This replica's retry-budget counts not yet told to the fleet's store."""
        return self._retry_budget.unsent()

    @property
    def retry_window_s(self) -> float:
        return self._retry_budget.window_s

    def retry_budget_fleet(self, deposits: int, withdrawals: int) -> None:
        """The other replicas' retry-budget counts, from the fleet's store."""
        self._retry_budget.fleet(deposits, withdrawals)

    def retry_budget_alone(self, parts: int, *, closed: bool) -> None:
        """The store is unreachable: the retry budget decides on this replica's part of it."""
        self._retry_budget.alone(parts, closed=closed)

    # -- what the state is (read-only) ----------------------------------------------------------

    def snapshot(self, now: float) -> dict[str, LaneView]:
        """Every lane's view."""
        return self._scheduler.snapshot(now)

    def heads(self) -> dict[str, float]:
        """Each lane's best-placed queued request's rank (lanes with nothing queued are absent)."""
        return self._scheduler.heads()

    def rank(self, ticket: Ticket) -> float:
        return self._scheduler.rank(ticket)

    def shadowed(self, lane: str) -> bool:
        """Whether the lane only observes: decides and counts, but admits everything."""
        return self._scheduler.shadowed(lane)

    @property
    def draining(self) -> bool:
        return self._scheduler.draining

    @property
    def total_inflight(self) -> int:
        return self._scheduler.total_inflight

    @property
    def total_queued(self) -> int:
        return self._scheduler.total_queued

    def drain_rates(self, now: float) -> dict[str, float | None]:
        """Completions per second per lane (None where not known yet)."""
        return self._scheduler.drain_rates(now)

    def bookings(self, now: float) -> int:
        """Returns booked on the lanes' return schedules and not yet claimed."""
        self._scheduler.expire_bookings(now)
        return self._scheduler.bookings



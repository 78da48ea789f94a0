"""Every admission decision of one running policy, in one pure object.

How this works: the :class:`Gatekeeper` owns the scheduler (lanes, queues, limits), the
retry budget and the saturation rules, and takes every decision that concerns them, each
call with an explicit ``now``:

* :meth:`submit` — a new request: a retry over the retry budget is refused (or only counted,
  in shadow mode), anything else goes to the scheduler (admitted, queued or rejected);
* :meth:`admitted` — an admission became final (at once, or once a shared store granted its
  slot): an original request deposits into the retry budget;
* :meth:`permit_retry` — a rejection that lets its client retry reserves that retry;
* :meth:`on_signals` — new cluster signal readings: saturation rules re-evaluated, lanes shed or
  shrunk (queued requests of a shed lane are answered at once), and the self-sizing fleet limit
  (``capacity.max_inflight: auto``) moved when the engines' signals say so;
* :meth:`set_limit` — the fleet limit in force (its own, or the one a shared store agreed on);
* :meth:`reconfigure` — a new policy, swapped in with queued work kept.

The live controller drives it with the wall clock and futures; the offline simulator with a
virtual clock; ``policy explain`` with a frozen one. None of them decides anything itself.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

from extproc.core.admission import Scheduler
from extproc.core.capacity import AutoLimit, Move, size
from extproc.core.decision import Decision, Outcome, Reason
from extproc.core.estimate import Job
from extproc.core.retry_budget import RetryBudget
from extproc.core.saturation import Change, Reading, Saturation
from extproc.policy.schema import Policy


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


class Gatekeeper:
    def __init__(self, policy: Policy, rng: random.Random | None = None, now: float = 0.0) -> None:
        self.base = policy
        auto = policy.capacity.auto
        self.auto = AutoLimit(auto, policy.signals, now) if auto is not None else None
        #: True when a shared store decides the fleet limit: moves are proposals, set_limit applies.
        self.fleet_managed = False
        self.scheduler = Scheduler(self._sized(), rng)
        self.retry_budget = RetryBudget.of(policy.retry_budget)
        # A rejection that lets its client retry reserves the retry where it is decided (the
        # scheduler books the return only if the budget has room).
        self.scheduler.permit = self.permit_retry
        self.saturation = Saturation(policy.signals)

    @property
    def policy(self) -> Policy:
        """The policy in force: with ``max_inflight: auto``, sized at the current fleet limit."""
        return self.scheduler.policy

    def _sized(self) -> Policy:
        if self.auto is None or not self.base.auto_capacity:
            return self.base
        return size(self.base, self.auto.limit)

    def set_limit(self, limit: int, now: float) -> list[Decision]:
        """Enforce ``limit`` as the fleet limit (auto only); returns the queued work it lets start.

        A smaller limit takes effect as slots free: nothing running is cut short.
        """
        if self.auto is None:
            return []
        self.auto.adopt(limit)
        if not self.base.auto_capacity or self.policy.total_capacity == self.auto.limit:
            return []
        return self.scheduler.reconfigure(self._sized(), now)

    def submit(self, lane: str, tenant: str, job: Job, now: float, *, retry: bool = False) -> Submitted:
        """Decide a new request; ``retry``: its client says it is a retry (it spends retry budget)."""
        shadowed = False
        # A retry holding a booked return had its retry reserved when it was told to come back: it
        # goes through even if that reservation lapsed with the budget's window meanwhile.
        if (retry and self.policy.retry_budget.enabled and not self.retry_budget.try_withdraw(now)
                and not self.scheduler.holds_booking(lane, tenant, now)):
            if not self.scheduler.shadowed(lane):
                return Submitted(self.scheduler.refuse(lane, tenant, job, Reason.RETRY_BUDGET, now))
            shadowed = True  # counted as what enforcing would have done, then decided as usual
        decision, evicted = self.scheduler.submit(lane, tenant, job, now, retry=retry)
        return Submitted(decision, tuple(evicted), shadowed)

    def admitted(self, decision: Decision) -> None:
        """An admission is final: an original (not a retry) deposits into the retry budget."""
        ticket = decision.ticket
        if decision.outcome is Outcome.ADMITTED and not ticket.retry:
            self.retry_budget.deposit(ticket.admitted_at or 0.0)

    def permit_retry(self, now: float) -> bool:
        """A rejection may tell its client to retry: reserve that retry, if the budget has room.

        False: no room, and the rejection should say ``x-should-retry: false`` (clients that obey
        it save an attempt that would be refused anyway).
        """
        return not self.policy.retry_budget.enabled or self.retry_budget.reserve(now)

    def on_signals(self, readings: Mapping[str, Reading], now: float, *, fleet_inflight: int | None = None
                   ) -> Signalled:
        """New signal readings: the rule changes they cause, the limit's move, and the decisions.

        ``fleet_inflight``: requests running fleet-wide (with a shared store; default: this one's).
        """
        changes = self.saturation.update(readings, now)
        decisions = self._apply_effects(now) if changes else []
        move = None
        if self.auto is not None:
            scheduler = self.scheduler
            inflight = fleet_inflight if fleet_inflight is not None else scheduler.total_inflight
            move = self.auto.update(readings, inflight, scheduler.held_back, now)
            if move is not None and not self.fleet_managed:
                decisions.extend(self.set_limit(move.limit, now))
        return Signalled(changes, decisions, move)

    def _apply_effects(self, now: float) -> list[Decision]:
        saturation = self.saturation
        return self.scheduler.apply_saturation({lane: saturation.effect(lane) for lane in saturation.lanes()},
                                               now)

    def reconfigure(self, policy: Policy, now: float) -> list[Decision]:
        """Swap in a new policy at once; returns the queued work it lets start (or sheds)."""
        self.base = policy
        auto = policy.capacity.auto
        if auto is None:
            self.auto = None
        elif self.auto is None:
            self.auto = AutoLimit(auto, policy.signals, now)
        else:
            self.auto.reconfigure(auto, policy.signals, now)
        out = self.scheduler.reconfigure(self._sized(), now)
        self.retry_budget.reconfigure(policy.retry_budget)
        # Rules may have been added, removed or retargeted: re-derive every lane's effect.
        self.saturation.reconfigure(policy.signals)
        out.extend(self._apply_effects(now))
        return out

"""Admission: slots, queues, deadlines and borrowing for every lane.

How this works: each lane owns ``max_inflight`` slots (its quota); all lanes
together share ``capacity.max_inflight`` slots. A request is admitted at once if
its lane is under quota and a slot is free, or — for lanes that may borrow — if a
slot is free that no other lane with waiting work is owed. Otherwise it is
queued (if the lane's queue has room and its deadline can plausibly be met) or
rejected with a reason and a Retry-After.

Whenever a slot frees, queued work is dispatched: lanes that are under quota
first (that is how lent capacity is given back), highest priority first, then
borrowers. After every call no queued request is admissible, so the order of
the queues, not the order of arrivals, decides who goes next.

The scheduler is pure: callers pass ``now`` and get decisions back. The live
service and the offline simulator both drive it. It takes the decisions; where
every request is and the slot rule are the lanes' (``core/lanes.py``), deadlines
and leases the timers' (``core/timers.py``), and what a rejection tells its
client about coming back the returns' (``core/drain.py``).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping

from extproc.core.decision import Decision, Outcome, Reason, State, Ticket
from extproc.core.drain import Returns, Told
from extproc.core.estimate import Estimator, Job
from extproc.core.lanes import LanePressure, Lanes, LaneView
from extproc.core.queue import Entry
from extproc.core.saturation import Effect
from extproc.core.timers import Timers
from extproc.policy.schema import Lane, Policy

#: Refusals that say only slots were missing (where the lane is slot-bound): Scheduler.turned_away_at.
_FOR_WANT_OF_A_SLOT = frozenset({Reason.QUEUE_FULL, Reason.DEADLINE_UNMEETABLE})


class Scheduler:
    """Every admission decision: a request's verdict, and what a slot freeing or a deadline passing
    sets in motion. Where requests are, and the slot rule, are the lanes' (:class:`Lanes`); when a
    rejected one should come back is the returns' (:class:`Returns`)."""

    def __init__(self, policy: Policy, rng: random.Random | None = None,
                 estimator: Estimator | None = None, permit: Callable[[float], bool] | None = None) -> None:
        self._ids = itertools.count(1)
        self.estimator = estimator or Estimator(policy.estimation)
        self._lanes = Lanes(policy)
        self._returns = Returns(self._lanes, rng or random.Random(), permit)
        self._timers = Timers()
        self.draining = False
        self.reclaimed = 0
        #: When a request was last refused for want of a slot (see ``turned_away``); None: never.
        self.turned_away_at: float | None = None
        self.reconfigure(policy)

    # -- configuration ------------------------------------------------------------

    @property
    def permit(self) -> Callable[[float], bool] | None:
        """Reserves a retry in the retry budget for a rejection that lets its client retry; False:
        no room (None: no budget)."""
        return self._returns.permit

    @permit.setter
    def permit(self, permit: Callable[[float], bool] | None) -> None:
        self._returns.permit = permit

    def reconfigure(self, policy: Policy, now: float | None = None) -> list[Decision]:
        """Swap in a policy; returns the queued requests it lets start.

        Queued and in-flight requests keep their place. A lane the new policy no longer
        has is retired: it takes no new requests, but its queue is still served (under its
        last limits) and its in-flight requests finish; it disappears once empty. Limits
        that shrink take effect as slots free: nothing running is cut short.
        """
        self._lanes.configure(policy)
        #: The policy in force (an attribute, not a property: read several times per decision).
        self.policy = policy
        self.estimator.reconfigure(policy.estimation)
        self._returns.forget(self._lanes.configs)
        self._returns.reweigh()
        return self._dispatch(now) if now is not None else []

    def apply_saturation(self, effects: Mapping[str, Effect], now: float) -> list[Decision]:
        """Swap in what cluster saturation does to each lane (lanes absent: no effect).

        Shrunk limits take effect as slots free; a lane that starts being shed rejects new
        requests and gives up its queued ones at once (it is the first to go); a lane no longer
        shrunk gets its slots back at once.
        """
        lanes = self._lanes
        lanes.set_effects(effects)
        out: list[Decision] = []
        for name, effect in lanes.effects.items():
            if effect.shed_by is not None and name in lanes.queues and not lanes.shadowed(name):
                for entry in list(lanes.queues[name].entries()):
                    ticket = lanes.queued(entry)
                    lanes.dequeue(ticket)
                    out.append(self._reject(ticket, Reason.SATURATED, now, effect))
        out.extend(self._dispatch(now))
        return out

    def shadowed(self, lane: str) -> bool:
        """Whether the lane only observes: decides and counts, but admits everything."""
        return self._lanes.shadowed(lane)

    # -- several replicas ---------------------------------------------------------

    def set_others(self, inflight: Mapping[str, int], queued: Mapping[str, int], now: float,
                   total: int | None = None) -> list[Decision]:
        """What the other replicas hold and queue per lane (from the shared store); admits what fits.

        ``total``: the slots of the whole capacity they hold, when not the sum over lanes (while the
        store is unreachable the others are taken to hold everything beyond this replica's share).
        """
        self._lanes.set_others(inflight, queued, total)
        return self._dispatch(now)

    @property
    def blocked(self) -> set[str]:
        """Lanes the shared store just refused: not admissible until a slot frees anywhere."""
        return self._lanes.blocked

    def unblock(self, now: float, lanes: set[str] | None = None) -> list[Decision]:
        """Slots may have freed somewhere: refused lanes may try again."""
        self._lanes.unblock(lanes)
        return self._dispatch(now)

    def requeue(self, ticket: Ticket, now: float) -> Decision:
        """An admitted request the shared store refused a slot: back to its place in the queue.

        Its lane takes nothing more until ``unblock`` (a slot freed somewhere), so the refusal
        cannot turn into a loop of grants and refusals.
        """
        assert ticket.state is State.INFLIGHT
        ticket.state = State.QUEUED
        ticket.admitted_at = None
        self._lanes.requeue(ticket)
        self._timers.deadline(ticket)
        return Decision(Outcome.QUEUED, ticket)

    def rank(self, ticket: Ticket) -> float:
        """The ticket's place in its lane's order (smaller is better), queued or not."""
        return self._lanes.rank(ticket)

    def charge_others(self, served: Mapping[tuple[str, str], float]) -> None:
        """Work (predicted seconds, by lane and tenant) other replicas served since the last call."""
        self._lanes.charge_others(served)

    def heads(self) -> dict[str, float]:
        """Each lane's best-placed queued request's rank (lanes with nothing queued are absent)."""
        return self._lanes.heads()

    # -- operator actions ---------------------------------------------------------

    @property
    def paused(self) -> set[str]:
        """Lanes an operator paused."""
        return self._lanes.paused

    def pause(self, lane: str) -> None:
        """Admit nothing more from the lane; its requests queue (to their deadline) until resumed."""
        self._lanes.pause(lane)

    def resume(self, lane: str, now: float) -> list[Decision]:
        self._lanes.resume(lane)
        return self._dispatch(now)

    def undrain(self, now: float) -> list[Decision]:
        """Admit again after an operator's drain."""
        self.draining = False
        return self._dispatch(now)

    # -- counts ---------------------------------------------------------------------

    @property
    def total_inflight(self) -> int:
        return self._lanes.total_inflight

    @property
    def total_queued(self) -> int:
        return self._lanes.total_queued

    @property
    def held_back(self) -> bool:
        """Whether requests wait only for want of a slot: see ``Lanes.held_back``."""
        return self._lanes.held_back

    def turned_away(self, lane_name: str, now: float, reason: Reason = Reason.QUEUE_FULL) -> None:
        """A request of ``lane_name`` refused (here, or at the edge) for want of a slot, only slots
        holding its lane back: work a larger limit would start, though none waits. ``turned_away_at``."""
        lane = self._lanes.configs.get(lane_name)
        if reason in _FOR_WANT_OF_A_SLOT and lane is not None and self._lanes.slot_bound(lane):
            self.turned_away_at = now

    def occupancy(self) -> float:
        return self._lanes.occupancy()

    def admissible(self, name: str) -> bool:
        """Whether one more request of lane ``name`` could start now (the edge asks: one rule)."""
        return self._lanes.admissible(name)

    def backlog_wait(self, lane: str, now: float) -> float:
        """Estimated seconds until a request arriving now, behind the whole queue, could start."""
        return self._lanes.backlog_wait(lane, now)

    # -- decisions ------------------------------------------------------------------

    def submit(self, lane_name: str, tenant: str, job: Job, now: float, *, retry: bool = False
               ) -> tuple[Decision, list[Decision]]:
        """Decide a new request. Returns its decision and any queued requests it evicted."""
        lanes = self._lanes
        lane = lanes.configs[lane_name]
        predicted = self.estimator.predict(job, self.occupancy())
        # A retry of the tenant that was told to come back about now claims that booking; a retry
        # without one (or a client that only says it retries) is an ordinary request. Only a tenant
        # the gateway vouches for may claim (anyone may say they are the default tenant), and the
        # place kept is at most a lane's deadline old (re-bookings cannot age it further).
        first = self._returns.claim(lane.name, tenant, now) if retry else None
        if first is not None:
            first = max(first, now - lane.deadline)
        ticket = Ticket(next(self._ids), lane.name, tenant, job, now, now + lane.deadline,
                        predicted, retry=retry, first=first)
        if self.draining:
            return self._reject(ticket, Reason.DRAINING, now), []
        outcome, reason, crowded, rank = self._verdict(lane, ticket, now)
        if outcome is Outcome.ADMITTED:
            self._admit(ticket, now)
            return Decision(Outcome.ADMITTED, ticket), []
        if lanes.shadowed(lane.name) and lane.name not in lanes.paused:
            # Observe only: the request starts now whatever the verdict, and takes a slot like
            # any other, so later verdicts see the load the backend really has.
            self._admit(ticket, now)
            return Decision(Outcome.ADMITTED, ticket, reason, shadow=outcome), []
        if outcome is Outcome.REJECTED:
            assert reason is not None
            self.turned_away(lane.name, now, reason)
            cause = lanes.effects[lane.name] if reason is Reason.SATURATED else None
            return self._reject(ticket, reason, now, cause), []
        evicted: list[Decision] = []
        if crowded is not None:
            reason = Reason.FAIR_SHARE if ticket.first is None else Reason.EVICTED
            evicted.append(self._withdraw(lanes.queued(crowded), reason, now))
        cap = self.policy.capacity.max_queued
        if cap is not None and lanes.total_queued >= cap:
            victim = lanes.victim(lane, ticket)
            if victim is None:
                self.turned_away(lane.name, now)
                return self._reject(ticket, Reason.QUEUE_FULL, now), evicted
            evicted.append(self._withdraw(victim, Reason.EVICTED, now))
        ticket.entry = Entry(ticket.id, tenant, now, ticket.deadline, predicted, rank)
        lanes.enqueue(ticket)
        self._timers.deadline(ticket)
        return Decision(Outcome.QUEUED, ticket), evicted

    def refuse(self, lane_name: str, tenant: str, job: Job, reason: Reason, now: float) -> Decision:
        """Reject a new request for a reason decided outside the scheduler (a spent retry budget)."""
        lane = self._lanes.configs[lane_name]
        ticket = Ticket(next(self._ids), lane.name, tenant, job, now, now + lane.deadline,
                        self.estimator.predict(job, self.occupancy()))
        return self._reject(ticket, reason, now)

    def _verdict(self, lane: Lane, ticket: Ticket, now: float
                 ) -> tuple[Outcome, Reason | None, Entry | None, float]:
        """What the policy says about a new request, without acting on it.

        Returns the outcome, the reason of a rejection, the entry a full queue would give
        up for it (fair share), and its rank in the queue.
        """
        lanes = self._lanes
        if lane.closed:
            return Outcome.REJECTED, Reason.LANE_CLOSED, None, 0.0
        effects = lanes.effects
        if effects and lane.name in effects and effects[lane.name].shed_by is not None:
            return Outcome.REJECTED, Reason.SATURATED, None, 0.0
        queue = lanes.queues[lane.name]
        if not queue and lanes.admits(lane):
            return Outcome.ADMITTED, None, None, 0.0
        crowded: Entry | None = None
        rank = lanes.rank(ticket)
        if len(queue) >= lane.max_queued:
            # A full queue still takes a tenant below its fair share of the places, in
            # exchange for the worst entry of the tenant furthest above its share; and a
            # returning retry that claimed its booking, in exchange for the worst entry ranked
            # behind it (its place was kept).
            crowded = queue.crowding(ticket.tenant) if lane.max_queued else None
            if crowded is None and ticket.first is not None and lane.max_queued:
                # Only its own tenant's place: a returning retry never pushes out another tenant.
                worst = queue.worst_of(ticket.tenant)
                crowded = worst if worst is not None and worst.rank > rank else None
            if crowded is None:
                return Outcome.REJECTED, Reason.QUEUE_FULL, None, 0.0
        if lanes.estimated_wait(lane, rank, now) > lane.deadline:
            return Outcome.REJECTED, Reason.DEADLINE_UNMEETABLE, None, rank
        cap = self.policy.capacity.max_queued
        if (cap is not None and lanes.total_queued - (crowded is not None) >= cap
                and lanes.victim(lane, ticket) is None):
            return Outcome.REJECTED, Reason.QUEUE_FULL, None, rank
        return Outcome.QUEUED, None, crowded, rank

    def release(self, ticket: Ticket, now: float, learn: bool = True) -> list[Decision]:
        """End a request however it ended; idempotent. Returns requests admitted in its place.

        An in-flight request frees its slot (and, with ``learn``, teaches the estimator
        its service time); a queued one leaves its queue.
        """
        if ticket.state is State.DONE:
            return []
        if ticket.state is State.QUEUED:
            self._lanes.dequeue(ticket)
        else:
            if self._lanes.stop(ticket):
                self._returns.completed(ticket.lane, now, idle=self._lanes.idle(ticket.lane))
            if learn and ticket.admitted_at is not None:
                self.estimator.observe(ticket.job, ticket.occupancy, now - ticket.admitted_at)
        ticket.state = State.DONE
        admitted = self._dispatch(now)
        self._prune_retired()
        return admitted

    def expire(self, now: float) -> list[Decision]:
        """Reject queued requests past their deadline; reclaim slots held past the backstop."""
        out: list[Decision] = []
        while (ticket := self._timers.overdue(now)) is not None:
            out.append(self._withdraw(ticket, Reason.DEADLINE_EXPIRED, now))
        while (ticket := self._timers.lapsed(now)) is not None:
            self.reclaimed += 1
            out.extend(self.release(ticket, now, learn=False))
        out.extend(self._dispatch(now))
        self._prune_retired()
        return out

    def next_timer(self) -> float | None:
        """When ``expire`` next has something to do."""
        return self._timers.next()

    def drain(self, now: float) -> list[Decision]:
        """Stop admitting; every queued request is rejected as draining."""
        self.draining = True
        out = []
        for queue in self._lanes.queues.values():
            for entry in list(queue.entries()):
                out.append(self._withdraw(self._lanes.queued(entry), Reason.DRAINING, now))
        return out

    def snapshot(self, now: float) -> dict[str, LaneView]:
        return self._lanes.snapshot()

    def lane_view(self, name: str) -> LaneView | None:
        """One lane's view (None for a lane the scheduler does not have)."""
        return self._lanes.lane_view(name)

    def lane_pressure(self, name: str) -> LanePressure | None:
        """One lane's load as the edge reads it, on every request (None for a lane it does not have)."""
        return self._lanes.pressure(name)

    def _prune_retired(self) -> None:
        """Forget retired lanes once their last request is gone."""
        if self._lanes.retired:
            self._lanes.prune_retired()
            self._returns.forget(self._lanes.configs)

    # -- internals ------------------------------------------------------------------

    def _admit(self, ticket: Ticket, now: float) -> None:
        self._returns.started(ticket.lane, now)
        ticket.state = State.INFLIGHT
        ticket.admitted_at = now
        ticket.occupancy = self.occupancy()
        self._lanes.start(ticket)
        until = now + self.policy.capacity.max_request_duration
        self._timers.lease(ticket, until, self._lanes.total_inflight)

    def _withdraw(self, ticket: Ticket, reason: Reason, now: float) -> Decision:
        self._lanes.dequeue(ticket)
        return self._reject(ticket, reason, now)

    def _reject(self, ticket: Ticket, reason: Reason, now: float, cause: Effect | None = None) -> Decision:
        ticket.state = State.DONE
        told = self._returns.retry_after(reason, ticket.lane, now, tenant=ticket.tenant,
                                         first=ticket.first if ticket.first is not None else ticket.arrival,
                                         predicted=ticket.predicted, rank=self.rank(ticket))
        return Decision(Outcome.REJECTED, ticket, reason, told.seconds, cause, retry_after_ms=told.ms,
                        retry_allowed=told.allowed)

    def _dispatch(self, now: float) -> list[Decision]:
        admitted: list[Decision] = []
        while True:
            lane = self._lanes.next_lane()
            if lane is None:
                return admitted
            ticket = self._lanes.pop(lane.name)
            self._admit(ticket, now)
            admitted.append(Decision(Outcome.ADMITTED, ticket))

    # -- when to come back (the returns') -------------------------------------------

    def retry_after(self, reason: Reason, lane: str, now: float, drain: float | None = None, *,
                    tenant: str | None = None, first: float | None = None,
                    predicted: float | None = None, rank: float | None = None) -> Told:
        """What a rejection tells its client: see ``Returns.retry_after``."""
        return self._returns.retry_after(reason, lane, now, drain, tenant=tenant, first=first,
                                         predicted=predicted, rank=rank)

    def claimable(self, lane: str, tenant: str, now: float) -> bool:
        """Whether a retry of ``tenant`` to ``lane`` arriving now would claim a booking (the edge asks)."""
        return self._returns.claimable(lane, tenant, now)

    def holds_booking(self, lane: str, tenant: str, now: float) -> bool:
        """Whether a retry of ``tenant`` to ``lane`` arriving now holds a booking (nothing is taken)."""
        return self._returns.holds_booking(lane, tenant, now)

    @property
    def bookings(self) -> int:
        """Returns booked on the lanes' schedules and not yet claimed (lapsed ones until swept)."""
        return self._returns.bookings

    def expire_bookings(self, now: float) -> None:
        """Sweep lapsed bookings."""
        self._returns.expire_bookings(now)

    def set_drain_rates(self, rates: Mapping[str, float], replicas: int = 1) -> None:
        """The fleet's completions per second per lane, and how many replicas share them."""
        self._returns.set_drain_rates(rates, replicas)

    def drain_rate(self, lane: str, now: float) -> float | None:
        """Completions per second in ``lane``, if known."""
        return self._returns.drain_rate(lane, now)

    def drain_rates(self, now: float) -> dict[str, float | None]:
        """Every lane's ``drain_rate``."""
        return self._returns.drain_rates(now)

    def drain_wait(self, lane: str, now: float, rank: float | None = None) -> float:
        """Seconds until a request joining ``lane``'s queue now would get a slot (``Returns.drain_wait``)."""
        return self._returns.drain_wait(lane, now, rank)


def held_queued(scheduler: Scheduler) -> int:
    """Requests waiting only for want of a slot: the queues of the lanes that only slots hold back
    (``Lanes.slot_bound``, as ``held_back`` asks), with what the other replicas queue in them as last
    seen. Not a paused or shed lane's backlog: more slots would not start it."""
    lanes = scheduler._lanes
    return sum(len(queue) + lanes.others_queued(name) for name, queue in lanes.queues.items()
               if (queue or lanes.others_queued(name)) and lanes.slot_bound(lanes.configs[name]))

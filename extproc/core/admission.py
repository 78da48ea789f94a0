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
service and the offline simulator both drive it.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from extproc.core.decision import Decision, Outcome, Reason, State, Ticket
from extproc.core.drain import CompletionRate, ReturnSchedule, Told
from extproc.core.estimate import Estimator, Job
from extproc.core.queue import Entry, LaneQueue, rank_of
from extproc.core.retry import bounds, retry_after
from extproc.core.saturation import Effect
from extproc.policy.schema import Lane, Policy

#: A lane completing fewer requests per second than this drains slower than a Retry-After can say
#: (a minute at most): its measured rate is not used.
_SLOWEST_RATE = 1e-3
#: Dead leases tolerated beyond twice the in-flight count before the lease heap is rebuilt.
_LEASE_SLACK = 1024


@dataclass(frozen=True, slots=True)
class LaneView:
    inflight: int
    limit: int
    queued: int
    borrowed: int
    queued_work: float
    tenants: dict[str, int] = field(default_factory=dict)
    max_queued: int = 0
    priority: int = 0
    paused: bool = False
    closed: bool = False
    shadow: bool = False
    retired: bool = False
    """Removed from the policy by a reload; still finishing its queued and in-flight requests."""
    effective_limit: int = 0
    """The in-flight limit in force: ``limit`` shrunk by saturation."""
    shed_by: str | None = None
    """The saturation rule shedding the lane's new requests, if any."""
    shed_signal: str | None = None
    """The signal behind ``shed_by``."""


def _remaining(ticket: Ticket, now: float) -> float:
    """Predicted seconds until an in-flight request ends (0 once it has overrun its prediction)."""
    return max(ticket.predicted - (now - (ticket.admitted_at or now)), 0.0)


class Scheduler:
    def __init__(self, policy: Policy, rng: random.Random | None = None,
                 estimator: Estimator | None = None, permit: Callable[[float], bool] | None = None) -> None:
        self._ids = itertools.count(1)
        self._rng = rng or random.Random()
        self.estimator = estimator or Estimator(policy.estimation)
        self._inflight: dict[str, dict[int, Ticket]] = {}
        self._queues: dict[str, LaneQueue] = {}
        self._deadlines: list[tuple[float, int, Ticket]] = []
        self._leases: list[tuple[float, int, Ticket]] = []
        self._tickets_by_entry: dict[int, Ticket] = {}
        # Running total of the per-lane maps in _inflight: several checks per decision need
        # it, and summing over every lane each time showed in the request path's profile.
        self._n_inflight = 0
        self.draining = False
        self.paused: set[str] = set()
        self._retired: set[str] = set()
        self._effects: dict[str, Effect] = {}
        self._limits: dict[str, int] = {}
        # Shared store (several replicas): what the other replicas hold and queue, per lane, as
        # last seen; and lanes the store just refused, not admissible until a slot frees anywhere.
        self._others_inflight: dict[str, int] = {}
        self._others_queued: dict[str, int] = {}
        self._others_total = 0
        self.blocked: set[str] = set()
        self.reclaimed = 0
        # How fast each lane frees slots: this replica's own completions, and the fleet's (from the
        # shared store's counters) when a store says.
        self._completions: dict[str, CompletionRate] = {}
        self._fleet_rates: dict[str, float] = {}
        self._replicas = 1
        self._schedule = ReturnSchedule(self._tenant_weight)
        #: Reserves a retry in the retry budget for a rejection that lets its client retry; False:
        #: no room (None: no budget).
        self.permit = permit
        self.reconfigure(policy)

    # -- configuration ------------------------------------------------------------

    def reconfigure(self, policy: Policy, now: float | None = None) -> list[Decision]:
        """Swap in a policy; returns the queued requests it lets start.

        Queued and in-flight requests keep their place. A lane the new policy no longer
        has is retired: it takes no new requests, but its queue is still served (under its
        last limits) and its in-flight requests finish; it disappears once empty. Limits
        that shrink take effect as slots free: nothing running is cut short.
        """
        previous: dict[str, Lane] = getattr(self, "_lanes", {})
        self.policy = policy
        lanes = {lane.name: lane for lane in policy.lanes}
        for name, lane in previous.items():
            if name not in lanes and (self._inflight.get(name) or self._queues.get(name)):
                lanes[name] = lane
        self._retired = {name for name in lanes if name not in {lane.name for lane in policy.lanes}}
        self._lanes = lanes
        self._order = sorted(lanes.values(), key=lambda lane: (-lane.priority, lane.name))
        self._capacity = policy.total_capacity
        self.estimator.reconfigure(policy.estimation)
        self.paused &= set(lanes)
        self.blocked &= set(lanes)
        for name in list(self._inflight):
            if name not in lanes:
                del self._inflight[name]
                del self._queues[name]
        for name in lanes:
            self._inflight.setdefault(name, {})
            if name not in self._queues:
                self._queues[name] = LaneQueue(self._tenant_weight)
        for name in [name for name in self._completions if name not in lanes]:
            del self._completions[name]
        self._schedule.forget(set(lanes))
        self._schedule.reweigh(self._tenant_weight)
        self._update_limits()
        return self._dispatch(now) if now is not None else []

    def _update_limits(self) -> None:
        self._limits = {
            name: self._effects[name].limit(lane.max_inflight) if name in self._effects else lane.max_inflight
            for name, lane in self._lanes.items()
        }

    def apply_saturation(self, effects: Mapping[str, Effect], now: float) -> list[Decision]:
        """Swap in what cluster saturation does to each lane (lanes absent: no effect).

        Shrunk limits take effect as slots free; a lane that starts being shed rejects new
        requests and gives up its queued ones at once (it is the first to go); a lane no longer
        shrunk gets its slots back at once.
        """
        self._effects = {lane: effect for lane, effect in effects.items()
                         if effect.shed_by is not None or effect.factor < 1.0}
        self._update_limits()
        out: list[Decision] = []
        for name, effect in self._effects.items():
            if effect.shed_by is not None and name in self._queues and not self.shadowed(name):
                for entry in list(self._queues[name].entries()):
                    ticket = self._tickets_by_entry[entry.id]
                    self._dequeue(ticket)
                    out.append(self._reject(ticket, Reason.SATURATED, now, effect))
        out.extend(self._dispatch(now))
        return out

    def _tenant_weight(self, tenant: str) -> float:
        # Read from the current policy on each use, so a reload re-weights queued tenants too.
        tenants = self.policy.tenants
        return tenants.weights.get(tenant, tenants.default_weight)

    def shadowed(self, lane: str) -> bool:
        """Whether the lane only observes: decides and counts, but admits everything."""
        config = self._lanes.get(lane)
        return self.policy.shadow or (config is not None and config.shadow)

    # -- several replicas ---------------------------------------------------------

    def set_others(self, inflight: Mapping[str, int], queued: Mapping[str, int], now: float,
                   total: int | None = None) -> list[Decision]:
        """What the other replicas hold and queue per lane (from the shared store); admits what fits.

        ``total``: the slots of the whole capacity they hold, when not the sum over lanes (while the
        store is unreachable the others are taken to hold everything beyond this replica's share).
        """
        self._others_inflight = {lane: n for lane, n in inflight.items() if n > 0}
        self._others_queued = {lane: n for lane, n in queued.items() if n > 0}
        self._others_total = sum(self._others_inflight.values()) if total is None else max(total, 0)
        return self._dispatch(now)

    def unblock(self, now: float, lanes: set[str] | None = None) -> list[Decision]:
        """Slots may have freed somewhere: refused lanes may try again."""
        if lanes is None:
            self.blocked.clear()
        else:
            self.blocked -= lanes
        return self._dispatch(now)

    def requeue(self, ticket: Ticket, now: float) -> Decision:
        """An admitted request the shared store refused a slot: back to its place in the queue.

        Its lane takes nothing more until ``unblock`` (a slot freed somewhere), so the refusal
        cannot turn into a loop of grants and refusals.
        """
        assert ticket.state is State.INFLIGHT
        if self._inflight[ticket.lane].pop(ticket.id, None) is not None:
            self._n_inflight -= 1
        ticket.state = State.QUEUED
        ticket.admitted_at = None
        # A fresh entry at the same rank: the old one may still sit, withdrawn, in the queue's heap.
        ticket.entry = Entry(ticket.id, ticket.tenant, ticket.arrival, ticket.deadline, ticket.predicted,
                             self.rank(ticket))
        # Not served after all: its tenant's fair-queuing charge is given back.
        self._queues[ticket.lane].refund(ticket.entry)
        self._queues[ticket.lane].push(ticket.entry)
        self._tickets_by_entry[ticket.id] = ticket
        heapq.heappush(self._deadlines, (ticket.deadline, ticket.id, ticket))
        self.blocked.add(ticket.lane)
        return Decision(Outcome.QUEUED, ticket)

    def rank(self, ticket: Ticket) -> float:
        """The ticket's place in its lane's order (smaller is better), queued or not."""
        if ticket.entry is not None:
            return ticket.entry.rank
        lane = self._lanes.get(ticket.lane)
        weight = self.policy.queueing.sjf_weight
        if lane is not None and lane.sjf_weight is not None:
            weight = lane.sjf_weight
        if ticket.first is not None:
            # A returning retry that claimed its booking keeps the place its first attempt had
            # (ranked as if it had arrived then): ahead of what arrived since, as far as its size
            # allows (a long job does not overtake short ones that SJF puts first).
            return rank_of(ticket.first, ticket.first + (ticket.deadline - ticket.arrival), ticket.predicted,
                           weight)
        return rank_of(ticket.arrival, ticket.deadline, ticket.predicted, weight)

    def charge_others(self, served: Mapping[tuple[str, str], float]) -> None:
        """Work (predicted seconds, by lane and tenant) other replicas served since the last call:
        each lane's fair queue counts it, so tenants' shares hold fleet-wide."""
        for (lane, tenant), seconds in served.items():
            queue = self._queues.get(lane)
            if queue is not None:
                queue.charge(tenant, seconds)

    def heads(self) -> dict[str, float]:
        """Each lane's best-placed queued request's rank (lanes with nothing queued are absent)."""
        out = {}
        for name, queue in self._queues.items():
            if queue and name not in self.paused:
                best = queue.peek()
                if best is not None:
                    out[name] = best.rank
        return out

    # -- operator actions ---------------------------------------------------------

    def pause(self, lane: str) -> None:
        """Admit nothing more from the lane; its requests queue (to their deadline) until resumed."""
        if lane not in self._lanes:
            raise KeyError(lane)
        self.paused.add(lane)

    def resume(self, lane: str, now: float) -> list[Decision]:
        if lane not in self._lanes:
            raise KeyError(lane)
        self.paused.discard(lane)
        return self._dispatch(now)

    def undrain(self, now: float) -> list[Decision]:
        """Admit again after an operator's drain."""
        self.draining = False
        return self._dispatch(now)

    # -- counts ---------------------------------------------------------------------

    @property
    def total_inflight(self) -> int:
        return self._n_inflight

    @property
    def total_queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    @property
    def held_back(self) -> bool:
        """Whether requests wait only for want of a slot: a lane has a queue and is at its share or
        the fleet is at its limit (not paused, closed, refused by the store, or shrunk by saturation).
        What a self-sizing limit asks before it grows: would more slots let more work start?"""
        for name, lane in self._lanes.items():
            if (self._queues[name] and name not in self._effects and name not in self.paused
                    and name not in self.blocked and not lane.closed and not self._admissible(lane)):
                return True
        return False

    def occupancy(self) -> float:
        return self.total_inflight / self._capacity

    def _within_quota(self, lane: Lane) -> bool:
        inflight = len(self._inflight[lane.name])
        if self._others_total:
            inflight += self._others_inflight.get(lane.name, 0)
        return inflight < self._limits[lane.name]

    def admissible(self, name: str) -> bool:
        """Whether one more request of lane ``name`` could start now (the edge asks: one rule)."""
        lane = self._lanes.get(name)
        return lane is not None and self._admissible(lane)

    def _admissible(self, lane: Lane) -> bool:
        """Whether one more request of ``lane`` may start now without breaking any limit.

        With a shared store the counts include the other replicas' (as last seen); the store
        makes the final, exact check when the request takes its slot.
        """
        others = self._others_total
        total = self._n_inflight + others
        if total >= self._capacity or lane.closed or lane.name in self.paused or lane.name in self.blocked:
            return False
        inflight = len(self._inflight[lane.name])
        if others:
            inflight += self._others_inflight.get(lane.name, 0)
        limit = self._limits[lane.name]
        if inflight < limit:
            return True
        if not lane.borrow:
            return False
        if lane.max_borrow is not None and inflight >= limit + lane.max_borrow:
            return False
        owed = 0
        for other in self._lanes.values():
            if other is lane:
                continue
            name = other.name
            waiting = len(self._queues[name]) + self._others_queued.get(name, 0)
            if waiting:
                held = len(self._inflight[name]) + self._others_inflight.get(name, 0)
                owed += min(waiting, max(0, self._limits[name] - held))
        return self._capacity - total - owed > 0

    def _estimated_wait(self, lane: Lane, rank: float, now: float) -> float:
        """When a request of ``rank`` would start, by list scheduling on the lane's slots.

        In-flight requests end at their predicted times and queued requests ranked
        ahead take slots in rank order as they free. A slot the lane owns but cannot
        use now (lent out) counts as free when the soonest request of any lane ends.
        """
        inflight = self._inflight[lane.name]
        ends = [_remaining(t, now) for t in inflight.values()]
        idle = self._limits[lane.name] - len(ends)
        if idle > 0:
            lent_back = 0.0
            if self.total_inflight >= self._capacity:
                lent_back = min(
                    (_remaining(t, now) for tickets in self._inflight.values() for t in tickets.values()),
                    default=0.0,
                )
            ends.extend([lent_back] * idle)
        if not ends:
            return 0.0
        heapq.heapify(ends)
        for _, predicted in sorted(
            (e.rank, e.predicted) for e in self._queues[lane.name].entries() if e.rank <= rank
        ):
            heapq.heapreplace(ends, ends[0] + predicted)
        return ends[0]

    def backlog_wait(self, lane: str, now: float) -> float:
        """Estimated seconds until a request arriving now, behind the whole queue, could start."""
        config = self._lanes.get(lane)
        # A lane removed by a reload may still have queued requests to reject.
        return self._estimated_wait(config, math.inf, now) if config is not None else 0.0

    # -- decisions ------------------------------------------------------------------

    def submit(self, lane_name: str, tenant: str, job: Job, now: float, *, retry: bool = False
               ) -> tuple[Decision, list[Decision]]:
        """Decide a new request. Returns its decision and any queued requests it evicted."""
        lane = self._lanes[lane_name]
        predicted = self.estimator.predict(job, self.occupancy())
        # A retry of the tenant that was told to come back about now claims that booking; a retry
        # without one (or a client that only says it retries) is an ordinary request. Only a tenant
        # the gateway vouches for may claim (anyone may say they are the default tenant), and the
        # place kept is at most a lane's deadline old (re-bookings cannot age it further).
        first = self._schedule.claim(lane.name, tenant, now) if retry and self._vouched(tenant) else None
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
        if self.shadowed(lane.name) and lane.name not in self.paused:
            # Observe only: the request starts now whatever the verdict, and takes a slot like
            # any other, so later verdicts see the load the backend really has.
            self._admit(ticket, now)
            return Decision(Outcome.ADMITTED, ticket, reason, shadow=outcome), []
        if outcome is Outcome.REJECTED:
            assert reason is not None
            cause = self._effects[lane.name] if reason is Reason.SATURATED else None
            return self._reject(ticket, reason, now, cause), []
        evicted: list[Decision] = []
        if crowded is not None:
            reason = Reason.FAIR_SHARE if ticket.first is None else Reason.EVICTED
            evicted.append(self._withdraw(self._tickets_by_entry[crowded.id], reason, now))
        cap = self.policy.capacity.max_queued
        if cap is not None and self.total_queued >= cap:
            victim = self._victim(lane, ticket)
            if victim is None:
                return self._reject(ticket, Reason.QUEUE_FULL, now), evicted
            evicted.append(self._withdraw(victim, Reason.EVICTED, now))
        ticket.entry = Entry(ticket.id, tenant, now, ticket.deadline, predicted, rank)
        self._queues[lane.name].push(ticket.entry)
        self._tickets_by_entry[ticket.id] = ticket
        heapq.heappush(self._deadlines, (ticket.deadline, ticket.id, ticket))
        return Decision(Outcome.QUEUED, ticket), evicted

    def refuse(self, lane_name: str, tenant: str, job: Job, reason: Reason, now: float) -> Decision:
        """Reject a new request for a reason decided outside the scheduler (a spent retry budget)."""
        lane = self._lanes[lane_name]
        ticket = Ticket(next(self._ids), lane.name, tenant, job, now, now + lane.deadline,
                        self.estimator.predict(job, self.occupancy()))
        return self._reject(ticket, reason, now)

    def _verdict(self, lane: Lane, ticket: Ticket, now: float
                 ) -> tuple[Outcome, Reason | None, Entry | None, float]:
        """What the policy says about a new request, without acting on it.

        Returns the outcome, the reason of a rejection, the entry a full queue would give
        up for it (fair share), and its rank in the queue.
        """
        if lane.closed:
            return Outcome.REJECTED, Reason.LANE_CLOSED, None, 0.0
        if self._effects and lane.name in self._effects and self._effects[lane.name].shed_by is not None:
            return Outcome.REJECTED, Reason.SATURATED, None, 0.0
        queue = self._queues[lane.name]
        if not queue and self._admissible(lane):
            return Outcome.ADMITTED, None, None, 0.0
        crowded: Entry | None = None
        rank = self.rank(ticket)
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
        if self._estimated_wait(lane, rank, now) > lane.deadline:
            return Outcome.REJECTED, Reason.DEADLINE_UNMEETABLE, None, rank
        cap = self.policy.capacity.max_queued
        if (cap is not None and self.total_queued - (crowded is not None) >= cap
                and self._victim(lane, ticket) is None):
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
            self._dequeue(ticket)
        else:
            inflight = self._inflight.get(ticket.lane)
            if inflight is not None and inflight.pop(ticket.id, None) is not None:
                self._n_inflight -= 1
                rate = self._completions.get(ticket.lane)
                if rate is None:
                    rate = self._completions[ticket.lane] = CompletionRate()
                rate.add(now)
                if not inflight and not self._queues[ticket.lane]:
                    rate.pause(now)  # idle: completing nothing says nothing of its pace
            if learn and ticket.admitted_at is not None:
                self.estimator.observe(ticket.job, ticket.occupancy, now - ticket.admitted_at)
        ticket.state = State.DONE
        admitted = self._dispatch(now)
        if self._retired:
            self._prune_retired()
        return admitted

    def expire(self, now: float) -> list[Decision]:
        """Reject queued requests past their deadline; reclaim slots held past the backstop."""
        out: list[Decision] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, ticket = heapq.heappop(self._deadlines)
            if ticket.state is State.QUEUED:
                out.append(self._withdraw(ticket, Reason.DEADLINE_EXPIRED, now))
        while self._leases and self._leases[0][0] <= now:
            _, _, ticket = heapq.heappop(self._leases)
            if ticket.state is State.INFLIGHT:
                self.reclaimed += 1
                out.extend(self.release(ticket, now, learn=False))
        out.extend(self._dispatch(now))
        if self._retired:
            self._prune_retired()
        return out

    def next_timer(self) -> float | None:
        """When ``expire`` next has something to do."""
        while self._deadlines and self._deadlines[0][2].state is not State.QUEUED:
            heapq.heappop(self._deadlines)
        while self._leases and self._leases[0][2].state is not State.INFLIGHT:
            heapq.heappop(self._leases)
        times = [h[0][0] for h in (self._deadlines, self._leases) if h]
        return min(times) if times else None

    def drain(self, now: float) -> list[Decision]:
        """Stop admitting; every queued request is rejected as draining."""
        self.draining = True
        out = []
        for queue in self._queues.values():
            for entry in list(queue.entries()):
                out.append(self._withdraw(self._tickets_by_entry[entry.id], Reason.DRAINING, now))
        return out

    def snapshot(self, now: float) -> dict[str, LaneView]:
        return {name: self._view(name) for name in self._inflight}

    def lane_view(self, name: str) -> LaneView | None:
        """One lane's view (None for a lane the scheduler does not have): what the edge asks per request."""
        return self._view(name) if name in self._inflight else None

    def _view(self, name: str) -> LaneView:
        tickets = self._inflight[name]
        lane = self._lanes[name]
        queue = self._queues[name]
        retired = name in self._retired
        effect = self._effects.get(name)
        return LaneView(
            inflight=len(tickets),
            limit=0 if retired else lane.max_inflight,
            effective_limit=0 if retired else self._limits[name],
            queued=len(queue),
            borrowed=max(0, len(tickets) - self._limits[name]),
            queued_work=queue.work,
            tenants=queue.tenants(),
            max_queued=lane.max_queued,
            priority=lane.priority,
            paused=name in self.paused,
            closed=lane.closed,
            shadow=self.shadowed(name),
            retired=retired,
            shed_by=effect.shed_by if effect is not None else None,
            shed_signal=effect.signal if effect is not None else None,
        )

    def _prune_retired(self) -> None:
        """Forget retired lanes once their last request is gone."""
        for name in [n for n in self._retired if not self._inflight[n] and not self._queues[n]]:
            self._retired.discard(name)
            self.paused.discard(name)
            self.blocked.discard(name)
            del self._lanes[name], self._inflight[name], self._queues[name]
            self._completions.pop(name, None)
            self._order = [lane for lane in self._order if lane.name != name]
        self._schedule.forget(set(self._lanes))

    # -- internals ------------------------------------------------------------------

    def _admit(self, ticket: Ticket, now: float) -> None:
        rate = self._completions.get(ticket.lane)
        if rate is not None:
            rate.resume(now)
        ticket.state = State.INFLIGHT
        ticket.admitted_at = now
        ticket.occupancy = self.occupancy()
        self._inflight[ticket.lane][ticket.id] = ticket
        self._n_inflight += 1
        if len(self._leases) >= 2 * self._n_inflight + _LEASE_SLACK:
            self._compact_leases()
        heapq.heappush(
            self._leases, (now + self.policy.capacity.max_request_duration, ticket.id, ticket)
        )

    def _compact_leases(self) -> None:
        """Drop the leases of requests that have ended.

        A finished request's lease stays in the heap (taking it out of the middle would cost
        O(n)) until it comes due, ``max_request_duration`` later (an hour by default): at a few
        hundred requests a second, a million dead entries, each keeping its Ticket alive and
        walked by every full garbage collection. Rebuilding once dead entries outnumber live
        ones keeps the heap within a constant factor of the in-flight count, in amortised O(1).
        """
        self._leases = [lease for lease in self._leases if lease[2].state is State.INFLIGHT]
        heapq.heapify(self._leases)

    def _dequeue(self, ticket: Ticket) -> None:
        if ticket.entry is not None:
            self._queues[ticket.lane].remove(ticket.entry)
        self._tickets_by_entry.pop(ticket.id, None)

    def _withdraw(self, ticket: Ticket, reason: Reason, now: float) -> Decision:
        self._dequeue(ticket)
        return self._reject(ticket, reason, now)

    def _reject(self, ticket: Ticket, reason: Reason, now: float, cause: Effect | None = None) -> Decision:
        ticket.state = State.DONE
        told = self.retry_after(reason, ticket.lane, now, tenant=ticket.tenant,
                                first=ticket.first if ticket.first is not None else ticket.arrival,
                                predicted=ticket.predicted, rank=self.rank(ticket))
        return Decision(Outcome.REJECTED, ticket, reason, told.seconds, cause, retry_after_ms=told.ms,
                        retry_allowed=told.allowed)

    def retry_after(self, reason: Reason, lane: str, now: float, drain: float | None = None, *,
                    tenant: str | None = None, first: float | None = None,
                    predicted: float | None = None, rank: float | None = None) -> Told:
        """What a rejection tells its client: when to come back, and whether retrying can help.

        Where retrying soon cannot help (a closed or shed lane): the longest allowed, jittered.
        Otherwise from when the request would start from its place (``drain_wait`` at ``rank``; a
        booked return keeps that place): once the lane's
        completion rate is known, the next place of the lane's return schedule from then on (one
        client per ``1 / (retry_after.share * rate)`` s; this replica's part of the fleet's rate),
        booked for ``tenant``'s return (``first``: when the request first arrived) if the retry
        budget has room. Returns also spend their service time (``predicted``) from ``share`` of
        the lane's slots: a long job that finds too little there is not booked. With the schedule
        full (to the longest wait allowed, or of slot time), retrying is not allowed.
        Before a rate is measured the schedule paces at the rate the running requests imply
        (``_running_rate``). With nothing running, with ``retry_after.share`` 0, or for a replica
        shutting down: the drain itself, jittered. ``drain``: ``drain_wait`` if the caller already
        has it (the edge's lane check computed it). The retry budget is asked once, here (``permit``).
        """
        config = self.policy.retry_after
        if not reason.retry_helps:
            return Told(retry_after(config.max, config, self._rng))
        if drain is None:
            drain = self.drain_wait(lane, now, rank)
        measured = self._rate(lane, now) or self._running_rate(lane)
        if measured is not None and tenant is not None and config.share > 0 and reason is not Reason.DRAINING:
            low, high = bounds(config)
            rate, share = measured
            pace = config.share * rate / share
            self._schedule.expire(now)
            # From the drain on (a return before a slot frees would find none), but at most the
            # longest allowed: a booked return keeps its first attempt's place, so it does not
            # wait behind all of a long queue.
            earliest = min(max(drain, low), high)
            # This replica's part of share of the lane's slots, as slot-seconds per second.
            supply = config.share * self._limits.get(lane, 0) / share
            work = predicted or 0.0
            cap = self._booking_cap(lane, tenant, pace, high, work, supply)
            if self._schedule.booked(lane, tenant) >= cap:
                # Its tenant holds its share of the returns: no place can be promised to this one.
                return Told(retry_after(drain, config, self._rng), allowed=False)
            due = self._schedule.place(lane, now, earliest, high, pace, work=work, supply=supply)
            if due is None:
                # Booked to the longest wait allowed: no return within it can be promised.
                return Told(retry_after(config.max, config, self._rng), allowed=False)
            if not self._permitted(now):
                return Told(retry_after(drain, config, self._rng), allowed=False)
            self._schedule.book(lane, tenant, due, pace, now if first is None else first, now=now,
                                latest=high, work=work, supply=supply)
            wait = due - now
            return Told(max(1, math.ceil(wait - 1e-9)), ms=max(1, round(wait * 1000)), booked=True)
        return Told(retry_after(drain, config, self._rng), allowed=self._permitted(now))

    def _running_rate(self, lane: str) -> tuple[float, int] | None:
        """Before a completion rate is measured: the rate the lane's running requests imply (each
        slot completes one request per predicted service time of what runs in it: the sum of
        1 / predicted; not the count over the mean, which long jobs, running longest, dominate),
        so the first rejections are spread too."""
        tickets = self._inflight.get(lane)
        if not tickets:
            return None
        rate = sum(1.0 / max(t.predicted, 1e-3) for t in tickets.values())
        return (rate, 1) if _SLOWEST_RATE <= rate < math.inf else None

    def _permitted(self, now: float) -> bool:
        return self.permit is None or self.permit(now)

    def claimable(self, lane: str, tenant: str, now: float) -> bool:
        """Whether a retry of ``tenant`` to ``lane`` arriving now would claim a booking (the edge
        lets one retry per booking through to ext_proc, which claims it)."""
        return self._vouched(tenant) and self._schedule.claimable(lane, tenant, now)

    def holds_booking(self, lane: str, tenant: str, now: float) -> bool:
        """Whether a retry of ``tenant`` to ``lane`` arriving now would claim a booking (nothing is
        taken: ext_proc's own check before it submits)."""
        return self._vouched(tenant) and self._schedule.holds(lane, tenant, now)

    def _vouched(self, tenant: str) -> bool:
        """Whether ``tenant`` came from a header the gateway vouches for (not the default)."""
        tenants = self.policy.tenants
        return (tenants.header is not None and tenants.header in self.policy.trusted_headers
                and tenant != tenants.default)

    def _booking_cap(self, lane: str, tenant: str, pace: float, high: float, work: float,
                     supply: float) -> int:
        """How many bookings ``tenant`` may hold on ``lane``'s schedule: its weight's share of the
        returns the longest wait holds (places at ``pace``, and the slot time allowed for returns,
        ``supply``, in jobs of this one's ``work``), among the tenants queued or booked there: one
        tenant's flood of rejections cannot take every return."""
        held = self._schedule.holders(lane)
        total = self._schedule.held_weight(lane)  # kept as bookings come and go: O(1)
        queue = self._queues.get(lane)
        queued = queue.tenants() if queue is not None else {}
        for name in queued:  # at most max_queued of them
            if name not in held:
                total += self._tenant_weight(name)
        mine = self._tenant_weight(tenant)
        if tenant not in held and tenant not in queued:
            total += mine
        share = mine / total if total > 0 else 1.0
        if share >= 1 - 1e-12:
            return sys.maxsize  # alone: the schedule's own limits are all there is
        returns = pace * high
        if work > 0 and math.isfinite(supply):
            returns = min(returns, supply * high / work)
        return max(1, math.ceil(share * returns))

    @property
    def bookings(self) -> int:
        """Returns booked on the lanes' schedules and not yet claimed (lapsed ones until swept)."""
        return len(self._schedule)

    def expire_bookings(self, now: float) -> None:
        """Sweep lapsed bookings (at most once per ``ReturnSchedule.LATE`` s)."""
        self._schedule.expire(now)

    def set_drain_rates(self, rates: Mapping[str, float], replicas: int = 1) -> None:
        """The fleet's completions per second per lane (from the shared store; lanes absent are
        measured here) and how many replicas share them (each books its part of the schedule)."""
        self._fleet_rates = dict(rates)
        self._replicas = max(1, replicas)

    def drain_rate(self, lane: str, now: float) -> float | None:
        """Completions per second in ``lane``: the fleet's if known, else this replica's once it
        has watched for a while; None before that (or while slower than Retry-After can say)."""
        measured = self._rate(lane, now)
        return measured[0] if measured is not None else None

    def _rate(self, lane: str, now: float) -> tuple[float, int] | None:
        """(completions per second, how many replicas share them) for ``lane``, if known."""
        fleet = self._fleet_rates.get(lane)
        if fleet is not None:
            rate, share = fleet, self._replicas
        else:
            local = self._completions.get(lane)
            if local is None or not local.known(now):
                return None
            rate, share = local.value(now), 1
        if not (rate >= _SLOWEST_RATE and math.isfinite(rate)):
            return None
        return rate, share

    def drain_rates(self, now: float) -> dict[str, float | None]:
        """Every lane's ``drain_rate``."""
        return {name: self.drain_rate(name, now) for name in self._lanes}

    def drain_wait(self, lane: str, now: float, rank: float | None = None) -> float:
        """Seconds until a request joining ``lane``'s queue now would get a slot: the requests
        ahead of it over every replica (this one's queue and the others' as last seen), plus
        itself, over the lane's measured completion rate. ``rank``: its place in the lane's order
        (None: behind the whole queue, as the edge, which knows no job size, asks); the other
        replicas' queues count in the share this one's has ahead of it. Until a rate is known,
        list scheduling on this replica's own predicted service times. 0 with a slot free now."""
        config = self._lanes.get(lane)
        if config is None:
            return 0.0
        queue = self._queues.get(lane)
        here = len(queue) if queue is not None else 0
        if here + self._others_queued.get(lane, 0) == 0 and self._admissible(config):
            return 0.0
        measured = self._rate(lane, now)
        if measured is None:
            return self._estimated_wait(config, math.inf if rank is None else rank, now)
        rate, _ = measured
        ahead: float = here
        others: float = self._others_queued.get(lane, 0)
        if rank is not None and queue is not None and here:
            ahead = sum(1 for e in queue.entries() if e.rank <= rank)
            others = others * ahead / here
        # The fleet's rate drains every replica's queue; this replica's own rate only its own.
        if lane in self._fleet_rates:
            ahead += others
        return (ahead + 1) / rate

    def _victim(self, incoming: Lane, ticket: Ticket | None = None) -> Ticket | None:
        for lane in reversed(self._order):
            if lane.priority >= incoming.priority:
                break
            if lane.evictable and self._queues[lane.name]:
                worst = self._queues[lane.name].worst()
                if worst is not None:
                    return self._tickets_by_entry[worst.id]
        if ticket is not None and ticket.first is not None:
            # A returning retry with its booking: its own tenant's worst entry ranked behind it.
            worst = self._queues[incoming.name].worst_of(ticket.tenant)
            if worst is not None and worst.rank > self.rank(ticket):
                return self._tickets_by_entry[worst.id]
        return None

    def _dispatch(self, now: float) -> list[Decision]:
        admitted: list[Decision] = []
        while True:
            lane = self._next_lane()
            if lane is None:
                return admitted
            entry = self._queues[lane.name].pop()
            assert entry is not None
            ticket = self._tickets_by_entry.pop(entry.id)
            self._admit(ticket, now)
            admitted.append(Decision(Outcome.ADMITTED, ticket))

    def _next_lane(self) -> Lane | None:
        borrower: Lane | None = None
        for lane in self._order:
            if not self._queues[lane.name] or not self._admissible(lane):
                continue
            if self._within_quota(lane):
                return lane
            borrower = borrower or lane
        return borrower

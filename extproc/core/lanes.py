"""Lanes: where every request of every lane is, and the slot rule over them.

How this works: :class:`Lanes` holds what the admission rule reads — each lane's configuration
and its place in the priority order, its queue and its in-flight requests, the limit in force
(its quota, shrunk by saturation), what the other replicas hold and queue as last seen, and the
lanes an operator paused, the shared store refused or a reload retired — and answers the rule's
questions over it: may one more request of a lane start now (:meth:`Lanes.admits`), whose queued
work goes next (:meth:`Lanes.next_lane`), when would a request of a given rank start (list
scheduling, :meth:`Lanes.estimated_wait`). It decides nothing: the scheduler
(``core/admission.py``) takes the decisions and moves requests between queue and slot here.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from extproc.core.decision import Ticket
from extproc.core.queue import Entry, LaneQueue, rank_of
from extproc.core.saturation import Effect
from extproc.policy.schema import Lane, Policy


@dataclass(frozen=True, slots=True)
class LanePressure:
    """A lane's load as the edge sees it."""

    queued: int
    max_queued: int
    inflight: int
    limit: int
    """The in-flight limit in force (saturation may have shrunk it)."""
    slot_free: bool = True
    """Whether one more request of this lane could start now, by the scheduler's own rule."""
    shed_by: str | None = None
    """What sheds this lane under saturation (None: not shed)."""
    signal: str | None = None
    """The signal that made it shed, for logs."""
    closed: bool = False
    """Closed by policy: every request is rejected."""
    paused: bool = False
    """Paused by an operator: nothing starts, requests queue until their deadline."""
    shadow: bool = False
    """The lane only observes (policy or lane shadow mode): the edge must not block it either."""
    tenants: Mapping[str, int] = field(default_factory=dict)
    """Queued requests by tenant (for fair shares of a full queue)."""


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


class Lanes:
    """Every lane's configuration, queue, in-flight requests and limits, and the slot rule."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.configs: dict[str, Lane] = {}
        self.order: list[Lane] = []
        self.capacity = 0
        self.inflight: dict[str, dict[int, Ticket]] = {}
        self.queues: dict[str, LaneQueue] = {}
        self._queued: dict[int, Ticket] = {}
        # Running total of the per-lane maps in inflight: several checks per decision need
        # it, and summing over every lane each time showed in the request path's profile.
        self._n_inflight = 0
        self.paused: set[str] = set()
        self.retired: set[str] = set()
        self.effects: dict[str, Effect] = {}
        self.limits: dict[str, int] = {}
        # Shared store (several replicas): what the other replicas hold and queue, per lane, as
        # last seen; and lanes the store just refused, not admissible until a slot frees anywhere.
        self._others_inflight: dict[str, int] = {}
        self._others_queued: dict[str, int] = {}
        self._others_total = 0
        self.blocked: set[str] = set()
        self.configure(policy)

    # -- configuration ------------------------------------------------------------

    def configure(self, policy: Policy) -> None:
        """Swap in a policy's lanes; a lane it no longer has but that still holds requests is retired."""
        previous = self.configs
        self.policy = policy
        lanes = {lane.name: lane for lane in policy.lanes}
        for name, lane in previous.items():
            if name not in lanes and (self.inflight.get(name) or self.queues.get(name)):
                lanes[name] = lane
        self.retired = {name for name in lanes if name not in {lane.name for lane in policy.lanes}}
        self.configs = lanes
        self.order = sorted(lanes.values(), key=lambda lane: (-lane.priority, lane.name))
        self.capacity = policy.total_capacity
        self.paused &= set(lanes)
        self.blocked &= set(lanes)
        for name in list(self.inflight):
            if name not in lanes:
                del self.inflight[name]
                del self.queues[name]
        for name in lanes:
            self.inflight.setdefault(name, {})
            if name not in self.queues:
                self.queues[name] = LaneQueue(self.tenant_weight)
        self._update_limits()

    def _update_limits(self) -> None:
        self.limits = {
            name: self.effects[name].limit(lane.max_inflight) if name in self.effects else lane.max_inflight
            for name, lane in self.configs.items()
        }

    def set_effects(self, effects: Mapping[str, Effect]) -> None:
        """What cluster saturation does to each lane (lanes absent, or unaffected: no effect)."""
        self.effects = {lane: effect for lane, effect in effects.items()
                        if effect.shed_by is not None or effect.factor < 1.0}
        self._update_limits()

    def tenant_weight(self, tenant: str) -> float:
        # Read from the current policy on each use, so a reload re-weights queued tenants too.
        tenants = self.policy.tenants
        return tenants.weights.get(tenant, tenants.default_weight)

    def shadowed(self, lane: str) -> bool:
        """Whether the lane only observes: decides and counts, but admits everything."""
        config = self.configs.get(lane)
        return self.policy.shadow or (config is not None and config.shadow)

    def prune_retired(self) -> None:
        """Forget retired lanes once their last request is gone."""
        for name in [n for n in self.retired if not self.inflight[n] and not self.queues[n]]:
            self.retired.discard(name)
            self.paused.discard(name)
            self.blocked.discard(name)
            del self.configs[name], self.inflight[name], self.queues[name]
            self.order = [lane for lane in self.order if lane.name != name]

    # -- several replicas ---------------------------------------------------------

    def set_others(self, inflight: Mapping[str, int], queued: Mapping[str, int], total: int | None) -> None:
        """What the other replicas hold and queue per lane; ``total``: the slots they hold, when not
        the sum over lanes."""
        self._others_inflight = {lane: n for lane, n in inflight.items() if n > 0}
        self._others_queued = {lane: n for lane, n in queued.items() if n > 0}
        self._others_total = sum(self._others_inflight.values()) if total is None else max(total, 0)

    def unblock(self, lanes: set[str] | None) -> None:
        """Slots may have freed somewhere: ``lanes`` (None: all) the store refused may try again."""
        if lanes is None:
            self.blocked.clear()
        else:
            self.blocked -= lanes

    def others_queued(self, lane: str) -> int:
        """What the other replicas queue in ``lane``, as last seen."""
        return self._others_queued.get(lane, 0)

    def charge_others(self, served: Mapping[tuple[str, str], float]) -> None:
        """Work (predicted seconds, by lane and tenant) other replicas served since the last call:
        each lane's fair queue counts it, so tenants' shares hold fleet-wide."""
        for (lane, tenant), seconds in served.items():
            queue = self.queues.get(lane)
            if queue is not None:
                queue.charge(tenant, seconds)

    # -- operator actions ---------------------------------------------------------

    def pause(self, lane: str) -> None:
        if lane not in self.configs:
            raise KeyError(lane)
        self.paused.add(lane)

    def resume(self, lane: str) -> None:
        if lane not in self.configs:
            raise KeyError(lane)
        self.paused.discard(lane)

    # -- requests -------------------------------------------------------------------

    def rank(self, ticket: Ticket) -> float:
        """The ticket's place in its lane's order (smaller is better), queued or not."""
        if ticket.entry is not None:
            return ticket.entry.rank
        lane = self.configs.get(ticket.lane)
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

    def requeue(self, ticket: Ticket) -> None:
        """An in-flight ticket the shared store refused a slot: back to its place in its lane's
        queue; the lane is blocked (takes nothing more until :meth:`unblock`)."""
        self.stop(ticket)
        # A fresh entry at the same rank: the old one may still sit, withdrawn, in the queue's heap.
        ticket.entry = Entry(ticket.id, ticket.tenant, ticket.arrival, ticket.deadline, ticket.predicted,
                             self.rank(ticket))
        # Not served after all: its tenant's fair-queuing charge is given back.
        self.queues[ticket.lane].refund(ticket.entry)
        self.enqueue(ticket)
        self.blocked.add(ticket.lane)

    def enqueue(self, ticket: Ticket) -> None:
        """``ticket`` (its entry made) joins its lane's queue."""
        assert ticket.entry is not None
        self.queues[ticket.lane].push(ticket.entry)
        self._queued[ticket.id] = ticket

    def dequeue(self, ticket: Ticket) -> None:
        """``ticket`` leaves its lane's queue (if it is there)."""
        if ticket.entry is not None:
            self.queues[ticket.lane].remove(ticket.entry)
        self._queued.pop(ticket.id, None)

    def queued(self, entry: Entry) -> Ticket:
        """The ticket of a queued entry."""
        return self._queued[entry.id]

    def pop(self, lane: str) -> Ticket:
        """The best-placed queued ticket of ``lane``, out of its queue."""
        entry = self.queues[lane].pop()
        assert entry is not None
        return self._queued.pop(entry.id)

    def victim(self, incoming: Lane, ticket: Ticket | None = None) -> Ticket | None:
        """The queued request a full queue gives up for ``incoming``'s ``ticket``: the worst of the
        lowest-priority evictable lane below it, else (for a returning retry with its booking) its
        own tenant's worst ranked behind it; None: nothing may be given up."""
        for lane in reversed(self.order):
            if lane.priority >= incoming.priority:
                break
            if lane.evictable and self.queues[lane.name]:
                worst = self.queues[lane.name].worst()
                if worst is not None:
                    return self.queued(worst)
        if ticket is not None and ticket.first is not None:
            # A returning retry with its booking: its own tenant's worst entry ranked behind it.
            worst = self.queues[incoming.name].worst_of(ticket.tenant)
            if worst is not None and worst.rank > self.rank(ticket):
                return self.queued(worst)
        return None

    def start(self, ticket: Ticket) -> None:
        """``ticket`` takes a slot of its lane."""
        self.inflight[ticket.lane][ticket.id] = ticket
        self._n_inflight += 1

    def stop(self, ticket: Ticket) -> bool:
        """``ticket`` gives its slot back; False if it held none."""
        inflight = self.inflight.get(ticket.lane)
        if inflight is not None and inflight.pop(ticket.id, None) is not None:
            self._n_inflight -= 1
            return True
        return False

    def idle(self, lane: str) -> bool:
        """Whether ``lane`` has nothing in flight and nothing queued."""
        return not self.inflight[lane] and not self.queues[lane]

    # -- counts ---------------------------------------------------------------------

    @property
    def total_inflight(self) -> int:
        return self._n_inflight

    @property
    def total_queued(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def occupancy(self) -> float:
        return self._n_inflight / self.capacity

    def queue(self, lane: str) -> LaneQueue | None:
        return self.queues.get(lane)

    def running(self, lane: str) -> Collection[Ticket]:
        """``lane``'s in-flight tickets on this replica."""
        tickets = self.inflight.get(lane)
        return tickets.values() if tickets is not None else ()

    def limit(self, lane: str) -> int:
        """``lane``'s in-flight limit in force (0 for a lane it does not have)."""
        return self.limits.get(lane, 0)

    @property
    def held_back(self) -> bool:
        """Whether requests wait only for want of a slot: a lane has a queue and is at its share or
        the fleet is at its limit (not paused, closed, refused by the store, or shrunk by saturation).
        What a self-sizing limit asks before it grows: would more slots let more work start?"""
        return any(self.queues[name] and self.slot_bound(lane) for name, lane in self.configs.items())

    def slot_bound(self, lane: Lane) -> bool:
        """Whether only slots keep ``lane`` from starting one more request: it is at its share or the
        fleet at its limit, and not paused, closed, refused by the store, or shrunk by saturation."""
        name = lane.name
        return (name not in self.effects and name not in self.paused and name not in self.blocked
                and not lane.closed and not self.admits(lane))

    # -- the slot rule --------------------------------------------------------------

    def _within_quota(self, lane: Lane) -> bool:
        inflight = len(self.inflight[lane.name])
        if self._others_total:
            inflight += self._others_inflight.get(lane.name, 0)
        return inflight < self.limits[lane.name]

    def admissible(self, name: str) -> bool:
        """Whether one more request of lane ``name`` could start now (the edge asks: one rule)."""
        lane = self.configs.get(name)
        return lane is not None and self.admits(lane)

    def admits(self, lane: Lane) -> bool:
        """Whether one more request of ``lane`` may start now without breaking any limit.

        With a shared store the counts include the other replicas' (as last seen); the store
        makes the final, exact check when the request takes its slot.
        """
        others = self._others_total
        total = self._n_inflight + others
        if total >= self.capacity or lane.closed or lane.name in self.paused or lane.name in self.blocked:
            return False
        inflight = len(self.inflight[lane.name])
        if others:
            inflight += self._others_inflight.get(lane.name, 0)
        limit = self.limits[lane.name]
        if inflight < limit:
            return True
        if not lane.borrow:
            return False
        if lane.max_borrow is not None and inflight >= limit + lane.max_borrow:
            return False
        owed = 0
        for other in self.configs.values():
            if other is lane:
                continue
            name = other.name
            waiting = len(self.queues[name]) + self._others_queued.get(name, 0)
            if waiting:
                held = len(self.inflight[name]) + self._others_inflight.get(name, 0)
                owed += min(waiting, max(0, self.limits[name] - held))
        return self.capacity - total - owed > 0

    def next_lane(self) -> Lane | None:
        """The lane whose queued work starts next: under quota first (that is how lent capacity is
        given back), highest priority first, then borrowers; None if no queued request may start."""
        borrower: Lane | None = None
        for lane in self.order:
            if not self.queues[lane.name] or not self.admits(lane):
                continue
            if self._within_quota(lane):
                return lane
            borrower = borrower or lane
        return borrower

    def estimated_wait(self, lane: Lane, rank: float, now: float) -> float:
        """When a request of ``rank`` would start, by list scheduling on the lane's slots.

        In-flight requests end at their predicted times and queued requests ranked
        ahead take slots in rank order as they free. A slot the lane owns but cannot
        use now (lent out) counts as free when the soonest request of any lane ends.
        """
        inflight = self.inflight[lane.name]
        ends = [_remaining(t, now) for t in inflight.values()]
        idle = self.limits[lane.name] - len(ends)
        if idle > 0:
            lent_back = 0.0
            if self.total_inflight >= self.capacity:
                lent_back = min(
                    (_remaining(t, now) for tickets in self.inflight.values() for t in tickets.values()),
                    default=0.0,
                )
            ends.extend([lent_back] * idle)
        if not ends:
            return 0.0
        heapq.heapify(ends)
        for _, predicted in sorted(
            (e.rank, e.predicted) for e in self.queues[lane.name].entries() if e.rank <= rank
        ):
            heapq.heapreplace(ends, ends[0] + predicted)
        return ends[0]

    def backlog_wait(self, lane: str, now: float) -> float:
        """Estimated seconds until a request arriving now, behind the whole queue, could start."""
        config = self.configs.get(lane)
        # A lane removed by a reload may still have queued requests to reject.
        return self.estimated_wait(config, math.inf, now) if config is not None else 0.0

    # -- views ----------------------------------------------------------------------

    def heads(self) -> dict[str, float]:
        """Each lane's best-placed queued request's rank (lanes with nothing queued are absent)."""
        out = {}
        for name, queue in self.queues.items():
            if queue and name not in self.paused:
                best = queue.peek()
                if best is not None:
                    out[name] = best.rank
        return out

    def snapshot(self) -> dict[str, LaneView]:
        return {name: self._view(name) for name in self.inflight}

    def lane_view(self, name: str) -> LaneView | None:
        """One lane's view (None for a lane it does not have): what the edge asks per request."""
        return self._view(name) if name in self.inflight else None

    def pressure(self, name: str) -> LanePressure | None:
        """One lane's load as the edge reads it (None for a lane it does not have)."""
        tickets = self.inflight.get(name)
        if tickets is None:
            return None
        lane = self.configs[name]
        queue = self.queues[name]
        effect = self.effects.get(name)
        return LanePressure(
            queued=len(queue), max_queued=lane.max_queued, inflight=len(tickets),
            limit=0 if name in self.retired else self.limits[name], slot_free=self.admits(lane),
            shed_by=effect.shed_by if effect is not None else None,
            signal=effect.signal if effect is not None else None, closed=lane.closed,
            paused=name in self.paused, shadow=self.shadowed(name), tenants=queue.tenants())

    def _view(self, name: str) -> LaneView:
        tickets = self.inflight[name]
        lane = self.configs[name]
        queue = self.queues[name]
        retired = name in self.retired
        effect = self.effects.get(name)
        return LaneView(
            inflight=len(tickets),
            limit=0 if retired else lane.max_inflight,
            effective_limit=0 if retired else self.limits[name],
            queued=len(queue),
            borrowed=max(0, len(tickets) - self.limits[name]),
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

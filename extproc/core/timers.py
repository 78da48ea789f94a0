"""Timers: when a queued request's deadline passes, and when an in-flight request's slot is reclaimed.

How this works: two heaps of ``(due, ticket id, ticket)``. A queued request's *deadline* is
watched from when it joins a queue; an admitted request's *lease* runs ``max_request_duration``
from when it takes its slot (the backstop that gives the slot back if its end is never heard).
A request that moves on leaves its entry where it is (taking it out of the middle of a heap would
cost O(n)): an entry whose request is no longer in the state it watches is skipped when it comes
due, and dead leases are compacted away once they outnumber the live ones.
"""

from __future__ import annotations

import heapq

from extproc.core.decision import State, Ticket

#: Dead leases tolerated beyond twice the in-flight count before the lease heap is rebuilt.
_LEASE_SLACK = 1024


def _pop_due(heap: list[tuple[float, int, Ticket]], state: State, now: float) -> Ticket | None:
    """The first ticket due by ``now`` and still in ``state``, off ``heap`` (the others due are dropped)."""
    while heap and heap[0][0] <= now:
        _, _, ticket = heapq.heappop(heap)
        if ticket.state is state:
            return ticket
    return None


class Timers:
    """Deadlines of queued requests and leases of in-flight ones."""

    def __init__(self) -> None:
        self._deadlines: list[tuple[float, int, Ticket]] = []
        self._leases: list[tuple[float, int, Ticket]] = []

    def deadline(self, ticket: Ticket) -> None:
        """``ticket`` joined a queue: watch its deadline."""
        heapq.heappush(self._deadlines, (ticket.deadline, ticket.id, ticket))

    def lease(self, ticket: Ticket, until: float, inflight: int) -> None:
        """``ticket`` took a slot, to hold until ``until`` at most; ``inflight``: requests in flight now."""
        if len(self._leases) >= 2 * inflight + _LEASE_SLACK:
            self._compact_leases()
        heapq.heappush(self._leases, (until, ticket.id, ticket))

    def overdue(self, now: float) -> Ticket | None:
        """A queued request whose deadline has passed (taken off its timer); None once there is none."""
        return _pop_due(self._deadlines, State.QUEUED, now)

    def lapsed(self, now: float) -> Ticket | None:
        """An in-flight request past its lease (taken off its timer); None once there is none."""
        return _pop_due(self._leases, State.INFLIGHT, now)

    def next(self) -> float | None:
        """When a deadline or a lease next comes due."""
        while self._deadlines and self._deadlines[0][2].state is not State.QUEUED:
            heapq.heappop(self._deadlines)
        while self._leases and self._leases[0][2].state is not State.INFLIGHT:
            heapq.heappop(self._leases)
        times = [h[0][0] for h in (self._deadlines, self._leases) if h]
        return min(times) if times else None

    def _compact_leases(self) -> None:
        """Drop the leases of requests that have ended.

        A finished request's lease stays in the heap until it comes due, ``max_request_duration``
        later (an hour by default): at a few hundred requests a second, a million dead entries,
        each keeping its Ticket alive and walked by every full garbage collection. Rebuilding once
        dead entries outnumber live ones keeps the heap within a constant factor of the in-flight
        count, in amortised O(1).
        """
        self._leases = [lease for lease in self._leases if lease[2].state is State.INFLIGHT]
        heapq.heapify(self._leases)

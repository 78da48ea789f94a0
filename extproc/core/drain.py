"""How fast each lane drains: completions per second, measured (pure: explicit time, no I/O).

Retry-After should say when a request rejected now would get a slot if it came back: the requests
ahead of it in its lane (over every replica) divided by how fast the lane completes requests
(over every replica). :class:`Rate` is an exponentially weighted event rate: each completion adds
``1/tau`` and the estimate decays by ``e^(-dt/tau)``, so it follows a change in throughput within
a few ``tau`` and needs no timer. :class:`FleetRate` turns the fleet's completion counters (one
per lane in the shared store, read on each sync) into the same kind of estimate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

#: Time constant of the completion-rate estimates (seconds).
TAU = 10.0


class Rate:
    """Events per second, exponentially weighted over ``tau``."""

    __slots__ = ("_at", "_rate", "_since", "tau")

    def __init__(self, tau: float = TAU) -> None:
        self.tau = tau
        self._rate = 0.0
        self._at: float | None = None
        self._since: float | None = None

    def add(self, now: float, events: float = 1.0) -> None:
        self._rate = self.value(now) + events / self.tau
        self._at = now
        self.watch(now)

    def value(self, now: float) -> float:
        if self._at is None:
            return 0.0
        return self._rate * math.exp(-max(0.0, now - self._at) / self.tau)

    def watch(self, now: float) -> None:
        """Start watching at ``now`` even before the first event (a lane that completes nothing
        for a ``tau`` drains at 0 per second, known)."""
        if self._since is None:
            self._since = now

    def known(self, now: float) -> bool:
        """Whether it has watched long enough to mean something (one ``tau`` since the first event)."""
        return self._since is not None and now - self._since >= self.tau


class FleetRate:
    """Per lane, completions per second over the whole fleet, from monotonic counters."""

    def __init__(self, tau: float = TAU) -> None:
        self.tau = tau
        self._last: dict[str, tuple[int, float]] = {}
        self._rates: dict[str, Rate] = {}

    def update(self, counters: Mapping[str, int], now: float) -> None:
        for lane, count in counters.items():
            before = self._last.get(lane)
            self._last[lane] = (count, now)
            if before is None or count < before[0]:
                continue  # a first reading, or the store restarted empty: a new baseline
            rate = self._rates.setdefault(lane, Rate(self.tau))
            rate.watch(before[1])
            if count > before[0]:
                rate.add(now, count - before[0])

    def rates(self, now: float) -> dict[str, float]:
        """Lanes watched for at least ``tau``: their fleet completion rates."""
        return {lane: rate.value(now) for lane, rate in self._rates.items() if rate.known(now)}


class RetryCalendar:
    """Per lane, how many rejected clients were told to come back in each coming second.

    A lane that completes ``rate`` requests per second can take about that many back each second:
    Retry-After is the first whole second, from when the drain says a slot frees, that has
    room left (at most ``rate``, at least one, per second), so retries come back spread at the pace
    the lane drains instead of in a wave when a burst of rejections all hear the same number.
    """

    def __init__(self) -> None:
        self._booked: dict[str, dict[int, int]] = {}

    def book(self, lane: str, now: float, earliest: float, latest: int, rate: float) -> int:
        """Seconds to tell a rejected client (whole, in [ceil(earliest), latest]); ``latest`` when
        every second until then is full (booked there all the same: nothing later is offered)."""
        booked = self._booked.setdefault(lane, {})
        base = math.floor(now)
        if len(booked) > 4 * max(latest, 1):
            for second in [s for s in booked if s < base]:
                del booked[second]
        room = max(1, math.floor(rate))
        first = max(1, math.ceil(earliest))
        for wait in range(min(first, latest), latest + 1):
            if booked.get(base + wait, 0) < room:
                booked[base + wait] = booked.get(base + wait, 0) + 1
                return wait
        booked[base + latest] = booked.get(base + latest, 0) + 1
        return latest

    def forget(self, lanes: set[str]) -> None:
        for lane in list(self._booked):
            if lane not in lanes:
                del self._booked[lane]

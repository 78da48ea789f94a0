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
    """Events per second, exponentially weighted over ``tau``; it does not decay while paused (a
    lane with nothing to do completes nothing, and that says nothing of how fast it drains)."""

    __slots__ = ("_at", "_paused", "_rate", "_since", "tau")

    def __init__(self, tau: float = TAU) -> None:
        self.tau = tau
        self._rate = 0.0
        self._at: float | None = None
        self._since: float | None = None
        self._paused: float | None = None

    def add(self, now: float, events: float = 1.0) -> None:
        self.resume(now)
        self._rate = self.value(now) + events / self.tau
        self._at = now
        self.watch(now)

    def value(self, now: float) -> float:
        if self._at is None:
            return 0.0
        until = self._paused if self._paused is not None else now
        return self._rate * math.exp(-max(0.0, until - self._at) / self.tau)

    def pause(self, now: float) -> None:
        """Nothing to do from ``now`` on: hold the estimate until :meth:`resume`."""
        if self._paused is None:
            self._paused = now

    def resume(self, now: float) -> None:
        if self._paused is not None:
            idle = max(0.0, now - self._paused)
            if self._at is not None:
                self._at += idle
            if self._since is not None:
                self._since += idle
            self._paused = None

    def watch(self, now: float) -> None:
        """Start watching at ``now`` even before the first event (a lane that completes nothing
        for a ``tau`` drains at 0 per second, known)."""
        if self._since is None:
            self._since = now

    def known(self, now: float) -> bool:
        """Whether it has watched long enough to mean something (one ``tau`` since the first event)."""
        until = self._paused if self._paused is not None else now
        return self._since is not None and until - self._since >= self.tau


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
            if before is None or count < before[0] or now - before[1] > self.tau:
                # A first reading, the store restarted empty, or readings missed for a while (what
                # completed meanwhile would count as a burst now): a new baseline.
                continue
            rate = self._rates.setdefault(lane, Rate(self.tau))
            rate.watch(before[1])
            if count > before[0]:
                rate.add(now, count - before[0])
        for lane in [lane for lane in self._rates if lane not in counters]:
            del self._rates[lane], self._last[lane]

    def rates(self, now: float) -> dict[str, float]:
        """Lanes watched for at least ``tau``: their fleet completion rates."""
        return {lane: rate.value(now) for lane, rate in self._rates.items() if rate.known(now)}


class RetryCalendar:
    """Per lane, when rejected clients were told to come back: no faster than the lane drains.

    Each booking takes the next ``1 / rate`` seconds of the lane's return schedule, from when the
    drain says a slot frees (``earliest``): a burst of rejections comes back spread at the pace
    the lane completes requests, not as one wave that all heard the same number. Answers are
    whole seconds (Retry-After's unit).
    """

    def __init__(self) -> None:
        self._next: dict[str, float] = {}

    def book(self, lane: str, now: float, earliest: float, latest: int, rate: float) -> int | None:
        """Seconds to tell a rejected client, in [ceil(earliest), latest]; None when the schedule is
        booked beyond ``latest`` (or the drain itself is): nothing is booked then."""
        if not (math.isfinite(earliest) and rate > 0 and math.isfinite(rate)) or earliest > latest:
            return None
        at = max(self._next.get(lane, -math.inf), now + earliest)
        wait = max(1, math.ceil(at - now - 1e-9))
        if wait > latest:
            return None
        self._next[lane] = at + 1.0 / rate
        return wait

    def forget(self, lanes: set[str]) -> None:
        """Only ``lanes`` are kept (after a reload)."""
        for lane in [lane for lane in self._next if lane not in lanes]:
            del self._next[lane]

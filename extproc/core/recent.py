"""What happened in the last minute, per lane: decision rates and queue-wait percentiles.

Prometheus answers these questions over any window, but the live view (``extproc top``,
``/admin/state``) must work with no Prometheus at all.

How this works: each lane keeps one bucket per second of the window: counts of admissions,
rejections and shadow rejections (so the rates are exact), and a uniform sample of at most
``WAITS_PER_SECOND`` of that second's queue waits (reservoir sampling). Percentiles weigh each
sampled wait by how many waits it stands for, so a busy second counts as much as it should.
Buckets older than the window are dropped as new ones come and when a summary is asked for.
Memory is bounded by the window's length in seconds, never by the request rate: at 10,000
requests a second a record per request would have held 600,000 records (~80 MB).
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass

ADMIT, REJECT, SHADOW = 0, 1, 2
#: Queue waits kept per lane and second: enough for a minute's p95 to within a few per cent.
WAITS_PER_SECOND = 64


@dataclass(frozen=True, slots=True)
class LaneRecent:
    admit_per_s: float
    reject_per_s: float
    shadow_reject_per_s: float
    """Requests shadow mode admitted that enforcing would have rejected."""
    wait_p50: float | None
    wait_p95: float | None


def quantile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile of sorted ``values``; None when there are none."""
    if not values:
        return None
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def weighted_quantile(pairs: list[tuple[float, float]], q: float) -> float | None:
    """The nearest-rank ``q`` quantile of (value, weight) pairs sorted by value: the smallest value
    whose cumulative weight reaches ``q`` of the total (with unit weights, :func:`quantile`)."""
    if not pairs:
        return None
    total = sum(weight for _, weight in pairs)
    # (As quantile's ceil: the rank is q × total rounded up, at least the first value.)
    target = max(math.ceil(q * total - 1e-9), 1e-9)
    seen = 0.0
    for value, weight in pairs:
        seen += weight
        if seen >= target - 1e-9:
            return value
    return pairs[-1][0]


class _Second:
    """One second of one lane: exact counts, a bounded sample of waits."""

    __slots__ = ("counts", "second", "waited", "waits")

    def __init__(self, second: int) -> None:
        self.second = second
        self.counts = [0, 0, 0]
        #: How many waits this second saw (the sample stands for all of them).
        self.waited = 0
        self.waits: list[float] = []


class Recent:
    def __init__(self, window_s: float = 60.0, *, seed: int = 0) -> None:
        self.window_s = window_s
        self._lanes: dict[str, deque[_Second]] = {}
        self._started: float | None = None
        # Which waits a full second keeps: any uniform choice will do, a seeded one repeats.
        self._rng = random.Random(seed)

    def add(self, lane: str, kind: int, now: float, wait: float = 0.0) -> None:
        seconds = self._lanes.get(lane)
        if seconds is None:
            seconds = self._lanes[lane] = deque()
        if self._started is None:
            self._started = now
        second = math.floor(now)
        if seconds and seconds[-1].second >= second:
            # (A record may carry a time a little older than the last one: an admission's time is
            # when it was admitted. It counts in the newest second.)
            bucket = seconds[-1]
        else:
            bucket = _Second(second)
            seconds.append(bucket)
            self._expire(seconds, now)
        bucket.counts[kind] += 1
        if kind != REJECT:
            bucket.waited += 1
            if len(bucket.waits) < WAITS_PER_SECOND:
                bucket.waits.append(wait)
            else:
                slot = self._rng.randrange(bucket.waited)
                if slot < WAITS_PER_SECOND:
                    bucket.waits[slot] = wait

    def _expire(self, seconds: deque[_Second], now: float) -> None:
        horizon = now - self.window_s
        # A bucket goes once the newest record it could hold is older than the window.
        while seconds and seconds[0].second + 1 <= horizon:
            seconds.popleft()

    def summary(self, now: float) -> dict[str, LaneRecent]:
        # Rates over the window, or over the time since the first record while younger than it.
        span = min(self.window_s, max(now - (self._started if self._started is not None else now), 1.0))
        out = {}
        for lane, seconds in self._lanes.items():
            self._expire(seconds, now)
            counts = [0, 0, 0]
            waits: list[tuple[float, float]] = []
            for bucket in seconds:
                for kind in (ADMIT, REJECT, SHADOW):
                    counts[kind] += bucket.counts[kind]
                if bucket.waits:
                    weight = bucket.waited / len(bucket.waits)
                    waits.extend((wait, weight) for wait in bucket.waits)
            waits.sort()
            out[lane] = LaneRecent(
                admit_per_s=counts[ADMIT] / span + counts[SHADOW] / span,
                reject_per_s=counts[REJECT] / span,
                shadow_reject_per_s=counts[SHADOW] / span,
                wait_p50=weighted_quantile(waits, 0.5),
                wait_p95=weighted_quantile(waits, 0.95),
            )
        return out

    def records(self) -> int:
        """What is held: buckets and sampled waits over every lane (bounded by the window alone)."""
        return sum(len(seconds) + sum(len(b.waits) for b in seconds) for seconds in self._lanes.values())

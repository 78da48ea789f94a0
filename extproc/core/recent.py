"""What happened in the last minute, per lane: decision rates and queue-wait percentiles.

Prometheus answers these questions over any window, but the live view (``extproc top``,
``/admin/state``) must work with no Prometheus at all. Each decision appends one small
record to its lane's deque; records older than the window are dropped as new ones come
and when a summary is asked for, so memory is bounded by the window's traffic.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

ADMIT, REJECT, SHADOW = 0, 1, 2


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


class Recent:
    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._lanes: dict[str, deque[tuple[float, int, float]]] = {}
        self._started: float | None = None

    def add(self, lane: str, kind: int, now: float, wait: float = 0.0) -> None:
        records = self._lanes.get(lane)
        if records is None:
            records = self._lanes[lane] = deque()
        if self._started is None:
            self._started = now
        records.append((now, kind, wait))
        horizon = now - self.window_s
        while records[0][0] < horizon:
            records.popleft()

    def summary(self, now: float) -> dict[str, LaneRecent]:
        # Rates over the window, or over the time since the first record while younger than it.
        span = min(self.window_s, max(now - (self._started if self._started is not None else now), 1.0))
        horizon = now - self.window_s
        out = {}
        for lane, records in self._lanes.items():
            while records and records[0][0] < horizon:
                records.popleft()
            counts = [0, 0, 0]
            waits = []
            for _, kind, wait in records:
                counts[kind] += 1
                if kind != REJECT:
                    waits.append(wait)
            waits.sort()
            out[lane] = LaneRecent(
                admit_per_s=counts[ADMIT] / span + counts[SHADOW] / span,
                reject_per_s=counts[REJECT] / span,
                shadow_reject_per_s=counts[SHADOW] / span,
                wait_p50=quantile(waits, 0.5),
                wait_p95=quantile(waits, 0.95),
            )
        return out

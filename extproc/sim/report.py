"""Load-test arithmetic: per-request results in, per-lane percentiles and goodput out (pure)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Result:
    """What one request of a workload experienced, retries included."""

    index: int
    cls: str
    tenant: str
    at: float
    """Scheduled arrival, seconds from the start of the run."""
    status: int
    """Final HTTP status; 0 for a connection error, -1 for a client-side timeout."""
    ttft: float | None
    """Seconds from the first attempt to the first token (None if no token came)."""
    e2e: float | None
    """Seconds from the first attempt to the end of the successful response."""
    attempts: int
    output_tokens: int
    reason: str = ""
    """extproc's x-extproc-reason on the final rejection, if any."""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0–100) with linear interpolation between closest ranks."""
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Slo:
    ttft: float
    e2e: float


@dataclass
class Summary:
    requests: int = 0
    ok: int = 0
    rejected: int = 0
    errors: int = 0
    timeouts: int = 0
    attempts: int = 0
    met_slo: int = 0
    ttft: dict[str, float | None] = field(default_factory=dict)
    e2e: dict[str, float | None] = field(default_factory=dict)
    goodput_rps: float = 0.0
    throughput_rps: float = 0.0
    rejection_rate: float = 0.0
    retry_amplification: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def summarise(results: Iterable[Result], slos: Mapping[str, Slo], duration: float) -> Summary:
    """Percentiles over successful requests; goodput counts only those that met their class's SLO.

    Rejected, failed and timed-out requests are misses: they count in the
    denominator of every rate and never in goodput.
    """
    rows = list(results)
    s = Summary(requests=len(rows))
    ttfts: list[float] = []
    e2es: list[float] = []
    for r in rows:
        s.attempts += r.attempts
        if r.ok:
            s.ok += 1
            if r.ttft is not None:
                ttfts.append(r.ttft)
            if r.e2e is not None:
                e2es.append(r.e2e)
            slo = slos.get(r.cls)
            if slo is not None and r.ttft is not None and r.e2e is not None and (
                r.ttft <= slo.ttft and r.e2e <= slo.e2e
            ):
                s.met_slo += 1
        elif r.status in (429, 503):
            s.rejected += 1
        elif r.status == -1:
            s.timeouts += 1
        else:
            s.errors += 1
    for q in (50, 90, 99):
        s.ttft[f"p{q}"] = percentile(ttfts, q)
        s.e2e[f"p{q}"] = percentile(e2es, q)
    if duration > 0:
        s.goodput_rps = s.met_slo / duration
        s.throughput_rps = s.ok / duration
    if rows:
        s.rejection_rate = s.rejected / len(rows)
        s.retry_amplification = s.attempts / len(rows)
    return s


def length_class(result: Result) -> str:
    return "long" if result.output_tokens >= 1000 else "short"


def grouped(results: Iterable[Result], slos: Mapping[str, Slo], duration: float,
            key: Callable[[Result], str] = lambda r: r.cls) -> dict[str, Summary]:
    """Summaries per group (by default per traffic class); each request is judged by its class's SLO."""
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(key(r), []).append(r)
    return {name: summarise(rows, slos, duration) for name, rows in sorted(groups.items())}

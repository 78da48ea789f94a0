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
    queue_wait: float | None = None
    """Seconds the admitted attempt waited for admission (known in simulation, not over HTTP)."""
    retries: tuple[float, ...] = ()
    """When each retry was sent, seconds after the request's first attempt (load runner only)."""
    retry_after: tuple[int | None, ...] = ()
    """The Retry-After each rejected attempt was given (None: none), in order (load runner only)."""
    engine_ttft: float | None = None
    """Seconds from the admitted attempt reaching the engine to its first token: the engine's own
    queue and prefill (known in simulation, not over HTTP)."""

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
    queue_wait: dict[str, float | None] = field(default_factory=dict)
    first_attempt_ttft: dict[str, float | None] = field(default_factory=dict)
    """TTFT of the requests served on their first attempt: without the waits of refused attempts."""
    engine_ttft: dict[str, float | None] = field(default_factory=dict)
    retried: int = 0
    """Requests served only on a retry (their TTFT counts from the first attempt)."""
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
    waits: list[float] = []
    first_ttfts: list[float] = []
    engine_ttfts: list[float] = []
    for r in rows:
        s.attempts += r.attempts
        if r.ok:
            s.ok += 1
            s.retried += r.attempts > 1
            if r.ttft is not None:
                ttfts.append(r.ttft)
                if r.attempts == 1:
                    first_ttfts.append(r.ttft)
            if r.engine_ttft is not None:
                engine_ttfts.append(r.engine_ttft)
            if r.e2e is not None:
                e2es.append(r.e2e)
            if r.queue_wait is not None:
                waits.append(r.queue_wait)
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
        s.queue_wait[f"p{q}"] = percentile(waits, q)
        s.first_attempt_ttft[f"p{q}"] = percentile(first_ttfts, q)
        s.engine_ttft[f"p{q}"] = percentile(engine_ttfts, q)
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


def fmt_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}s" if value < 10 else f"{value:.1f}s"


#: Rows of a side-by-side table: label and how to show one Summary's value.
_ROWS: tuple[tuple[str, Callable[[Summary], str]], ...] = (
    ("queue wait p50", lambda s: fmt_seconds(s.queue_wait.get("p50"))),
    ("queue wait p99", lambda s: fmt_seconds(s.queue_wait.get("p99"))),
    ("TTFT p50", lambda s: fmt_seconds(s.ttft.get("p50"))),
    ("TTFT p99", lambda s: fmt_seconds(s.ttft.get("p99"))),
    ("  first attempts", lambda s: fmt_seconds(s.first_attempt_ttft.get("p99"))),
    ("  in the engine", lambda s: fmt_seconds(s.engine_ttft.get("p99"))),
    ("E2E p99", lambda s: fmt_seconds(s.e2e.get("p99"))),
    ("goodput", lambda s: f"{s.goodput_rps:.1f}/s"),
    ("rejected (429)", lambda s: f"{s.rejection_rate:.0%}"),
    ("failed/timed out", lambda s: str(s.errors + s.timeouts)),
    ("attempts/request", lambda s: f"{s.retry_amplification:.2f}"),
)


def side_by_side(columns: Mapping[str, tuple[Mapping[str, Summary], Summary]]) -> str:
    """One table: a block of rows per lane (and "all"), one column per run.

    ``columns`` maps a run's name to its per-lane summaries and its overall summary.
    Queue-wait rows, and the TTFT p99 of first attempts and of the engine alone (where the rest of
    a TTFT goes: retries after a refusal, and the wait for admission), appear only when some run
    knows them (simulation).
    """
    runs = list(columns.items())
    summaries = [s for _, (lanes, overall) in runs for s in [*lanes.values(), overall]]
    has_waits = any(s.queue_wait.get("p50") is not None for s in summaries)
    has_engine = any(s.engine_ttft.get("p50") is not None for s in summaries)
    rows_spec = [r for r in _ROWS if (has_waits or not r[0].startswith("queue wait"))
                 and (has_engine or not r[0].startswith("  "))]
    lanes = sorted({name for _, (per_lane, _) in runs for name in per_lane})
    rows: list[tuple[str, ...]] = [("lane", "", *[name for name, _ in runs])]
    for lane in [*lanes, "all"]:
        for i, (label, show) in enumerate(rows_spec):
            cells = [show(overall if lane == "all" else per_lane.get(lane, Summary()))
                     for _, (per_lane, overall) in runs]
            rows.append((lane if i == 0 else "", label, *cells))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        padded = zip(row, widths, strict=True)
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(padded)))
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)

"""The engine's record of recent latencies: p95 of the TTFTs and inter-token latencies in a window.

How this works: the record keeps the last ``LATENCY_HISTORY_S`` seconds, so a caller on a virtual
clock gets what ``histogram_quantile(0.95, rate(…[window]))`` over vLLM's histograms would give,
without the buckets: TTFT once per request at its first token (``vllm:time_to_first_token_seconds``),
and inter-token latency (ITL) once per generated token after a request's first, the time since that
request's previous token (``vllm:inter_token_latency_seconds``). The engine
(:class:`~extproc.sim.engine.Engine`) says what its steps made: a decoding sequence sees one ITL of
the step's length per step, so a prefill chunk sharing the step stretches its ITL; a sequence
preempted and recomputed sees one long ITL, from its last token before the preemption to the first
after its prefill is redone. A run of identical steps is one record (length, steps, sequences), so
the cost stays per event, not per token. Percentiles are nearest-rank (the smallest sample with at
least 95 % of the samples at or below it), or, for an engine whose simulated signals are read as its
``/metrics`` would be (``Dynamics.percentiles == "histogram"``), Prometheus' ``histogram_quantile``
over the samples counted into that engine's buckets: linear interpolation inside the bucket the rank
falls in, the highest finite bound for a rank in +Inf (the arithmetic of
:func:`extproc.signals.scrape.histogram_quantile`, which reads the live histograms).
"""

from __future__ import annotations

import bisect
import math
from collections import deque

from extproc.sim.dynamics import Histograms

#: How far back the latency record reaches (engine seconds).
LATENCY_HISTORY_S = 600.0
#: Rounding tolerance: a percentile's rank is taken before it.
_EPS = 1e-9


class LatencyRecord:
    """TTFTs and inter-token latencies of the last ``LATENCY_HISTORY_S`` seconds, added in time order.

    With ``histograms``, percentiles are read through those buckets (see the module doc).
    """

    __slots__ = ("_histograms", "_itls", "_ttfts")

    def __init__(self, histograms: Histograms | None = None) -> None:
        self._histograms = histograms
        self._ttfts: deque[tuple[float, float]] = deque()  # (time, ttft)
        #: (first step end, last step end, interval, steps, sequences): ``sequences`` intervals of
        #: ``interval`` seconds ended at each of ``steps`` evenly spaced step ends.
        self._itls: deque[tuple[float, float, float, int, int]] = deque()

    def add_ttft(self, at: float, ttft: float) -> None:
        records = self._ttfts
        while records and records[0][0] < at - LATENCY_HISTORY_S:
            records.popleft()
        records.append((at, ttft))

    def add_itl(self, first: float, interval: float, steps: int, sequences: int) -> None:
        """``sequences`` tokens after a first were made at each of ``steps`` (≥ 1) step ends from ``first``.

        Records older than ``LATENCY_HISTORY_S`` before the last of them are dropped.
        """
        last = first + interval * (steps - 1)
        records = self._itls
        while records and records[0][1] < last - LATENCY_HISTORY_S:
            records.popleft()
        records.append((first, last, interval, steps, sequences))

    def ttft_p95(self, lo: float) -> float | None:
        """p95 of the TTFTs of requests whose first token came after ``lo``; None if none."""
        samples = []
        for at, ttft in reversed(self._ttfts):
            if at <= lo:
                break
            samples.append((ttft, 1))
        if self._histograms is not None:
            return bucket_quantile(samples, 0.95, self._histograms.ttft)
        return _nearest_rank(samples, 0.95)

    def itl_p95(self, lo: float) -> float | None:
        """p95 of the inter-token latencies that ended after ``lo``; None if none.

        One sample per generated token after a request's first, so a long request weighs by its
        tokens, as in vLLM's ``inter_token_latency_seconds`` histogram.
        """
        samples = []
        for first, last, interval, steps, sequences in reversed(self._itls):
            if last <= lo:
                break
            if first > lo:
                n = steps
            else:  # only the step ends after lo count: they are ``interval`` apart from ``first``
                n = steps - 1 - math.floor((lo - first) / interval)
                n = min(max(n, 0), steps)
            if n:
                samples.append((interval, n * sequences))
        if self._histograms is not None:
            return bucket_quantile(samples, 0.95, self._histograms.itl)
        return _nearest_rank(samples, 0.95)


def _nearest_rank(samples: list[tuple[float, int]], q: float) -> float | None:
    """The smallest value with at least ``q`` of the (value, weight) samples at or below it."""
    total = sum(weight for _, weight in samples)
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total - _EPS))
    seen = 0
    for value, weight in sorted(samples):
        seen += weight
        if seen >= rank:
            return value
    return samples[-1][0]  # pragma: no cover - unreachable: the weights add up to total


def bucket_quantile(samples: list[tuple[float, int]], q: float, bounds: tuple[float, ...]) -> float | None:
    """The ``q``-quantile of the (value, weight) samples as a histogram with these upper ``bounds``
    (+Inf implied, a value on a bound counted in it) gives it to Prometheus' ``histogram_quantile``."""
    counts = [0] * (len(bounds) + 1)
    for value, weight in samples:
        counts[bisect.bisect_left(bounds, value)] += weight
    total = sum(counts)
    if total == 0:
        return None
    cumulative = []
    seen = 0
    for count in counts:
        seen += count
        cumulative.append(seen)
    rank = q * total
    b = bisect.bisect_left(cumulative, rank)
    if b >= len(bounds):  # in +Inf: the highest finite bound
        return bounds[-1]
    start, below = (bounds[b - 1], cumulative[b - 1]) if b > 0 else (0.0, 0)
    # Prometheus' order of operations, so that both answer the very same float.
    return start + (bounds[b] - start) * ((rank - below) / (cumulative[b] - below))

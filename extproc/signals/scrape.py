"""Model servers' own /metrics pages, read directly and reduced to one number per signal.

How this works: every target of a scrape source is fetched once per round. Only the lines
of the sample names some signal wants are handed to prometheus_client's text parser (a
vLLM page is mostly histogram buckets nobody asked for). Each signal then takes, from
every target that answered, the series matching its metric (or the first name of its
preset that this target exposes) and its label matchers, and aggregates them across all
targets with max, min, sum or avg. A target that is down drops out; only when every
target failed is the signal's reading a failure.

Presets spare SREs the engines' metric names; each resolves per target, so a fleet that
mixes vLLM versions, SGLang and TensorRT-LLM still yields one number.

A signal with ``quantile`` reads a histogram's ``_bucket`` series instead, through a
:class:`HistogramWindow` that lives as long as the signal: each round it stores, per target
and per matching series, the cumulative bucket counts with resets already added back in
(so a restarted engine's counts simply continue), keeps such snapshots for ``window``
seconds, and answers the quantile of "now minus the oldest snapshot in the window", summed
over every series and target, with :func:`histogram_quantile`: the arithmetic of
Prometheus' ``histogram_quantile(q, sum by (le) (increase(x_bucket[window])))`` without its
extrapolation to the window's edges.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from extproc.policy.signals import Aggregate, Preset, Signal
from extproc.signals import ErrorKind, SignalError, fetch

#: Labels → value of one series.
Sample = tuple[Mapping[str, str], float]
#: Sample name → its series, for the names asked for; what one target's page contributes.
Page = Mapping[str, list[Sample]]

#: Text format 0.0.4: what every engine serves, and what this parser reads.
ACCEPT = "text/plain;version=0.0.4;q=1.0, */*;q=0.1"


@dataclass(frozen=True, slots=True)
class Selector:
    """A sample name and the label values a series must have."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(key) == value for key, value in self.labels)

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        return self.name + "{" + ",".join(f'{k}="{v}"' for k, v in self.labels) + "}"


#: Per preset, the engines' names for it, tried in this order on each target. The same names are the
#: ones the Gateway API Inference Extension's model-server metrics protocol lists for vLLM, SGLang,
#: trtllm-serve and Triton TensorRT-LLM.
PRESETS: dict[Preset, tuple[Selector, ...]] = {
    "kv_cache_usage": (
        # vLLM V1 engine (vllm-project/vllm, vllm/v1/metrics): "KV-cache usage. 1 means 100 percent
        # usage." (0–1).
        Selector("vllm:kv_cache_usage_perc"),
        # vLLM V0 engine (vllm/engine/metrics.py, before the V1 rename): "GPU KV-cache usage. 1 means
        # 100 percent usage." (0–1).
        Selector("vllm:gpu_cache_usage_perc"),
        # SGLang (sgl-project/sglang, python/sglang/srt/metrics/collector.py): "The token usage", the
        # share of the KV token pool in use (0–1).
        Selector("sglang:token_usage"),
        # trtllm-serve, TensorRT-LLM's own OpenAI server (NVIDIA/TensorRT-LLM,
        # tensorrt_llm/metrics/collector.py, which prefixes "trtllm_"): "KV cache utilization" (0–1).
        Selector("trtllm_kv_cache_utilization"),
        # Triton's TensorRT-LLM backend (triton-inference-server/tensorrtllm_backend, inflight batcher
        # custom metrics): KV-cache blocks in use as a fraction (0–1).
        Selector("nv_trt_llm_kv_cache_block_metrics", (("kv_cache_block_type", "fraction"),)),
    ),
    "waiting_requests": (
        # vLLM: requests waiting to be scheduled.
        Selector("vllm:num_requests_waiting"),
        # SGLang: requests in the waiting queue.
        Selector("sglang:num_queue_reqs"),
        # trtllm-serve: queued requests.
        Selector("trtllm_num_requests_waiting"),
        # Triton's TensorRT-LLM backend: requests waiting in the in-flight batcher.
        Selector("nv_trt_llm_request_metrics", (("request_type", "waiting"),)),
        # Text Generation Inference (huggingface/text-generation-inference router): requests queued.
        Selector("tgi_queue_size"),
        # Triton core, any backend: "Instantaneous number of pending requests awaiting execution per-model"
        # (a fallback for Triton without the TensorRT-LLM backend's own count).
        Selector("nv_inference_pending_request_count"),
    ),
    "running_requests": (
        Selector("vllm:num_requests_running"),
        Selector("sglang:num_running_reqs"),
        Selector("trtllm_num_requests_running"),
        # Triton's TensorRT-LLM backend: requests scheduled in the current iteration.
        Selector("nv_trt_llm_request_metrics", (("request_type", "scheduled"),)),
        # Text Generation Inference: size of the batch being decoded.
        Selector("tgi_batch_current_size"),
    ),
    # Histograms (base names; their _bucket series are read). Each needs a quantile.
    "ttft_seconds": (
        # vLLM (V0 and V1 engines): "Histogram of time to first token in seconds."
        Selector("vllm:time_to_first_token_seconds"),
        # SGLang (python/sglang/srt/metrics/collector.py, TokenizerMetricsCollector).
        Selector("sglang:time_to_first_token_seconds"),
        # trtllm-serve (tensorrt_llm/metrics/collector.py, prefix "trtllm_").
        Selector("trtllm_time_to_first_token_seconds"),
    ),
    "inter_token_latency_seconds": (
        # vLLM V1: "Histogram of inter-token latency in seconds." V1 also serves the next name with
        # the same observations, deprecated; the first name a target has is the one read, so once.
        Selector("vllm:inter_token_latency_seconds"),
        # vLLM before inter_token_latency_seconds (V0 engine): time per output token, per token.
        Selector("vllm:time_per_output_token_seconds"),
        # SGLang today: inter-token latency, observed per decoded token.
        Selector("sglang:inter_token_latency_seconds"),
        # Older SGLang releases: "Histogram of time per output token in seconds."
        Selector("sglang:time_per_output_token_seconds"),
        # trtllm-serve: time per output token, one observation per request (its mean gap).
        Selector("trtllm_time_per_output_token_seconds"),
    ),
}


def selectors(signal: Signal) -> tuple[Selector, ...]:
    """What ``signal`` looks for on each target, best first; its own labels narrow every one.

    For a signal with ``quantile`` these are the histograms' ``<name>_bucket`` sample names.
    """
    extra = tuple(sorted(signal.labels.items()))
    suffix = "_bucket" if signal.quantile is not None else ""
    if signal.preset is not None:
        return tuple(Selector(s.name + suffix, s.labels + extra) for s in PRESETS[signal.preset])
    if signal.metric is None:
        raise ValueError("a scrape signal needs metric or preset")
    return (Selector(signal.metric + suffix, extra),)


def names_of(signals: Collection[Signal]) -> frozenset[str]:
    """Every sample name the given signals may read."""
    return frozenset(s.name for signal in signals for s in selectors(signal))


def parse_page(text: str, names: Collection[str]) -> dict[str, list[Sample]]:
    """The series of the wanted sample names in exposition ``text``.

    Raises :class:`SignalError` (bad_response) if the lines of those names do not parse.
    """
    wanted = set(names)
    prefixes = tuple(wanted)
    lines = []
    if prefixes:
        for line in text.splitlines():
            # Cheap prefix test first; then the exact name (up to "{" or the first blank).
            if line.startswith(prefixes):
                end = len(line)
                for stop in ("{", " ", "\t"):
                    at = line.find(stop)
                    if 0 <= at < end:
                        end = at
                if line[:end] in wanted:
                    lines.append(line)
    out: dict[str, list[Sample]] = {}
    if not lines:
        return out
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for sample in family.samples:
                if sample.name in wanted:
                    out.setdefault(sample.name, []).append((sample.labels, float(sample.value)))
    except (ValueError, TypeError, IndexError) as exc:
        raise SignalError(ErrorKind.BAD_RESPONSE, f"cannot parse metrics: {exc}") from None
    return out


def aggregate(values: Sequence[float], how: Aggregate) -> float:
    if how == "max":
        return max(values)
    if how == "min":
        return min(values)
    total = math.fsum(values)
    return total if how == "sum" else total / len(values)


def read(signal: Signal, pages: Sequence[Page]) -> float:
    """The signal's number from the pages of the targets that answered (not for ``quantile``
    signals, which need the pages of earlier rounds too: see :class:`HistogramWindow`).

    Raises :class:`SignalError` (no_data) when no page has a matching series with a number.
    """
    if signal.quantile is not None:
        raise ValueError("a quantile signal is read through a HistogramWindow")
    candidates = selectors(signal)
    values: list[float] = []
    for page in pages:
        match = first_match(page, candidates)
        if match is not None:
            values.extend(value for _, value in match[1])
    if not values:
        wanted = " or ".join(str(s) for s in candidates)
        raise SignalError(ErrorKind.NO_DATA, f"none of the {len(pages)} target(s) that answered "
                                             f"exposes {wanted} with a number")
    return aggregate(values, signal.how)


def first_match(page: Page, candidates: Sequence[Selector]) -> tuple[Selector, list[Sample]] | None:
    """On one target's page, the first candidate with a matching series that has a number, and
    those series (a target is read under the first name it exposes, so never counted twice)."""
    for selector in candidates:
        found = [(labels, value) for labels, value in page.get(selector.name, ())
                 if not math.isnan(value) and selector.matches(labels)]
        if found:
            return selector, found
    return None


async def scrape(session: aiohttp.ClientSession, url: str, time_limit: float,
                 names: Collection[str]) -> dict[str, list[Sample]]:
    """Fetch one target's page and keep the wanted names; raise :class:`SignalError` on failure."""
    status, body = await fetch(session, url, time_limit=time_limit, accept=ACCEPT)
    if status != 200:
        raise SignalError(ErrorKind.HTTP_STATUS, f"HTTP {status} from {url}")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise SignalError(ErrorKind.BAD_RESPONSE, f"{url} did not answer UTF-8 text") from None
    return parse_page(text, names)


# -- histograms ----------------------------------------------------------------------------------

#: A histogram's cumulative bucket counts: upper bound (``le``, +Inf included) → observations ≤ it.
Buckets = Mapping[float, float]
#: One histogram series of a target: its sample name and its labels other than ``le``.
SeriesKey = tuple[str, tuple[tuple[str, str], ...]]

#: A series keeps at most about this many snapshots per window, however short the interval: with a
#: window of 30 s, snapshots closer than 30/64 s apart are not all kept (the newest always is).
MAX_SNAPSHOTS = 64


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """The ``q``-quantile of cumulative ``buckets``, computed as Prometheus' histogram_quantile does.

    Linear interpolation within the bucket the rank falls in (the first bucket starts at 0 unless
    its bound is ≤ 0, which is then the answer); a rank in the +Inf bucket answers the highest
    finite bound; counts that decrease with the bound are raised to the running maximum. None
    (Prometheus: NaN) without observations, without a +Inf bucket, or with no finite bucket.
    """
    bounds = sorted(b for b in buckets if not math.isnan(b))
    if len(bounds) < 2 or bounds[-1] != math.inf:
        return None
    counts: list[float] = []
    highest = 0.0
    for bound in bounds:
        count = buckets[bound]
        if not math.isnan(count):
            highest = max(highest, count)
        counts.append(highest)
    observations = counts[-1]
    if observations <= 0:
        return None
    rank = q * observations
    b = bisect.bisect_left(counts, rank)
    if b >= len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, below = (bounds[b - 1], counts[b - 1]) if b > 0 else (0.0, 0.0)
    # Prometheus' order of operations, so that both answer the very same float.
    return start + (bounds[b] - start) * ((rank - below) / (counts[b] - below))


def histogram_series(candidates: Sequence[Selector], page: Page) -> dict[SeriesKey, dict[float, float]]:
    """The bucket counts of every histogram series on one target's page (``candidates``: a quantile
    signal's ``selectors``).

    Per target the first candidate name with a matching series is read, as for gauges; buckets
    whose ``le`` or count is not a number are skipped.
    """
    match = first_match(page, candidates)
    if match is None:
        return {}
    selector, samples = match
    found: dict[SeriesKey, dict[float, float]] = {}
    for labels, value in samples:
        try:
            bound = float(labels.get("le", "nan"))
        except ValueError:
            continue
        if math.isnan(bound):
            continue
        key = (selector.name, tuple(sorted((k, v) for k, v in labels.items() if k != "le")))
        found.setdefault(key, {})[bound] = value
    return found


def merge(parts: Sequence[tuple[Sequence[float], Sequence[float]]]) -> dict[float, float]:
    """Add up cumulative bucket counts (each part: sorted bounds and their counts) by bound.

    Parts with other bucket layouts count, at a bound they lack, what they have at their next
    lower bound (all that is known to be ≤ it); with one layout this is Prometheus' sum by (le).
    """
    union = sorted({bound for bounds, _ in parts for bound in bounds})
    out = dict.fromkeys(union, 0.0)
    for bounds, counts in parts:
        i, current = 0, 0.0
        for bound in union:
            while i < len(bounds) and bounds[i] <= bound:
                current = counts[i]
                i += 1
            out[bound] += current
    return out


@dataclass(slots=True)
class _Series:
    """One histogram series of one target: reset-adjusted cumulative counts and their snapshots."""

    bounds: tuple[float, ...]
    raw: tuple[float, ...]
    """The counts as last scraped, to tell a reset."""
    total: tuple[float, ...]
    """Cumulative counts with every reset added back in (a new bucket layout starts it afresh)."""
    at: float
    """When ``total`` was scraped."""
    kept: deque[tuple[float, tuple[float, ...]]] = field(default_factory=deque)
    """(time, total) snapshots within the window, oldest first."""

    def update(self, now: float, bounds: tuple[float, ...], raw: tuple[float, ...], spacing: float) -> None:
        if bounds != self.bounds:
            # Another bucket layout (an engine restarted with other buckets): a reset whose counts
            # all came after the previous scrape; the old snapshots cannot be subtracted from them.
            self.kept = deque([(self.at, (0.0,) * len(bounds))])
            self.bounds, self.total = bounds, raw
        elif any(new < old for new, old in zip(raw, self.raw, strict=True)):
            # A bucket went down: the engine restarted and its counts began again at zero.
            self.total = tuple(t + n for t, n in zip(self.total, raw, strict=True))
        else:
            self.total = tuple(t + n - o for t, n, o in zip(self.total, raw, self.raw, strict=True))
        self.raw, self.at = raw, now
        if not self.kept or now - self.kept[-1][0] >= spacing:
            self.kept.append((now, self.total))

    def prune(self, start: float) -> None:
        while self.kept and self.kept[0][0] < start:
            self.kept.popleft()

    def increase(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """Counts added between the oldest snapshot in the window and the latest scrape."""
        if not self.kept or self.kept[0][0] >= self.at:
            return None
        base = self.kept[0][1]
        return self.bounds, tuple(t - b for t, b in zip(self.total, base, strict=True))


class HistogramWindow:
    """A quantile signal's memory: per target, per matching series, snapshots of its buckets.

    Feed it every round with :meth:`observe` (the pages of the targets that answered, and the
    source's current targets); ask :meth:`value`. Memory stays bounded: only the series the signal
    reads are kept, at most about ``MAX_SNAPSHOTS`` snapshots each and none older than the window;
    a series gone from its target's page is dropped, and so is a target no longer configured. A
    target that fails a round keeps what it had, so its observations within the window still count.
    """

    def __init__(self, signal: Signal) -> None:
        if signal.quantile is None:
            raise ValueError("a HistogramWindow reads a signal with quantile")
        self.signal = signal
        self._selectors = selectors(signal)
        self._quantile = signal.quantile
        self._window = signal.span
        self._spacing = signal.span / MAX_SNAPSHOTS
        self._targets: dict[str, dict[SeriesKey, _Series]] = {}
        self._answered = 0

    def observe(self, now: float, pages: Mapping[str, Page], targets: Collection[str] | None = None) -> None:
        """Record one round: target → its page for those that answered. Targets not in ``targets``
        (default: those of ``pages``) are forgotten; the others that did not answer keep their state."""
        keep = set(pages) if targets is None else set(targets)
        for target in [t for t in self._targets if t not in keep]:
            del self._targets[target]
        start = now - self._window
        for target, page in pages.items():
            if target not in keep:
                continue
            old = self._targets.get(target, {})
            new: dict[SeriesKey, _Series] = {}
            for key, buckets in histogram_series(self._selectors, page).items():
                bounds = tuple(sorted(buckets))
                raw = tuple(buckets[b] for b in bounds)
                series = old.get(key)
                if series is None:
                    series = _Series(bounds, raw, raw, now, deque([(now, raw)]))
                else:
                    series.update(now, bounds, raw, self._spacing)
                new[key] = series
            self._targets[target] = new
        for series_of in self._targets.values():
            for series in series_of.values():
                series.prune(start)
        self._answered = len(pages)

    @property
    def snapshots(self) -> int:
        """Snapshots held, over every target and series (what bounds this window's memory)."""
        return sum(len(s.kept) for series_of in self._targets.values() for s in series_of.values())

    def _parts(self) -> list[tuple[tuple[float, ...], tuple[float, ...]]]:
        return [part for series_of in self._targets.values() for s in series_of.values()
                if (part := s.increase()) is not None]

    def buckets(self) -> dict[float, float]:
        """The window's observations as cumulative buckets, summed over every target and series."""
        return merge(self._parts())

    def value(self) -> float | None:
        """The quantile of the observations within the window; None while every series has only
        its baseline (its first scrape), which is not yet a reading.

        Raises :class:`SignalError` (no_data) when no target exposes the histogram or nothing was
        observed within the window.
        """
        if not any(self._targets.values()):
            raise SignalError(ErrorKind.NO_DATA, f"none of the {self._answered} target(s) that answered "
                                                 f"exposes {self._wanted()}")
        parts = self._parts()
        if not parts:
            return None
        buckets = merge(parts)
        if math.inf not in buckets:
            raise SignalError(ErrorKind.NO_DATA, f"{self._wanted()} has no le=\"+Inf\" bucket")
        value = histogram_quantile(self._quantile, buckets)
        if value is None:
            raise SignalError(ErrorKind.NO_DATA, f"no observations of {self._wanted()} in the last "
                                                 f"{self._window:g}s")
        return value

    def _wanted(self) -> str:
        return " or ".join(str(s) for s in self._selectors)

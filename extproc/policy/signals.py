"""The policy's ``signals`` section: where cluster signals come from and what saturation does.

Three parts, each referring to the one before by name:

* ``sources``: a Prometheus HTTP API to run PromQL against, or model servers to scrape
  directly (``/metrics`` of vLLM, SGLang, TensorRT-LLM, Triton, TGI), each on an interval;
* ``read``: named signals, one number each: a PromQL query on a prometheus source, or a
  metric (or an engine-neutral ``preset``) aggregated across a scrape source's targets, or,
  with ``quantile``, a percentile of a histogram's observations during the last ``window``
  (summed over the targets, as ``histogram_quantile(q, sum by (le) (increase(x_bucket[w])))``
  would compute it; see :class:`Signal`); each with a staleness limit and what to do when it
  is stale;
* ``saturation``: rules with hysteresis; while one is active it sheds whole lanes and/or
  shrinks lanes' in-flight limits.

The models are strict and frozen like the rest of the schema. Checks that need more than
one model (unknown names, a query on a scrape source, thresholds out of order) live in
:func:`problems`, which ``Policy`` calls so that every problem is reported at once.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Collection
from typing import Annotated, Literal, get_args

from pydantic import Field, ValidationInfo, field_validator, model_validator

from extproc.policy.fields import Duration, Strict

_NAME = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
_METRIC = r"^[a-zA-Z_:][a-zA-Z0-9_:]{0,199}$"
_LABEL = r"^[a-zA-Z_][a-zA-Z0-9_]{0,99}$"




#: Seconds, written as ``250ms``, ``10s``, ``2m`` or a plain number (as everywhere in the policy).
Seconds = Duration
Name = Annotated[str, Field(pattern=_NAME)]
Threshold = Annotated[float, Field(allow_inf_nan=False)]

Aggregate = Literal["max", "min", "sum", "avg"]
OnStale = Literal["ignore", "saturated", "hold"]
#: Presets that name a gauge: one number per series, read as it is.
GaugePreset = Literal["kv_cache_usage", "waiting_requests", "running_requests"]
#: How far back a quantile looks when ``window`` is not given (seconds).
DEFAULT_WINDOW = 30.0
#: A PromQL range selector, e.g. ``[30s]`` in ``rate(x[30s])``, ``[1m30s]``, or a subquery's
#: range ``[5m:30s]`` (its resolution after the colon is not how far back it reaches).
_RANGE = re.compile(r"\[((?:\d+(?:ms|[smhdwy]))+)(?::[^\]]*)?\]")
_UNIT = re.compile(r"(\d+)(ms|[smhdwy])")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0, "w": 604_800.0, "y": 31_536_000.0}

#: Presets that name a histogram: read only as a percentile (``quantile``) over a ``window``.
HistogramPreset = Literal["ttft_seconds", "inter_token_latency_seconds"]
Preset = Literal[GaugePreset, HistogramPreset]
Kind = Literal["gauge", "kv_cache_utilization"]

GAUGE_PRESETS: frozenset[str] = frozenset(get_args(GaugePreset))
HISTOGRAM_PRESETS: frozenset[str] = frozenset(get_args(HistogramPreset))

#: How a preset combines the series of several engines/targets unless ``aggregate`` says otherwise:
#: the fullest KV cache is the one that preempts first; queues and batches add up; a histogram's
#: bucket counts add up over every target before its quantile is taken (and cannot be told otherwise).
PRESET_AGGREGATE: dict[Preset, Aggregate] = {
    "kv_cache_usage": "max",
    "waiting_requests": "sum",
    "running_requests": "sum",
    "ttft_seconds": "sum",
    "inter_token_latency_seconds": "sum",
}


def _check_url(value: str) -> str:
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URL with a host, got {value!r}")
    if parts.fragment:
        raise ValueError(f"a URL with a #fragment cannot be fetched: {value!r}")
    try:
        _ = parts.port
    except ValueError as exc:
        raise ValueError(f"bad port in {value!r}: {exc}") from None
    return value


Url = Annotated[str, Field(max_length=2048)]


class PrometheusSource(Strict):
    """A Prometheus-compatible HTTP API (Prometheus, Thanos, Mimir, VictoriaMetrics …)."""

    url: Url
    """Base URL; queries go to ``<url>/api/v1/query`` (a path prefix such as /prometheus is kept)."""
    interval: Annotated[Seconds, Field(ge=0.05, le=3600)] = 5.0
    timeout: Annotated[Seconds, Field(gt=0, le=60)] = 2.0

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        value = _check_url(value)
        if urllib.parse.urlsplit(value).query:
            raise ValueError(f"the base URL must not carry a ?query: {value!r}")
        return value


class ScrapeSource(Strict):
    """Model servers' own /metrics pages, read directly (for setups without Prometheus)."""

    targets: Annotated[tuple[Url, ...], Field(min_length=1, max_length=256)]
    """Full URLs, e.g. http://10.0.0.7:8000/metrics."""
    interval: Annotated[Seconds, Field(ge=0.05, le=3600)] = 2.0
    timeout: Annotated[Seconds, Field(gt=0, le=60)] = 1.0

    @field_validator("targets")
    @classmethod
    def _targets(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for url in value:
            _check_url(url)
        duplicates = sorted({url for url in value if value.count(url) > 1})
        if duplicates:
            raise ValueError(f"duplicate target(s) {duplicates}: each would count twice")
        return value


class Source(Strict):
    """Exactly one of ``prometheus`` or ``scrape``."""

    prometheus: PrometheusSource | None = None
    scrape: ScrapeSource | None = None

    @model_validator(mode="after")
    def _one(self) -> Source:
        if (self.prometheus is None) == (self.scrape is None):
            raise ValueError("give exactly one of prometheus or scrape")
        return self

    @property
    def kind(self) -> Literal["prometheus", "scrape"]:
        return "prometheus" if self.prometheus is not None else "scrape"

    @property
    def interval(self) -> float:
        config = self.prometheus or self.scrape
        assert config is not None
        return config.interval

    @property
    def timeout(self) -> float:
        config = self.prometheus or self.scrape
        assert config is not None
        return config.timeout


class Signal(Strict):
    """One number read from a source. A prometheus source needs ``query``; a scrape source
    needs ``metric`` or ``preset`` (plus optional ``labels`` to match and ``aggregate``).

    With ``quantile`` (scrape sources only), ``metric`` or ``preset`` names a *histogram* by its
    base name (``vllm:time_to_first_token_seconds``, not ``..._bucket``) and the signal is the
    q-quantile of the observations made during the last ``window``, over every target and every
    series that matches ``labels``: what Prometheus answers to
    ``histogram_quantile(q, sum by (le) (increase(x_bucket[window])))``. Linear interpolation
    within the bucket; a quantile in the +Inf bucket is the highest finite bound. One difference:
    when any bucket of a series goes down (a restarted engine) the whole series restarts and its
    new counts are the increase (Prometheus' increase() resets each bucket on its own). A window without
    observations (an idle fleet) has no quantile: the reading fails with ``no_data`` and the last
    value ages out after ``stale_after`` like any other missing reading.
    """

    source: Name
    query: Annotated[str, Field(min_length=1, max_length=16_384)] | None = None
    """PromQL instant query that returns one number: a scalar or a vector of one series."""
    metric: Annotated[str, Field(pattern=_METRIC)] | None = None
    """Sample name as exposed, e.g. vllm:num_requests_waiting (counters keep their _total); with
    ``quantile`` the histogram's base name, e.g. vllm:time_to_first_token_seconds."""
    preset: Preset | None = None
    """Engine-neutral name; resolved per target to whichever engine metric that target exposes.
    ttft_seconds and inter_token_latency_seconds are histograms and need ``quantile``."""
    labels: dict[Annotated[str, Field(pattern=_LABEL)], str] = Field(default_factory=dict)
    """Only series whose labels have exactly these values."""
    aggregate: Aggregate | None = None
    """How the matching series of all targets become one number (default: max; presets choose).
    Not with ``quantile``: a histogram's buckets always add up."""
    quantile: Annotated[float, Field(gt=0, lt=1)] | None = Field(default=None, validate_default=True)
    """Read a histogram as this quantile of its recent observations (0.95: the 95th percentile)."""
    window: Annotated[Seconds, Field(ge=1, le=3600)] | None = None
    """With ``quantile``: the observations of this last stretch of time count (default 30s). It must
    be above the source's interval (a few intervals are better: the first scrape in it is the baseline)."""
    stale_after: Annotated[Seconds, Field(gt=0, le=86_400)] = 30.0
    """The signal is stale when no good reading came for this long."""
    on_stale: OnStale = "ignore"
    """ignore: rules on it are released (fail open); saturated: they act as active (fail closed);
    hold: they keep their state until the signal is fresh again."""
    kind: Kind | None = None
    """kv_cache_utilization also exports it as inference_kv_cache_utilization (default for the
    kv_cache_usage preset)."""

    @field_validator("quantile")
    @classmethod
    def _quantile(cls, value: float | None, info: ValidationInfo) -> float | None:
        preset = info.data.get("preset")
        if value is None:
            if preset in HISTOGRAM_PRESETS:
                raise ValueError(f"preset {preset!r} is a histogram: give the quantile to read, e.g. 0.95")
            return value
        if preset in GAUGE_PRESETS:
            raise ValueError(f"preset {preset!r} is a gauge, not a histogram; quantile is only for a "
                             f"histogram metric or preset ({', '.join(sorted(HISTOGRAM_PRESETS))})")
        if info.data.get("aggregate") is not None:
            raise ValueError("give aggregate or quantile, not both: a quantile adds up the buckets of "
                             "every target")
        return value

    @field_validator("window")
    @classmethod
    def _window(cls, value: float | None, info: ValidationInfo) -> float | None:
        # Only runs when window is given; a quantile that failed its own check is not in data.
        if value is not None and "quantile" in info.data and info.data["quantile"] is None:
            raise ValueError("only for a signal with quantile (the time its observations count)")
        return value

    @property
    def span(self) -> float:
        """The window a quantile looks back over (``window``, default 30 s)."""
        return self.window if self.window is not None else DEFAULT_WINDOW

    @property
    def lookback(self) -> float | None:
        """How far back one reading reaches: a quantile's window, or a query's range (``[30s]``,
        the first one); None for a reading of the present (a gauge)."""
        if self.quantile is not None:
            return self.span
        found = _RANGE.search(self.query or "")
        if found is None:
            return None
        return sum(float(n) * _SECONDS[unit] for n, unit in _UNIT.findall(found[1]))

    @model_validator(mode="after")
    def _metric_or_preset(self) -> Signal:
        if self.metric is not None and self.preset is not None:
            raise ValueError("give metric or preset, not both")
        if self.quantile is not None and self.metric is not None and self.metric.endswith("_bucket"):
            raise ValueError(f"with quantile, metric names the histogram without _bucket: "
                             f"{self.metric.removesuffix('_bucket')!r}")
        if self.quantile is not None and "le" in self.labels:
            raise ValueError("a quantile reads every bucket of a series; labels cannot select le")
        return self

    @property
    def exported_kind(self) -> Kind:
        if self.kind is not None:
            return self.kind
        return "kv_cache_utilization" if self.preset == "kv_cache_usage" else "gauge"

    @property
    def how(self) -> Aggregate:
        """The aggregation a scrape source applies (``sum`` for a quantile: its buckets add up)."""
        if self.aggregate is not None:
            return self.aggregate
        if self.quantile is not None:
            return "sum"
        return PRESET_AGGREGATE[self.preset] if self.preset is not None else "max"


class SaturationRule(Strict):
    """Active once the signal is above ``above``; inactive again only once it is below ``below``
    and the rule has been active for ``min_active``. A rule with neither ``shed`` nor ``shrink``
    only reports (a dry run, to watch before enforcing)."""

    name: Name
    signal: Name
    above: Threshold
    below: Threshold | None = None
    """Defaults to ``above`` (no hysteresis band)."""
    min_active: Annotated[Seconds, Field(ge=0, le=3600)] = 0.0
    shed: tuple[Name, ...] = ()
    """Lanes that reject new requests while the rule is active."""
    shrink: dict[Name, Annotated[float, Field(gt=0, le=1)]] = Field(default_factory=dict)
    """Lane → factor applied to its in-flight limit while the rule is active."""

    @property
    def release(self) -> float:
        return self.below if self.below is not None else self.above


class Signals(Strict):
    sources: dict[Name, Source] = Field(default_factory=dict)
    read: dict[Name, Signal] = Field(default_factory=dict)
    saturation: tuple[SaturationRule, ...] = ()
    """Listed most severe first: when several active rules shed a lane, the first names the cause."""

    def signals_of(self, source: str) -> dict[str, Signal]:
        return {name: signal for name, signal in self.read.items() if signal.source == source}

    def hurriable(self, names: Collection[str]) -> frozenset[str]:
        """Which of these sources may be read again sooner than their interval (``SignalHub.hurry``):
        the ``scrape`` ones. What a Prometheus source answers changes only as often as Prometheus
        scrapes; an unknown name is none."""
        return frozenset(name for name in names
                         if (source := self.sources.get(name)) is not None and source.scrape is not None)


def _known(names: Collection[str]) -> str:
    return f"one of {sorted(names)}" if names else "none (define some first)"


def _seconds_text(value: float) -> str:
    return f"{value:g}s"


def problems(signals: Signals, lanes: set[str]) -> list[str]:
    """Cross-field problems of the ``signals`` section, one ``key.path: message`` per entry."""
    out: list[str] = []
    for name, source in signals.sources.items():
        if source.timeout > source.interval:
            out.append(
                f"signals.sources.{name}.{source.kind}.timeout: {_seconds_text(source.timeout)} exceeds "
                f"the interval ({_seconds_text(source.interval)}); polls would overlap"
            )
    for name, signal in signals.read.items():
        at = f"signals.read.{name}"
        origin = signals.sources.get(signal.source)
        if origin is None:
            out.append(f"{at}.source: unknown source {signal.source!r}, expected {_known(signals.sources)}")
            continue
        if origin.kind == "prometheus":
            if signal.query is None:
                out.append(f"{at}.query: required for a signal on prometheus source {signal.source!r}")
            for key in ("metric", "preset", "aggregate"):
                if getattr(signal, key) is not None:
                    out.append(f"{at}.{key}: only for scrape sources; {signal.source!r} is a prometheus "
                               f"source (select and aggregate in the query)")
            if signal.quantile is not None:
                out.append(f"{at}.quantile: only for scrape sources; {signal.source!r} is a prometheus "
                           f"source (use histogram_quantile in the query)")
            if signal.labels:
                out.append(f"{at}.labels: only for scrape sources; {signal.source!r} is a prometheus "
                           f"source (match labels in the query)")
        else:
            if signal.query is not None:
                out.append(f"{at}.query: {signal.source!r} is a scrape source, which cannot run PromQL; "
                           f"give metric or preset")
            elif signal.metric is None and signal.preset is None:
                out.append(f"{at}.metric: a signal on scrape source {signal.source!r} needs metric or preset")
            if signal.quantile is not None and signal.span < 2 * origin.interval:
                # Rounds slip a little past the interval: a window of one interval and a bit would
                # often hold a single scrape, and so no increase at all.
                out.append(
                    f"{at}.window: {_seconds_text(signal.span)} is under two of source {signal.source!r}'s "
                    f"intervals ({_seconds_text(origin.interval)}); the window must hold two scrapes"
                )
        if signal.stale_after <= origin.interval:
            out.append(
                f"{at}.stale_after: {_seconds_text(signal.stale_after)} is not above source "
                f"{signal.source!r}'s interval ({_seconds_text(origin.interval)}); the signal would "
                f"go stale between polls"
            )
    seen: set[str] = set()
    known_lanes = _known(lanes)
    for i, rule in enumerate(signals.saturation):
        at = f"signals.saturation[{i}]"
        if rule.name in seen:
            out.append(f"{at}.name: duplicate rule name {rule.name!r}")
        seen.add(rule.name)
        if rule.signal not in signals.read:
            out.append(f"{at}.signal: unknown signal {rule.signal!r}, expected {_known(signals.read)}")
        if rule.below is not None and rule.below > rule.above:
            out.append(f"{at}.below: {rule.below:g} exceeds above ({rule.above:g}); the rule could "
                       f"never be released while it is triggered")
        for j, lane in enumerate(rule.shed):
            if lane not in lanes:
                out.append(f"{at}.shed[{j}]: unknown lane {lane!r}, expected {known_lanes}")
            elif rule.shed.index(lane) != j:
                out.append(f"{at}.shed[{j}]: lane {lane!r} is listed twice")
        for lane in rule.shrink:
            if lane not in lanes:
                out.append(f"{at}.shrink.{lane}: unknown lane {lane!r}, expected {known_lanes}")
            elif lane in rule.shed:
                out.append(f"{at}.shrink.{lane}: the rule also sheds {lane!r}, so shrinking it does nothing")
    return out

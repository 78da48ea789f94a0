"""Every Prometheus metric ``extproc serve`` exports, on an injected registry.

By part: :class:`Metrics` (admission: decisions, waits, service times, the live state of the
lanes and the shared store), :class:`RateLimitMetrics` (the edge shed), :class:`SignalMetrics`
(the cluster signals extproc reads) and :class:`SaturationCollector` (what the saturation
rules do to the lanes). The simulated backend's vLLM-named metrics belong to that program
(``extproc/sim/backend.py``), not here.

The names are a public interface (alerts and autoscalers are built on them):
add new ones, never rename. Gauges of current state (pending, in flight,
limits) are computed at scrape time from the scheduler, so the request path
pays nothing for them and they can never drift from the truth.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Generic, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.core.decision import Outcome
from extproc.core.machine import LaneView
from extproc.core.saturation import Saturation
from extproc.state import GlobalView

#: Resolves both sub-second waits and multi-second ones up to the longest hold.
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
SERVICE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


_M = TypeVar("_M", Counter, Histogram)
_REJECTED = Outcome.REJECTED.value


class Children(Generic[_M]):
    """A labelled metric's children by label values, looked up once and then kept.

    ``metric.labels(...)`` validates its arguments and takes a lock on every call; the request
    path asks for the same few children (lanes × outcomes or reasons, all from the policy and
    small enums) thousands of times a second. prometheus_client keeps every child it hands out
    anyway, so keeping them here as well holds nothing extra.
    """

    __slots__ = ("_children", "metric")

    def __init__(self, metric: _M) -> None:
        self.metric: _M = metric
        self._children: dict[tuple[str, ...], _M] = {}

    def __call__(self, *values: str) -> _M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


class _StateCollector(Collector):
    def __init__(self, lanes: Callable[[], Mapping[str, LaneView]], draining: Callable[[], bool],
                 cluster: Callable[[], GlobalView | None] | None = None,
                 drain: Callable[[], Mapping[str, float | None]] | None = None,
                 bookings: Callable[[], int] | None = None) -> None:
        self._lanes = lanes
        self._draining = draining
        self._cluster = cluster
        self._drain = drain
        self._bookings = bookings

    def collect(self) -> Iterator[GaugeMetricFamily]:
        pending = GaugeMetricFamily(
            "inference_pending_requests", "Requests waiting in extproc's queue, by lane.", labels=["lane"]
        )
        inflight = GaugeMetricFamily(
            "inference_inflight_requests", "Requests admitted and not yet finished, by lane.",
            labels=["lane"],
        )
        limit = GaugeMetricFamily(
            "inference_inflight_limit", "The lane's own in-flight limit (borrowing may exceed it).",
            labels=["lane"],
        )
        effective = GaugeMetricFamily(
            "extproc_inflight_effective_limit", "The lane's in-flight limit in force: its own, shrunk "
            "while a saturation rule says so.", labels=["lane"],
        )
        borrowed = GaugeMetricFamily(
            "inference_borrowed_slots", "In-flight requests above the lane's own limit, on idle slots "
            "of other lanes.", labels=["lane"],
        )
        paused = GaugeMetricFamily(
            "extproc_lane_paused", "1 while an operator has paused the lane on this replica: its new "
            "requests queue and none is admitted until it is resumed.", labels=["lane"],
        )
        for name, view in self._lanes().items():
            pending.add_metric([name], view.queued)
            inflight.add_metric([name], view.inflight)
            limit.add_metric([name], view.limit)
            effective.add_metric([name], view.effective_limit)
            borrowed.add_metric([name], view.borrowed)
            paused.add_metric([name], 1.0 if view.paused else 0.0)
        yield from (pending, inflight, limit, effective, borrowed, paused)
        if self._drain is not None:
            rate = GaugeMetricFamily(
                "extproc_lane_drain_rate", "Requests completed per second in the lane (exponentially "
                "weighted over 10 s; the fleet's with a shared store): what Retry-After is computed "
                "from. Absent until measured.", labels=["lane"],
            )
            for name, value in sorted(self._drain().items()):
                if value is not None:
                    rate.add_metric([name], value)
            yield rate
        if self._bookings is not None:
            yield GaugeMetricFamily(
                "extproc_retry_bookings", "Returns booked on the lanes' return schedules for rejected "
                "clients, not yet claimed by their retry (lapsed ones count until swept, within 2 s).",
                value=self._bookings(),
            )
        yield GaugeMetricFamily(
            "extproc_draining", "1 while this replica is shutting down and admits nothing.",
            value=1.0 if self._draining() else 0.0,
        )
        shared = self._cluster() if self._cluster is not None else None
        if shared is not None:
            cluster_inflight = GaugeMetricFamily(
                "extproc_cluster_inflight_requests", "Slots held per lane by every replica sharing the "
                "store, as this replica last read them.", labels=["lane"],
            )
            cluster_pending = GaugeMetricFamily(
                "extproc_cluster_pending_requests", "Requests queued per lane on every live replica sharing "
                "the store, as this replica last read them.", labels=["lane"],
            )
            for lane, n in sorted(shared.inflight.items()):
                cluster_inflight.add_metric([lane], n)
            for lane, n in sorted(shared.queued.items()):
                cluster_pending.add_metric([lane], n)
            yield from (cluster_inflight, cluster_pending)
            yield GaugeMetricFamily("extproc_cluster_replicas", "Live replicas sharing the store.",
                                    value=shared.replicas)
            yield GaugeMetricFamily(
                "extproc_store_degraded", "1 while the shared store is unreachable and this replica "
                "decides alone (within its share of the limits, or refusing).",
                value=1.0 if shared.degraded else 0.0,
            )


class ResponseCounts(Collector):
    """The response-headers message: admitted requests whose response headers extproc asked the proxy
    for (``asked``) or, sampled out (``extproc serve --response-sample``), did not (``skipped``), and the
    messages that came (``received``). Plain counts on the request path (a labelled counter's lock and
    lookup would cost more than the sampling saves), exported at scrape time."""

    __slots__ = ("asked", "received", "skipped")

    def __init__(self) -> None:
        self.asked = 0
        self.skipped = 0
        self.received = 0

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "extproc_response_headers", "Admitted requests whose response headers extproc asked the proxy "
            "for (asked) or, sampled out by --response-sample, did not (skipped: no status, no service time "
            "learnt); and the response-headers messages that came (received).", labels=["kind"])
        for kind in ("asked", "skipped", "received"):
            family.add_metric([kind], getattr(self, kind))
        yield family


#: The tenant label of every tenant the policy does not name (``extproc_tenant_*``): a label per
#: client-chosen value would let clients grow the series without bound.
OTHER_TENANT = "(other)"


class Metrics:
    """Admission's metrics, declared by subject; the public handles are the attributes.

    Every refusal, whoever made it (the scheduler, the edge, the intake), is counted the same way:
    once in ``inference_admission_decisions_total{outcome="rejected"}`` and once in
    ``inference_admission_rejections_total`` by reason, both by lane (``*``, ``core.decision.ANY_LANE``,
    when no single lane owns it), so that the share of rejections in decisions never exceeds 1; and
    once by tenant.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._declare_decisions(registry)
        self._declare_tenants(registry)
        self._declare_store(registry)
        self._declare_streams(registry)
        self._declare_policy(registry)
        self._declare_capacity(registry)
        # The request path goes through these (see Children); the metrics declared below stay the
        # public handles.
        self.queue_wait_of = Children(self.queue_wait)
        self.service_time_of = Children(self.service_time)
        self.decisions_of = Children(self.decisions)
        self.rejections_of = Children(self.rejections)
        self.shadow_of = Children(self.shadow)
        self.tenant_requests_of = Children(self.tenant_requests)
        self.tenant_rejections_of = Children(self.tenant_rejections)

    def _declare_decisions(self, registry: CollectorRegistry) -> None:
        """What admission decided, by lane: outcomes, rejections and their reasons, shadow verdicts,
        and the waits and service times of what it admitted."""
        self.queue_wait = Histogram(
            "inference_queue_wait_seconds", "Time from arrival to admission, by lane.", ["lane"],
            buckets=WAIT_BUCKETS, registry=registry,
        )
        self.service_time = Histogram(
            "inference_service_seconds", "Time from admission until the request finished, by lane.",
            ["lane"], buckets=SERVICE_BUCKETS, registry=registry,
        )
        self.decisions = Counter(
            "inference_admission_decisions", "Admission decisions by lane and outcome.",
            ["lane", "outcome"], registry=registry,
        )
        self.rejections = Counter(
            "inference_admission_rejections", "Requests answered by extproc itself, by lane and reason.",
            ["lane", "reason"], registry=registry,
        )
        self.saturation_rejections = Counter(
            "extproc_saturation_rejections", "Requests shed because a cluster signal says the backend is "
            "saturated, by lane, saturation rule and signal.", ["lane", "rule", "signal"], registry=registry,
        )
        self.shadow = Counter(
            "extproc_shadow_decisions", "Requests a shadow-mode lane admitted that enforcing would have "
            "queued or rejected, by lane, outcome and reason.", ["lane", "outcome", "reason"],
            registry=registry,
        )

    def _declare_tenants(self, registry: CollectorRegistry) -> None:
        """Requests and refusals by tenant: the tenants the policy names, by name; the rest together."""
        self.tenant_requests = Counter(
            "extproc_tenant_requests", "Requests decided, by tenant: every arrival ext_proc submitted, and "
            f"every one the edge or the intake refused first. Tenants the policy names by name, the rest as "
            f"{OTHER_TENANT}.", ["tenant"], registry=registry,
        )
        self.tenant_rejections = Counter(
            "extproc_tenant_rejections", "Requests refused (everything inference_admission_rejections_total "
            "counts), by tenant (as in extproc_tenant_requests_total) and reason.", ["tenant", "reason"],
            registry=registry,
        )
        #: The tenants counted by name: those the policy in force names (the controller sets it).
        self.named_tenants: frozenset[str] = frozenset()

    def tenant(self, name: str | None) -> str:
        """The tenant label of ``name`` (None: not known, refused before its tenant was read)."""
        return name if name is not None and name in self.named_tenants else OTHER_TENANT

    def refused(self, lane: str, reason: str, tenant: str | None) -> None:
        """One refusal, counted as every refusal is (see the class docstring); its arrival is counted
        by whoever saw it arrive."""
        self.decisions_of(lane, _REJECTED).inc()
        self.rejections_of(lane, reason).inc()
        self.tenant_rejections_of(self.tenant(tenant), reason).inc()

    def _declare_store(self, registry: CollectorRegistry) -> None:
        """The shared store: its failing scripts and the admissions it refused."""
        self.store_script_errors = Counter(
            "extproc_store_script_errors", "Calls to the shared store that failed with an error reply while "
            "the store was up (a script's own failure, not an outage: the replica stays healthy), by script.",
            ["script"], registry=registry,
        )
        self.ledger_refusals = Counter(
            "extproc_ledger_refusals", "Admissions the shared store refused (the request went back to its "
            "queue), by lane and why: the cluster-wide counts were higher than this replica had seen, or "
            "another replica's waiting request was better placed.", ["lane", "verdict"], registry=registry,
        )

    def _declare_streams(self, registry: CollectorRegistry) -> None:
        """Envoy's ext_proc streams: refused at intake, ended abnormally, never ended."""
        self.stream_errors = Counter(
            "extproc_stream_errors", "ext_proc streams that ended abnormally, by kind.", ["kind"],
            registry=registry,
        )
        self.resets_after_close = Counter(
            "extproc_stream_resets_after_close", "ext_proc streams that Envoy reset right after closing "
            "them (sampled): its runtime flag envoy.reloadable_features.ext_proc_graceful_grpc_close is off, "
            "and each such stream can cost extproc ~120 bytes that are never freed (grpc/grpc#43360).",
            registry=registry,
        )
        self.intake_rejections = Counter(
            "extproc_intake_rejections", "Requests refused before classification, by reason (bad_request: a "
            "header classification reads came twice, or a token limit the model servers refuse; "
            "body_timeout; slow_bodies; unsupported_encoding: a body extproc cannot read, refused by "
            "policy; overloaded: reached extproc too late to be decided).", ["reason"],
            registry=registry,
        )
        self.slots_reclaimed = Counter(
            "extproc_slots_reclaimed", "Slots reclaimed by the lease backstop (their stream never ended).",
            registry=registry,
        )
        self.responses = ResponseCounts()
        registry.register(self.responses)

    def _declare_policy(self, registry: CollectorRegistry) -> None:
        """Reloads of the policy file, and the age of the policy in force."""
        self.policy_reloads = Counter(
            "extproc_policy_reloads", "Policy reload attempts that found a changed file, by result "
            "(ok: swapped in; error: rejected, the previous policy stays).", ["result"], registry=registry,
        )
        self.policy_reload_failing = Gauge(
            "extproc_policy_reload_failing", "1 while the policy file on disk is invalid and an older policy "
            "is in force.", registry=registry,
        )
        self.policy_loaded = Gauge(
            "extproc_policy_loaded_timestamp_seconds", "When the policy in force was loaded (epoch seconds).",
            registry=registry,
        )
        self.policy_stale_since = Gauge(
            "extproc_policy_stale_since_timestamp_seconds", "Since when the policy file on disk has been "
            "invalid while an older policy serves (epoch seconds; 0 while the file is the policy in force).",
            registry=registry,
        )

    def _declare_capacity(self, registry: CollectorRegistry) -> None:
        """The self-sized fleet in-flight limit (capacity.max_inflight: auto)."""
        self.capacity_limit = Gauge(
            "extproc_capacity_limit", "The self-sized fleet in-flight limit (capacity.max_inflight: auto): "
            "the same on every replica sharing a store; mode shadow: computed and shown, not enforced.",
            ["mode"], registry=registry,
        )
        self.capacity_moves = Counter(
            "extproc_capacity_limit_moves", "Moves of the self-sized limit, by reason (running: it started "
            "from what the engines run; engine_queue, ttft, tpot: it fell; headroom: it grew; stale: it "
            "decayed with no fresh signal; reload: new bounds).",
            ["reason"], registry=registry,
        )
        self.capacity_stale = Gauge(
            "extproc_capacity_signals_stale", "1 while no engine signal of the self-sized limit is fresh (it "
            "holds, then decays to its min).", registry=registry,
        )
        self.capacity_unreachable = Gauge(
            "extproc_capacity_target_unreachable", "1 while a latency target is not met even at the limit's "
            "min (the limit stays at min).", registry=registry,
        )
        self.capacity_bounds = Gauge(
            "extproc_capacity_limit_bounds", "The self-sized limit's bounds (capacity.auto min and max): a "
            "limit held at its min for long is one the engines' signals keep down, or stale ones decayed.",
            ["bound"], registry=registry,
        )
        self.capacity_sources = Gauge(
            "extproc_capacity_source", "1 for each signal source (signals.sources) that feeds the self-sized "
            "limit: its scrape targets' extproc_scrape_target_up says whether the limit can see.",
            ["source"], registry=registry,
        )

    def rejection_counts(self) -> dict[str, dict[str, int]]:
        """Rejections since start, by lane and reason (for the admin state document; ``ANY_LANE``:
        those no single lane owns)."""
        out: dict[str, dict[str, int]] = {}
        for family in self.rejections.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out.setdefault(sample.labels["lane"], {})[sample.labels["reason"]] = int(sample.value)
        return out

    def watch(self, lanes: Callable[[], Mapping[str, LaneView]], draining: Callable[[], bool],
              cluster: Callable[[], GlobalView | None] | None = None,
              drain: Callable[[], Mapping[str, float | None]] | None = None,
              bookings: Callable[[], int] | None = None) -> None:
        self.registry.register(_StateCollector(lanes, draining, cluster, drain, bookings))


# -- the edge shed (Envoy's rate limit service) ---------------------------------------------------


class _TenantCollector(Collector):
    def __init__(self, sizes: Callable[[], Mapping[str, int]]) -> None:
        self._sizes = sizes

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("extproc_ratelimit_tenants", "Tenants with a budget bucket in memory, "
                                   "by budget (requests, tokens).", labels=["budget"])
        for name, size in self._sizes().items():
            family.add_metric([name], size)
        yield family


class RateLimitMetrics:
    def __init__(self, registry: CollectorRegistry, saturation: Counter | None = None) -> None:
        self.registry = registry
        #: ext_proc's ``extproc_saturation_rejections`` {lane, rule, signal}: a request shed under
        #: saturation is counted there whichever of the two shed it.
        self.saturation = saturation
        self.decisions = Counter(
            "extproc_ratelimit_decisions", "Edge decisions on request descriptors, by lane, code "
            "(ok, over_limit), reason and shadow (true: counted, answered OK).",
            ["lane", "code", "reason", "shadow"], registry=registry,
        )
        self.usage_tokens = Counter(
            "extproc_ratelimit_usage_tokens", "Tokens reported at stream end and charged to tenant budgets.",
            registry=registry,
        )
        self.usage_reports = Counter(
            "extproc_ratelimit_usage_reports", "Token usage reports: one per finished response that had one.",
            registry=registry,
        )
        self.usage_estimates = Counter(
            "extproc_ratelimit_usage_estimates", "Finished responses without a usage report that extproc had "
            "admitted, charged an estimate (a stream cut short, an answer without usage).",
            registry=registry,
        )
        self.usage_estimated_tokens = Counter(
            "extproc_ratelimit_usage_estimated_tokens", "Tokens charged to tenant budgets by estimate.",
            registry=registry,
        )
        self.usage_unknown = Counter(
            "extproc_ratelimit_usage_unknown", "Finished responses charged nothing: no usage report and no "
            "admission by ext_proc (shed or refused first; or a proxy config without the usage filter or "
            "ext_proc's metadata_options).",
            registry=registry,
        )
        self.ignored = Counter(
            "extproc_ratelimit_ignored", "Descriptors answered OK without a decision, by kind "
            "(unknown_domain, unknown_descriptor): a sign of a mismatched Envoy config.",
            ["kind"], registry=registry,
        )
        self.errors = Counter(
            "extproc_ratelimit_errors", "Edge judgements that failed: a ShouldRateLimit call (Envoy then "
            "applies its failure mode) or one judged in ext_proc (the request goes on to its decision).",
            registry=registry,
        )
        self.budget_alone = Counter(
            "extproc_ratelimit_budget_alone", "Tenant budget operations decided without the fleet's shared "
            "store (it was unreachable): with this replica's part of the budget, or refused (fail_closed).",
            registry=registry,
        )
        self.charges_dropped = Counter(
            "extproc_ratelimit_charges_dropped", "Tenants' token usage dropped from the backlog kept while "
            "the shared store was unreachable (it holds at most ratelimit.budgets.max_tenants tenants; the "
            "one charged least recently goes first): usage the fleet's budgets never saw.", registry=registry,
        )
        self.budget_timeouts = Counter(
            "extproc_ratelimit_budget_timeouts", "Arrivals whose tenant budgets the shared store did not "
            "answer within --store-budget-timeout: decided alone (this replica's part of each budget), so "
            "that Envoy's ratelimit filter gets an answer before its own timeout.", registry=registry,
        )
        self.decisions_of = Children(self.decisions)

    def watch(self, sizes: Callable[[], Mapping[str, int]]) -> None:
        self.registry.register(_TenantCollector(sizes))


# -- cluster signals ------------------------------------------------------------------------------


class SignalReport(Protocol):
    """One signal as the reader reports it (``signals.hub.SignalStatus``)."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def value(self) -> float | None: ...
    @property
    def age(self) -> float | None: ...
    @property
    def stale(self) -> bool: ...


class _SignalCollector(Collector):
    def __init__(self, status: Callable[[], Iterable[SignalReport]],
                 targets: Callable[[], Mapping[tuple[str, str], bool]]) -> None:
        self._status = status
        self._targets = targets

    def collect(self) -> Iterator[Metric]:
        value = GaugeMetricFamily("extproc_signal_value", "Last good value of each signal extproc reads.",
                                  labels=["signal"])
        age = GaugeMetricFamily("extproc_signal_age_seconds", "Seconds since the last good reading of "
                                "each signal.", labels=["signal"])
        stale = GaugeMetricFamily("extproc_signal_stale", "1 while a signal had no good reading within its "
                                  "stale_after (its on_stale policy applies).", labels=["signal"])
        kv_cache = GaugeMetricFamily("inference_kv_cache_utilization", "Model servers' KV-cache "
                                     "utilization (0-1) as extproc reads it; absent while stale.",
                                     labels=["signal"])
        for status in self._status():
            stale.add_metric([status.name], 1.0 if status.stale else 0.0)
            if status.value is None or status.age is None:
                continue
            value.add_metric([status.name], status.value)
            age.add_metric([status.name], status.age)
            if status.kind == "kv_cache_utilization" and not status.stale:
                kv_cache.add_metric([status.name], status.value)
        up = GaugeMetricFamily("extproc_scrape_target_up", "1 if the last fetch of a scrape target "
                               "succeeded.", labels=["source", "target"])
        for (source, target), ok in sorted(self._targets().items()):
            up.add_metric([source, target], 1.0 if ok else 0.0)
        yield from (value, age, stale, kv_cache, up)


class SignalMetrics:
    """The signal reader's counters, and gauges computed at scrape time from its reports: an age
    keeps growing while a source is down and a removed signal disappears at once."""

    def __init__(self, registry: CollectorRegistry, status: Callable[[], Iterable[SignalReport]],
                 targets: Callable[[], Mapping[tuple[str, str], bool]]) -> None:
        self.errors = Counter("extproc_signal_errors", "Failed readings of a signal, by kind of failure.",
                              ["signal", "kind"], registry=registry)
        registry.register(_SignalCollector(status, targets))


class SaturationCollector(Collector):
    """Saturation rules and their effect on lanes, as gauges (register it once, beside the signals)."""

    def __init__(self, saturation: Saturation, clock: Callable[[], float] = time.monotonic) -> None:
        self._saturation = saturation
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        active = GaugeMetricFamily("extproc_saturation_active", "1 while a saturation rule is active.",
                                   labels=["rule", "signal"])
        for rule in self._saturation.rules(self._clock()):
            active.add_metric([rule.name, rule.signal], 1.0 if rule.active else 0.0)
        shed = GaugeMetricFamily("extproc_saturation_shed", "1 while saturation sheds the lane (its new "
                                 "requests are rejected).", labels=["lane"])
        factor = GaugeMetricFamily("extproc_saturation_limit_factor", "Factor saturation applies to the "
                                   "lane's in-flight limit (1: none).", labels=["lane"])
        for lane in self._saturation.lanes():
            effect = self._saturation.effect(lane)
            shed.add_metric([lane], 1.0 if effect.shed else 0.0)
            factor.add_metric([lane], effect.factor)
        yield from (active, shed, factor)

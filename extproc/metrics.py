"""Every Prometheus metric extproc exports, on an injected registry.

The names are a public interface (alerts and autoscalers are built on them):
add new ones, never rename. Gauges of current state (pending, in flight,
limits) are computed at scrape time from the scheduler, so the request path
pays nothing for them and they can never drift from the truth.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.core.admission import LaneView
from extproc.state import GlobalView

#: Resolves both sub-second waits and multi-second ones up to the longest hold.
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
SERVICE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


_M = TypeVar("_M", Counter, Histogram)


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
                 cluster: Callable[[], GlobalView | None] | None = None) -> None:
        self._lanes = lanes
        self._draining = draining
        self._cluster = cluster

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
        for name, view in self._lanes().items():
            pending.add_metric([name], view.queued)
            inflight.add_metric([name], view.inflight)
            limit.add_metric([name], view.limit)
            effective.add_metric([name], view.effective_limit)
            borrowed.add_metric([name], view.borrowed)
        yield from (pending, inflight, limit, effective, borrowed)
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


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
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
        self.ledger_refusals = Counter(
            "extproc_ledger_refusals", "Admissions the shared store refused (the request went back to its "
            "queue), by lane and why: the cluster-wide counts were higher than this replica had seen, or "
            "another replica's waiting request was better placed.", ["lane", "verdict"], registry=registry,
        )
        self.shadow = Counter(
            "extproc_shadow_decisions", "Requests a shadow-mode lane admitted that enforcing would have "
            "queued or rejected, by lane, outcome and reason.", ["lane", "outcome", "reason"],
            registry=registry,
        )
        self.stream_errors = Counter(
            "extproc_stream_errors", "ext_proc streams that ended abnormally, by kind.", ["kind"],
            registry=registry,
        )
        self.intake_rejections = Counter(
            "extproc_intake_rejections", "Requests refused before classification, by reason (bad_request: a "
            "header classification reads came twice; body_timeout; slow_bodies).", ["reason"],
            registry=registry,
        )
        self.slots_reclaimed = Counter(
            "extproc_slots_reclaimed", "Slots reclaimed by the lease backstop (their stream never ended).",
            registry=registry,
        )
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
        # The request path goes through these (see Children); the metrics above stay the public handles.
        self.queue_wait_of = Children(self.queue_wait)
        self.service_time_of = Children(self.service_time)
        self.decisions_of = Children(self.decisions)
        self.rejections_of = Children(self.rejections)
        self.shadow_of = Children(self.shadow)

    def rejection_counts(self) -> dict[str, dict[str, int]]:
        """Rejections since start, by lane and reason (for the admin state document)."""
        out: dict[str, dict[str, int]] = {}
        for family in self.rejections.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out.setdefault(sample.labels["lane"], {})[sample.labels["reason"]] = int(sample.value)
        return out

    def watch(self, lanes: Callable[[], Mapping[str, LaneView]], draining: Callable[[], bool],
              cluster: Callable[[], GlobalView | None] | None = None) -> None:
        self.registry.register(_StateCollector(lanes, draining, cluster))

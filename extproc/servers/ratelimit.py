"""Envoy's rate limit service: the cheap, coarse shed at the edge, and per-tenant budgets.

How this works: Envoy's ratelimit filter runs before ext_proc and, as a request
arrives, calls ``ShouldRateLimit`` with a descriptor built from what Envoy knows
then: ``generic_key`` (the policy's ``request_descriptor``), ``method``, ``path``
and the headers the policy may trust, each under its own name. The service
classifies these with the same Classifier as ext_proc, so both agree on lane and
tenant. Rules on the model cannot be decided without the body: a request whose
lane depends on its model is shed only when every lane it could land in is shed.

A request descriptor is OVER_LIMIT when

* its lane is closed, or shed by saturation — ``x-should-retry: false``, since a
  retry cannot help soon;
* its lane's queue holds ``queue_share`` of its places and no slot is free;
* its tenant's token budget is in debt, or its request budget is empty.

Only a request that nothing else refuses is taken from its tenant's request
budget. When a response ends, Envoy sends a second descriptor
(``usage_descriptor``) whose ``hits_addend`` is the tokens the backend reported;
they are charged to the tenant's token budget, which may go into debt.

Every answer carries ``statuses``, which Envoy turns into ``x-ratelimit-*``
headers. A lane's status counts places (slots + queue places before the edge
sheds) rather than a rate, so it has no unit and its header no window. An
OVER_LIMIT answer also carries ``retry-after`` (jittered and bounded like
ext_proc's), ``x-extproc-reason`` and an OpenAI-style JSON body. In shadow mode
everything is decided and counted, but the answer is always a plain OK.
"""

from __future__ import annotations

import math
import random
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol

import grpc
import structlog
from envoy.config.core.v3.base_pb2 import HeaderValue
from envoy.service.ratelimit.v3 import rls_pb2 as pb
from envoy.service.ratelimit.v3 import rls_pb2_grpc as pb_grpc
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.controller import Controller
from extproc.core.budget import Budget, Rate, Verdict
from extproc.core.classify import Classifier, RequestFacts
from extproc.core.decision import Reason, reject
from extproc.core.redaction import Redactor
from extproc.core.retry import retry_after
from extproc.metrics import Children
from extproc.policy.ratelimit import RateLimit, TenantLimit
from extproc.policy.schema import Lane, Policy

SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
#: Lane label of a decision whose lane depends on the model (not known at the edge).
ANY_LANE = "*"
#: Descriptor entries that are not request headers.
_NOT_HEADERS = frozenset({"generic_key", "method", "path"})
_UINT32 = 2**32 - 1

log = structlog.get_logger("extproc.ratelimit")

_Limit = pb.RateLimitResponse.RateLimit
_UNITS = {"second": _Limit.SECOND, "minute": _Limit.MINUTE, "hour": _Limit.HOUR, "day": _Limit.DAY}


# -- what the service needs from the running scheduler -------------------------------------


@dataclass(frozen=True, slots=True)
class LanePressure:
    """A lane's load as the edge sees it (or all lanes together, from ``Pressure.overall``)."""

    queued: int
    max_queued: int
    inflight: int
    limit: int
    """The in-flight limit in force (saturation may have shrunk it)."""
    shed_by: str | None = None
    """What sheds this lane under saturation (None: not shed)."""
    signal: str | None = None
    """The signal that made it shed, for logs."""
    closed: bool = False
    """Closed by policy: every request is rejected."""
    paused: bool = False
    """Paused by an operator: nothing starts, requests queue until their deadline."""
    shadow: bool = False
    """The lane only observes (policy or lane shadow mode): the edge must not block it either."""
    tenants: Mapping[str, int] = field(default_factory=dict)
    """Queued requests by tenant (for fair shares of a full queue)."""


class Pressure(Protocol):
    """Read-only view of the scheduler; every call reads the current state."""

    @property
    def policy(self) -> Policy: ...

    def lane(self, name: str) -> LanePressure | None: ...

    def overall(self) -> LanePressure: ...

    def drain_s(self, lane: str) -> float:
        """Estimated seconds until a request queued now, behind the whole queue, would start."""
        ...


class ControllerPressure:
    """``Pressure`` read from a live Controller."""

    def __init__(self, controller: Controller) -> None:
        self._controller = controller

    @property
    def policy(self) -> Policy:
        return self._controller.policy

    def lane(self, name: str) -> LanePressure | None:
        # One lane, not the whole snapshot: the edge asks on every request.
        view = self._controller.scheduler.lane_view(name)
        if view is None:
            return None
        return LanePressure(queued=view.queued, max_queued=view.max_queued, inflight=view.inflight,
                            limit=view.effective_limit, shed_by=view.shed_by, signal=view.shed_signal,
                            closed=view.closed, paused=view.paused, shadow=view.shadow, tenants=view.tenants)

    def overall(self) -> LanePressure:
        scheduler = self._controller.scheduler
        policy = self._controller.policy
        max_queued = policy.capacity.max_queued
        if max_queued is None:
            max_queued = sum(lane.max_queued for lane in policy.lanes)
        return LanePressure(queued=scheduler.total_queued, max_queued=max_queued,
                            inflight=scheduler.total_inflight, limit=policy.total_capacity)

    def drain_s(self, lane: str) -> float:
        return self._controller.scheduler.backlog_wait(lane, self._controller.now())


# -- pure decisions ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Check:
    """One limit's view of a request: over or not, and the status to report for it."""

    over: bool
    reason: Reason | None
    name: str
    limit: int
    unit: int
    """A ``RateLimitResponse.RateLimit.Unit`` (UNKNOWN: places, not a rate)."""
    remaining: int
    reset_s: float
    """Seconds until the limit has room again (0 when it has room now)."""


def may_crowd(tenant: str, queued: Mapping[str, int], weight: Callable[[str], float]) -> bool:
    """Whether a full queue would still take ``tenant``: some other tenant holds more places per
    unit of weight than ``tenant`` would after queueing (the rule of LaneQueue.crowding)."""
    mine = (queued.get(tenant, 0) + 1) / weight(tenant)
    return any(name != tenant and size / weight(name) > mine for name, size in queued.items())


def lane_check(name: str, lane: Lane, pressure: LanePressure, overall: LanePressure, *, tenant: str,
               weight: Callable[[str], float], queue_share: float, shed_saturated: bool, retry_max_s: float,
               drain_s: Callable[[], float]) -> Check:
    """Whether the edge sheds ``tenant``'s request to ``lane`` under ``pressure``.

    The lane's room is its slots plus the queue places before the edge sheds
    (``queue_share`` of ``max_queued``, rounded up). A full queue sheds only if no
    slot is free either (none is while the lane is paused), counting the idle slots of
    other lanes for a lane that may borrow them, and only a tenant that already holds
    its fair share of the queue. ``drain_s`` is called only for a full lane.
    """
    threshold = math.ceil(queue_share * pressure.max_queued)
    room = pressure.limit + threshold
    remaining = max(room - pressure.inflight - pressure.queued, 0)
    label = f"lane:{name}"
    if lane.closed or pressure.closed:
        return Check(True, Reason.LANE_CLOSED, label, room, _Limit.UNKNOWN, 0, retry_max_s)
    if shed_saturated and pressure.shed_by is not None:
        return Check(True, Reason.SATURATED, label, room, _Limit.UNKNOWN, 0, retry_max_s)
    slots_full = pressure.paused or pressure.inflight >= pressure.limit
    if slots_full and lane.borrow and not pressure.paused:
        capped = lane.max_borrow is not None and pressure.inflight >= pressure.limit + lane.max_borrow
        slots_full = capped or overall.inflight >= overall.limit
    crowds = pressure.max_queued > 0 and may_crowd(tenant, pressure.tenants, weight)
    if slots_full and pressure.queued >= threshold and not crowds:
        drain = drain_s()
        wait = drain if math.isfinite(drain) and drain > 0 else 0.0
        return Check(True, Reason.QUEUE_FULL, label, room, _Limit.UNKNOWN, 0, wait)
    return Check(False, None, label, room, _Limit.UNKNOWN, remaining, 0.0)


def rate_of(limit: int, tenant_limit: TenantLimit) -> Rate:
    """The bucket for ``limit`` units per ``tenant_limit.per``; it always holds at least one unit."""
    return Rate(limit / tenant_limit.unit_seconds, max(limit * tenant_limit.burst, 1.0))


def budget_check(name: str, reason: Reason, limit: int, tenant_limit: TenantLimit,
                 verdict: Verdict) -> Check:
    reset = verdict.full_s if verdict.allowed else verdict.wait_s
    return Check(not verdict.allowed, None if verdict.allowed else reason, name, limit,
                 _UNITS[tenant_limit.per], max(math.floor(verdict.remaining), 0), reset)


@dataclass(frozen=True, slots=True)
class Judgement:
    """The decision on one request descriptor."""

    lane: str
    tenant: str
    status: Check
    """The check reported in the descriptor's status: the one that sheds longest, else the tightest."""
    over: tuple[Check, ...]
    shadow: bool = False
    """Decided and counted, but answered OK (shadow mode, or a lane that only observes)."""

    @property
    def reason(self) -> Reason | None:
        return self.status.reason if self.over else None

    @property
    def retry_helps(self) -> bool:
        return all(c.reason is None or c.reason.retry_helps for c in self.over)


def judge(lane: str, tenant: str, checks: list[Check], *, shadow: bool = False) -> Judgement:
    over = tuple(c for c in checks if c.over)
    status = max(over, key=lambda c: c.reset_s) if over else min(checks, key=lambda c: c.remaining)
    return Judgement(lane, tenant, status, over, shadow)


# -- metrics ------------------------------------------------------------------------------------


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
        self.ignored = Counter(
            "extproc_ratelimit_ignored", "Descriptors answered OK without a decision, by kind "
            "(unknown_domain, unknown_descriptor): a sign of a mismatched Envoy config.",
            ["kind"], registry=registry,
        )
        self.errors = Counter(
            "extproc_ratelimit_errors", "ShouldRateLimit calls that failed (Envoy then applies its failure "
            "mode).", registry=registry,
        )
        self.decisions_of = Children(self.decisions)

    def watch(self, sizes: Callable[[], Mapping[str, int]]) -> None:
        self.registry.register(_TenantCollector(sizes))


# -- the service --------------------------------------------------------------------------------


class _Edge:
    """What one policy needs at the edge, built once per policy."""

    def __init__(self, policy: Policy, log_key: bytes) -> None:
        self.policy = policy
        self.classifier = Classifier(policy)
        self.redactor = Redactor(policy, log_key)
        self.model_header = policy.estimation.model_header
        self.lanes_by_name = {lane.name: lane for lane in policy.lanes}
        weights, default = policy.tenants.weights, policy.tenants.default_weight
        self.weight: Callable[[str], float] = lambda tenant: weights.get(tenant, default)
        models = sorted({m for rule in policy.classification.rules for m in rule.match.models})
        # Classifying once per model named by a rule, and once for any other model, gives
        # every lane a request could land in once ext_proc knows its model.
        self.models: tuple[str | None, ...] = (None, *models)

    def facts(self, entries: Mapping[str, str]) -> RequestFacts:
        headers = {k: v for k, v in entries.items() if k not in _NOT_HEADERS}
        model = headers.get(self.model_header) if self.model_header else None
        return RequestFacts(method=entries.get("method", ""), path=entries.get("path", ""),
                            headers=headers, model=model or None)

    def lanes(self, facts: RequestFacts) -> list[str]:
        """Every lane the request could be in; one when its model does not matter (or is known)."""
        if facts.model is not None or len(self.models) == 1:
            return [self.classifier.classify(facts).lane]
        lanes: list[str] = []
        for model in self.models:
            lane = self.classifier.classify(replace(facts, model=model)).lane
            if lane not in lanes:
                lanes.append(lane)
        return lanes


def _entries(descriptor: Any) -> dict[str, str]:
    return {e.key.lower(): e.value for e in descriptor.entries}


class RateLimitService(pb_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    """``ShouldRateLimit`` for Envoy's ratelimit filter.

    ``config`` returns the current ``ratelimit`` policy (read on every call, so a
    policy reload applies at once); ``pressure`` gives the lanes' load.
    """

    def __init__(self, pressure: Pressure, metrics: RateLimitMetrics, config: Callable[[], RateLimit], *,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None,
                 permit_retry: Callable[[], bool] | None = None, log_key: bytes | None = None) -> None:
        self.pressure = pressure
        #: Reserves a retry in ext_proc's retry budget for a shed that lets its client retry;
        #: False (no room) makes the shed say x-should-retry: false.
        self.permit_retry = permit_retry
        self.metrics = metrics
        self.config = config
        self.now = clock
        self._rng = rng or random.Random()
        self._edge: _Edge | None = None
        self._log_key = log_key or secrets.token_bytes(32)
        max_tenants = config().budgets.max_tenants
        self.requests = Budget(max_tenants)
        self.tokens = Budget(max_tenants)
        self._warned: set[str] = set()
        self.log: structlog.typing.FilteringBoundLogger = log.bind()
        metrics.watch(lambda: {"requests": len(self.requests), "tokens": len(self.tokens)})

    async def ShouldRateLimit(self, request: pb.RateLimitRequest,
                              context: grpc.aio.ServicerContext[Any, Any]) -> pb.RateLimitResponse:
        try:
            return self.decide(request)
        except Exception:
            self.metrics.errors.inc()
            self.log.exception("rate limit decision failed")
            raise

    def decide(self, request: pb.RateLimitRequest) -> pb.RateLimitResponse:
        config = self.config()
        response = pb.RateLimitResponse(overall_code=pb.RateLimitResponse.OK)
        if config.mode == "off" or request.domain != config.domain:
            if config.mode != "off":
                self._ignore("unknown_domain", request.domain)
            for _ in request.descriptors:
                response.statuses.add(code=pb.RateLimitResponse.OK)
            return response
        edge = self._edge_of(self.pressure.policy)
        if config.budgets.max_tenants != self.requests.max_keys:
            self.requests.resize(config.budgets.max_tenants)
            self.tokens.resize(config.budgets.max_tenants)
        now = self.now()
        shed: list[Judgement] = []
        for descriptor in request.descriptors:
            entries = _entries(descriptor)
            kind = entries.get("generic_key")
            status = response.statuses.add(code=pb.RateLimitResponse.OK)
            explicit = descriptor.HasField("hits_addend")
            hits = descriptor.hits_addend.value if explicit else request.hits_addend
            if kind == config.usage_descriptor:
                self._charge_usage(edge, config, entries, hits, now)
            elif kind == config.request_descriptor:
                judgement = self._judge(edge, config, entries, hits if explicit or hits else 1, now)
                self._count(judgement, edge)
                if judgement.shadow:
                    if judgement.over:
                        # The access log shows it: %DYNAMIC_METADATA(envoy.filters.http.ratelimit:shadow)%.
                        reason = judgement.reason
                        response.dynamic_metadata.update({"shadow": reason.value if reason else ""})
                    continue
                _fill(status, judgement.status)
                if judgement.over:
                    status.code = pb.RateLimitResponse.OVER_LIMIT
                    shed.append(judgement)
            else:
                self._ignore("unknown_descriptor", kind or "")
        if shed:
            self._over_limit(response, shed, edge.policy)
        return response

    # -- internals ----------------------------------------------------------------------------

    def _edge_of(self, policy: Policy) -> _Edge:
        edge = self._edge
        if edge is None or edge.policy is not policy:
            edge = self._edge = _Edge(policy, self._log_key)
        return edge

    def _judge(self, edge: _Edge, config: RateLimit, entries: Mapping[str, str], hits: int,
               now: float) -> Judgement:
        facts = edge.facts(entries)
        tenant = edge.classifier.tenant(facts)
        candidates = edge.lanes(facts)
        checks: list[Check] = []
        # A request that may land in a lane that only observes must not be blocked here either.
        shadow = config.mode == "shadow"
        lane_checks: list[Check] = []
        for name in candidates:
            pressure = self.pressure.lane(name)
            config_of_lane = edge.lanes_by_name.get(name)
            if pressure is None or config_of_lane is None:
                continue
            # A paused lane holds its requests even in shadow mode, as ext_proc does.
            shadow = shadow or (pressure.shadow and not pressure.paused)
            lane_checks.append(lane_check(
                name, config_of_lane, pressure, self.pressure.overall(), tenant=tenant, weight=edge.weight,
                queue_share=config.queue_share, shed_saturated=config.shed_saturated,
                retry_max_s=edge.policy.retry_after.max, drain_s=partial(self.pressure.drain_s, name)))
        if lane_checks:
            # Shed only if every lane the request could land in sheds; else report one that has room.
            open_lanes = [c for c in lane_checks if not c.over]
            checks.append(open_lanes[0] if open_lanes else lane_checks[0])
        limits = config.budgets.of(tenant)
        if limits.tokens is not None:
            rate = rate_of(limits.tokens, limits)
            checks.append(budget_check("tenant_tokens", Reason.TENANT_TOKENS, limits.tokens, limits,
                                       self.tokens.check(tenant, rate, 1.0, now)))
        if limits.requests is not None:
            rate = rate_of(limits.requests, limits)
            # Taken only when nothing else refuses the request: a refused request costs nothing.
            if any(c.over for c in checks):
                verdict = self.requests.check(tenant, rate, hits, now)
            else:
                verdict = self.requests.take(tenant, rate, hits, now)
            checks.append(budget_check("tenant_requests", Reason.TENANT_REQUESTS, limits.requests,
                                       limits, verdict))
        lane = candidates[0] if len(candidates) == 1 else ANY_LANE
        if not checks:
            checks.append(Check(False, None, "none", 0, _Limit.UNKNOWN, _UINT32, 0.0))
        return judge(lane, tenant, checks, shadow=shadow)

    def _charge_usage(self, edge: _Edge, config: RateLimit, entries: Mapping[str, str], tokens: int,
                      now: float) -> None:
        if tokens <= 0:
            return
        self.metrics.usage_reports.inc()
        self.metrics.usage_tokens.inc(tokens)
        tenant = edge.classifier.tenant(edge.facts(entries))
        limits = config.budgets.of(tenant)
        if limits.tokens is not None:
            self.tokens.charge(tenant, rate_of(limits.tokens, limits), tokens, now)

    def _count(self, judgement: Judgement, edge: _Edge) -> None:
        reason = judgement.reason
        code = "over_limit" if judgement.over else "ok"
        self.metrics.decisions_of(judgement.lane, code, reason.value if reason else "none",
                                  "true" if judgement.shadow else "false").inc()
        if judgement.over:
            self.log.info("edge_shed", lane=judgement.lane, tenant=edge.redactor.tenant(judgement.tenant),
                          reason=reason.value if reason else None, shadow=judgement.shadow)

    def _ignore(self, kind: str, value: str) -> None:
        self.metrics.ignored.labels(kind).inc()
        key = f"{kind}:{value}"
        # One warning per distinct value (and a bounded number of them): a misconfigured Envoy
        # would otherwise log on every request.
        if key not in self._warned and len(self._warned) < 64:
            self._warned.add(key)
            self.log.warning("rate limit request not for this service; answered OK", kind=kind, value=value)

    def _over_limit(self, response: pb.RateLimitResponse, shed: list[Judgement], policy: Policy) -> None:
        response.overall_code = pb.RateLimitResponse.OVER_LIMIT
        worst = max(shed, key=lambda j: j.status.reset_s)
        reason = worst.reason
        assert reason is not None
        wait = retry_after(worst.status.reset_s, policy.retry_after, self._rng)
        lane = worst.lane if worst.lane != ANY_LANE else None
        signal = rule = None
        if lane is not None and reason is Reason.SATURATED:
            pressure = self.pressure.lane(lane)
            if pressure is not None and pressure.shed_by is not None:
                # Named as ext_proc names it, so a client or an SRE sees the same cause either way.
                signal, rule = pressure.signal, pressure.shed_by
                if self.metrics.saturation is not None:
                    self.metrics.saturation.labels(lane, rule, signal or "").inc()
        retry_helps = all(j.retry_helps for j in shed)
        allowed = not retry_helps or self.permit_retry is None or self.permit_retry()
        rejection = reject(reason, lane, wait, signal=signal, rule=rule,
                           retry_allowed=retry_helps and allowed)
        response.response_headers_to_add.extend(HeaderValue(key=k, value=v) for k, v in rejection.headers)
        response.raw_body = rejection.body


def _fill(status: pb.RateLimitResponse.DescriptorStatus, check: Check) -> None:
    if check.limit <= 0:
        return
    status.current_limit.name = check.name
    status.current_limit.requests_per_unit = min(check.limit, _UINT32)
    status.current_limit.unit = check.unit
    status.limit_remaining = min(check.remaining, _UINT32)
    if math.isfinite(check.reset_s) and check.reset_s > 0:
        status.duration_until_reset.seconds = min(math.ceil(check.reset_s), _UINT32)


def add_to_server(service: RateLimitService, server: grpc.aio.Server) -> None:
    pb_grpc.add_RateLimitServiceServicer_to_server(service, server)

"""The edge shed: the cheap, coarse decision taken before ext_proc, and per-tenant budgets.

How this works: the edge sees what Envoy's ratelimit filter sends as a request arrives —
method, path and the headers the policy trusts, no body. :class:`Edge` runs the one intake
on them (so lane and tenant are ext_proc's), then judges the request against

* its lane: closed, or shed by saturation (retrying cannot help soon); or its queue holding
  ``queue_share`` of its places while no slot is free — "free" as the scheduler itself decides
  admission (:meth:`Scheduler.admissible`, borrowing and owed slots included), never a rule of
  its own — unless the tenant is below its fair share of that queue;
* the tenant's token budget (in debt: shed) and request budget (empty: shed; taken only from a
  request nothing else refuses).

A request whose lane depends on its model (unknown here) is shed only when every lane it could
land in sheds. Token usage reported when a response ends is charged to the tenant's token
budget, which may go into debt. Pure: every call takes ``now``; the live rate limit service
and the simulator drive the same object.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Protocol

from extproc.core.admission import Scheduler
from extproc.core.budget import BucketVerdict, Budget, Refill
from extproc.core.decision import ANY_LANE, Reason, Rejection, reject
from extproc.core.drain import Told
from extproc.core.intake import Intake
from extproc.core.lanes import LanePressure
from extproc.core.retry import retry_after
from extproc.core.retry_budget import is_retry
from extproc.policy.ratelimit import RateLimit, TenantLimit
from extproc.policy.schema import Lane, Policy

#: The descriptor entry carrying Envoy's request id (x-request-id): logged with a shed, so it joins the
#: proxy's access log; never classified, never part of what the edge remembers of an arrival.
REQUEST_ID = "request_id"
#: Descriptor entries that are not request headers.
NOT_HEADERS = frozenset({"generic_key", "method", "path", REQUEST_ID})
#: Entries never part of what the edge remembers of an arrival.
_NOT_KEYED = frozenset({"generic_key", REQUEST_ID})
#: Distinct arrival descriptors whose classification the edge keeps (all forgotten once full).
_ARRIVAL_KEY_BYTES = 1024
_ARRIVALS_KEPT = 4096
#: A status count with no limit to report.
UNLIMITED = 2**32 - 1


def _no_weight(name: str) -> float:
    return 1.0  # (never asked: the intake of a policy comes first, and its weights with it)


#: Reasons that are a tenant's budget, not a lane's pressure.
_BUDGETS = frozenset({Reason.TENANT_REQUESTS, Reason.TENANT_TOKENS})


class Pressure(Protocol):
    """Read-only view of the scheduler; every call reads the current state."""

    @property
    def policy(self) -> Policy: ...

    def lane(self, name: str) -> LanePressure | None: ...

    def drain_s(self, lane: str) -> float:
        """Estimated seconds until a request queued now, behind the whole queue, would start."""
        ...

    def retry_after(self, lane: str, reason: Reason, drain: float, tenant: str) -> Told:
        """What the scheduler itself would tell ``tenant``'s request of ``lane`` refused for
        ``reason``, its drain (``drain_s``) already known: the same return schedule, booked."""
        ...

    def claimable(self, lane: str, tenant: str) -> bool:
        """Whether a retry of ``tenant`` to ``lane`` arriving now holds a booking ext_proc would honour."""
        ...


class SchedulerPressure:
    """``Pressure`` read from a scheduler (the live one, or the simulator's)."""

    def __init__(self, scheduler: Scheduler, clock: Callable[[], float]) -> None:
        self._scheduler = scheduler
        self._clock = clock

    @property
    def policy(self) -> Policy:
        return self._scheduler.policy

    def lane(self, name: str) -> LanePressure | None:
        # One lane, not the whole snapshot, nor even its whole view: the edge asks on every request.
        return self._scheduler.lane_pressure(name)

    def drain_s(self, lane: str) -> float:
        # The same drain as the scheduler's own rejections: the edge and ext_proc answer alike.
        return self._scheduler.drain_wait(lane, self._clock())

    def retry_after(self, lane: str, reason: Reason, drain: float, tenant: str) -> Told:
        # The edge has no body: the request is sized as ext_proc sizes one whose body it did not
        # read (the policy's defaults), so its return spends the slot time such a request would.
        scheduler = self._scheduler
        estimator = scheduler.estimator
        predicted = estimator.predict(estimator.job(None, 0, None, None), scheduler.occupancy())
        return scheduler.retry_after(reason, lane, self._clock(), drain, tenant=tenant, predicted=predicted)

    def claimable(self, lane: str, tenant: str) -> bool:
        return self._scheduler.claimable(lane, tenant, self._clock())


@dataclass(frozen=True, slots=True)
class Check:
    """One limit's view of a request: over or not, and the status to report for it."""

    over: bool
    reason: Reason | None
    name: str
    limit: int
    unit: str | None
    """The budget's unit of time (``second`` … ``day``); None for a lane: places, not a rate."""
    remaining: int
    reset_s: float
    """Seconds until the limit has room again (0 when it has room now)."""


def may_crowd(tenant: str, queued: Mapping[str, int], weight: Callable[[str], float]) -> bool:
    """Whether a full queue would still take ``tenant``: some other tenant holds more places per
    unit of weight than ``tenant`` would after queueing (the rule of LaneQueue.crowding)."""
    mine = (queued.get(tenant, 0) + 1) / weight(tenant)
    return any(name != tenant and size / weight(name) > mine for name, size in queued.items())


def lane_check(name: str, lane: Lane, pressure: LanePressure, *, tenant: str, weight: Callable[[str], float],
               queue_share: float, shed_saturated: bool, retry_max_s: float,
               drain_s: Callable[[str], float], claimable: Callable[[str, str], bool] | None = None) -> Check:
    """Whether the edge sheds ``tenant``'s request to ``lane`` under ``pressure``.

    The lane's room is its slots plus the queue places before the edge sheds
    (``queue_share`` of ``max_queued``, rounded up). A full queue sheds only if no slot is
    free either (the scheduler's verdict), and only a tenant that already holds its fair
    share of the queue, nor a returning retry that holds a booking (``claimable(name, tenant)``:
    ext_proc gives it its kept place; asked only when the lane would shed otherwise, as asking takes
    the booking's one pass). ``drain_s(name)`` is called only for a full lane.
    """
    threshold = math.ceil(queue_share * pressure.max_queued)
    room = pressure.limit + threshold
    remaining = max(room - pressure.inflight - pressure.queued, 0)
    label = f"lane:{name}"
    if lane.closed or pressure.closed:
        return Check(True, Reason.LANE_CLOSED, label, room, None, 0, retry_max_s)
    if shed_saturated and pressure.shed_by is not None:
        return Check(True, Reason.SATURATED, label, room, None, 0, retry_max_s)
    # (Whether the tenant may crowd in is asked only of a lane that is full otherwise.)
    if (not pressure.slot_free and pressure.queued >= threshold
            and not (pressure.max_queued > 0 and may_crowd(tenant, pressure.tenants, weight))
            and not (claimable is not None and claimable(name, tenant))):
        drain = drain_s(name)
        wait = drain if math.isfinite(drain) and drain > 0 else 0.0
        return Check(True, Reason.QUEUE_FULL, label, room, None, 0, wait)
    return Check(False, None, label, room, None, remaining, 0.0)


def rate_of(limit: int, tenant_limit: TenantLimit) -> Refill:
    """The bucket for ``limit`` units per ``tenant_limit.per``; it always holds at least one unit."""
    return Refill(limit / tenant_limit.unit_seconds, max(limit * tenant_limit.burst, 1.0))


def budget_check(name: str, reason: Reason, limit: int, tenant_limit: TenantLimit,
                 verdict: BucketVerdict) -> Check:
    reset = verdict.full_s if verdict.allowed else verdict.wait_s
    return Check(not verdict.allowed, None if verdict.allowed else reason, name, limit,
                 tenant_limit.per, max(math.floor(verdict.remaining), 0), reset)


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


_RESET = attrgetter("reset_s")
_REMAINING = attrgetter("remaining")


def judge(lane: str, tenant: str, checks: list[Check], *, shadow: bool = False) -> Judgement:
    over = tuple(c for c in checks if c.over)
    status = max(over, key=_RESET) if over else min(checks, key=_REMAINING)
    return Judgement(lane, tenant, status, over, shadow)


#: The budget kinds.
TOKENS = "tokens"
REQUESTS = "requests"


@dataclass(frozen=True, slots=True)
class BudgetAsk:
    """One budget operation an arrival (or a usage report) needs."""

    kind: str
    """``tokens`` or ``requests``."""
    tenant: str
    rate: Refill
    amount: float
    op: str
    """``check``, ``take`` (all or nothing) or ``charge`` (may go into debt): ``Budget.apply``."""
    limit: int
    tenant_limit: TenantLimit


@dataclass(frozen=True, slots=True)
class Assessment:
    """An arrival judged but for its tenant's budgets (``Edge.assess``)."""

    lane: str
    tenant: str
    checks: tuple[Check, ...]
    asks: tuple[BudgetAsk, ...]
    shadow: bool


@dataclass(frozen=True, slots=True)
class Shed:
    """An OVER_LIMIT answer: what the client sees, and the saturation rule behind it (if any)."""

    rejection: Rejection
    lane: str | None
    rule: str | None
    signal: str | None
    reason: Reason
    """Why, as counted (the descriptor that sheds longest)."""
    tenant: str
    counted_as: str = ANY_LANE
    """The lane the refusal is counted in: ``lane``, or ``ANY_LANE`` when it could land in several."""


class Edge:
    """The edge of one running scheduler: per-policy intake, tenant budgets, judgements."""

    def __init__(self, pressure: Pressure, rng: random.Random | None = None,
                 max_tenants: int = 10_000) -> None:
        self.pressure = pressure
        self._rng = rng or random.Random()
        self._intake: Intake | None = None
        self.requests = Budget(max_tenants)
        self.tokens = Budget(max_tenants)
        #: True when a fleet's shared store keeps the budgets: charges are queued in ``charges``.
        self.shared = False
        self.charges: list[BudgetAsk] = []
        #: ``request``'s answers for arrival descriptors seen under the current intake.
        self._arrivals: dict[tuple[tuple[str, str], ...], tuple[str, list[str]]] = {}
        self._lanes: dict[str, Lane] = {}
        self._weight: Callable[[str], float] = _no_weight

    def _intake_of(self, policy: Policy) -> Intake:
        intake = self._intake
        if intake is None or intake.policy is not policy:
            intake = self._intake = Intake(policy)
            self._arrivals.clear()
            self._lanes = {lane.name: lane for lane in policy.lanes}
            weights, default = policy.tenants.weights, policy.tenants.default_weight

            def weight(name: str) -> float:
                return weights.get(name, default)

            self._weight = weight
        return intake

    def arrival(self, entries: Mapping[str, str]) -> tuple[str, list[str]]:
        """``request`` for an arrival descriptor, remembered per distinct descriptor (a pure function of
        it and the policy; arrivals repeat a few paths and tenants): classifying anew cost more than the
        rest of the edge's decision."""
        self._intake_of(self.pressure.policy)
        # Classification reads the path without its query: so does the key. A key longer than
        # _ARRIVAL_KEY_BYTES (client-chosen paths and header values) is classified, not kept: the
        # memo holds at most _ARRIVALS_KEPT small keys.
        # The request id (a descriptor's own, with --edge call) is unique per request: never in the key;
        # nor the generic key, the same for every arrival (judged inline, the entries come without it).
        key = tuple((k, v.split("?", 1)[0]) if k == "path" else (k, v) for k, v in entries.items()
                    if k not in _NOT_KEYED)
        known = self._arrivals.get(key)
        if known is None:
            known = self.request(entries)
            if sum(len(k) + len(v) for k, v in key) <= _ARRIVAL_KEY_BYTES:
                if len(self._arrivals) >= _ARRIVALS_KEPT:
                    self._arrivals.clear()
                self._arrivals[key] = known
        return known

    def request(self, entries: Mapping[str, str]) -> tuple[str, list[str]]:
        """The tenant and every lane the request could land in (the one intake, without a body)."""
        intake = self._intake_of(self.pressure.policy)
        headers = {k: v for k, v in entries.items() if k not in NOT_HEADERS}
        method, path = entries.get("method", ""), entries.get("path", "")
        return intake.tenant(method, path, headers), intake.lanes(method, path, headers)

    def _sized(self, config: RateLimit) -> None:
        if config.budgets.max_tenants != self.requests.max_keys:
            self.requests.resize(config.budgets.max_tenants)
            self.tokens.resize(config.budgets.max_tenants)

    def judge(self, config: RateLimit, entries: Mapping[str, str], hits: int, now: float) -> Judgement:
        """The decision on one arrival descriptor (``hits``: the requests it stands for), with this
        edge's own budgets."""
        assessment = self.assess(config, entries, hits, now)
        return self.conclude(assessment, self.settle(assessment.asks, now))

    def settle(self, asks: Sequence[BudgetAsk], now: float) -> list[BucketVerdict]:
        """``asks`` against this edge's own budgets, in order (the rule of ``bucket.lua``: a take
        after a refusal only checks)."""
        verdicts: list[BucketVerdict] = []
        for ask in asks:
            op = "check" if ask.op == "take" and any(not v.allowed for v in verdicts) else ask.op
            budget = self.tokens if ask.kind == TOKENS else self.requests
            verdicts.append(budget.apply(op, ask.tenant, ask.rate, ask.amount, now))
        return verdicts

    def assess(self, config: RateLimit, entries: Mapping[str, str], hits: int, now: float) -> Assessment:
        """Everything about one arrival but its tenant's budgets: its lanes' checks, and the budget
        operations it needs (``asks``, in order), for this edge's budgets or a shared store."""
        self._sized(config)
        source = self.pressure
        policy = source.policy
        tenant, candidates = self.arrival(entries)
        # A retry (the retry budget's header, sent in the descriptor) may hold a booking on its
        # lane's return schedule: the edge lets it through for ext_proc to claim.
        retry = is_retry(entries, policy.retry_budget.header)
        checks: list[Check] = []
        # A request that may land in a lane that only observes must not be blocked here either.
        shadow = config.mode == "shadow"
        lane_checks: list[Check] = []
        configs = self._lanes
        for name in candidates:
            pressure = source.lane(name)
            config_of_lane = configs.get(name)
            if pressure is None or config_of_lane is None:
                continue
            # A paused lane holds its requests even in shadow mode, as ext_proc does.
            shadow = shadow or (pressure.shadow and not pressure.paused)
            lane_checks.append(lane_check(
                name, config_of_lane, pressure, tenant=tenant, weight=self._weight,
                queue_share=config.queue_share, shed_saturated=config.shed_saturated,
                retry_max_s=policy.retry_after.max, drain_s=source.drain_s,
                claimable=source.claimable if retry else None))
        if lane_checks:
            # Shed only if every lane the request could land in sheds; else report one that has room.
            open_lanes = [c for c in lane_checks if not c.over]
            checks.append(open_lanes[0] if open_lanes else lane_checks[0])
        limits = config.budgets.of(tenant)
        asks: list[BudgetAsk] = []
        if limits.tokens is not None:
            # In debt: shed. Only looked at: tokens are charged when the response has used them.
            asks.append(BudgetAsk(TOKENS, tenant, rate_of(limits.tokens, limits), 1.0, "check", limits.tokens,
                            limits))
        if limits.requests is not None:
            # Taken only when nothing else refuses the request: a refused request costs nothing.
            op = "check" if any(c.over for c in checks) else "take"
            asks.append(BudgetAsk(REQUESTS, tenant, rate_of(limits.requests, limits), float(hits), op,
                            limits.requests, limits))
        lane = candidates[0] if len(candidates) == 1 else ANY_LANE
        return Assessment(lane, tenant, tuple(checks), tuple(asks), shadow)

    def conclude(self, assessment: Assessment, verdicts: Sequence[BucketVerdict]) -> Judgement:
        """The judgement, once the budgets answered ``assessment.asks`` (one verdict each, in order)."""
        checks = list(assessment.checks)
        for ask, verdict in zip(assessment.asks, verdicts, strict=True):
            name, reason = ("tenant_tokens", Reason.TENANT_TOKENS) if ask.kind == TOKENS \
                else ("tenant_requests", Reason.TENANT_REQUESTS)
            checks.append(budget_check(name, reason, ask.limit, ask.tenant_limit, verdict))
        if not checks:
            checks.append(Check(False, None, "none", 0, None, UNLIMITED, 0.0))
        return judge(assessment.lane, assessment.tenant, checks, shadow=assessment.shadow)

    def charge(self, config: RateLimit, entries: Mapping[str, str], tokens: int, now: float) -> str:
        """Charge reported token usage to the request's tenant; returns the tenant.

        With ``shared`` set, the charge is not applied here but queued in ``charges`` (the adapter
        sends them to the fleet's store)."""
        self._sized(config)
        tenant, _ = self.request(entries)
        limits = config.budgets.of(tenant)
        if limits.tokens is not None and tokens > 0:
            rate = rate_of(limits.tokens, limits)
            if self.shared:
                self.charges.append(BudgetAsk(TOKENS, tenant, rate, float(tokens), "charge", limits.tokens,
                                              limits))
            else:
                self.tokens.charge(tenant, rate, tokens, now)
        return tenant

    def shed(self, shed: list[Judgement], permit_retry: Callable[[], bool] | None = None) -> Shed:
        """The answer to a request some of whose descriptors are over their limits."""
        policy = self.pressure.policy
        worst = max(shed, key=lambda j: j.status.reset_s)
        reason = worst.reason
        assert reason is not None
        lane = worst.lane if worst.lane != ANY_LANE else None
        told: Told | None = None
        if lane is not None and reason not in _BUDGETS:
            # A lane's pressure: the scheduler's own answer (its drain, as the lane check measured
            # it, and its return schedule, booked for this tenant, the retry budget asked there),
            # so the edge and ext_proc answer alike.
            told = self.pressure.retry_after(lane, reason, worst.status.reset_s, worst.tenant)
            wait = told.seconds
        else:  # a tenant budget: when its bucket has room again
            wait = retry_after(worst.status.reset_s, policy.retry_after, self._rng)
        signal = rule = None
        if lane is not None and reason is Reason.SATURATED:
            pressure = self.pressure.lane(lane)
            if pressure is not None and pressure.shed_by is not None:
                # Named as ext_proc names it, so a client or an SRE sees the same cause either way.
                signal, rule = pressure.signal, pressure.shed_by
        retry_helps = all(j.retry_helps for j in shed)
        # A shed that lets its client retry reserves that retry in the retry budget; with no room
        # it says x-should-retry: false, saving the client the attempt.
        if told is not None:
            allowed = retry_helps and told.allowed
        else:
            allowed = retry_helps and (permit_retry is None or permit_retry())
        rejection = reject(reason, lane, wait, signal=signal, rule=rule, retry_allowed=allowed,
                           retry_after_ms=told.ms if told is not None else None)
        return Shed(rejection, lane, rule, signal, reason, worst.tenant, lane or ANY_LANE)

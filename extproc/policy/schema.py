"""The policy file's schema: typed, immutable, validated when it is loaded.

Every model forbids unknown keys and is frozen, so a policy that loaded is a
policy the rest of the code can trust without re-checking. Cross-field rules
(unknown lane names, untrusted headers, limits that cannot hold together) are
checked here too, so that `extproc policy check` reports all of them at once.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, PlainValidator, field_validator, model_validator

from extproc.policy.fields import Duration, HeaderName, Strict
from extproc.policy.ratelimit import RateLimit, RetryBudgetPolicy
from extproc.policy.signals import Signals
from extproc.policy.signals import problems as signal_problems

_NAME = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
_HTTP_METHODS = {"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"}
_Strict = Strict


class Lane(_Strict):
    """A class of traffic with its own slots, queue and deadline."""

    name: Annotated[str, Field(pattern=_NAME)]
    priority: Annotated[int, Field(ge=0, le=1000)] = 0
    max_inflight: Annotated[int, Field(ge=1, le=100_000)]
    max_queued: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    deadline: Annotated[Duration, Field(gt=0)]
    """Longest a request of this lane may wait in the queue before it is admitted."""
    borrow: bool = False
    """May use other lanes' idle slots beyond its own max_inflight."""
    max_borrow: Annotated[int | None, Field(ge=0)] = None
    """Cap on borrowed slots (None: as many as are idle)."""
    evictable: bool = False
    """Its queued requests may be dropped to make room for higher-priority lanes."""
    closed: bool = False
    """A closed lane rejects every request (reason lane_closed)."""
    sjf_weight: Annotated[float | None, Field(ge=0, le=1000)] = None
    """Overrides queueing.sjf_weight for this lane (short deadlines want a small weight)."""
    shadow: bool = False
    """Observe only: decide, log and count as if enforcing, but admit every request at once."""


class Match(_Strict):
    """Conditions of a rule; all given conditions must hold (an empty match always holds)."""

    path: str | None = None
    path_prefix: str | None = None
    path_regex: str | None = None
    methods: tuple[str, ...] = ()
    headers: dict[HeaderName, tuple[str, ...]] = Field(default_factory=dict)
    models: tuple[str, ...] = ()
    tenants: tuple[str, ...] = ()

    @field_validator("headers", mode="before")
    @classmethod
    def _header_values(cls, value: object) -> object:
        if isinstance(value, dict):
            return {
                str(k).lower(): (v,) if isinstance(v, str) else v for k, v in value.items()
            }
        return value

    @field_validator("methods")
    @classmethod
    def _methods(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        upper = tuple(m.upper() for m in value)
        unknown = sorted(set(upper) - _HTTP_METHODS)
        if unknown:
            raise ValueError(f"unknown HTTP method(s) {unknown}; expected some of {sorted(_HTTP_METHODS)}")
        return upper

    @field_validator("path_regex")
    @classmethod
    def _regex(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a valid regular expression: {exc}") from exc
        return value


class Rule(_Strict):
    name: Annotated[str, Field(pattern=_NAME)] | None = None
    match: Match = Field(default_factory=Match)
    lane: str


class ClassificationPolicy(_Strict):
    default_lane: str
    lane_header: HeaderName | None = None
    """A trusted header whose value names the lane directly (checked before the rules)."""
    rules: tuple[Rule, ...] = ()

    @field_validator("lane_header")
    @classmethod
    def _lower(cls, value: str | None) -> str | None:
        return value.lower() if value else value


class Tenants(_Strict):
    header: HeaderName | None = None
    """Header naming the tenant; it must be set by something you trust (listed in trusted_headers)."""
    default: Annotated[str, Field(min_length=1, max_length=128)] = "default"
    weights: dict[str, Annotated[float, Field(gt=0, le=1_000_000)]] = Field(default_factory=dict)
    default_weight: Annotated[float, Field(gt=0, le=1_000_000)] = 1.0
    max_tenant_length: Annotated[int, Field(ge=1, le=1024)] = 128

    @field_validator("header")
    @classmethod
    def _lower(cls, value: str | None) -> str | None:
        return value.lower() if value else value


def ratelimit_problems(ratelimit: RateLimit, tenants: Tenants) -> list[str]:
    """The ``ratelimit`` section's rules that need the ``tenants`` section too, as "key.path: message"
    lines (empty when all hold)."""
    out: list[str] = []
    if ratelimit.usage_descriptor == ratelimit.request_descriptor:
        out.append(
            f"ratelimit.usage_descriptor: equals request_descriptor ({ratelimit.request_descriptor!r}); "
            f"token reports could not be told from requests"
        )
    for name in ratelimit.budgets.tenants:
        where = f"ratelimit.budgets.tenants.{name}"
        if len(name) > tenants.max_tenant_length:
            out.append(
                f"{where}: longer than tenants.max_tenant_length ({tenants.max_tenant_length}); "
                f"tenant names are cut to that length, so this budget could never apply"
            )
        elif tenants.header is None and name != tenants.default:
            out.append(
                f"{where}: no tenants.header is set, so every request is tenant {tenants.default!r} "
                f"and this budget could never apply"
            )
    return out


class ModelCost(_Strict):
    """Prior for a model's service time; learning refines decode cost from observations."""

    prefill_ms_per_token: Annotated[float, Field(ge=0)] = 0.05
    decode_ms_per_token: Annotated[float, Field(gt=0)] = 15.0
    overhead_ms: Annotated[float, Field(ge=0)] = 20.0


class Estimation(_Strict):
    read_body: Literal["auto", "always", "never"] = "auto"
    """auto: read the JSON body only when a rule matches on models or costs differ per model."""
    max_body_bytes: Annotated[int, Field(ge=1024, le=64 * 1024 * 1024)] = 1024 * 1024
    body_timeout: Annotated[Duration, Field(gt=0, le=600)] = 10.0
    """How long a request whose body is read may take to send it (then 408 body_timeout, noticed within
    an eighth of it: servers/deadlines.py)."""
    max_slow_bodies: Annotated[int, Field(ge=0, le=1_000_000)] = 64
    """Requests one client (source address) may have waiting more than a second for their body;
    beyond it new ones get 429 slow_bodies (0: no cap)."""
    chars_per_token: Annotated[float, Field(gt=0, le=64)] = 4.0
    default_max_tokens: Annotated[int, Field(ge=1, le=10_000_000)] = 256
    """The output size of a request whose body gives no token limit (or is not read)."""
    max_output_tokens: Annotated[int, Field(ge=1, le=10_000_000)] = 32768
    """The largest output the estimate takes: a larger token limit in a body is sized at this (set it to
    your models' longest output, their context length), and so is a body extproc cannot read."""
    unreadable_body: Literal["estimate", "refuse"] = "estimate"
    """A body extproc cannot read — a Content-Encoding it does not decode (it decodes gzip, x-gzip,
    deflate and identity, one at a time), stacked encodings, or bytes that do not decode as their
    encoding says — must not make a request cheaper: ``estimate`` sizes it as the largest job the
    policy expects (``max_output_tokens``, its prompt from its size as sent, no model: the lane the
    rules give a request without one); ``refuse`` answers 415 (reason unsupported_encoding)."""
    model_header: HeaderName | None = None
    default: ModelCost = Field(default_factory=ModelCost)
    models: dict[str, ModelCost] = Field(default_factory=dict)
    learning_rate: Annotated[float, Field(ge=0, le=1)] = 0.1
    """Weight of each observation in the per-model EWMA of per-token cost (0 disables learning)."""
    occupancy_slowdown: Annotated[float, Field(ge=0, le=100)] = 1.0
    """Decode cost grows by this factor times the occupied share of capacity (batching slows tokens)."""

    @field_validator("model_header")
    @classmethod
    def _lower(cls, value: str | None) -> str | None:
        return value.lower() if value else value

    @model_validator(mode="after")
    def _outputs(self) -> Estimation:
        if self.default_max_tokens > self.max_output_tokens:
            raise ValueError(f"default_max_tokens ({self.default_max_tokens}) must not exceed "
                             f"max_output_tokens ({self.max_output_tokens}), the largest output estimated")
        return self


class Queueing(_Strict):
    sjf_weight: Annotated[float, Field(ge=0, le=1000)] = 4.0
    """A queued request's rank is arrival + min(sjf_weight × predicted service, deadline).

    Short jobs overtake long ones, but never by more than sjf_weight times the long
    job's predicted service time: this bounds starvation. 0 gives FIFO.
    """


class AutoTarget(_Strict):
    """What the engine must keep meeting while the limit grows (each optional)."""

    ttft_p95: Annotated[Duration, Field(gt=0, le=600)] | None = None
    """Time to first token, 95th percentile, as the engine reports it."""
    tpot_p95: Annotated[Duration, Field(gt=0, le=60)] | None = None
    """Time per output token (inter-token latency), 95th percentile."""
    queue: Annotated[int, Field(ge=0, le=100_000)] = 0
    """Requests the engines may keep waiting in their own queues (summed) before the limit falls."""


class AutoSignals(_Strict):
    """Which of ``signals.read`` tell the engine's state (names of signals; each optional)."""

    waiting: Annotated[str, Field(pattern=_NAME)] | None = None
    """Requests waiting in the engines' own queues (e.g. preset waiting_requests)."""
    running: Annotated[str, Field(pattern=_NAME)] | None = None
    """Requests the engines run (e.g. preset running_requests): a starting limit begins from it (at least
    what runs, or exactly that while the engines queue) rather than from ``start``."""
    ttft_p95: Annotated[str, Field(pattern=_NAME)] | None = None
    tpot_p95: Annotated[str, Field(pattern=_NAME)] | None = None
    kv_cache: Annotated[str, Field(pattern=_NAME)] | None = None
    """The engines' KV-cache usage, 0 to 1 (e.g. preset kv_cache_usage; needs ``running``): a starting
    limit grows no further than where the cache would be 90 % full at what each running request uses
    of it now (+5 % per reading once there, while it is not) rather than doubling; and no limit grows
    while the cache is 90 % full or more."""


class AutoCapacity(_Strict):
    """A fleet in-flight limit that finds and follows the engines' real concurrency.

    It falls fast when the engines' own queue grows or a latency passes its target, and grows
    carefully while there is headroom and the limit is what holds traffic back; it never leaves
    ``[min, max]``. Lanes' ``max_inflight`` then are shares of it (see ``Capacity``).
    """

    min: Annotated[int, Field(ge=1, le=100_000)] = 1
    max: Annotated[int, Field(ge=1, le=100_000)]
    start: Annotated[int, Field(ge=1, le=100_000)] | None = None
    """Where a fresh fleet starts (default: min); it grows from there while there is headroom."""
    target: AutoTarget = Field(default_factory=AutoTarget)
    signals: AutoSignals = Field(default_factory=AutoSignals)
    interval: Annotated[Duration, Field(ge=0.1, le=600)] = 2.0
    """How often the limit may move."""
    cooldown: Annotated[Duration, Field(ge=0, le=3600)] = 6.0
    """After a fall, latency percentiles (which look back over a window) may not cut it again for
    this long; a growing engine queue always may."""
    stale_hold: Annotated[Duration, Field(ge=0, le=3600)] = 30.0
    """With every signal stale or missing, the last limit holds this long, then decays to min."""
    shadow: bool = False
    """Compute, export and log the limit, but enforce capacity.max_inflight (a number) instead."""

    @model_validator(mode="after")
    def _bounds(self) -> AutoCapacity:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        if self.start is not None and not self.min <= self.start <= self.max:
            raise ValueError(f"start ({self.start}) must lie within [min, max] = [{self.min}, {self.max}]")
        return self

    @property
    def first(self) -> int:
        return self.start if self.start is not None else self.min


def _limit_or_auto(value: object) -> int | Literal["auto"] | None:
    """A whole number of slots ≥ 1, or ``auto`` (one clear message, not one per union member)."""
    if value is None or value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer() and value >= 1:
            return int(value)
        raise ValueError("Input should be a whole number of slots or auto")
    if value < 1:
        raise ValueError("Input should be greater than or equal to 1")
    return value


class Capacity(_Strict):
    max_inflight: Annotated[int | Literal["auto"] | None, PlainValidator(_limit_or_auto)] = None
    """Slots in all (default: the sum of the lanes' max_inflight), or ``auto`` (see ``auto``).

    With ``auto`` each lane's max_inflight is its share: lane limit = the fleet limit × its
    max_inflight / the lanes' max_inflight summed (at least 1), and so is its max_borrow."""
    auto: AutoCapacity | None = None
    """The self-sizing limit: enforced with ``max_inflight: auto``, only shown with ``shadow: true``."""
    max_queued: Annotated[int | None, Field(ge=0)] = None
    """Queued requests in all; when full, evictable lanes lose their worst entry to higher lanes."""
    max_request_duration: Annotated[Duration, Field(gt=0)] = 3600.0
    """Backstop: a slot held longer than this is reclaimed even if its stream never ended."""
    max_hold: Annotated[Duration, Field(gt=0, le=3600)] = 300.0
    """Must equal the ext_proc filter's max_message_timeout: no lane may hold longer."""


class RetryAfter(_Strict):
    min: Annotated[Duration, Field(ge=1, le=60)] = 1.0
    max: Annotated[Duration, Field(ge=1, le=60)] = 30.0
    jitter: Annotated[float, Field(ge=0, le=1)] = 0.2
    share: Annotated[float, Field(ge=0, le=1)] = 0.08
    """The share of a lane's measured completion rate (and slot time) kept for returning retries:
    rejected clients are booked on the lane's return schedule at that pace, and a retry that comes
    back on time keeps its first attempt's place. 0: no schedule (Retry-After is the drain,
    jittered). Keep it at most retry_budget.ratio / (1 + ratio) (the budget counts retries against
    admitted originals, the schedule against every completion), or the budget, not the schedule,
    decides who returns and the returns come unevenly."""

    @model_validator(mode="after")
    def _ordered(self) -> RetryAfter:
        if self.min > self.max:
            raise ValueError(f"min ({self.min:g}s) must not exceed max ({self.max:g}s)")
        return self


class Policy(_Strict):
    version: Literal[1] = 1
    shadow: bool = False
    """Every lane observes only (see Lane.shadow): the safe way to roll out a new policy."""
    lanes: Annotated[tuple[Lane, ...], Field(min_length=1)]
    classification: ClassificationPolicy
    trusted_headers: tuple[HeaderName, ...] = ()
    """Request headers the policy may act on. Anything else a client sends cannot pick a lane."""
    tenants: Tenants = Field(default_factory=Tenants)
    estimation: Estimation = Field(default_factory=Estimation)
    queueing: Queueing = Field(default_factory=Queueing)
    capacity: Capacity = Field(default_factory=Capacity)
    retry_after: RetryAfter = Field(default_factory=RetryAfter)
    signals: Signals = Field(default_factory=Signals)
    """Cluster signals (Prometheus queries, model-server scrapes) and the saturation rules on them."""
    ratelimit: RateLimit = Field(default_factory=RateLimit)
    """The rate limit service Envoy's ratelimit filter asks before ext_proc: the coarse edge shed."""
    retry_budget: RetryBudgetPolicy = Field(default_factory=RetryBudgetPolicy)

    @field_validator("trusted_headers")
    @classmethod
    def _lower(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(v.lower() for v in value)

    @model_validator(mode="after")
    def _consistent(self) -> Policy:
        problems: list[str] = []
        names = [lane.name for lane in self.lanes]
        seen: set[str] = set()
        for i, name in enumerate(names):
            if name in seen:
                problems.append(f"lanes[{i}].name: duplicate lane name {name!r}")
            seen.add(name)
        known = f"one of {sorted(seen)}"
        if self.classification.default_lane not in seen:
            problems.append(
                f"classification.default_lane: unknown lane "
                f"{self.classification.default_lane!r}, expected {known}"
            )
        trusted = set(self.trusted_headers)
        for i, rule in enumerate(self.classification.rules):
            if rule.lane not in seen:
                problems.append(
                    f"classification.rules[{i}].lane: unknown lane {rule.lane!r}, expected {known}"
                )
            for header in rule.match.headers:
                if header not in trusted:
                    problems.append(
                        f"classification.rules[{i}].match.headers.{header}: header is not in "
                        f"trusted_headers; a client could choose its own lane with it"
                    )
        lane_header = self.classification.lane_header
        if lane_header and lane_header not in trusted:
            problems.append(
                f"classification.lane_header: {lane_header!r} is not in trusted_headers; "
                f"a client could choose its own lane with it"
            )
        if self.tenants.header and self.tenants.header not in trusted:
            problems.append(
                f"tenants.header: {self.tenants.header!r} is not in trusted_headers; "
                f"list it there once your gateway sets it (clients could claim any tenant)"
            )
        total = sum(lane.max_inflight for lane in self.lanes)
        problems.extend(self._auto_problems())
        capacity = self.capacity.max_inflight if self.capacity.max_inflight != "auto" else None
        for i, lane in enumerate(self.lanes):
            if capacity is not None and lane.max_inflight > capacity:
                problems.append(
                    f"lanes[{i}].max_inflight: {lane.max_inflight} exceeds "
                    f"capacity.max_inflight ({capacity})"
                )
            if lane.deadline >= self.capacity.max_hold:
                problems.append(
                    f"lanes[{i}].deadline: {lane.deadline:g}s must be below capacity.max_hold "
                    f"({self.capacity.max_hold:g}s, Envoy's max_message_timeout)"
                )
            if lane.max_borrow is not None and not lane.borrow:
                problems.append(f"lanes[{i}].max_borrow: set but lane.borrow is false")
        if capacity is not None and capacity > total and not any(lane.borrow for lane in self.lanes):
            problems.append(
                f"capacity.max_inflight: {capacity} exceeds the lanes' total ({total}) but no lane "
                f"may borrow, so the extra slots could never be used"
            )
        problems.extend(signal_problems(self.signals, seen))
        problems.extend(ratelimit_problems(self.ratelimit, self.tenants))
        if problems:
            # One problem per line: the loader splits them back into separate errors.
            raise ValueError("\n".join(problems))
        return self

    def _auto_problems(self) -> list[str]:
        auto, limit = self.capacity.auto, self.capacity.max_inflight
        if auto is None:
            return ["capacity.auto: required with capacity.max_inflight: auto (its min, max and "
                    "signals)"] if limit == "auto" else []
        out: list[str] = []
        if limit != "auto" and not auto.shadow:
            out.append("capacity.auto: set capacity.max_inflight: auto to enforce it, or "
                       "capacity.auto.shadow: true to only watch it")
        if limit == "auto" and auto.shadow:
            out.append("capacity.auto.shadow: shadow mode enforces a number: set "
                       "capacity.max_inflight to the limit in force while auto is watched")
        roles = auto.signals.model_dump()
        for role, name in roles.items():
            if name is not None and name not in self.signals.read:
                known = sorted(self.signals.read)
                out.append(f"capacity.auto.signals.{role}: unknown signal {name!r}, expected "
                           + (f"one of {known}" if known else "a signal of signals.read (none defined)"))
        if all(name is None for name in roles.values()):
            out.append("capacity.auto.signals: name at least one of waiting, ttft_p95, tpot_p95 "
                       "(signals of signals.read): without the engine's signals the limit cannot move")
        if roles["kv_cache"] is not None and roles["running"] is None:
            out.append("capacity.auto.signals.kv_cache: needs capacity.auto.signals.running, the requests "
                       "that use the cache it reads")
        for role in ("ttft_p95", "tpot_p95"):
            if getattr(auto.target, role) is not None and roles[role] is None:
                out.append(f"capacity.auto.target.{role}: needs capacity.auto.signals.{role}, the "
                           f"signal to compare it with")
        return out

    def lane(self, name: str) -> Lane:
        for lane in self.lanes:
            if lane.name == name:
                return lane
        raise KeyError(name)

    @property
    def total_capacity(self) -> int:
        """The slots in all; with ``auto`` (before sizing), where the fleet starts."""
        limit = self.capacity.max_inflight
        if limit == "auto":
            assert self.capacity.auto is not None
            return self.capacity.auto.first
        if limit is not None:
            return limit
        return sum(lane.max_inflight for lane in self.lanes)

    @property
    def auto_capacity(self) -> bool:
        """The fleet limit is self-sized and enforced (``capacity.max_inflight: auto``)."""
        return self.capacity.max_inflight == "auto"

    @property
    def capacity_sources(self) -> frozenset[str]:
        """The signal sources that feed the self-sized limit (``capacity.auto.signals``; none without)."""
        auto = self.capacity.auto
        if auto is None:
            return frozenset()
        read = self.signals.read
        return frozenset(signal.source for name in auto.signals.model_dump().values()
                         if name and (signal := read.get(name)) is not None)

    @property
    def needs_body(self) -> bool:
        """Whether requests' JSON bodies should be read (model, max_tokens, prompt size).

        In auto mode the body is read when something uses what it says (``body_uses``).
        """
        mode = self.estimation.read_body
        if mode != "auto":
            return mode == "always"
        return bool(self.body_uses)

    @property
    def body_uses(self) -> list[str]:
        """What uses what a request's body says, in words: shortest-job-first ordering, per-model
        costs, rules that match on the model, token budgets (a streamed request is asked for its
        usage). In auto mode the body is read when this is not empty (``needs_body``)."""
        uses = []
        if self.queueing.sjf_weight > 0:
            uses.append(f"queueing.sjf_weight {self.queueing.sjf_weight:g} orders queues by size")
        uses += [f"lane {lane.name} has sjf_weight {lane.sjf_weight:g}"
                 for lane in self.lanes if lane.sjf_weight]
        if self.estimation.models:
            uses.append("estimation.models has per-model costs")
        uses += [f"rule {rule.name or f'rules[{i}]'} matches on models"
                 for i, rule in enumerate(self.classification.rules) if rule.match.models]
        if self.ratelimit.asks_usage:
            uses.append("token budgets: a streamed request is asked for its usage (ratelimit.ask_usage)")
        return uses

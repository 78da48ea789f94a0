"""Which changes from one policy to another can refuse or reorder more traffic: the risks of a diff.

How this works: one check per part of the policy compares the old and the new value and yields a
``Risk`` for every change that can turn away a request the old policy would have taken, or serve
one later than before: a limit, cap, deadline, queue or budget cut; a stricter check switched on;
requests moved to another lane (a rule added, removed, widened, narrowed, reordered or sent
elsewhere, another default lane); work reordered (priorities, shortest-job-first weights, tenant
weights); shadow mode left. Values are compared by what they do, not how they are written: lanes
by name across renames, a lane under ``capacity.max_inflight: auto`` by its share, a tenant by the
budget and weight that apply to it (its own or the default), a model by the cost the estimator
uses for it, a budget by its rate and its bucket (``600 per minute`` is ``10 per second`` with a
larger bucket). A change that only loosens is not a risk.

``CHECKED`` names every schema field a check here looks at and ``SAFE`` every other one, with why
its change cannot refuse or reorder more; a test keeps the two covering the whole schema (so a
field added later needs a decision here) and shows a risk for every field in ``CHECKED``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from extproc.policy.ratelimit import TenantLimit
from extproc.policy.schema import AutoCapacity, Lane, Match, ModelCost, Policy, Rule
from extproc.policy.signals import SaturationRule, Signal
from extproc.tools.explain import describe_match, duration


@dataclass(frozen=True, slots=True)
class Risk:
    path: str
    """Where, by names: ``lanes.interactive.deadline``, ``ratelimit.budgets.tenants.free``."""
    text: str


Renames = Mapping[str, str]
"""Old lane name → new name, for lanes that look renamed."""

#: Fields whose change can refuse or reorder more traffic: each has a check below (by schema path;
#: a list's or a mapping's items are one path).
CHECKED = frozenset({
    "shadow",
    "lanes.priority", "lanes.max_inflight", "lanes.max_queued", "lanes.deadline", "lanes.borrow",
    "lanes.max_borrow", "lanes.evictable", "lanes.closed", "lanes.sjf_weight", "lanes.shadow",
    "classification.default_lane", "classification.lane_header", "classification.rules.lane",
    "classification.rules.match.path", "classification.rules.match.path_prefix",
    "classification.rules.match.path_regex", "classification.rules.match.methods",
    "classification.rules.match.headers", "classification.rules.match.models",
    "classification.rules.match.tenants",
    "trusted_headers",
    "tenants.header", "tenants.default", "tenants.weights", "tenants.default_weight",
    "tenants.max_tenant_length",
    "estimation.read_body", "estimation.max_body_bytes", "estimation.body_timeout",
    "estimation.max_slow_bodies", "estimation.chars_per_token", "estimation.default_max_tokens",
    "estimation.max_output_tokens", "estimation.unreadable_body",
    "estimation.model_header", "estimation.default.prefill_ms_per_token",
    "estimation.default.decode_ms_per_token", "estimation.default.overhead_ms",
    "estimation.models.prefill_ms_per_token", "estimation.models.decode_ms_per_token",
    "estimation.models.overhead_ms", "estimation.occupancy_slowdown",
    "queueing.sjf_weight",
    "capacity.max_inflight", "capacity.auto.min", "capacity.auto.max", "capacity.auto.start",
    "capacity.auto.target.ttft_p95", "capacity.auto.target.tpot_p95", "capacity.auto.target.queue",
    "capacity.auto.signals.waiting", "capacity.auto.signals.running", "capacity.auto.signals.ttft_p95",
    "capacity.auto.signals.tpot_p95", "capacity.auto.signals.kv_cache", "capacity.auto.cooldown",
    "capacity.auto.stale_hold",
    "capacity.max_queued", "capacity.max_hold",
    "retry_after.share",
    "signals.sources.prometheus.url", "signals.sources.prometheus.timeout",
    "signals.sources.scrape.targets", "signals.sources.scrape.timeout",
    "signals.read.source", "signals.read.query", "signals.read.metric", "signals.read.preset",
    "signals.read.labels", "signals.read.aggregate", "signals.read.quantile", "signals.read.window",
    "signals.read.stale_after", "signals.read.on_stale",
    "signals.saturation.signal", "signals.saturation.above", "signals.saturation.below",
    "signals.saturation.min_active", "signals.saturation.shed", "signals.saturation.shrink",
    "ratelimit.mode", "ratelimit.domain", "ratelimit.request_descriptor", "ratelimit.usage_descriptor",
    "ratelimit.ask_usage", "ratelimit.queue_share", "ratelimit.shed_saturated",
    "ratelimit.budgets.default.requests", "ratelimit.budgets.default.tokens",
    "ratelimit.budgets.default.per", "ratelimit.budgets.default.burst",
    "ratelimit.budgets.tenants.requests", "ratelimit.budgets.tenants.tokens",
    "ratelimit.budgets.tenants.per", "ratelimit.budgets.tenants.burst",
    "retry_budget.enabled", "retry_budget.header", "retry_budget.ratio", "retry_budget.min_per_second",
})

#: Fields whose change cannot refuse or reorder more traffic, and why.
SAFE: Mapping[str, str] = {
    "version": "there is one version",
    "lanes.name": "a renamed lane keeps its traffic; where requests go is checked on rules and default lane",
    "classification.rules.name": "how a rule is known; what it matches and where it sends are checked",
    "estimation.learning_rate": "how fast observed times refine the priors, in either direction",
    "capacity.auto.interval": "how often the limit may move, up as well as down",
    "capacity.auto.shadow": "tied to capacity.max_inflight (number or auto), whose change is checked",
    "capacity.max_request_duration": "a backstop for slots whose stream never ended; it refuses nothing",
    "retry_after.min": "when a refused client is told to come back; it refuses nothing itself",
    "retry_after.max": "when a refused client is told to come back; it refuses nothing itself",
    "retry_after.jitter": "spreads the returns of refused clients; it refuses nothing itself",
    "signals.sources.prometheus.interval": "how often signals are read (staleness is judged by stale_after)",
    "signals.sources.scrape.interval": "how often signals are read (staleness is judged by stale_after)",
    "signals.read.kind": "only how the signal is exported as a metric",
    "signals.saturation.name": "a rule is known by its name; what it judges and does is checked",
    "ratelimit.budgets.max_tenants": "a forgotten tenant starts again with a full budget",
    "retry_budget.window": "the span retries and originals are counted over; ratio and floor hold either way",
}

_FALL = "requests it no longer matches fall through to later rules or the default lane"
_TAKE = "taking requests from later rules or the default lane"
_STALE_ORDER = {"ignore": 0, "hold": 1, "saturated": 2}


def _v(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _d(value: float | None) -> str:
    """A duration as policy files write it (``250ms``, ``10s``), ``0s`` or ``unset``."""
    return "unset" if value is None else duration(value) if value else "0s"


def _cap(value: float | None) -> float:
    """A limit where unset means none."""
    return math.inf if value is None else value


def _cut(old: float | None, new: float | None) -> bool:
    """A limit lowered, or set where there was none (unset: no limit)."""
    return _cap(new) < _cap(old)


# -- lanes -------------------------------------------------------------------------------------------


def by_priority(policy: Policy) -> list[Lane]:
    """The lanes in the order freed slots go to their queued work (ties by name, as the scheduler)."""
    return sorted(policy.lanes, key=lambda lane: (-lane.priority, lane.name))


def _pairs(a: Policy, b: Policy, renames: Renames) -> Iterator[tuple[Lane, Lane]]:
    before = {renames.get(lane.name, lane.name): lane for lane in a.lanes}
    for lane in b.lanes:
        if lane.name in before:
            yield before[lane.name], lane


def _share(policy: Policy, lane: Lane) -> float:
    return lane.max_inflight / sum(other.max_inflight for other in policy.lanes)


def _lane_slots(a: Policy, b: Policy, old: Lane, new: Lane) -> Iterator[Risk]:
    at, name = f"lanes.{new.name}", new.name
    fewer = "fewer of its requests run at once; the rest queue or are rejected"
    if a.auto_capacity and b.auto_capacity:
        was, now = _share(a, old), _share(b, new)
        if now < was:
            yield Risk(f"{at}.max_inflight", f"{name}: its share of the auto limit {was:.0%} → {now:.0%} "
                       f"(max_inflight {old.max_inflight} → {new.max_inflight}): {fewer}")
    elif new.max_inflight < old.max_inflight:
        yield Risk(f"{at}.max_inflight",
                   f"{name}: max_inflight {old.max_inflight} → {new.max_inflight}: {fewer}")
    if old.max_queued and not new.max_queued:
        yield Risk(f"{at}.max_queued", f"{name} loses its queue (max_queued 0): requests that find no free "
                   "slot are rejected")
    elif new.max_queued < old.max_queued:
        yield Risk(f"{at}.max_queued", f"{name}: max_queued {old.max_queued} → {new.max_queued}: its queue "
                   "fills sooner, then requests are rejected (queue_full)")
    if new.deadline < old.deadline:
        yield Risk(f"{at}.deadline", f"{name}: deadline {_d(old.deadline)} → {_d(new.deadline)}: "
                   "more requests rejected as deadline_unmeetable or expired in the queue")


def _lane_borrow(old: Lane, new: Lane) -> Iterator[Risk]:
    at, name = f"lanes.{new.name}", new.name
    if old.borrow and not new.borrow:
        yield Risk(f"{at}.borrow", f"{name}: borrow true → false: it no longer uses other lanes' idle "
                   "slots beyond its max_inflight")
    elif old.borrow and _cut(old.max_borrow, new.max_borrow):
        yield Risk(f"{at}.max_borrow", f"{name}: max_borrow {_v(old.max_borrow)} → {new.max_borrow}: it "
                   "borrows fewer of other lanes' idle slots")
    lent = _cap(old.max_borrow) if old.borrow else 0
    if new.borrow and _cap(new.max_borrow) > lent:
        if new.max_borrow is None:
            yield Risk(f"{at}.max_borrow", f"{name} may now borrow every idle slot (no max_borrow): a "
                       "borrowed slot returns only when its job ends")
        else:
            yield Risk(f"{at}.max_borrow", f"{name} may now borrow up to {new.max_borrow} idle slots (was "
                       f"{_v(lent)}): other lanes' requests can find them taken until its jobs end")


_SJF_WHY = (": short requests may overtake a long one by more of its predicted service time; long ones "
            "wait longer")


def _sjf(policy: Policy, lane: Lane) -> float:
    return lane.sjf_weight if lane.sjf_weight is not None else policy.queueing.sjf_weight


def _lane_modes(a: Policy, b: Policy, old: Lane, new: Lane) -> Iterator[Risk]:
    at, name = f"lanes.{new.name}", new.name
    if old.shadow != new.shadow and not b.shadow:
        yield (Risk(f"{at}.shadow", f"{name} leaves shadow mode: it starts enforcing (queueing and "
                    "rejecting)")
               if old.shadow else
               Risk(f"{at}.shadow", f"{name} enters shadow mode: it admits everything; overload reaches "
                    "the backend"))
    if new.evictable and not old.evictable:
        yield Risk(f"{at}.evictable", f"{name} becomes evictable: when the queues are full "
                   "(capacity.max_queued), its queued requests can be dropped (evicted) to make room for "
                   "higher lanes")
    if old.evictable and not new.evictable:
        yield Risk(f"{at}.evictable", f"{name} becomes non-evictable: when the queues are full "
                   "(capacity.max_queued), higher lanes get queue_full instead of taking its places")
    if new.closed and not old.closed:
        yield Risk(f"{at}.closed", f"{name} becomes closed: every request it gets is rejected (lane_closed)")
    was, now = _sjf(a, old), _sjf(b, new)
    if now > was and (old.sjf_weight is not None or new.sjf_weight is not None):
        yield Risk(f"{at}.sjf_weight", f"{name}: sjf_weight {was:g} → {now:g}{_SJF_WHY}")


def _lanes(a: Policy, b: Policy, renames: Renames) -> Iterator[Risk]:
    for old, new in _pairs(a, b, renames):
        yield from _lane_slots(a, b, old, new)
        yield from _lane_borrow(old, new)
        yield from _lane_modes(a, b, old, new)
    following = [new.name for old, new in _pairs(a, b, renames)
                 if old.sjf_weight is None and new.sjf_weight is None and _sjf(b, new) > _sjf(a, old)]
    if following:
        yield Risk("queueing.sjf_weight", f"queueing.sjf_weight {a.queueing.sjf_weight:g} → "
                   f"{b.queueing.sjf_weight:g} (lanes {', '.join(following)}){_SJF_WHY}")
    yield from _priorities(a, b, renames)


def _priorities(a: Policy, b: Policy, renames: Renames) -> Iterator[Risk]:
    order_a = [renames.get(lane.name, lane.name) for lane in by_priority(a)]
    order_b = [lane.name for lane in by_priority(b)]
    common = set(order_a) & set(order_b)
    kept_a, kept_b = [n for n in order_a if n in common], [n for n in order_b if n in common]
    if kept_a != kept_b:
        yield Risk("lanes.order", f"priority order {' > '.join(kept_a)} → {' > '.join(kept_b)}: a lane that "
                   "moved down gets freed slots after the lanes now above it (and cannot evict them)")
    for lane in b.lanes:
        if lane.name not in common:
            below = [other.name for other in b.lanes
                     if other.name in common and other.priority < lane.priority]
            if below:
                yield Risk(f"lanes.{lane.name}", f"{lane.name} added with priority {lane.priority}, above "
                           f"{', '.join(below)}: its queued work gets freed slots before theirs")


# -- capacity ---------------------------------------------------------------------------------------


def _capacity(a: Policy, b: Policy, renames: Renames) -> Iterator[Risk]:
    old, new = a.capacity, b.capacity
    fewer = "fewer requests run at once across all lanes; the rest queue or are rejected"
    if not a.auto_capacity and not b.auto_capacity:
        if (old.max_inflight, new.max_inflight) != (None, None) and b.total_capacity < a.total_capacity:
            yield Risk("capacity.max_inflight", f"capacity.max_inflight {a.total_capacity} → "
                       f"{b.total_capacity}: {fewer}")
    elif b.auto_capacity and not a.auto_capacity:
        auto = new.auto
        assert auto is not None
        if auto.min < a.total_capacity:
            yield Risk("capacity.max_inflight", f"capacity.max_inflight {a.total_capacity} → auto: the "
                       f"limit sizes itself in [{auto.min}, {auto.max}] from {auto.first}; it can fall to "
                       f"{auto.min}")
    elif a.auto_capacity and not b.auto_capacity:
        assert old.auto is not None
        if b.total_capacity < old.auto.max:
            yield Risk("capacity.max_inflight", f"capacity.max_inflight auto → {b.total_capacity}: the "
                       f"limit no longer grows past {b.total_capacity} (auto could reach {old.auto.max})")
    elif old.auto is not None and new.auto is not None:
        yield from _auto(old.auto, new.auto)
    limits = sum(lane.max_inflight for lane in b.lanes)
    limits_a = sum(lane.max_inflight for lane in a.lanes)
    if not b.auto_capacity and b.total_capacity < limits and (b.total_capacity, limits) != (
            a.total_capacity, limits_a):
        yield Risk("capacity.max_inflight", f"capacity ({b.total_capacity} slots) is below the lanes' "
                   f"max_inflight summed ({limits}): the lanes cannot all reach their limits at once")
    if _cut(old.max_queued, new.max_queued):
        yield Risk("capacity.max_queued", f"capacity.max_queued {_v(old.max_queued)} → "
                   f"{new.max_queued}: once that many requests queue in all, new ones are rejected "
                   "(queue_full) unless an evictable lane below gives up a place")
    if (new.max_queued is not None and any(lane.evictable for lane in a.lanes)
            and not any(lane.evictable for lane in b.lanes)):
        yield Risk("lanes.evictable", "no lane is evictable any more: a full capacity.max_queued rejects "
                   "even the highest lanes")
    if old.max_hold != new.max_hold:
        yield Risk("capacity.max_hold", f"capacity.max_hold {_d(old.max_hold)} → "
                   f"{_d(new.max_hold)}: it must equal the ext_proc filter's max_message_timeout; "
                   "change Envoy's config with it")


def _auto(old: AutoCapacity, new: AutoCapacity) -> Iterator[Risk]:
    at = "capacity.auto"
    for key, why in (("min", "the limit may fall further"), ("max", "the limit grows no further"),
                     ("first", "a fresh fleet starts with fewer slots")):
        if getattr(new, key) < getattr(old, key):
            name = "start" if key == "first" else key
            yield Risk(f"{at}.{name}", f"{at}.{name} {getattr(old, key)} → {getattr(new, key)}: {why}")
    for key in ("ttft_p95", "tpot_p95"):
        was, now = getattr(old.target, key), getattr(new.target, key)
        if _cut(was, now):
            yield Risk(f"{at}.target.{key}", f"{at}.target.{key} {_d(was)} → {_d(now)}: the limit falls "
                       "once the engines' latency passes it")
    if new.target.queue < old.target.queue:
        yield Risk(f"{at}.target.queue", f"{at}.target.queue {old.target.queue} → {new.target.queue}: the "
                   "limit falls once the engines queue more than that")
    for key in ("waiting", "running", "ttft_p95", "tpot_p95", "kv_cache"):
        was, now = getattr(old.signals, key), getattr(new.signals, key)
        if now is not None and now != was:
            what = {"running": "a starting limit begins from what it reads",
                    "kv_cache": "a starting limit grows no further than where it says the cache fills, "
                                "and no limit grows while it says the cache is 90 % full"}.get(
                key, "the limit now falls on what it reads")
            yield Risk(f"{at}.signals.{key}", f"{at}.signals.{key} {_v(was)} → {now}: {what}")
    if new.cooldown < old.cooldown:
        yield Risk(f"{at}.cooldown", f"{at}.cooldown {_d(old.cooldown)} → {_d(new.cooldown)}: "
                   "after a fall the limit may be cut again sooner")
    if new.stale_hold < old.stale_hold:
        yield Risk(f"{at}.stale_hold", f"{at}.stale_hold {_d(old.stale_hold)} → "
                   f"{_d(new.stale_hold)}: without fresh signals the limit decays to min sooner")


# -- classification ---------------------------------------------------------------------------------


def keyed_rules(rules: Sequence[Rule]) -> dict[str, tuple[int, Rule]]:
    """Rules by name; an unnamed rule is known by what it matches and where it sends."""
    out: dict[str, tuple[int, Rule]] = {}
    for i, rule in enumerate(rules):
        base = rule.name or f"({describe_match(rule.match)} → {rule.lane})"
        key, n = base, 1
        while key in out:
            n += 1
            key = f"{base} #{n}"
        out[key] = (i, rule)
    return out


def _classification(a: Policy, b: Policy, renames: Renames) -> Iterator[Risk]:
    was = a.lane(a.classification.default_lane)
    now = b.lane(b.classification.default_lane)
    if renames.get(was.name, was.name) != now.name:
        yield Risk("classification.default_lane", f"unclassified requests now land in {now.name} (priority "
                   f"{now.priority}), no longer in {was.name} (priority {was.priority}): they take its "
                   "slots, queue and deadline")
    old, new = a.classification.lane_header, b.classification.lane_header
    if old != new:
        yield Risk("classification.lane_header", f"classification.lane_header {_v(old)} → {_v(new)}: "
                   + (f"requests carrying {new} pick their lane before any rule" if new else
                      f"requests that named their lane in {old} go through the rules"))
    yield from _rules(a, b, renames)
    for header in b.trusted_headers:
        if header not in a.trusted_headers:
            yield Risk("trusted_headers", f"{header} is now trusted: make sure your gateway sets or strips "
                       "it, or clients can send it themselves")


def _renamed(before: dict[str, tuple[int, Rule]], after: dict[str, tuple[int, Rule]],
             renames: Renames) -> dict[str, str]:
    """Old key → new key of rules that only changed their name (same match, same lane)."""
    out: dict[str, str] = {}
    for key, (_, rule) in before.items():
        if key in after:
            continue
        same = [k for k, (_, r) in after.items() if k not in before and k not in out.values()
                and r.match == rule.match and r.lane == renames.get(rule.lane, rule.lane)]
        if same:
            out[key] = same[0]
    return out


def _rules(a: Policy, b: Policy, renames: Renames) -> Iterator[Risk]:
    before, after = keyed_rules(a.classification.rules), keyed_rules(b.classification.rules)
    names = _renamed(before, after, renames)
    before = {names.get(key, key): value for key, value in before.items()}
    default = b.classification.default_lane
    for key, (i, rule) in after.items():
        if key not in before:
            later = [k for k, (j, _) in after.items() if j > i and k in before]
            took = (f"{', '.join(later)} after it no longer get the requests it matches" if later
                    else f"requests it matches no longer land in the default lane {default}")
            yield Risk(f"classification.rules.{key}", f"rule {key} added as rules[{i}] "
                       f"({describe_match(rule.match)} → {rule.lane}): {took}")
    for key, (_, rule) in before.items():
        at = f"classification.rules.{key}"
        if key not in after:
            yield Risk(at, f"rule {key} removed: requests it sent to {rule.lane} now go to the next rule "
                       f"that matches, or the default lane {default}")
            continue
        new = after[key][1]
        if renames.get(rule.lane, rule.lane) != new.lane:
            yield Risk(f"{at}.lane", f"rule {key} now sends to {new.lane} (was {rule.lane}): the requests it "
                       "matches take that lane's slots, queue and deadline")
        yield from _match(f"rule {key}", at, rule.match, new.match, default)
    order_a = [k for k in before if k in after]
    order_b = [k for k in after if k in before]
    if order_a != order_b:
        yield Risk("classification.rules.order", f"rules reordered (the first match wins): "
                   f"{', '.join(order_a)} → {', '.join(order_b)}: a request both match goes to another lane")
    shadowed = _shadowing(a)
    for catch_all, hidden in _shadowing(b).items():
        if catch_all not in shadowed:
            yield Risk("classification.rules", f"rule {catch_all} matches every request: {', '.join(hidden)} "
                       "after it can never match")


def _shadowing(policy: Policy) -> dict[str, list[str]]:
    """Rules with an empty match that are not last → the rules they hide."""
    rules = policy.classification.rules
    out: dict[str, list[str]] = {}
    for i, rule in enumerate(rules[:-1]):
        if rule.match == Match():
            out[rule.name or f"rules[{i}]"] = [r.name or f"rules[{j}]" for j, r in enumerate(rules) if j > i]
            break
    return out


def _match(label: str, at: str, old: Match, new: Match, default: str) -> Iterator[Risk]:
    for key in ("path", "path_prefix", "path_regex"):
        was, now = getattr(old, key), getattr(new, key)
        if was == now:
            continue
        text = f"{label}: match.{key} {_v(was)} → {_v(now)}: "
        if now is None:
            text += f"it now matches any path, {_TAKE} {default}"
        elif was is None:
            text += f"it matches fewer requests; {_FALL} {default}"
        else:
            text += f"it matches other requests; {_FALL} {default}, and those it matches now leave theirs"
        yield Risk(f"{at}.match.{key}", text)
    for key, noun in (("methods", "method"), ("models", "model"), ("tenants", "tenant")):
        yield from _condition(label, f"{at}.match.{key}", f"match.{key}", noun, getattr(old, key),
                              getattr(new, key), default)
    for header in [*old.headers, *(h for h in new.headers if h not in old.headers)]:
        yield from _condition(label, f"{at}.match.headers.{header}", f"match.headers.{header}",
                              f"{header} value", old.headers.get(header, ()), new.headers.get(header, ()),
                              default)


def _condition(label: str, at: str, key: str, noun: str, old: tuple[str, ...], new: tuple[str, ...],
               default: str) -> Iterator[Risk]:
    """One condition of a rule: any of some values, or (empty) anything at all."""
    added = [v for v in new if v not in old]
    removed = [v for v in old if v not in new]
    take = f"{_TAKE} {default}"
    if old and not new:
        yield Risk(at, f"{label}: {key} [{', '.join(old)}] removed: it now matches every {noun}, {take}")
    elif new and not old:
        yield Risk(at, f"{label}: {key} now [{', '.join(new)}]: it matches fewer requests; {_FALL} {default}")
    else:
        if added:
            yield Risk(at, f"{label}: {key}: added {', '.join(added)}: it now matches those too, {take}")
        if removed:
            yield Risk(at, f"{label}: {key}: removed {', '.join(removed)}: {_FALL} {default}")


# -- tenants ----------------------------------------------------------------------------------------


def _tenants(a: Policy, b: Policy, renames: Renames) -> Iterator[Risk]:
    old, new = a.tenants, b.tenants
    if old.header != new.header:
        why = (f"every request is now tenant {new.default!r}: one budget and one fair share for all"
               if new.header is None else
               "requests are now told apart by tenant: per-tenant budgets and fair shares apply"
               if old.header is None else
               "requests are told apart by another header: per-tenant budgets and fair shares fall "
               "differently")
        yield Risk("tenants.header", f"tenants.header {_v(old.header)} → {_v(new.header)}: {why}")
    if old.default != new.default:
        yield Risk("tenants.default", f"tenants.default {old.default} → {new.default}: requests without a "
                   f"tenant now get the budget and weight of tenant {new.default!r}")
    if new.max_tenant_length < old.max_tenant_length:
        yield Risk("tenants.max_tenant_length", f"tenants.max_tenant_length {old.max_tenant_length} → "
                   f"{new.max_tenant_length}: tenants whose names agree that far now share one budget and "
                   "fair share")
    if new.header is None:
        return  # one tenant: weights decide nothing
    for name in [*old.weights, *(t for t in new.weights if t not in old.weights)]:
        was, now = old.weights.get(name, old.default_weight), new.weights.get(name, new.default_weight)
        if was != now:
            whose = "its" if now < was else "other tenants'"
            yield Risk(f"tenants.weights.{name}", f"tenant {name}: weight {was:g} → {now:g}: {whose} queued "
                       "requests get a smaller share of freed slots")
    if old.default_weight != new.default_weight:
        whose = "their" if new.default_weight < old.default_weight else "listed tenants'"
        yield Risk("tenants.default_weight", f"tenants.default_weight {old.default_weight:g} → "
                   f"{new.default_weight:g} (tenants without a weight of their own): {whose} queued requests "
                   "get a smaller share of freed slots")


# -- estimation -------------------------------------------------------------------------------------

_LONGER = ("predicted service times grow: estimated waits grow and more requests are rejected as "
           "deadline_unmeetable")


def _estimation(a: Policy, b: Policy, renames: Renames) -> Iterator[Risk]:
    old, new = a.estimation, b.estimation
    yield from _body(a, b)
    if new.model_header != old.model_header:
        yield Risk("estimation.model_header", f"estimation.model_header {_v(old.model_header)} → "
                   f"{_v(new.model_header)}: the model is read elsewhere; per-model costs and rules on "
                   "models see another value")
    for key, worse in (("chars_per_token", new.chars_per_token < old.chars_per_token),
                       ("default_max_tokens", new.default_max_tokens > old.default_max_tokens),
                       ("occupancy_slowdown", new.occupancy_slowdown > old.occupancy_slowdown)):
        if worse:
            yield Risk(f"estimation.{key}", f"estimation.{key} {_v(getattr(old, key))} → "
                       f"{_v(getattr(new, key))}: {_LONGER}")
    costs: list[tuple[str, ModelCost, ModelCost]] = [("estimation.default", old.default, new.default)]
    costs += [(f"estimation.models.{m}", old.models.get(m, old.default), new.models.get(m, new.default))
              for m in [*old.models, *(m for m in new.models if m not in old.models)]]
    for at, was, now in costs:
        grown = [f"{key} {getattr(was, key):g} → {getattr(now, key):g}" for key in type(was).model_fields
                 if getattr(now, key) > getattr(was, key)]
        if grown:
            yield Risk(at, f"{at}: {', '.join(grown)}: {_LONGER}")


def _body(a: Policy, b: Policy) -> Iterator[Risk]:
    old, new = a.estimation, b.estimation
    if b.needs_body and not a.needs_body:
        yield Risk("estimation.read_body", "request bodies are now read: a body that does not come within "
                   f"{_d(new.body_timeout)} is refused (body_timeout), and so are a client's slow "
                   "bodies beyond max_slow_bodies (slow_bodies)")
    elif a.needs_body and not b.needs_body:
        yield Risk("estimation.read_body", "request bodies are no longer read: every request is sized as "
                   "default_max_tokens, so queues no longer put short requests first")
    if not b.needs_body:
        return
    if new.max_body_bytes < old.max_body_bytes:
        yield Risk("estimation.max_body_bytes", f"estimation.max_body_bytes {old.max_body_bytes} → "
                   f"{new.max_body_bytes}: a model or max_tokens past that is missed (the request is sized "
                   "as default_max_tokens; rules on models may miss it)")
    if new.body_timeout < old.body_timeout:
        yield Risk("estimation.body_timeout", f"estimation.body_timeout {_d(old.body_timeout)} → "
                   f"{_d(new.body_timeout)}: slower bodies are refused (body_timeout)")
    slow_a, slow_b = old.max_slow_bodies or None, new.max_slow_bodies or None  # 0: no cap
    if _cut(slow_a, slow_b):
        yield Risk("estimation.max_slow_bodies", f"estimation.max_slow_bodies {old.max_slow_bodies} → "
                   f"{new.max_slow_bodies}: a client's requests beyond that many waiting for their body are "
                   "refused (slow_bodies)")
    if new.unreadable_body == "refuse" and (old.unreadable_body != "refuse" or not a.needs_body):
        yield Risk("estimation.unreadable_body", f"estimation.unreadable_body {old.unreadable_body} → "
                   "refuse: a body extproc cannot read (a Content-Encoding it does not decode, stacked "
                   "encodings) is refused (415 unsupported_encoding)")
    if new.max_output_tokens > old.max_output_tokens:
        yield Risk("estimation.max_output_tokens", f"estimation.max_output_tokens {old.max_output_tokens} → "
                   f"{new.max_output_tokens} (bodies it cannot read, and larger max_tokens): {_LONGER}")


def _retry_after(a: Policy, b: Policy, renames: Renames) -> Iterator[Risk]:
    old, new = a.retry_after.share, b.retry_after.share
    if new > old:
        yield Risk("retry_after.share", f"retry_after.share {old:g} → {new:g}: more of each lane's slots are "
                   "kept for returning retries; fresh requests wait behind them")
    elif old and not new:
        yield Risk("retry_after.share", f"retry_after.share {old:g} → 0: a returning retry no longer keeps "
                   "its first attempt's place")


# -- signals ----------------------------------------------------------------------------------------


def _reads(policy: Policy, signal: Signal) -> tuple[object, ...]:
    """What a signal's number is: its source's address and its own selection."""
    source = policy.signals.sources.get(signal.source)
    where = source.prometheus or source.scrape if source is not None else None
    address = getattr(where, "url", None) or getattr(where, "targets", None)
    chosen = signal.model_dump(exclude={"stale_after", "on_stale", "kind"})
    return address, tuple(sorted((k, str(v)) for k, v in chosen.items()))


def _timeout(policy: Policy, signal: Signal) -> float:
    source = policy.signals.sources.get(signal.source)
    return source.timeout if source is not None else math.inf


def _users(policy: Policy, signal: str) -> list[str]:
    """What acts on a signal: saturation rules that shed or shrink, the enforced auto limit."""
    users = [f"saturation rule {r.name}" for r in policy.signals.saturation
             if r.signal == signal and (r.shed or r.shrink)]
    auto = policy.capacity.auto
    if auto is not None and policy.auto_capacity:
        users += [f"capacity.auto.signals.{role}" for role, name in auto.signals.model_dump().items()
                  if name == signal]
    return users


def _signals(a: Policy, b: Policy, renames: Renames) -> Iterator[Risk]:
    old, new = a.signals.read, b.signals.read
    for name, now in new.items():
        was = old.get(name)
        if was is None:
            continue
        at = f"signals.read.{name}"
        users = _users(b, name)
        if users and _reads(a, was) != _reads(b, now):
            yield Risk(at, f"signal {name} reads another number, and {' and '.join(users)} "
                       f"{'acts' if len(users) == 1 else 'act'} on it")
        if _STALE_ORDER[now.on_stale] > _STALE_ORDER[was.on_stale]:
            what = ("act as active (fail closed)" if now.on_stale == "saturated"
                    else "keep their state (an active rule stays active)")
            yield Risk(f"{at}.on_stale", f"{at}.on_stale {was.on_stale} → {now.on_stale}: while {name} is "
                       f"stale the rules on it {what}")
        if now.on_stale != "ignore" and now.stale_after < was.stale_after:
            yield Risk(f"{at}.stale_after", f"{at}.stale_after {_d(was.stale_after)} → "
                       f"{_d(now.stale_after)}: {name} goes stale sooner (on_stale {now.on_stale})")
        if now.on_stale != "ignore" and _timeout(b, now) < _timeout(a, was):
            yield Risk(f"signals.sources.{now.source}", f"signals.sources.{now.source} timeout "
                       f"{_d(_timeout(a, was))} → {_d(_timeout(b, now))}: more reads fail, and "
                       f"{name} goes stale sooner (on_stale {now.on_stale})")
    yield from _saturation(a, b, renames)


def _saturation(a: Policy, b: Policy, renames: Renames) -> Iterator[Risk]:
    def renamed(rule: SaturationRule) -> SaturationRule:
        return rule.model_copy(update={"shed": tuple(renames.get(lane, lane) for lane in rule.shed),
                                       "shrink": {renames.get(k, k): f for k, f in rule.shrink.items()}})

    before = {rule.name: renamed(rule) for rule in a.signals.saturation}
    for rule in b.signals.saturation:
        at = f"signals.saturation.{rule.name}"
        acts = [*(f"sheds {lane}" for lane in rule.shed),
                *(f"shrinks {lane} to ×{f:g}" for lane, f in rule.shrink.items())]
        old = before.get(rule.name)
        if old is None:
            if acts:
                yield Risk(at, f"saturation rule {rule.name} added: while {rule.signal} is above "
                           f"{rule.above:g} it {', '.join(acts)}")
            continue
        if not acts:
            continue
        if rule.signal != old.signal:
            yield Risk(f"{at}.signal", f"saturation rule {rule.name} judges {rule.signal} (was {old.signal})")
        for key, was, now, why in (("above", old.above, rule.above, "it fires sooner"),
                                   ("below", old.release, rule.release, "it releases later")):
            if now < was:
                yield Risk(f"{at}.{key}", f"saturation rule {rule.name}: {key} {was:g} → {now:g}: {why}")
        if rule.min_active > old.min_active:
            yield Risk(f"{at}.min_active", f"saturation rule {rule.name}: min_active "
                       f"{_d(old.min_active)} → {_d(rule.min_active)}: it stays active longer")
        for lane in rule.shed:
            if lane not in old.shed:
                yield Risk(f"{at}.shed", f"saturation rule {rule.name} now sheds {lane} while active")
        for lane, factor in rule.shrink.items():
            if factor < old.shrink.get(lane, 1.0):
                yield Risk(f"{at}.shrink", f"saturation rule {rule.name} now shrinks {lane} to ×{factor:g} "
                           f"while active (was ×{old.shrink.get(lane, 1.0):g})")


# -- the edge and retries ---------------------------------------------------------------------------


def _ratelimit(a: Policy, b: Policy, renames: Renames) -> Iterator[Risk]:
    old, new = a.ratelimit, b.ratelimit
    if new.mode == "enforce" and old.mode != "enforce":
        yield Risk("ratelimit.mode", f"ratelimit.mode {old.mode} → enforce: the edge starts refusing (429 at "
                   "Envoy's ratelimit filter, before ext_proc)")
    for key in ("domain", "request_descriptor", "usage_descriptor"):
        if getattr(old, key) != getattr(new, key):
            yield Risk(f"ratelimit.{key}", f"ratelimit.{key} {getattr(old, key)} → {getattr(new, key)}: it "
                       "must match Envoy's ratelimit filter; change Envoy's config with it")
    if new.mode != "enforce":
        return
    if new.queue_share < old.queue_share:
        yield Risk("ratelimit.queue_share", f"ratelimit.queue_share {old.queue_share:g} → "
                   f"{new.queue_share:g}: lanes are shed at the edge while their queues are less full")
    if new.shed_saturated and not old.shed_saturated:
        yield Risk("ratelimit.shed_saturated", "ratelimit.shed_saturated false → true: lanes that saturation "
                   "sheds are refused at the edge too")
    if old.ask_usage and not new.ask_usage and new.budgets.tokens:
        yield Risk("ratelimit.ask_usage", "ratelimit.ask_usage true → false: streams that did not ask for "
                   "their usage are charged an estimate of their tokens instead")
    yield from _budgets(a, b)


def _stricter(old: TenantLimit, new: TenantLimit) -> bool:
    """A lower rate or a smaller bucket, for requests or tokens (unset: no limit)."""
    for kind in ("requests", "tokens"):
        was, now = getattr(old, kind), getattr(new, kind)
        if now is None:
            continue
        if was is None or now / new.unit_seconds < was / old.unit_seconds:
            return True
        if now * new.burst < was * old.burst:
            return True
    return False


def _budgets(a: Policy, b: Policy) -> Iterator[Risk]:
    old, new = a.ratelimit.budgets, b.ratelimit.budgets
    refused = "more of its requests are refused at the edge (429)"
    if _stricter(old.default, new.default):
        yield Risk("ratelimit.budgets.default", f"ratelimit.budgets.default {old.default.in_words} → "
                   f"{new.default.in_words}: tenants without a budget of their own: {refused}")
    for name in [*old.tenants, *(t for t in new.tenants if t not in old.tenants)]:
        was, now = old.of(name), new.of(name)
        if _stricter(was, now):
            had = "" if name in old.tenants else " (the default)"
            yield Risk(f"ratelimit.budgets.tenants.{name}", f"tenant {name}'s budget {was.in_words}{had} → "
                       f"{now.in_words}: {refused}")


def _retry_budget(a: Policy, b: Policy, renames: Renames) -> Iterator[Risk]:
    old, new = a.retry_budget, b.retry_budget
    if not new.enabled:
        return
    at = "retry_budget"
    if not old.enabled:
        yield Risk(f"{at}.enabled", f"{at}.enabled false → true: retries beyond {new.ratio:g} of admitted "
                   f"requests (plus {new.min_per_second:g}/s) are refused (retry_budget)")
        return
    if new.header != old.header:
        yield Risk(f"{at}.header", f"{at}.header {old.header} → {new.header}: other requests count as "
                   "retries")
    for key in ("ratio", "min_per_second"):
        if getattr(new, key) < getattr(old, key):
            yield Risk(f"{at}.{key}", f"{at}.{key} {getattr(old, key):g} → {getattr(new, key):g}: fewer "
                       "retries are admitted; the rest are refused (retry_budget)")


def _shadow(a: Policy, b: Policy, renames: Renames) -> Iterator[Risk]:
    if a.shadow != b.shadow:
        yield Risk("shadow", "policy.shadow turns off: every lane not in shadow itself starts enforcing "
                   "(queueing and rejecting)" if a.shadow else
                   "policy.shadow turns on: nothing is enforced any more; overload reaches the backend")


_CHECKS: tuple[Callable[[Policy, Policy, Renames], Iterator[Risk]], ...] = (
    _shadow, _lanes, _classification, _tenants, _estimation, _capacity, _retry_after, _signals, _ratelimit,
    _retry_budget)


def risks(a: Policy, b: Policy, renames: Renames) -> list[Risk]:
    """Every change from ``a`` to ``b`` that can refuse or reorder more traffic, in the policy's order."""
    return [risk for check in _CHECKS for risk in check(a, b, renames)]

"""What a policy does with one sample request: ``extproc policy explain``.

How this works: the sample request goes through the steps the live service
takes, with the live service's own parts. Untrusted ``x-extproc-*`` headers are
stripped; the body is read with ``read_body`` under the same conditions as in
``servers/extproc.py`` (only when the policy needs it, cut at
``max_body_bytes``); the model comes from the policy's model header first, then
from the body; ``Classifier`` picks the lane and tenant and ``Estimator`` sizes
the job. The words around those verdicts (why a rule did not match) are written
here, but every verdict comes from the core: each rule's "match / no match" is
the classifier's own answer on a policy holding that rule alone.

Decisions at states come from the decision machine itself (``tools/scenario.py``): a
fresh machine is brought to the state through the events that reach it live, then the
sample is offered as the live path meets it, the edge first (``sim/driver.py``); a queued
sample is played forward on predicted service times with no new arrivals, to say when it
would start or whether its deadline would pass first.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.core.body import BodyFacts
from extproc.core.classify import Classifier, RequestFacts, normalize_path
from extproc.core.decision import Outcome, Reason
from extproc.core.estimate import Estimator, Job
from extproc.core.machine import Machine
from extproc.policy.loader import PolicyError, load_policy
from extproc.policy.schema import Estimation, Lane, Match, Policy
from extproc.settings import positive_int
from extproc.sim.driver import Offer
from extproc.tools.scenario import (
    SPENDABLE,
    LaneLoad,
    ScenarioResult,
    Spent,
    StateError,
    by_priority,
    default_scenarios,
    load_state_file,
    parse_spent,
    parse_state,
    run_scenario,
)

#: Headers every HTTP request carries: not worth an "ignored" line each.
_TRANSPORT = frozenset({
    "accept", "accept-encoding", "authorization", "connection", "content-length", "content-type", "host",
    "te", "transfer-encoding", "user-agent", "x-forwarded-for", "x-forwarded-proto", "x-request-id",
})


class ExplainError(ValueError):
    """The sample request or a queue state cannot be understood; the message says why."""


# -- the sample request -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SampleRequest:
    method: str
    path: str
    headers: dict[str, str]
    """Lower-cased names; a repeated header's values joined with ``,`` as HTTP allows."""
    body: bytes | None = None


def _read_arg(value: str, what: str) -> bytes:
    """``@file`` → the file's bytes; anything else → the text itself."""
    if not value.startswith("@"):
        return value.encode()
    try:
        return Path(value[1:]).read_bytes()
    except OSError as exc:
        raise ExplainError(f"{what}: cannot read {value[1:]}: {exc.strerror}") from None


def _header_value(name: str, value: object) -> str:
    if isinstance(value, list) and all(isinstance(v, str | int | float) for v in value):
        return ",".join(str(v) for v in value)
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        return str(value)
    raise ExplainError(f"--request: headers.{name}: expected a string or a list of strings")


def parse_request_document(raw: bytes, what: str = "--request") -> SampleRequest:
    """A request written as ``{"method", "path", "headers", "body"}`` JSON.

    ``body`` is a JSON value sent as its JSON text, or a string sent as it is (so a
    body that is not JSON can be tried too).
    """
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ExplainError(f"{what}: not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ExplainError(f"{what}: expected a JSON object with method, path, headers and body")
    unknown = sorted(set(doc) - {"method", "path", "headers", "body"})
    if unknown:
        raise ExplainError(f"{what}: unknown key(s) {unknown}; expected method, path, headers, body")
    method = doc.get("method", "POST")
    path = doc.get("path", "")
    if not isinstance(method, str) or not isinstance(path, str):
        raise ExplainError(f"{what}: method and path must be strings")
    headers = doc.get("headers", {})
    if not isinstance(headers, dict):
        raise ExplainError(f"{what}: headers must be an object of name → value")
    body = doc.get("body")
    raw_body: bytes | None
    if body is None:
        raw_body = None
    elif isinstance(body, str):
        raw_body = body.encode()
    else:
        raw_body = json.dumps(body).encode()
    return SampleRequest(
        method=method.upper(),
        path=path,
        headers={str(k).lower(): _header_value(str(k), v) for k, v in headers.items()},
        body=raw_body,
    )


def sample_request(document: str | None = None, *, method: str | None = None, path: str | None = None,
                   headers: Iterable[str] = (), body: str | None = None) -> SampleRequest:
    """The request from ``--request JSON|@file`` and the flags that add to or replace its parts."""
    base = (parse_request_document(_read_arg(document, "--request")) if document is not None
            else SampleRequest("POST", "", {}))
    given: dict[str, str] = {}
    for line in headers:
        name, sep, value = line.partition(":")
        name = name.strip().lower()
        if not sep or not name:
            raise ExplainError(f"-H {line!r}: expected 'name: value'")
        value = value.strip()
        given[name] = f"{given[name]},{value}" if name in given else value
    request = SampleRequest(
        method=(method or base.method).upper(),
        path=path if path is not None else base.path,
        headers={**base.headers, **given},
        body=_read_arg(body, "--body") if body is not None else base.body,
    )
    if not request.path.startswith("/"):
        raise ExplainError("give the request's path (--path /v1/chat/completions, or in --request)"
                           if not request.path else f"path {request.path!r} must start with /")
    return request


# -- what the live service would know of it ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IntakeView:
    """The request as the live service sees it when it decides, with the words for each step."""

    facts: RequestFacts
    stripped: tuple[str, ...]
    """Client-sent x-extproc-* headers the policy does not trust: removed before anything reads them."""
    has_body: bool
    body: BodyFacts
    body_read: bool
    body_why: str
    model_from: str
    retry: bool
    """The retry header says the request is a retry (it spends the retry budget)."""


def _why_body(policy: Policy) -> str:
    """In words, why this policy reads request bodies or not (``Policy.body_uses``, from which
    ``Policy.needs_body`` is decided)."""
    mode = policy.estimation.read_body
    if mode != "auto":
        return f"estimation.read_body is {mode}"
    uses = policy.body_uses
    if uses:
        return "read_body auto: " + "; ".join(uses)
    return ("read_body auto and nothing uses it (sjf_weight 0, no per-model costs, no rule on models, "
            "no token budgets)")


def intake(policy: Policy, request: SampleRequest) -> IntakeView:
    """What extproc knows of ``request`` when it decides: the live service's own intake."""
    arrival = Machine(policy).intake.request(request.method, request.path, request.headers, request.body)
    why = _why_body(policy)
    if request.body and not arrival.body_read:
        why = f"not read: {why}"
    model_header = policy.estimation.model_header
    model_from = {"header": f"header {model_header}", "body": "the body"}.get(arrival.model_from, "")
    return IntakeView(arrival.facts, arrival.head.stripped, bool(request.body), arrival.body,
                      arrival.body_read, why, model_from, arrival.retry)


# -- classification ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RuleCheck:
    index: int
    name: str
    lane: str
    conditions: str
    matched: bool
    why: tuple[str, ...] = ()
    """The conditions that do not hold (empty when the rule matched)."""


@dataclass(frozen=True, slots=True)
class ClassificationView:
    lane: str
    rule: str
    """The classifier's name for what decided: a rule's name, ``rules[i]``, ``lane_header`` or ``default``."""
    rule_index: int | None
    lane_header: str | None
    """What the lane header did, in words (None when the policy has none)."""
    checks: tuple[RuleCheck, ...]
    """The rules tried, in order, up to the one that matched."""
    tenant: str
    tenant_from: str
    tenant_weight: float
    weight_from: str
    ignored: tuple[str, ...]


def _rule_name(index: int, name: str | None) -> str:
    return name or f"rules[{index}]"


def _one_of(values: Iterable[str]) -> str:
    return " or ".join(values)


def describe_match(match: Match) -> str:
    """A rule's conditions in words, e.g. ``path /v1/chat/completions, method POST``."""
    parts = []
    if match.path is not None:
        parts.append(f"path {match.path}")
    if match.path_prefix is not None:
        parts.append(f"path under {match.path_prefix}")
    if match.path_regex is not None:
        parts.append(f"path ~ {match.path_regex}")
    if match.methods:
        parts.append(f"method {_one_of(match.methods)}")
    for name, values in match.headers.items():
        parts.append(f"{name}: {_one_of(values)}")
    if match.models:
        parts.append(f"model {_one_of(match.models)}")
    if match.tenants:
        parts.append(f"tenant {_one_of(match.tenants)}")
    return ", ".join(parts) or "every request"


def _unmet(match: Match, facts: RequestFacts, tenant: str) -> list[str]:
    """The conditions of ``match`` that ``facts`` do not meet, in words."""
    path = normalize_path(facts.path)
    out = []
    if match.path is not None and path != match.path:
        out.append(f"path {path} is not {match.path}")
    if match.path_prefix is not None and not path.startswith(match.path_prefix):
        out.append(f"path {path} is not under {match.path_prefix}")
    if match.path_regex is not None and re.fullmatch(match.path_regex, path) is None:
        out.append(f"path {path} does not match {match.path_regex}")
    if match.methods and facts.method.upper() not in match.methods:
        out.append(f"method {facts.method} is not {_one_of(match.methods)}")
    for name, values in match.headers.items():
        value = facts.headers.get(name)
        if value is None:
            out.append(f"{name} not sent (wants {_one_of(values)})")
        elif value not in values:
            out.append(f"{name}: {value} is not {_one_of(values)}")
    if match.models and facts.model not in match.models:
        out.append(f"model {facts.model} is not {_one_of(match.models)}" if facts.model is not None
                   else f"no model known (wants {_one_of(match.models)})")
    if match.tenants and tenant not in match.tenants:
        out.append(f"tenant {tenant} is not {_one_of(match.tenants)}")
    return out


def classify(policy: Policy, facts: RequestFacts, stripped: Iterable[str] = ()) -> ClassificationView:
    """Which rule, lane and tenant, with the words for each step."""
    classifier = Classifier(policy)
    result = classifier.classify(facts)
    config = policy.classification
    tenant = result.tenant
    lane_header: str | None = None
    if config.lane_header:
        value = facts.headers.get(config.lane_header)
        if result.rule == "lane_header":
            lane_header = f"{config.lane_header}: {value} names lane {result.lane}; the rules are not tried"
        elif value is None:
            lane_header = f"{config.lane_header} not sent, so the rules decide"
        else:
            lane_header = (f"{config.lane_header}: {value!r} names no lane (lanes: "
                           f"{', '.join(lane.name for lane in policy.lanes)}), so the rules decide")
    checks: list[RuleCheck] = []
    index: int | None = None
    if result.rule != "lane_header":
        for i, rule in enumerate(config.rules):
            # The verdict is the classifier's own, on a policy that holds this rule alone.
            alone = policy.model_copy(update={"classification": config.model_copy(
                update={"rules": (rule,), "lane_header": None})})
            matched = Classifier(alone).classify(facts).rule != "default"
            why = () if matched else tuple(_unmet(rule.match, facts, tenant) or ["does not match"])
            checks.append(RuleCheck(i, _rule_name(i, rule.name), rule.lane, describe_match(rule.match),
                                    matched, why))
            if matched:
                index = i
                break
    tenants = policy.tenants
    if tenants.header is None:
        tenant_from = "tenants.default (the policy names no tenants.header)"
    elif facts.headers.get(tenants.header, "").strip():
        sent = facts.headers[tenants.header].strip()
        tenant_from = f"header {tenants.header}"
        if len(sent) > tenants.max_tenant_length:
            tenant_from += f", cut to tenants.max_tenant_length ({tenants.max_tenant_length})"
    else:
        tenant_from = f"tenants.default ({tenants.header} not sent)"
    weight = tenants.weights.get(tenant)
    weight_from = "tenants.weights" if weight is not None else "tenants.default_weight"
    ignored = [f"{name} is not in trusted_headers: stripped before classification, so it cannot pick a lane"
               for name in stripped]
    for name in facts.headers:
        if name.startswith(":") or name in _TRANSPORT or classifier.trusted(name):
            continue
        if name == policy.estimation.model_header:
            continue  # read for the model, trusted or not; said under the estimate
        if name == policy.retry_budget.header:
            continue  # read for whether the request is a retry, trusted or not; said under "retry"
        ignored.append(f"{name} is not in trusted_headers, so it cannot pick a lane or tenant")
    return ClassificationView(
        lane=result.lane, rule=result.rule, rule_index=index, lane_header=lane_header, checks=tuple(checks),
        tenant=tenant, tenant_from=tenant_from,
        tenant_weight=weight if weight is not None else tenants.default_weight,
        weight_from=weight_from, ignored=tuple(ignored),
    )


# -- the estimate -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EstimateView:
    job: Job
    costs_from: str
    prompt_from: str
    output_from: str
    occupancy: float
    slowdown: float
    overhead_ms: float
    prefill_ms_per_token: float
    decode_ms_per_token: float
    predicted_s: float


def estimate(policy: Policy, seen: IntakeView, occupancy: float = 0.0) -> EstimateView:
    """The job and its predicted service time at ``occupancy``, from a fresh estimator (priors only)."""
    config = policy.estimation
    estimator = Estimator(config)
    body = seen.body
    job = estimator.job(seen.facts.model, body.prompt_chars, body.prompt_tokens, body.max_tokens,
                        unreadable=body.unreadable)
    model = estimator.sized_as(job, occupancy)
    cost = config.models.get(model or "", config.default)
    if job.unread and job.model is None:
        costs_from = (f"estimation.models.{model}" if model is not None else "estimation.default") \
            + ", the costliest (the body cannot be read: no model known)"
    elif model is not None and model in config.models:
        costs_from = f"estimation.models.{model}"
    else:
        costs_from = "estimation.default" + (f" ({model} has no entry in estimation.models)"
                                             if model is not None else " (no model known)")
    if body.prompt_tokens is not None:
        prompt_from = "token ids in the body"
    elif body.unreadable:
        prompt_from = (f"the body's size as sent: {body.prompt_chars} chars / {config.chars_per_token:g} "
                       f"chars per token")
    elif seen.body_read:
        prompt_from = f"{body.prompt_chars} chars / {config.chars_per_token:g} chars per token"
    else:
        prompt_from = "body not read" if seen.has_body else "no body"
    return EstimateView(
        job=job, costs_from=costs_from, prompt_from=prompt_from, output_from=_output_from(config, body),
        occupancy=occupancy, slowdown=estimator.slowdown(occupancy), overhead_ms=cost.overhead_ms,
        prefill_ms_per_token=cost.prefill_ms_per_token,
        decode_ms_per_token=estimator.decode_ms_per_token(model),
        predicted_s=estimator.predict(job, occupancy),
    )


def _output_from(config: Estimation, body: BodyFacts) -> str:
    """Where the output size comes from, in words (``Estimator.job`` decides it)."""
    if body.unreadable:
        return ("estimation.max_output_tokens: the body cannot be read, so it is sized as the largest "
                "job (estimation.unreadable_body: estimate)")
    if body.max_tokens is None:
        return "estimation.default_max_tokens"
    if body.max_tokens > config.max_output_tokens:
        return f"the body's {body.max_tokens} max_tokens, cut to estimation.max_output_tokens"
    return "max_tokens from the body"


# -- the whole explanation --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Explanation:
    source: str
    policy: Policy
    request: SampleRequest
    intake: IntakeView
    classification: ClassificationView
    lane: Lane
    estimate: EstimateView
    scenarios: tuple[ScenarioResult, ...]
    fill_tokens: int | None = None
    retry: str | None = None
    """What the retry header says, and what the retry budget does with a retry (None: not a retry)."""
    budgets: str | None = None
    """The tenant's budgets at the edge (None: none apply)."""
    shadow: str | None = None
    """Why the lane only observes (shadow mode), when it does: the scenarios show what enforcing would do."""
    capacity: str | None = None
    """With a self-sizing limit (capacity.auto): how it works and the limit the scenarios use."""


def _auto_text(policy: Policy, limit: int) -> str | None:
    auto = policy.capacity.auto
    if auto is None:
        return None
    roles = ", ".join(f"{role} ({name})" for role, name in auto.signals.model_dump().items() if name)
    goals = [f"{role} ≤ {duration(value)}" for role, value in
             (("ttft_p95", auto.target.ttft_p95), ("tpot_p95", auto.target.tpot_p95)) if value is not None]
    goals.append(f"engine queue ≤ {auto.target.queue}")
    mode = ("shadow: computed and shown, capacity.max_inflight enforced" if auto.shadow
            else f"decided below at {limit} (the live limit: GET /admin/state, extproc top)")
    return (f"auto in [{auto.min}, {auto.max}], from {roles}; falls when {' or '.join(goals)} is broken, "
            f"grows while there is headroom; {mode}")


def _retry_text(policy: Policy, request: SampleRequest, seen: IntakeView) -> str | None:
    header = policy.retry_budget.header
    if not seen.retry:
        return None
    budget = policy.retry_budget
    if not budget.enabled:
        return (f"{header}: {request.headers.get(header)}: a retry (it may claim a booked return); the "
                "policy has no retry budget")
    return (f"{header}: {request.headers.get(header)}: a retry: it spends the retry budget (retries at most "
            f"{budget.ratio:g} of admitted originals plus {budget.min_per_second:g}/s, over "
            f"{duration(budget.window)}), refused with retry_budget once it is spent")


def _budgets_text(policy: Policy, tenant: str) -> str | None:
    config = policy.ratelimit
    limits = config.budgets.of(tenant)
    if limits.requests is None and limits.tokens is None:
        return None
    source = f"ratelimit.budgets.tenants.{tenant}" if tenant in config.budgets.tenants \
        else "ratelimit.budgets.default"
    parts = [f"{n} {kind}" for kind, n in (("requests", limits.requests), ("tokens", limits.tokens))
             if n is not None]
    text = f"tenant {tenant}: {' and '.join(parts)} per {limits.per} ({source})"
    if config.mode == "off":
        return text + "; ratelimit.mode is off: not enforced"
    return text + ("; shadow mode: counted, never refused" if config.mode == "shadow"
                   else "; refused at the edge once spent")


def explain(policy: Policy, request: SampleRequest, *, source: str = "", occupancy: float = 0.0,
            state: Mapping[str, LaneLoad] | None = None, spent: Spent | None = None,
            fill_tokens: int | None = None, seed: int = 0, capacity_limit: int | None = None) -> Explanation:
    """Everything ``extproc policy explain`` says, as values.

    With ``capacity.max_inflight: auto`` the scenarios run at ``capacity_limit`` (default: where
    the limit starts), the fleet limit set on the machine as a shared store sets it live.
    """
    auto = policy.capacity.auto
    machine = Machine(policy)
    if auto is not None and policy.auto_capacity and capacity_limit is not None:
        machine.set_limit(capacity_limit, 0.0)
    limit = machine.policy.total_capacity
    capacity = _auto_text(policy, limit)
    sized = machine.policy
    seen = intake(sized, request)
    view = classify(sized, seen.facts, seen.stripped)
    estimated = estimate(sized, seen, occupancy)
    job = estimated.job
    fill_job = Job(job.model, job.prompt_tokens, fill_tokens) if fill_tokens is not None else job
    if state or (spent is not None and spent.any):
        scenarios = [("given state", dict(state or {}), spent or Spent())]
    else:
        scenarios = default_scenarios(sized, view.lane, view.tenant, seen.retry)
    lane = sized.lane(view.lane)
    shadow: str | None = None
    if policy.shadow or lane.shadow:
        shadow = "policy.shadow is true" if policy.shadow else f"lane {lane.name} has shadow: true"
    # In shadow mode every request is admitted, so no queue state could even be reached: show
    # what the policy would do once it enforces, which is what shadow mode is there to tell.
    enforcing = _enforcing(policy) if shadow else policy
    offer = Offer(request.method, request.path, request.headers, body=request.body)
    limit_given = limit if auto is not None and policy.auto_capacity else None
    results = tuple(run_scenario(enforcing, name, loads, offer, view.tenant, fill_job, spent=spent_now,
                                 seed=seed, capacity_limit=limit_given)
                    for name, loads, spent_now in scenarios)
    return Explanation(source, sized, request, seen, view, lane, estimated, results, fill_tokens=fill_tokens,
                       retry=_retry_text(policy, request, seen), budgets=_budgets_text(policy, view.tenant),
                       shadow=shadow, capacity=capacity)


def _enforcing(policy: Policy) -> Policy:
    lanes = tuple(lane.model_copy(update={"shadow": False}) for lane in policy.lanes)
    return policy.model_copy(update={"shadow": False, "lanes": lanes})


def _seconds(value: float) -> str:
    if value < 1:
        return f"{value * 1000:.0f} ms"
    return f"{value:.2f} s" if value < 10 else f"{value:.1f} s"


def duration(value: float) -> str:
    """A policy duration the way policy files write it: ``250ms``, ``10s``, ``1.5s``."""
    return f"{value * 1000:g}ms" if value < 1 else f"{value:g}s"


def lane_summary(lane: Lane) -> str:
    parts = [f"priority {lane.priority}", f"{lane.max_inflight} in flight", f"{lane.max_queued} queued",
             f"deadline {duration(lane.deadline)}"]
    if lane.borrow:
        parts.append("may borrow" + (f" up to {lane.max_borrow}" if lane.max_borrow is not None else ""))
    if lane.evictable:
        parts.append("evictable")
    if lane.closed:
        parts.append("CLOSED")
    return ", ".join(parts)


def _state_text(policy: Policy, loads: Mapping[str, LaneLoad]) -> str:
    if not loads:
        return "nothing in flight or queued"
    parts = []
    for lane in by_priority(policy):
        load = loads.get(lane.name)
        if load is None:
            continue
        text = f"{lane.name} {load.inflight}/{lane.max_inflight}"
        if load.queued:
            text += f" +{load.queued} queued"
        parts.append(text)
    return ", ".join(parts)


def _verdict(result: ScenarioResult, lane: Lane) -> str:
    if result.outcome is Outcome.ADMITTED:
        text = "ADMITTED at once"
        if result.borrowed:
            text += " on a slot borrowed from an idle lane"
    elif result.outcome is Outcome.REJECTED:
        reason = result.reason or Reason.QUEUE_FULL
        where = " at the edge" if result.at == "edge" else ""
        status = result.status or reason.http_status
        text = f"REJECTED{where} {status} {reason}"
        if result.detail is not None:
            text += f" before it is classified: {result.detail}"
        if result.retry_after is not None:
            text += f", Retry-After {result.retry_after} s"
        if result.retry_after_ms is not None:
            text += f" (a return booked in {result.retry_after_ms} ms: retry-after-ms)"
        elif reason.retry_helps and not result.retry_allowed:
            text += " (x-should-retry: false: no return can be promised)"
    else:
        text = "QUEUED"
        if result.then is Outcome.ADMITTED and result.then_after_s is not None:
            text += (f", starts after ~{_seconds(result.then_after_s)} "
                     f"(deadline {duration(lane.deadline)})")
        elif result.then is Outcome.REJECTED and result.then_after_s is not None:
            text += (f", then REJECTED {result.then_reason} after {_seconds(result.then_after_s)}: "
                     "no slot comes its way before its deadline")
    if result.predicted_s is not None:
        text += f"; predicted service {_seconds(result.predicted_s)}"
    if result.edge_shadow is not None:
        text += f" (the edge, in shadow mode, would have shed it: {result.edge_shadow})"
    return text


def _body_lines(expl: Explanation) -> list[str]:
    """What was read of the body, and why it was read or not."""
    r, seen = expl.request, expl.intake
    if r.body is None or not r.body:
        return ["body      none"]
    if not seen.body_read:
        return [f"body      {len(r.body)} bytes, {seen.body_why}"]
    b = seen.body
    why = f"          why read: {seen.body_why}"
    if b.unreadable:
        choice = expl.policy.estimation.unreadable_body
        then = ("so it is sized as the largest job" if choice == "estimate"
                else "so it is refused (415 unsupported_encoding)")
        return [f"body      {len(r.body)} bytes, cannot be read ({b.note}): "
                f"estimation.unreadable_body is {choice}, {then}", why]
    got = [f"model {b.model}" if b.model is not None else "no model",
           f"max_tokens {b.max_tokens}" if b.max_tokens is not None else "no max_tokens",
           f"{b.prompt_tokens} prompt token ids" if b.prompt_tokens is not None
           else f"{b.prompt_chars} prompt chars"]
    note = f" ({b.note})" if b.note else ""
    lines = [f"body      {len(r.body)} bytes, read{note}: {', '.join(got)}"]
    if b.invalid:
        lines.append(f"          the model servers refuse it ({b.invalid}), and so does extproc: "
                     "400 bad_request")
    return [*lines, why]


def render(expl: Explanation) -> str:
    """Plain text, in the order a request meets the policy."""
    r, seen, view, est = expl.request, expl.intake, expl.classification, expl.estimate
    lines = [f"policy    {expl.source}" if expl.source else "policy    (given)",
             f"request   {r.method} {r.path}"]
    lines += [f"          {k}: {v}" for k, v in r.headers.items()]
    lines += _body_lines(expl)

    lines += ["", f"classification → lane {view.lane}, tenant {view.tenant}"]
    if view.lane_header:
        lines.append(f"  {view.lane_header}")
    for check in view.checks:
        head = f"  rule {check.index} {check.name} (→ {check.lane}; {check.conditions}):"
        lines.append(f"{head} MATCH" if check.matched else f"{head} no: {'; '.join(check.why)}")
        if check.matched and check.index < len(expl.policy.classification.rules) - 1:
            lines.append(f"  rules after {check.name} are not tried: the first match wins")
    if view.rule == "default":
        none = "no rule matches" if view.checks else "the policy has no rules"
        lines.append(f"  {none}, so classification.default_lane {view.lane} takes it")
    lines.append(f"  lane      {view.lane}: {lane_summary(expl.lane)}")
    lines.append(f"  tenant    {view.tenant} from {view.tenant_from}; weight {view.tenant_weight:g} "
                 f"({view.weight_from})")
    lines += [f"  ignored   {text}" for text in view.ignored]
    if expl.retry:
        lines.append(f"  retry     {expl.retry}")
    if expl.budgets:
        lines.append(f"  budgets   {expl.budgets}")

    job = est.job
    lines += ["", f"estimate → {_seconds(est.predicted_s)} at occupancy {est.occupancy:.0%}",
              f"  model     {job.model or '(unknown)'}"
              + (f" from {seen.model_from}" if seen.model_from else "") + f"; costs from {est.costs_from}",
              f"  prompt    {job.prompt_tokens} tokens ({est.prompt_from})",
              f"  output    {job.output_tokens} tokens ({est.output_from})",
              f"  time      {est.overhead_ms:g} ms overhead + {job.prompt_tokens} × "
              f"{est.prefill_ms_per_token:g} ms prefill + {job.output_tokens} × "
              f"{est.decode_ms_per_token:g} ms decode × {est.slowdown:.2f} slowdown "
              f"= {est.predicted_s * 1000:.0f} ms",
              "            (priors: a running replica also learns decode cost from finished requests)"]

    if expl.capacity:
        lines += ["", f"capacity  {expl.capacity}"]
    fill = (f"requests of {expl.fill_tokens} output tokens" if expl.fill_tokens is not None
            else "requests like this one")
    lines += ["", f"decisions (the state is filled with {fill} from tenant {view.tenant}, all arriving now)"]
    if expl.shadow:
        lines += [f"  SHADOW MODE ({expl.shadow}): the live service admits every request of this lane",
                  "  at once, marking what enforcing would do (x-extproc-shadow); below: what enforcing does"]
    for result in expl.scenarios:
        state = _state_text(expl.policy, result.reached)
        if result.spent:
            state += "; " + ", ".join(result.spent)
        lines.append(f"  {result.name}: {state}")
        lines.append(f"    → {_verdict(result, expl.lane)}")
        lines += [f"      evicts {text}" for text in result.evicted]
        lines += [f"      note: {text}" for text in result.notes]
    return "\n".join(lines)


def as_json(expl: Explanation) -> dict[str, Any]:
    """The explanation as plain JSON data (``--json``)."""
    r, seen, view, est = expl.request, expl.intake, expl.classification, expl.estimate
    body = seen.body
    return {
        "policy": expl.source,
        "request": {"method": r.method, "path": r.path, "headers": r.headers,
                    "body_bytes": len(r.body) if r.body is not None else None},
        "stripped_headers": list(seen.stripped),
        "body": {"read": seen.body_read, "why": seen.body_why, "model": body.model,
                 "max_tokens": body.max_tokens, "prompt_chars": body.prompt_chars,
                 "prompt_tokens": body.prompt_tokens, "note": body.note, "unreadable": body.unreadable,
                 "invalid": body.invalid or None},
        "classification": {
            "lane": view.lane, "rule": view.rule, "rule_index": view.rule_index,
            "lane_header": view.lane_header,
            "rules_tried": [{"index": c.index, "name": c.name, "lane": c.lane, "conditions": c.conditions,
                             "matched": c.matched, "why_not": list(c.why)} for c in view.checks],
            "tenant": view.tenant, "tenant_from": view.tenant_from, "tenant_weight": view.tenant_weight,
            "weight_from": view.weight_from, "ignored_headers": list(view.ignored),
        },
        "lane": expl.lane.model_dump(mode="json"),
        "estimate": {
            "model": est.job.model, "model_from": seen.model_from or None, "costs_from": est.costs_from,
            "prompt_tokens": est.job.prompt_tokens, "prompt_from": est.prompt_from,
            "output_tokens": est.job.output_tokens, "output_from": est.output_from,
            "occupancy": est.occupancy, "slowdown": est.slowdown, "overhead_ms": est.overhead_ms,
            "prefill_ms_per_token": est.prefill_ms_per_token, "decode_ms_per_token": est.decode_ms_per_token,
            "predicted_s": est.predicted_s,
        },
        "fill_tokens": expl.fill_tokens,
        "retry": expl.retry,
        "budgets": expl.budgets,
        "shadow": expl.shadow,
        "capacity": expl.capacity,
        "scenarios": [{
            "name": s.name,
            "asked": {k: {"inflight": v.inflight, "queued": v.queued} for k, v in s.asked.items()},
            "reached": {k: {"inflight": v.inflight, "queued": v.queued} for k, v in s.reached.items()},
            "notes": list(s.notes), "outcome": s.outcome.value,
            "reason": s.reason.value if s.reason else None, "retry_after": s.retry_after,
            "retry_after_ms": s.retry_after_ms, "retry_allowed": s.retry_allowed,
            "predicted_s": s.predicted_s, "borrowed": s.borrowed, "evicted": list(s.evicted),
            "then": s.then.value if s.then else None,
            "then_reason": s.then_reason.value if s.then_reason else None, "then_after_s": s.then_after_s,
            "at": s.at, "status": s.status, "detail": s.detail, "spent": list(s.spent),
            "edge_shadow": s.edge_shadow.value if s.edge_shadow else None,
        } for s in expl.scenarios],
    }


# -- the command ------------------------------------------------------------------------------------


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="the policy file")
    parser.add_argument("--request", metavar="JSON|@FILE",
                        help='the request: {"method": ..., "path": ..., "headers": {...}, "body": ...}; '
                        "a string body is sent as it is, any other JSON body as its JSON text")
    parser.add_argument("--method", help="HTTP method (default: POST, or the one in --request)")
    parser.add_argument("--path", help="request path (replaces the one in --request)")
    parser.add_argument("-H", "--header", dest="headers", action="append", default=[],
                        metavar="'NAME: VALUE'", help="a request header (repeatable; replaces --request's)")
    parser.add_argument("--body", metavar="JSON|@FILE",
                        help="the request body, sent as it is (@FILE: any bytes, read from FILE)")
    parser.add_argument("--occupancy", type=_fraction, default=0.0, metavar="0..1",
                        help="share of capacity busy for the estimate, 0..1 (default 0)")
    parser.add_argument("--state", action="append", default=[], metavar="LANE=inflight:N,queued:M",
                        help="decide at this queue state instead of the default scenarios (repeatable)")
    parser.add_argument("--spent", action="append", default=[], metavar="|".join(SPENDABLE),
                        help="decide with this budget used up: the retry budget, or the request's tenant's "
                        "request or token budget (repeatable; with --state, on top of it)")
    parser.add_argument("--state-file", metavar="FILE",
                        help="the state as YAML: lanes: {LANE: {inflight: N, queued: M}}, spent: [...]")
    parser.add_argument("--fill-tokens", type=positive_int, default=None, metavar="N",
                        help="output tokens of the synthetic requests that fill a state "
                        "(default: as many as this request)")
    parser.add_argument("--seed", type=int, default=0, help="seed of Retry-After jitter")
    parser.add_argument("--capacity-limit", type=positive_int, default=None, metavar="N",
                        help="with capacity.max_inflight: auto, decide at this fleet limit (default: "
                        "where it starts; clamped into its bounds)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def command(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.file)
    except PolicyError as exc:
        print(f"{args.file}: {len(exc.problems)} problem(s)", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    try:
        request = sample_request(args.request, method=args.method, path=args.path, headers=args.headers,
                                 body=args.body)
        state = parse_state(args.state, policy)
        spent = parse_spent(args.spent)
        if args.state_file:
            if state or spent.any:
                raise ExplainError("give the state as --state-file or as --state/--spent, not both")
            state, spent = load_state_file(args.state_file, policy)
    except (ExplainError, StateError) as exc:
        print(f"extproc policy explain: {exc}", file=sys.stderr)
        return 2
    expl = explain(policy, request, source=args.file, occupancy=args.occupancy, state=state, spent=spent,
                   fill_tokens=args.fill_tokens, seed=args.seed, capacity_limit=args.capacity_limit)
    print(json.dumps(as_json(expl), indent=2) if args.json else render(expl))
    return 0

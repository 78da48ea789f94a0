"""Decisions at a described state: the machine run for one request (``policy explain``'s verdicts).

How this works: a fresh decision machine (``core/machine.py``) is brought to the state the user
describes through the events that reach such a state live — synthetic requests submitted until each
lane holds its in-flight and queued counts (they arrive now, from the sample's tenant); rejections
that reserved every retry the retry budget allows; the tenant's arrivals until its request budget is
empty; a usage report that puts its token budget in debt — and then the sample request is offered
through the shared virtual-clock driver (``sim/driver.py``) as the live path meets it: the edge
first (when the policy has one), then the one intake, then the machine. A queued sample is played
forward on predicted service times with no new arrivals, to say when it would start or whether its
deadline passes first. Nothing here decides: every verdict is the machine's.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from extproc.core.decision import Decision, Outcome, Reason, State, Ticket
from extproc.core.estimate import Job
from extproc.core.machine import Machine
from extproc.policy.schema import Lane, Policy
from extproc.sim.driver import Driver, Offer

_STATE_ITEM = re.compile(r"^\s*(inflight|queued)\s*:\s*(\d{1,7})\s*$")
#: What ``--spent`` may name.
SPENDABLE = ("retry-budget", "tenant-requests", "tenant-tokens")
#: A state is never filled with more requests than this (a backstop for huge limits).
_MAX_FILL = 100_000


class StateError(ValueError):
    """A described state cannot be understood; the message says why."""


@dataclass(frozen=True, slots=True)
class LaneLoad:
    inflight: int = 0
    queued: int = 0


@dataclass(frozen=True, slots=True)
class Spent:
    """Budgets used up in the described state."""

    retry_budget: bool = False
    """Every retry the retry budget allows is reserved: a retry is refused (retry_budget)."""
    tenant_requests: bool = False
    """The sample's tenant's request budget is empty."""
    tenant_tokens: bool = False
    """The sample's tenant's token budget is in debt."""

    @property
    def any(self) -> bool:
        return self.retry_budget or self.tenant_requests or self.tenant_tokens

    def words(self) -> list[str]:
        return [text for flag, text in ((self.retry_budget, "the retry budget spent"),
                                        (self.tenant_requests, "the tenant's request budget spent"),
                                        (self.tenant_tokens, "the tenant's token budget in debt")) if flag]


@dataclass(frozen=True, slots=True)
class ScenarioResult:
    name: str
    asked: dict[str, LaneLoad]
    reached: dict[str, LaneLoad]
    """The state the machine was in when the sample came (differs from ``asked`` when unreachable)."""
    notes: tuple[str, ...]
    outcome: Outcome
    reason: Reason | None
    retry_after: int | None
    predicted_s: float | None
    evicted: tuple[str, ...] = ()
    retry_after_ms: int | None = None
    """A rejection booked on its lane's return schedule: the exact wait it is told."""
    retry_allowed: bool = True
    """False: the answer says x-should-retry: false (no return can be promised)."""
    borrowed: bool = False
    """Admitted beyond its lane's max_inflight, on another lane's idle slot."""
    then: Outcome | None = None
    """For a queued request: admitted or rejected (deadline_expired), played forward."""
    then_reason: Reason | None = None
    then_after_s: float | None = None
    at: str = "ext_proc"
    """Where it was decided: ``edge`` (the rate limit service's shed) or ``ext_proc``."""
    status: int | None = None
    """The HTTP status of a refusal."""
    edge_shadow: Reason | None = None
    """The edge, in shadow mode, would have shed it for this reason (it let it through)."""
    detail: str | None = None
    """A refusal at the intake (for its body): what its answer tells the client."""
    spent: tuple[str, ...] = field(default_factory=tuple)


# -- the state, as the user describes it ------------------------------------------------------------


def parse_state(texts: Iterable[str], policy: Policy) -> dict[str, LaneLoad]:
    """``--state interactive=inflight:50,queued:10`` (repeatable, one lane each) → loads by lane."""
    out: dict[str, LaneLoad] = {}
    for text in texts:
        name, sep, items = text.partition("=")
        name = name.strip()
        if not sep:
            raise StateError(f"--state {text!r}: expected LANE=inflight:N,queued:M")
        counts = {"inflight": 0, "queued": 0}
        for item in items.split(","):
            match = _STATE_ITEM.match(item)
            if match is None:
                raise StateError(f"--state {text!r}: expected inflight:N and/or queued:M, got {item!r}")
            counts[match.group(1)] = int(match.group(2))
        _add_load(out, name, LaneLoad(**counts), policy, f"--state {text!r}")
    return out


def _add_load(out: dict[str, LaneLoad], name: str, load: LaneLoad, policy: Policy, where: str) -> None:
    known = [lane.name for lane in policy.lanes]
    if name not in known:
        raise StateError(f"{where}: unknown lane {name!r}; lanes: {', '.join(known)}")
    if name in out:
        raise StateError(f"{where}: lane {name} given twice")
    out[name] = load


def parse_spent(texts: Iterable[str]) -> Spent:
    """``--spent retry-budget`` (repeatable): budgets used up in the state."""
    names = set()
    for text in texts:
        name = text.strip().lower()
        if name not in SPENDABLE:
            raise StateError(f"--spent {text!r}: expected one of {', '.join(SPENDABLE)}")
        names.add(name)
    return Spent("retry-budget" in names, "tenant-requests" in names, "tenant-tokens" in names)


def load_state_file(path: str, policy: Policy) -> tuple[dict[str, LaneLoad], Spent]:
    """A state file: ``lanes: {LANE: {inflight: N, queued: M}}`` and ``spent: [retry-budget, ...]``."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise StateError(f"--state-file: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise StateError(f"--state-file {path}: not valid YAML: {exc}") from None
    doc = {} if doc is None else doc
    if not isinstance(doc, dict) or set(doc) - {"lanes", "spent"}:
        raise StateError(f"--state-file {path}: expected a mapping with lanes and spent")
    lanes = doc.get("lanes") or {}
    spent = doc.get("spent") or []
    if not isinstance(lanes, dict) or not isinstance(spent, list):
        raise StateError(f"--state-file {path}: lanes must be a mapping, spent a list")
    loads: dict[str, LaneLoad] = {}
    for name, counts in lanes.items():
        where = f"--state-file {path}: lanes.{name}"
        if not isinstance(counts, dict) or set(counts) - {"inflight", "queued"} or not all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 9_999_999
                for v in counts.values()):
            raise StateError(f"{where}: expected {{inflight: N, queued: M}} with counts from 0")
        _add_load(loads, str(name), LaneLoad(**counts), policy, where)
    return loads, parse_spent(str(s) for s in spent)


def by_priority(policy: Policy) -> list[Lane]:
    return sorted(policy.lanes, key=lambda lane: (-lane.priority, lane.name))


def busy(policy: Policy) -> dict[str, LaneLoad]:
    """Every lane at its limit, highest priority first, then borrowers on what is left: as many as
    the machine admits (a closed lane holds none)."""
    machine = Machine(policy)
    job = Job(None, 1, 1)
    for lane in by_priority(policy):
        for _ in range(min(lane.max_inflight, _MAX_FILL)):
            if not _admitted(machine, lane.name, job):
                break
    for lane in by_priority(policy):
        if lane.borrow:
            for _ in range(_MAX_FILL):
                if not _admitted(machine, lane.name, job):
                    break
    return {name: LaneLoad(view.inflight) for name, view in machine.snapshot(0.0).items() if view.inflight}


def _admitted(machine: Machine, lane: str, job: Job) -> bool:
    decision = machine.submit(lane, "fill", job, 0.0).decision
    if decision.outcome is Outcome.QUEUED:
        machine.release(decision.ticket, 0.0, learn=False)
    return decision.outcome is Outcome.ADMITTED


def default_scenarios(policy: Policy, lane_name: str, tenant: str, retry: bool
                      ) -> list[tuple[str, dict[str, LaneLoad], Spent]]:
    """Idle; the lane at its limit; all slots busy; and the lane's queue full on top of that; then, where
    the policy has them and they apply to this request, each budget spent on an idle replica."""
    lane = policy.lane(lane_name)
    out: list[tuple[str, dict[str, LaneLoad], Spent]] = [("idle", {}, Spent())]
    if not lane.closed:  # (a closed lane gives lane_closed in every state)
        at_limit = {lane.name: LaneLoad(lane.max_inflight)}
        out.append((f"{lane.name} at its in-flight limit", at_limit, Spent()))
        full = busy(policy)
        used = sum(load.inflight for load in full.values())
        cap = policy.total_capacity
        busy_name = (f"all {cap} slots busy" if used == cap
                     else f"{used} of {cap} slots busy (all lanes may use)")
        if full != at_limit:
            out.append((busy_name, full, Spent()))
        if lane.max_queued:
            queued = dict(full)
            queued[lane.name] = LaneLoad(full.get(lane.name, LaneLoad()).inflight, lane.max_queued)
            out.append((f"{busy_name}, {lane.name}'s queue full ({lane.max_queued})", queued, Spent()))
    if retry and policy.retry_budget.enabled:
        out.append(("idle, the retry budget spent", {}, Spent(retry_budget=True)))
    config = policy.ratelimit
    if config.mode != "off":
        limits = config.budgets.of(tenant)
        if limits.requests is not None:
            out.append((f"idle, tenant {tenant}'s request budget spent", {}, Spent(tenant_requests=True)))
        if limits.tokens is not None:
            out.append((f"idle, tenant {tenant}'s token budget in debt", {}, Spent(tenant_tokens=True)))
    return out


# -- reaching the state ---------------------------------------------------------------------------


class _Watch:
    """The driver's listener: admitted requests end at their predicted time; the last decision on
    each ticket is kept."""

    def __init__(self) -> None:
        self.driver: Driver | None = None
        self.last: dict[int, tuple[Decision, float]] = {}

    def admitted(self, decision: Decision, now: float) -> None:
        assert self.driver is not None
        self.driver.finish_at(decision.ticket, now + decision.ticket.predicted, learn=False)
        self.last[decision.ticket.id] = (decision, now)

    def rejected(self, decision: Decision, now: float) -> None:
        self.last[decision.ticket.id] = (decision, now)


def _why_not_admitted(machine: Machine, lane: Lane) -> str:
    if lane.closed:
        return "the lane is closed"
    cap = machine.policy.total_capacity
    if machine.total_inflight >= cap:
        return f"all {cap} slots are taken"
    if lane.borrow:
        return f"its limit is {lane.max_inflight}, and it may borrow no more"
    return f"its limit is {lane.max_inflight} and it may not borrow"


def _fill(driver: Driver, loads: Mapping[str, LaneLoad], tenant: str, job: Job, now: float) -> list[str]:
    """Submit synthetic requests until ``loads`` is reached (or cannot be); say where it fell short."""
    notes: list[str] = []
    machine = driver.machine
    for name, load in loads.items():
        for i in range(min(load.inflight, _MAX_FILL)):
            decision = driver.submit(name, tenant, job, now).decision
            if decision.outcome is not Outcome.ADMITTED:
                if decision.outcome is Outcome.QUEUED:
                    driver.release(decision.ticket, now, learn=False)
                notes.append(f"{name}: only {i} of {load.inflight} can be in flight: "
                             f"{_why_not_admitted(machine, machine.policy.lane(name))}")
                break
    for name, load in loads.items():
        for i in range(min(load.queued, _MAX_FILL)):
            submitted = driver.submit(name, tenant, job, now)
            decision = submitted.decision
            notes += [f"{name}: filling its queue evicted a queued {gone.ticket.lane} request ({gone.reason})"
                      for gone in submitted.evicted]
            if decision.outcome is Outcome.ADMITTED:
                driver.release(decision.ticket, now, learn=False)
                notes.append(f"{name}: cannot hold queued requests while a slot is free for it "
                             f"(queued {i} of {load.queued})")
                break
            if decision.outcome is Outcome.REJECTED:
                notes.append(f"{name}: only {i} of {load.queued} can be queued: the next is rejected "
                             f"({decision.reason})")
                break
    return notes


def _spend(driver: Driver, spent: Spent, offer: Offer, tenant: str, now: float) -> list[str]:
    """Bring the budgets ``spent`` names to empty through the events that spend them live (after the
    lanes are filled: the fill's admitted originals deposit into the retry budget, as live)."""
    machine = driver.machine
    policy = machine.policy
    notes: list[str] = []
    if spent.retry_budget:
        if not policy.retry_budget.enabled:
            notes.append("retry budget: the policy has none (retry_budget.enabled is false)")
        else:
            # Other clients' retries take what the budget allows (each admitted and ended at once),
            # until one is refused for it.
            lane = machine.intake.request(offer.method, offer.path, offer.headers, offer.body).lane
            for _ in range(_MAX_FILL):
                decision = driver.submit(lane, "other-client", Job(None, 1, 1), now, retry=True).decision
                if decision.reason is Reason.RETRY_BUDGET:
                    break
                driver.release(decision.ticket, now, learn=False)
    config = policy.ratelimit
    limits = config.budgets.of(tenant)
    entries = {"generic_key": config.request_descriptor,
               **machine.intake.descriptor(offer.method, offer.path, offer.headers)}
    if spent.tenant_requests:
        if config.mode == "off" or limits.requests is None:
            notes.append(f"tenant {tenant}: no request budget (ratelimit mode {config.mode})")
        else:
            # The tenant's arrivals take what the bucket holds: in doubling steps (a refused take
            # costs nothing), down to less than one request.
            hits = 1
            while hits >= 1:
                judgement = machine.judge(config, entries, hits, now)
                if judgement.over and not judgement.shadow:
                    machine.shed([judgement], now)  # (each refusal answered, as the service answers it)
                hits = hits // 2 if judgement.over else hits * 2
    if spent.tenant_tokens:
        if config.mode == "off" or limits.tokens is None:
            notes.append(f"tenant {tenant}: no token budget (ratelimit mode {config.mode})")
        else:
            # A response's reported usage beyond the whole bucket: the budget is in debt.
            machine.charge(config, entries, int(limits.tokens * limits.burst) + 2, now)
    return notes


def _snapshot(machine: Machine) -> dict[str, LaneLoad]:
    return {name: LaneLoad(view.inflight, view.queued)
            for name, view in machine.snapshot(0.0).items() if view.inflight or view.queued}


def _header(headers: Iterable[tuple[str, str]], name: str) -> str | None:
    return next((value for key, value in headers if key == name), None)


# -- the sample --------------------------------------------------------------------------------


def run_scenario(policy: Policy, name: str, loads: Mapping[str, LaneLoad], offer: Offer, tenant: str,
                 fill_job: Job, *, spent: Spent | None = None, seed: int = 0,
                 capacity_limit: int | None = None) -> ScenarioResult:
    """Bring a fresh machine to the state, offer the sample, and say what happens to it."""
    machine = Machine(policy, random.Random(seed), edge_rng=random.Random(seed + 1))
    watch = _Watch()
    driver = watch.driver = Driver(machine, watch)
    now = 0.0
    if capacity_limit is not None:
        machine.set_limit(capacity_limit, now)
    notes = _fill(driver, loads, tenant, fill_job, now)
    spent = spent or Spent()
    notes += _spend(driver, spent, offer, tenant, now)
    reached = _snapshot(machine)
    answer = driver.offer(offer, now)
    judgement = answer.judgement
    edge_shadow = judgement.reason if judgement is not None and judgement.over and judgement.shadow else None
    base = ScenarioResult(name, dict(loads), reached, tuple(notes), Outcome.REJECTED, None, None, None,
                          edge_shadow=edge_shadow, spent=tuple(spent.words()))
    if answer.shed is not None:
        rejection = answer.shed.rejection
        retry_after = _header(rejection.headers, "retry-after")
        ms = _header(rejection.headers, "retry-after-ms")
        return replace(base, reason=judgement.reason if judgement else None,
                       retry_after=int(retry_after) if retry_after else None,
                       retry_after_ms=int(ms) if ms else None,
                       retry_allowed=_header(rejection.headers, "x-should-retry") is None,
                       at="edge", status=rejection.status)
    if answer.refusal is not None:
        reason = answer.refusal.reason
        return replace(base, reason=reason, status=reason.http_status, detail=answer.refusal.detail)
    decision = answer.decision
    assert decision is not None
    sample = decision.ticket
    lane = policy.lane(sample.lane)
    rejected = decision.outcome is Outcome.REJECTED and decision.reason is not None
    result = replace(
        base, outcome=decision.outcome, reason=decision.reason, retry_after=decision.retry_after,
        predicted_s=sample.predicted,
        evicted=tuple(f"a queued {d.ticket.lane} request ({d.reason})" for d in answer.evicted),
        retry_after_ms=decision.retry_after_ms, retry_allowed=decision.retry_allowed,
        borrowed=(decision.outcome is Outcome.ADMITTED
                  and machine.snapshot(now)[sample.lane].inflight > lane.max_inflight),
        status=decision.reason.http_status if rejected and decision.reason else None)
    if decision.outcome is not Outcome.QUEUED:
        return result
    return _played_forward(driver, watch, sample, now, result)


def _played_forward(driver: Driver, watch: _Watch, sample: Ticket, start: float, result: ScenarioResult
                    ) -> ScenarioResult:
    """Run the state on predicted service times, no new arrivals, until ``sample`` leaves the queue."""
    driver.run(until=lambda: sample.state is not State.QUEUED)
    last = watch.last.get(sample.id)
    if last is None:
        return result
    decision, when = last
    return replace(result, then=decision.outcome, then_reason=decision.reason, then_after_s=when - start)

"""Does the simulator decide what the live service decided? ``extproc simulate --trace LOG --verify``.

How this works: ``extproc serve`` writes one JSON record per request (``decision``, at the
end of its ext_proc stream) and one per request the edge shed (``edge_shed``); each carries
its arrival time, method, path, the trusted headers, and for ext_proc's its model, sizes,
retry mark, response status, queue wait and service time. The replay sends every logged
attempt, retries included, as one arrival at its logged time through the same core as the
live service — the decision machine: the edge, the one intake, the scheduler — with no
simulated client retries and no simulated backend: a request the replay admits holds its slot
for the service time the log recorded (or, where live never admitted it, its predicted time), and teaches the
estimator as live did (only a 2xx response does). Requests whose clients went away while
queued are left out: their time of leaving is not logged.

Each attempt's outcome is compared in three classes — admitted at once, held then admitted
(a logged ``queue_ms`` of 1 or more), rejected with its reason — beside its lane and tenant.

A log may span several policies: each record names the sha256 of the policy file that decided it
(``policy``), and the ``operator`` records say when an operator reloaded, drained, undrained,
paused or resumed. The replay is given the policies by file (:func:`policies_by_hash`), matches
them by hash, and replays each span under the policy that decided it — one machine, reconfigured
where the live one was (at a reload record, or else at the first record decided by the next
policy), as the live service swaps policies without losing its queues — and applies every drain
and pause where it happened. A log that names a policy it was not given is refused
(:class:`PolicyMissing`), its spans named. A log from before records carried a hash replays under
its one policy.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.core.decision import Decision
from extproc.core.machine import Machine
from extproc.policy.schema import Policy
from extproc.sim.driver import Driver, Offer

_CONSOLE_MARKS = ("[info", "[warning", "[error", "[debug")


class LogError(ValueError):
    """The file is not a decision log extproc wrote in its JSON format."""


class PolicyMissing(ValueError):
    """The log was decided (in part) by policies the replay was not given: the message names the spans."""


@dataclass(frozen=True, slots=True)
class Attempt:
    """One logged attempt: what arrived, and what the live service made of it."""

    at: float
    method: str
    path: str
    headers: dict[str, str]
    lane: str | None
    tenant: str | None
    outcome: str
    """``admitted``, ``held`` or ``rejected:<reason>`` (what the comparison compares)."""
    edge: bool = False
    model: str | None = None
    prompt_tokens: int = 0
    output_tokens: int | None = None
    retry: bool = False
    status: int | None = None
    service_s: float | None = None
    policy: str = ""
    """The sha256 of the policy file that decided it ("": a log from before records carried it)."""


#: The operator actions a replay applies (the ``operator`` records' ``action``).
ACTIONS = ("drain", "undrain", "pause", "resume", "reload")


@dataclass(frozen=True, slots=True)
class Action:
    """One operator record: what an operator (or a shutdown, or the policy watcher) did, and when."""

    at: float
    action: str
    policy: str
    """The sha256 of the policy in force after it."""
    lane: str | None = None


@dataclass
class Log:
    """A decision log's replayable attempts and operator actions, each in time order."""

    attempts: list[Attempt]
    actions: list[Action] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Span:
    """A run of consecutive attempts decided by one policy."""

    policy: str
    first: float
    last: float
    attempts: int

    def describe(self) -> str:
        when = "–".join(dict.fromkeys(_clock(t) for t in (self.first, self.last)))
        name = f"policy {self.policy[:12]}" if self.policy else "no policy hash"
        return f"{name}: {self.attempts} attempt{'s' if self.attempts != 1 else ''}, {when}"


def _clock(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def _outcome(doc: dict[str, Any]) -> str | None:
    outcome = doc.get("outcome")
    if doc.get("event") == "edge_shed":
        return None if doc.get("shadow") else f"rejected:{doc.get('reason')}"
    if outcome == "admitted":
        return "held" if (doc.get("queue_ms") or 0) >= 1 else "admitted"
    if outcome == "rejected":
        return f"rejected:{doc.get('reason')}"
    return None  # cancelled or abandoned: the client went away


def read_log(lines: Iterable[str], source: str = "<log>") -> Log:
    """Every replayable attempt and operator action of a decision log, in time order; other lines
    are skipped."""
    out = Log([], [])
    json_lines = console_lines = 0
    for line in lines:
        text = line.strip()
        if not text.startswith("{"):
            if any(mark in text for mark in _CONSOLE_MARKS):
                console_lines += 1
            continue
        try:
            doc = json.loads(text)
        except ValueError:
            continue
        json_lines += 1
        if doc.get("event") == "operator":
            if doc.get("action") in ACTIONS and isinstance(doc.get("at"), int | float):
                out.actions.append(Action(float(doc["at"]), doc["action"], str(doc.get("policy") or ""),
                                          doc.get("lane")))
            continue
        attempt = _attempt(doc)
        if attempt is not None:
            out.attempts.append(attempt)
    if not out.attempts and console_lines and not json_lines:
        raise LogError(f"{source}: a console-format log; replay needs extproc serve's JSON log "
                       "(--log-format json, the default)")
    out.attempts.sort(key=lambda a: a.at)
    out.actions.sort(key=lambda a: a.at)
    return out


def _attempt(doc: dict[str, Any]) -> Attempt | None:
    """A decision or edge_shed record as a replayable attempt (None: not one, or not replayable)."""
    if doc.get("event") not in ("decision", "edge_shed") or "arrival" not in doc:
        return None
    if doc.get("event") == "decision" and doc.get("lane") is None:
        return None  # refused before classification (a repeated header, a late body)
    outcome = _outcome(doc)
    if outcome is None:
        return None
    service = doc.get("service_ms")
    return Attempt(
        at=float(doc["arrival"]), method=doc.get("method") or "POST", path=doc.get("path") or "/",
        headers={str(k): str(v) for k, v in (doc.get("headers") or {}).items()},
        lane=doc.get("lane"), tenant=doc.get("tenant"), outcome=outcome,
        edge=doc.get("event") == "edge_shed", model=doc.get("model"),
        prompt_tokens=int(doc.get("prompt_tokens") or 0), output_tokens=doc.get("output_tokens"),
        retry=bool(doc.get("retry")), status=doc.get("status"),
        service_s=service / 1000 if isinstance(service, int | float) else None,
        policy=str(doc.get("policy") or ""))


def read_log_file(path: str | Path) -> Log:
    with Path(path).open(errors="replace") as source:
        return read_log(source, str(path))


def spans(attempts: Iterable[Attempt]) -> list[Span]:
    """The runs of consecutive attempts decided by one policy, in order."""
    out: list[Span] = []
    for attempt in attempts:
        last = out[-1] if out else None
        if last is not None and last.policy == attempt.policy:
            out[-1] = Span(last.policy, last.first, attempt.at, last.attempts + 1)
        else:
            out.append(Span(attempt.policy, attempt.at, attempt.at, 1))
    return out


def policies_by_hash(paths: Iterable[str], load: Callable[[str], Policy]) -> dict[str, tuple[str, Policy]]:
    """Each policy file by the sha256 of its bytes (what a record's ``policy`` names): its path, and
    the policy ``load(path)`` made of it."""
    out: dict[str, tuple[str, Policy]] = {}
    for path in paths:
        out[hashlib.sha256(Path(path).read_bytes()).hexdigest()] = (path, load(path))
    return out


def resolve(log: Log, given: Mapping[str, Policy]) -> dict[str, Policy]:
    """The policy of each hash the log names, from ``given`` (by hash); a log without hashes takes the
    one policy given. PolicyMissing, naming the spans, for a log that needs a policy not given."""
    named = {a.policy for a in log.attempts} | {a.policy for a in log.actions if a.action == "reload"}
    out = {sha: given[sha] for sha in named if sha in given}
    if "" in named:
        if len(given) != 1:
            raise PolicyMissing(
                "the log's records carry no policy hash (a log from before extproc recorded it): give "
                "exactly the one policy that decided it")
        out[""] = next(iter(given.values()))
    missing = [span for span in spans(log.attempts) if span.policy not in out]
    if missing:
        lines = "\n".join(f"  {span.describe()}" for span in missing)
        raise PolicyMissing(f"the log was decided by {len({s.policy for s in missing})} policy file(s) not "
                            f"given (each --policy FILE is matched by the sha256 of its bytes):\n{lines}")
    return out


@dataclass
class Verdicts:
    """The replay's outcome for each attempt, beside the live one."""

    attempts: list[Attempt]
    lanes: list[str | None] = field(default_factory=list)
    tenants: list[str | None] = field(default_factory=list)
    outcomes: list[str] = field(default_factory=list)
    #: Operator actions applied, by action.
    applied: dict[str, int] = field(default_factory=dict)

    def agreement(self, mine: list[str | None] | list[str], theirs: list[str | None]) -> float:
        pairs = [(a, b) for a, b in zip(mine, theirs, strict=True) if b is not None]
        return sum(1 for a, b in pairs if a == b) / len(pairs) if pairs else 1.0

    def summary(self) -> dict[str, Any]:
        attempts = self.attempts
        mismatched: dict[str, int] = {}
        for attempt, outcome in zip(attempts, self.outcomes, strict=True):
            if attempt.outcome != outcome:
                key = f"{attempt.outcome} -> {outcome}"
                mismatched[key] = mismatched.get(key, 0) + 1
        return {
            "requests": len(attempts),
            "lane_agreement": round(self.agreement(self.lanes, [a.lane for a in attempts]), 4),
            "tenant_agreement": round(self.agreement(self.tenants, [a.tenant for a in attempts]), 4),
            "outcome_agreement": round(self.agreement(self.outcomes, [a.outcome for a in attempts]), 4),
            "disagreements": dict(sorted(mismatched.items(), key=lambda kv: -kv[1])),
            "spans": [{"policy": span.policy, "from": span.first, "to": span.last, "attempts": span.attempts}
                      for span in spans(attempts)],
            "actions": dict(sorted(self.applied.items())),
        }


class _Replay:
    """Listens to the driver: each attempt's outcome, and its end at the logged service time."""

    def __init__(self, attempts: list[Attempt], driver: Driver | None = None) -> None:
        self.attempts = attempts
        self.out = Verdicts(attempts, [None] * len(attempts), [None] * len(attempts), [""] * len(attempts))
        #: ticket id → the attempt it stands for.
        self.index: dict[int, int] = {}
        self.driver = driver

    def admitted(self, decision: Decision, now: float) -> None:
        index = self.index.get(decision.ticket.id)
        if index is None:
            return
        ticket = decision.ticket
        self.out.outcomes[index] = "held" if ticket.queue_wait * 1000 >= 1 else "admitted"
        attempt = self.attempts[index]
        service = attempt.service_s
        learn = attempt.status is not None and 200 <= attempt.status < 300
        assert self.driver is not None
        ends = now + (service if service is not None else ticket.predicted)
        self.driver.finish_at(ticket, ends, learn=learn)

    def rejected(self, decision: Decision, now: float) -> None:
        index = self.index.pop(decision.ticket.id, None)
        if index is not None:
            self.out.outcomes[index] = f"rejected:{decision.reason.value if decision.reason else ''}"

    def arrive(self, index: int, now: float, policy: Policy) -> None:
        attempt = self.attempts[index]
        headers = dict(attempt.headers)
        if attempt.retry:
            headers[policy.retry_budget.header] = "1"
        offer = Offer(attempt.method, attempt.path, headers, sized=True, model=attempt.model,
                      prompt_tokens=attempt.prompt_tokens, output_tokens=attempt.output_tokens)
        assert self.driver is not None
        answer = self.driver.offer(offer, now, decided=lambda t: self.index.__setitem__(t.id, index))
        out = self.out
        out.lanes[index], out.tenants[index] = answer.lane, answer.tenant
        if answer.shed is not None and answer.judgement is not None:
            reason = answer.judgement.reason
            out.outcomes[index] = f"rejected:{reason.value if reason else ''}"


def replay(log: Log | list[Attempt], policy: Policy | Mapping[str, Policy], seed: int = 1) -> Verdicts:
    """Decide every attempt again on the logged arrivals and service times: each under the policy that
    decided it (``policy``: by hash, as :func:`resolve` gives them; one policy: for every attempt), with
    the logged operator actions applied where they happened."""
    if isinstance(log, list):
        log = Log(log)
    attempts = log.attempts
    policies = policy if isinstance(policy, Mapping) else {a.policy: policy for a in attempts}
    listener = _Replay(attempts)
    if not attempts:
        return listener.out
    first = policies[attempts[0].policy]
    driver = listener.driver = Driver(Machine(first, random.Random(seed), edge_rng=random.Random(seed + 1)),
                                      listener)
    origin = min(attempts[0].at, log.actions[0].at if log.actions else attempts[0].at)
    swap = _Swap(driver, policies, attempts[0].policy, listener.out)
    for action in log.actions:
        driver.at(action.at - origin, lambda now, action=action: swap.act(action, now))  # type: ignore[misc]
    for i, attempt in enumerate(attempts):
        def arrive(now: float, i: int = i, attempt: Attempt = attempt) -> None:
            swap.to(attempt.policy, now)
            listener.arrive(i, now, driver.machine.policy)
        driver.at(attempt.at - origin, arrive)
    driver.run()
    return listener.out


class _Swap:
    """The policy in force in the replay, and the operator actions on it."""

    def __init__(self, driver: Driver, policies: Mapping[str, Policy], current: str, out: Verdicts) -> None:
        self.driver = driver
        self.policies = policies
        self.current = current
        self.out = out

    def to(self, sha: str, now: float) -> None:
        """Reconfigure to the policy of ``sha`` if it is not the one in force (and is known)."""
        if sha == self.current or sha not in self.policies:
            return
        self.current = sha
        driver = self.driver
        driver.settle(driver.machine.reconfigure(self.policies[sha], now), now)

    def act(self, action: Action, now: float) -> None:
        machine, driver = self.driver.machine, self.driver
        if action.action == "reload":
            self.to(action.policy, now)
        elif action.action == "drain":
            driver.settle(machine.drain(now), now)
        elif action.action == "undrain":
            driver.settle(machine.undrain(now), now)
        elif action.lane is not None and action.lane in machine.snapshot(now):
            if action.action == "pause":
                machine.pause(action.lane)
            else:
                driver.settle(machine.resume(action.lane, now), now)
        else:
            return
        self.out.applied[action.action] = self.out.applied.get(action.action, 0) + 1

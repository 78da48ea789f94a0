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
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
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


def _outcome(doc: dict[str, Any]) -> str | None:
    outcome = doc.get("outcome")
    if doc.get("event") == "edge_shed":
        return None if doc.get("shadow") else f"rejected:{doc.get('reason')}"
    if outcome == "admitted":
        return "held" if (doc.get("queue_ms") or 0) >= 1 else "admitted"
    if outcome == "rejected":
        return f"rejected:{doc.get('reason')}"
    return None  # cancelled or abandoned: the client went away


def read_log(lines: Iterable[str], source: str = "<log>") -> list[Attempt]:
    """Every replayable attempt of a decision log, in arrival order; other lines are skipped."""
    attempts: list[Attempt] = []
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
        if doc.get("event") not in ("decision", "edge_shed") or "arrival" not in doc:
            continue
        if doc.get("event") == "decision" and doc.get("lane") is None:
            continue  # refused before classification (a repeated header, a late body)
        outcome = _outcome(doc)
        if outcome is None:
            continue
        service = doc.get("service_ms")
        attempts.append(Attempt(
            at=float(doc["arrival"]), method=doc.get("method") or "POST", path=doc.get("path") or "/",
            headers={str(k): str(v) for k, v in (doc.get("headers") or {}).items()},
            lane=doc.get("lane"), tenant=doc.get("tenant"), outcome=outcome,
            edge=doc.get("event") == "edge_shed", model=doc.get("model"),
            prompt_tokens=int(doc.get("prompt_tokens") or 0), output_tokens=doc.get("output_tokens"),
            retry=bool(doc.get("retry")), status=doc.get("status"),
            service_s=service / 1000 if isinstance(service, int | float) else None))
    if not attempts and console_lines and not json_lines:
        raise LogError(f"{source}: a console-format log; replay needs extproc serve's JSON log "
                       "(--log-format json, the default)")
    attempts.sort(key=lambda a: a.at)
    return attempts


def read_log_file(path: str | Path) -> list[Attempt]:
    with Path(path).open(errors="replace") as source:
        return read_log(source, str(path))


@dataclass
class Verdicts:
    """The replay's outcome for each attempt, beside the live one."""

    attempts: list[Attempt]
    lanes: list[str | None] = field(default_factory=list)
    tenants: list[str | None] = field(default_factory=list)
    outcomes: list[str] = field(default_factory=list)

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


def replay(attempts: list[Attempt], policy: Policy, seed: int = 1) -> Verdicts:
    """Decide every attempt again with ``policy``, on the logged arrivals and service times."""
    listener = _Replay(attempts)
    if not attempts:
        return listener.out
    driver = listener.driver = Driver(Machine(policy, random.Random(seed), edge_rng=random.Random(seed + 1)),
                                      listener)
    origin = attempts[0].at
    for i, attempt in enumerate(attempts):
        driver.at(attempt.at - origin, lambda now, i=i: listener.arrive(i, now, policy))  # type: ignore[misc]
    driver.run()
    return listener.out

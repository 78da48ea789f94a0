"""The small vocabulary every part shares: a request's ticket, the decision on it (its outcome and
reason), and how a rejection is told.

Their string values are log fields and metric labels, so they are a public
interface: add to them, never rename. Every rejection — ext_proc's, the edge's, the
simulator's — is rendered by :func:`reject`, so status, headers, body, ``Retry-After``
and ``x-should-retry`` are the same whichever part refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum, StrEnum

from extproc.core.estimate import Job
from extproc.core.queue import Entry
from extproc.core.saturation import Effect

#: The lane label of a refusal no single lane owns: an edge shed of a request that could land in several
#: lanes (its model decides, and the edge sees no body), or a request refused before it was classified
#: (overloaded, a repeated header, a body that never came when its lane depends on it). A lane name
#: can never be it (the policy's lane names are words).
ANY_LANE = "*"


class Outcome(StrEnum):
    ADMITTED = "admitted"
    """Sent upstream (at once or after waiting in the queue)."""
    QUEUED = "queued"
    """Held in a lane's queue until a slot frees."""
    REJECTED = "rejected"
    """Answered by extproc itself (429 or 503); never reached the backend."""
    CANCELLED = "cancelled"
    """The client went away while the request was queued."""


class Reason(StrEnum):
    QUEUE_FULL = "queue_full"
    DEADLINE_UNMEETABLE = "deadline_unmeetable"
    DEADLINE_EXPIRED = "deadline_expired"
    EVICTED = "evicted"
    FAIR_SHARE = "fair_share"
    LANE_CLOSED = "lane_closed"
    DRAINING = "draining"
    SATURATED = "saturated"
    """Shed because a cluster signal says the backend is saturated (the signal is named)."""
    RETRY_BUDGET = "retry_budget"
    """A retry beyond the retry budget: retries may only be a set share of admitted work."""
    BAD_REQUEST = "bad_request"
    """The request cannot be read as sent: a header classification reads is repeated, or its body has
    a token limit the model servers refuse (not a whole number, or negative)."""
    BODY_TIMEOUT = "body_timeout"
    """The request announced a body and did not send it in time."""
    SLOW_BODIES = "slow_bodies"
    """The client already holds too many requests whose bodies are late."""
    UNSUPPORTED_ENCODING = "unsupported_encoding"
    """Its body cannot be read (a Content-Encoding extproc does not decode, stacked encodings, or bytes
    that are not what their encoding says), and the policy refuses such bodies
    (``estimation.unreadable_body: refuse``)."""
    OVERLOADED = "overloaded"
    """extproc itself is beyond its decision rate: the request reached it too late to be decided."""
    UNAVAILABLE = "unavailable"
    """extproc cannot answer (down, stalled, overloaded): Envoy's admission gate says so, not extproc."""
    TENANT_REQUESTS = "tenant_request_budget"
    """The tenant's request budget is spent (the edge)."""
    TENANT_TOKENS = "tenant_token_budget"
    """The tenant's token budget is in debt (the edge)."""

    @property
    def http_status(self) -> int:
        """429 asks the client to come back later; 503 says this replica is going away or is down."""
        return _STATUS.get(self, 429)

    @property
    def retry_helps(self) -> bool:
        """False where an SDK's prompt retry cannot help: the answer then says ``x-should-retry: false``."""
        return self not in _NO_RETRY

    @property
    def retry_elsewhere(self) -> bool:
        """True where the refusal is this replica's alone (it is draining): another replica will
        take the request, so the answer never says ``x-should-retry: false``, whatever the retry
        budget (a rollout's drain must not make SDKs give up)."""
        return self is Reason.DRAINING

    @property
    def message(self) -> str:
        return _MESSAGES[self]


_MESSAGES = {
    Reason.QUEUE_FULL: "The inference queue for this lane is full.",
    Reason.DEADLINE_UNMEETABLE: "The request could not start within its lane's deadline.",
    Reason.DEADLINE_EXPIRED: "The request waited in the queue past its lane's deadline.",
    Reason.EVICTED: "The queued request was dropped to make room for higher-priority work.",
    Reason.FAIR_SHARE: "The queued request gave its place to a tenant below its fair share of the queue.",
    Reason.LANE_CLOSED: "This lane is closed by policy.",
    Reason.DRAINING: "This admission controller is shutting down.",
    Reason.SATURATED: "The inference backend is saturated; this lane is shed until it recovers.",
    Reason.RETRY_BUDGET: "Too many retries: the retry budget is spent. Retrying now cannot help.",
    Reason.BAD_REQUEST: "The request cannot be read as sent.",
    Reason.BODY_TIMEOUT: "The request body did not arrive in time.",
    Reason.SLOW_BODIES: "Too many of this client's requests are waiting for their bodies.",
    Reason.UNSUPPORTED_ENCODING: "The request body cannot be read: send it unencoded, or gzip or deflate "
                                 "encoded, once.",
    Reason.OVERLOADED: "The admission controller is overloaded; the request was not decided.",
    Reason.UNAVAILABLE: "The admission controller is unavailable; no new requests are admitted.",
    Reason.TENANT_REQUESTS: "This tenant's request budget is spent.",
    Reason.TENANT_TOKENS: "This tenant's token budget is spent.",
}
_NO_RETRY = frozenset({Reason.LANE_CLOSED, Reason.SATURATED, Reason.RETRY_BUDGET, Reason.BAD_REQUEST,
                       Reason.UNSUPPORTED_ENCODING})
_STATUS = {Reason.DRAINING: 503, Reason.OVERLOADED: 503, Reason.UNAVAILABLE: 503, Reason.BAD_REQUEST: 400,
           Reason.BODY_TIMEOUT: 408, Reason.UNSUPPORTED_ENCODING: 415}
_TYPES = {429: "rate_limit_exceeded", 503: "service_unavailable"}


class State(Enum):
    QUEUED = "queued"
    INFLIGHT = "inflight"
    DONE = "done"


@dataclass(slots=True, eq=False)
class Ticket:
    """One request's place in the scheduler, from submission until its slot is released."""

    id: int
    lane: str
    tenant: str
    job: Job
    arrival: float
    deadline: float
    predicted: float
    state: State = State.QUEUED
    admitted_at: float | None = None
    occupancy: float = 0.0
    entry: Entry | None = None
    retry: bool = False
    """Its client said it is a retry (admitted retries deposit nothing in the retry budget)."""
    first: float | None = None
    """A retry that claimed its booking on the return schedule: when its first attempt arrived
    (it ranks from then, keeping that attempt's place)."""

    @property
    def queue_wait(self) -> float:
        return (self.admitted_at - self.arrival) if self.admitted_at is not None else 0.0


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: Outcome
    ticket: Ticket
    reason: Reason | None = None
    retry_after: int | None = None
    saturation: Effect | None = None
    """For a saturation rejection: the rule and signal behind it."""
    shadow: Outcome | None = None
    """In shadow mode: what enforcing would have done (queued or rejected, with ``reason``)."""
    retry_after_ms: int | None = None
    """For a rejection booked on its lane's return schedule: the exact wait (``retry-after-ms``)."""
    retry_allowed: bool = True
    """For a rejection whose retry could help: False when the return schedule is full or the retry
    budget has no room (the answer then says ``x-should-retry: false``)."""


def error_body(reason: Reason, lane: str | None, retry_after: int | None, signal: str | None = None,
               detail: str | None = None) -> bytes:
    """An OpenAI-style error document, so SDKs show a useful message and back off."""
    message = reason.message
    if detail:
        message += f" {detail}"
    if signal:
        message += f" Signal: {signal}."
    if retry_after is not None:
        message += f" Retry after {retry_after} s."
    doc = {
        "error": {
            "message": message,
            "type": _TYPES.get(reason.http_status, "invalid_request_error"),
            "param": None,
            "code": reason.value,
            "lane": lane,
        }
    }
    return json.dumps(doc, separators=(",", ":")).encode()



@dataclass(frozen=True, slots=True)
class Rejection:
    """A refusal as the client will see it."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


def reject(reason: Reason, lane: str | None, retry_after: int | None, *, signal: str | None = None,
           rule: str | None = None, retry_allowed: bool = True, detail: str | None = None,
           retry_after_ms: int | None = None) -> Rejection:
    """The one rendering of a refusal: status, ``content-type``, ``x-extproc-reason``, the lane, the
    saturation rule and signal behind it, ``retry-after``, ``retry-after-ms`` (the exact wait of a
    booked return: the OpenAI SDKs prefer it to ``retry-after``), ``x-should-retry: false`` where
    retrying cannot help, the return schedule is full or the retry budget has no room
    (``retry_allowed``; never for a drain, whose retry goes to another replica), and the JSON error
    document."""
    headers = [("content-type", "application/json"), ("x-extproc-reason", reason.value)]
    if lane is not None:
        headers.append(("x-extproc-lane", lane))
    if retry_after is not None:
        headers.append(("retry-after", str(retry_after)))
        if retry_after_ms is not None and retry_allowed and reason.retry_helps:
            headers.append(("retry-after-ms", str(retry_after_ms)))
    if signal is not None or rule is not None:
        headers.append(("x-extproc-signal", signal or ""))
        headers.append(("x-extproc-rule", rule or ""))
    if not reason.retry_elsewhere and (not reason.retry_helps or not retry_allowed):
        headers.append(("x-should-retry", "false"))
    return Rejection(reason.http_status, tuple(headers),
                     error_body(reason, lane, retry_after, signal, detail))

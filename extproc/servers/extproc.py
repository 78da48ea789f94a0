"""Envoy's ext_proc protocol ↔ admission decisions.

How this works: one gRPC stream per HTTP request. On the request headers the
request is classified; if the policy needs the JSON body (model, max_tokens,
prompt size) and the request has one, the reply switches body reading on for
this request only (``mode_override``, ``BUFFERED_PARTIAL``: the first chunk,
never a stall) and the decision waits for the body. The decision is then one of

* admit — CONTINUE, with ``x-extproc-*`` headers for the upstream;
* hold  — first a reply carrying only ``override_message_timeout`` (so Envoy's
  per-message timer does not fire while queued), then CONTINUE once a slot
  frees, or a 429 when the deadline passes;
* reject — an ImmediateResponse (429 or 503) with ``retry-after``, the reason,
  and an OpenAI-style JSON error body.

Before that, a request may be refused at its intake, with no ticket taken: 400 (a
trusted header twice, a token limit the model servers refuse), 415 (a body it cannot
decode, when the policy refuses those), 408 and 429 (bodies late).

``response_trailer_mode: SEND`` keeps the stream open until the HTTP request
ends; the stream's end — normal, client reset, Envoy timeout — is the only
reliable "finished" signal, so the slot is released in ``finally``, once.

The response headers are asked for in the same ``mode_override``, for one admitted request in
``response_sample`` (``ResponseSample``; 1, the default: every one): their status says whether
the service time is worth learning from, and they carry the edge's x-ratelimit-* headers. A
request not sampled skips that message; its x-ratelimit-* values go into the admission's
dynamic metadata (``extproc.ratelimit_*``), which the proxy's route configuration turns into
the same headers (``response_headers_to_add``), and its release learns nothing.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import grpc
import structlog
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.duration_pb2 import Duration

from extproc.controller import Controller
from extproc.core.body import BodyFacts
from extproc.core.classify import Classification
from extproc.core.decision import ANY_LANE, Decision, Outcome, Reason, Rejection, Ticket, reject
from extproc.core.intake import EDGE_HEADER, JUDGED_HEADER, Head, Intake
from extproc.core.machine import UNLIMITED, Check
from extproc.core.overload import ARRIVAL_HEADER, SHED_STATUS, OverloadGuard
from extproc.core.redaction import Redactor
from extproc.core.saturation import Effect
from extproc.core.usage import NAMESPACE, admission_metadata, ask_for_usage, plan
from extproc.log import Lines
from extproc.metrics import ResponseCounts
from extproc.servers.deadlines import Deadlines

if TYPE_CHECKING:
    from extproc.servers.ratelimit import Inline, RateLimitService

#: Envoy must never time out a hold before extproc answers it: the override carries this margin.
HOLD_MARGIN_S = 2.0
_OVERWRITE = HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD


def _mode(request_body: ProcessingMode.BodySendMode.ValueType, response_headers: bool = True
          ) -> ProcessingMode:
    # Every field spelled out: Envoy replaces the whole mode with an override. Response headers
    # are asked for here, per request, rather than in the filter's static mode: their status says
    # whether a service time is worth learning from, while Envoy's own error replies to requests
    # that never reached extproc (a malformed request's 400) must not wait on it. Trailers stay on
    # whether or not the headers are asked for: they keep the stream open to the request's end.
    return ProcessingMode(
        request_header_mode=ProcessingMode.SEND,
        response_header_mode=ProcessingMode.SEND if response_headers else ProcessingMode.SKIP,
        request_body_mode=request_body,
        response_body_mode=ProcessingMode.NONE,
        request_trailer_mode=ProcessingMode.SKIP,
        response_trailer_mode=ProcessingMode.SEND,
    )


#: For a request whose body is read: the first buffered chunk only, so a huge body never stalls.
BODY_MODE = _mode(ProcessingMode.BUFFERED_PARTIAL)
#: For a request decided on its headers: whatever the filter's static mode, skip the body.
NO_BODY_MODE = _mode(ProcessingMode.NONE)
#: The same two for a request whose response headers are not asked for (``ResponseSample``).
BODY_MODE_UNSAMPLED = _mode(ProcessingMode.BUFFERED_PARTIAL, response_headers=False)
NO_BODY_MODE_UNSAMPLED = _mode(ProcessingMode.NONE, response_headers=False)


def _read_body(mode: ProcessingMode) -> pb.ProcessingResponse:
    response = pb.ProcessingResponse(mode_override=mode)
    response.request_headers.response.header_mutation.SetInParent()
    return response


#: The answer to request headers whose body is to be read, when no header needs removing (the
#: usual case): built once and shared by every stream, since it never varies. Never mutated.
_READ_BODY = _read_body(BODY_MODE)
_READ_BODY_UNSAMPLED = _read_body(BODY_MODE_UNSAMPLED)
_NO_BODY = BodyFacts()

log = structlog.get_logger("extproc.decision")


def _header(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)


def _continue(common: pb.CommonResponse, remove: list[str],
              set_headers: Iterable[tuple[str, str]] = ()) -> None:
    """Fill in a CONTINUE that drops ``remove`` and sets ``set_headers`` upstream.

    Built in place (``add()`` and field assignment) rather than from nested constructor
    calls: protobuf copies every sub-message passed to a constructor, which made building
    the admit answer the most expensive part of it.
    """
    common.status = pb.CommonResponse.CONTINUE
    mutation = common.header_mutation
    mutation.SetInParent()
    if remove:
        mutation.remove_headers.extend(remove)
    add = mutation.set_headers.add
    for key, value in set_headers:
        option = add(append_action=_OVERWRITE)
        option.header.key = key
        option.header.raw_value = value.encode()


def _headers_of(message: pb.HttpHeaders) -> tuple[dict[str, str], list[str]]:
    """The headers (lower-case names), and the names that came more than once."""
    out: dict[str, str] = {}
    repeated: list[str] = []
    for h in message.headers.headers:
        raw = h.raw_value
        value = raw.decode("utf-8", "replace") if raw else h.value
        key = h.key.lower()
        if key in out:
            # Joined as HTTP allows; a header classification reads must not come twice (400).
            out[key] = f"{out[key]},{value}"
            repeated.append(key)
        else:
            out[key] = value
    return out, repeated


def _status_of(message: pb.HttpHeaders) -> int | None:
    for h in message.headers.headers:
        if h.key == ":status":
            try:
                return int(h.raw_value or h.value)
            except ValueError:
                return None
    return None


def _client_of(request: pb.ProcessingRequest) -> str | None:
    """The downstream address without its port (``request_attributes: [source.address]``), if sent."""
    attributes = request.attributes.get("envoy.filters.http.ext_proc")
    if attributes is None:
        return None
    value = attributes.fields.get("source.address")
    if value is None or not value.string_value:
        return None
    host: str = value.string_value
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


Headers = tuple[tuple[str, str], ...]
_NO_LIMITS: Headers = ()


def _immediate(rejection: Rejection, reason: Reason, limits: Headers = _NO_LIMITS) -> pb.ProcessingResponse:
    """A refusal; ``limits``: the edge's x-ratelimit-* headers (the ratelimit filter, in front of ext_proc,
    puts them on every response that passes it, ext_proc's own refusals included)."""
    headers = rejection.headers + limits
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=HttpStatus(code=rejection.status),
        headers=pb.HeaderMutation(set_headers=[_header(k, v) for k, v in headers]),
        body=rejection.body,
        details=f"extproc_{reason.value}",
    ))


#: on_headers' word that the edge is to judge the request first (Process awaits it, then after_edge).
_JUDGE_EDGE = pb.ProcessingResponse()
#: Seconds per rate limit unit, as Envoy's ratelimit filter reads them (none: no window).
_WINDOWS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}
#: gRPC clients shed at the edge get RESOURCE_EXHAUSTED (the filter's rate_limited_as_resource_exhausted).
_RESOURCE_EXHAUSTED = 8


def _ratelimit_headers(statuses: Sequence[Check]) -> Headers:
    """The x-ratelimit-limit / -remaining / -reset headers Envoy's ratelimit filter adds for an answer's
    statuses (``enable_x_ratelimit_headers: DRAFT_VERSION_03``), each as the rate limit service reports
    it (``servers/ratelimit.py``: counts within 32 bits, the reset in whole seconds rounded up): the
    status with the fewest remaining, then each windowed limit's quota policy."""
    least = None
    policy = ""
    for status in statuses:
        if status.limit <= 0:
            continue  # (reported with no limit: the filter skips it)
        if least is None or min(status.remaining, UNLIMITED) < min(least.remaining, UNLIMITED):
            least = status
        window = _WINDOWS.get(status.unit or "", 0)
        if window:
            policy += f", {min(status.limit, UNLIMITED)};w={window}"
            if status.name:
                policy += f';name="{status.name}"'
    if least is None:
        return _NO_LIMITS
    reset = least.reset_s
    return (("x-ratelimit-limit", f"{min(least.limit, UNLIMITED)}{policy}"),
            ("x-ratelimit-remaining", str(min(least.remaining, UNLIMITED))),
            ("x-ratelimit-reset", str(min(math.ceil(reset), UNLIMITED) if math.isfinite(reset) and reset > 0
                                      else 0)))


#: Where each x-ratelimit-* header's value goes in the ``extproc`` dynamic metadata of a request whose
#: response headers are not asked for: the proxy's route configuration adds the header from it
#: (``%DYNAMIC_METADATA(extproc:ratelimit_limit)%``; a test keeps the shipped configs to these keys).
LIMIT_KEYS = {"x-ratelimit-limit": "ratelimit_limit", "x-ratelimit-remaining": "ratelimit_remaining",
              "x-ratelimit-reset": "ratelimit_reset"}


def limits_metadata(limits: Headers) -> dict[str, str]:
    """The x-ratelimit-* headers as ``extproc`` dynamic metadata entries (``LIMIT_KEYS``)."""
    return {LIMIT_KEYS[key]: value for key, value in limits}


class ResponseSample:
    """Whether a request's response headers are asked for: one request in ``every`` (1: each one), by a
    counter, so the share is exact and a test can tell which: the first, then every ``every``-th after
    it. Asked when the mode is sent: with the admission made on the headers, or with the answer that
    asks for the body (a request then refused on its body took its turn all the same).

    Nothing else depends on the message: a token budget's charge is read by the proxy (the usage
    filter, the rate limit filter's call at stream end: ``core/usage.py``), the slot is released when
    the stream ends (which ``response_trailer_mode: SEND`` keeps open either way), and the edge's
    x-ratelimit-* go through dynamic metadata. What a request not sampled loses: its service time is
    not learnt (no status says it was a success), and its decision line has ``status: null``."""

    __slots__ = ("_left", "every")

    def __init__(self, every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"the response sample must be 1 or more, not {every}")
        self.every = every
        self._left = 0

    def __call__(self) -> bool:
        if self._left:
            self._left -= 1
            return False
        self._left = self.every - 1
        return True


def _edge_shed(rejection: Rejection, limits: Headers) -> pb.ProcessingResponse:
    """The edge's refusal as Envoy's ratelimit filter answers OVER_LIMIT: 429, x-envoy-ratelimited,
    the service's headers and body, the x-ratelimit-* headers."""
    headers = (("x-envoy-ratelimited", "true"), *rejection.headers, *limits)
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=HttpStatus(code=429),
        headers=pb.HeaderMutation(set_headers=[_header(k, v) for k, v in headers]),
        body=rejection.body,
        details="request_rate_limited",
        grpc_status=pb.GrpcStatus(status=_RESOURCE_EXHAUSTED),
    ))


K = TypeVar("K", bound=Hashable)


class _Answers(Generic[K]):
    """Answers built once per distinct key and shared by every stream (never mutated): the same few
    recur (lanes, tenants, predictions, limits), but the keys hold client-chosen values, so at most
    ``KEPT`` are kept, all forgotten at once when full."""

    KEPT = 1024
    __slots__ = ("_build", "_kept")

    def __init__(self, build: Callable[[K], pb.ProcessingResponse]) -> None:
        self._build = build
        self._kept: dict[K, pb.ProcessingResponse] = {}

    def __call__(self, key: K) -> pb.ProcessingResponse:
        response = self._kept.get(key)
        if response is None:
            response = self._build(key)
            if len(self._kept) >= self.KEPT:
                self._kept.clear()
            self._kept[key] = response
        return response

    def __len__(self) -> int:
        return len(self._kept)


def _with_limits(limits: Headers) -> pb.ProcessingResponse:
    """The answer to the response headers that sets ``limits`` on them."""
    response = pb.ProcessingResponse()
    _continue(response.response_headers.response, [], limits)
    return response


def _admission(key: tuple[str, Headers, bool, Headers]) -> pb.ProcessingResponse:
    """An admission answered in ``phase`` (its request's headers or body) that sets ``headers`` upstream;
    ``sampled``: its response headers asked for (else ``limits``, the edge's x-ratelimit-*, go in its
    dynamic metadata for the proxy to add)."""
    phase, headers, sampled, limits = key
    response, common = _answer_in(phase, sampled)
    _continue(common, [], headers)
    if limits:
        response.dynamic_metadata.update({NAMESPACE: limits_metadata(limits)})
    return response


def _answer_in(phase: str, sampled: bool = True) -> tuple[pb.ProcessingResponse, pb.CommonResponse]:
    """A new answer to the message of ``phase`` (request headers: the body skipped, the response headers
    asked for if ``sampled``), and its common part."""
    response = pb.ProcessingResponse()
    if phase == "request_headers":
        response.mode_override.CopyFrom(NO_BODY_MODE if sampled else NO_BODY_MODE_UNSAMPLED)
        return response, response.request_headers.response
    return response, response.request_body.response


#: The response headers' answers by the limits they set.
_RESPONSE_HEADERS = _Answers(_with_limits)
#: Admissions that drop no header and record no usage, by phase, the headers they set, whether their
#: response headers are asked for, and the limits their metadata carries.
_ADMISSIONS = _Answers(_admission)


class Linger:
    """Whether a stream that ended cleanly waits a few turns of the event loop before its final status.

    Why: grpc.aio never frees the operation array of a batch that fails (grpc/grpc#43360; fixes
    proposed in grpc/grpc#43361 and #43409, unreleased as of grpcio 1.85): sending the final status
    on a call the peer has already reset fails, and leaks ~120 bytes per stream. An Envoy without
    ``envoy.reloadable_features.ext_proc_graceful_grpc_close`` (the shipped configs set it) ends every
    stream by half-closing and resetting it at once. Lingering a few turns lets that reset arrive
    first: grpc.aio then cancels the handler, sends nothing, and nothing leaks. A stream whose client
    goes away mid-request still leaks its pending read; only a grpcio release with the fix ends that,
    and then this class can go.

    Against an Envoy that ends streams gracefully no linger is ever cut short, and lingering on every
    stream would only cost CPU: after ``CALM`` lingers in a row that no reset cut, only one stream in
    ``PROBE`` lingers, to notice an Envoy that changed (one cut brings lingering back for every stream).
    """

    #: Turns of the event loop: the reset comes in the same read as the half-close, a turn or two later.
    YIELDS = 3
    CALM = 256
    PROBE = 64

    __slots__ = ("_calm", "_seen")

    def __init__(self) -> None:
        self._calm = 0
        self._seen = 0

    def wanted(self) -> bool:
        if self._calm < self.CALM:
            return True
        self._seen += 1
        return self._seen % self.PROBE == 0

    def calm(self) -> None:
        self._calm += 1

    def cut(self) -> None:
        self._calm = 0


class _Request:
    """One HTTP request's life on one ext_proc stream."""

    # One of these is made per request: slots spare it an instance __dict__.
    __slots__ = ("arrival", "body", "client", "cls", "edge_shadow", "edge_shed", "head", "headers", "limits",
                 "model", "outcome", "p", "pending", "policy", "raw_body", "reason", "remove", "request_id",
                 "sampled", "saturation", "shadow", "status", "ticket", "waiting_body")

    def __init__(self, processor: ExternalProcessor) -> None:
        self.p = processor
        self.ticket: Ticket | None = None
        #: The request as its headers tell it (the one intake's view), once they came.
        self.head: Head | None = None
        #: The request's headers, once they came (None: the stream never got that far).
        self.headers: Mapping[str, str] | None = None
        self.request_id = ""
        #: From the policy's model header, else from the body once it was read.
        self.model: str | None = None
        self.body: BodyFacts | None = None
        self.cls: Classification | None = None
        self.outcome: Outcome | None = None
        self.reason: Reason | None = None
        #: In shadow mode, what enforcing would have done (with ``reason``).
        self.shadow: Outcome | None = None
        self.saturation: Effect | None = None
        self.remove: list[str] = []
        #: Wall-clock arrival (epoch seconds): lets the decision log be replayed as a trace.
        self.arrival = 0.0
        #: The response's HTTP status, once its headers came (None: they never did, or were not asked for).
        self.status: int | None = None
        #: False once the response headers are sampled out (``ResponseSample``): not asked for.
        self.sampled = True
        #: The downstream client's address (for the cap on slow bodies), when Envoy sends it.
        self.client: str | None = None
        #: Whether the body was asked for and has not come yet.
        self.waiting_body = False
        #: The first body chunk of a stream that did not ask for its usage: rewritten to ask for it
        #: if the request is admitted (core/usage.py plan); the proxy strips that event again.
        self.raw_body: bytes | None = None
        #: Judged at the edge here (the proxy's x-extproc-edge): the x-ratelimit-* headers its answer
        #: gives the response, as Envoy's ratelimit filter renders them (empty: none).
        self.limits: Headers = _NO_LIMITS
        #: The edge shed it: the edge logged and counted it; no decision record of ext_proc's.
        self.edge_shed = False
        #: A read begun while the request was held (ExternalProcessor._held), consumed before any new one.
        self.pending: asyncio.Future[pb.ProcessingRequest | None] | None = None
        #: In the edge's shadow mode, what it would have done (for the access log), until sent.
        self.edge_shadow: str | None = None
        #: The sha256 of the policy file in force when the request was decided (its record says it).
        self.policy = ""

    def on_headers(self, message: pb.HttpHeaders, client: str | None) -> pb.ProcessingResponse | None:
        """The answer to the request headers, or None when the request is to be decided on them."""
        self.arrival = time.time()
        self.client = client
        self.policy = self.p.policy_hash()
        raw, repeated = _headers_of(message)
        head = self.head = self.p.intake.head(raw.get(":method", ""), raw.get(":path", ""), raw,
                                              repeated=repeated, has_body=not message.end_of_stream)
        self.headers = head.headers
        self.remove = list(head.stripped)
        self.request_id = head.request_id
        self.model = head.model
        if head.repeated is not None:
            # Never a merged tenant or lane ("acme,globex"): the client must say it once.
            return self.refuse(Reason.BAD_REQUEST, f"Header {head.repeated!r} appears more than once.")
        headers = head.headers
        if self.p.edge is not None and headers.get(EDGE_HEADER) == "1" and JUDGED_HEADER not in headers:
            return _JUDGE_EDGE
        return self.proceed()

    def edge_entries(self) -> dict[str, str]:
        """What the ratelimit filter's arrival descriptor would carry (besides ``generic_key``)."""
        head = self.head
        assert head is not None
        return self.p.intake.descriptor(head.method, head.path, head.headers)

    def after_edge(self, answer: Inline | None) -> pb.ProcessingResponse | None:
        """The edge's answer (None: off or failed, so the request goes on), as Envoy's ratelimit
        filter would apply it: over the limit, its 429 now; else its x-ratelimit-* headers for the
        response, and ext_proc's own decision."""
        if answer is not None:
            if answer.status is not None:
                self.limits = _ratelimit_headers((answer.status,))
            if answer.shed is not None:
                # Decided: whatever a stream sends after its refusal passes untouched (never a ticket).
                self.edge_shed, self.outcome = True, Outcome.REJECTED
                return _edge_shed(answer.shed, self.limits)
            if answer.shadow is not None:
                self.edge_shadow = answer.shadow
        return self.proceed()

    def with_edge_shadow(self, response: pb.ProcessingResponse) -> pb.ProcessingResponse:
        """``response`` (a copy: answers may be shared) carrying the edge's shadow verdict, once."""
        marked = pb.ProcessingResponse()
        marked.CopyFrom(response)
        # Beside what the answer records there already (the admission, for a token charge).
        marked.dynamic_metadata.get_or_create_struct(NAMESPACE)["edge_shadow"] = self.edge_shadow
        self.edge_shadow = None
        return marked

    def proceed(self) -> pb.ProcessingResponse | None:
        """After the headers (and the edge): read the body, or None to decide on the headers."""
        head = self.head
        assert head is not None
        client = self.client
        if head.read_body:
            machine = self.p.controller.machine
            refused = machine.body_refusal(client, id(self), self.p.controller.now())
            if refused is not None:
                return self.refuse(refused, None, retry_after=int(machine.body_timeout_s) or 1)
            self.waiting_body = True
            # The mode can change only here, in the answer to the request headers: whether the response
            # headers are asked for is settled now, for a decision that comes with the body.
            sampled = self.sampled = self.p.sample()
            if not self.remove:
                return _READ_BODY if sampled else _READ_BODY_UNSAMPLED
            response = pb.ProcessingResponse(mode_override=BODY_MODE if sampled else BODY_MODE_UNSAMPLED)
            _continue(response.request_headers.response, self.remove)
            return response
        return None

    def refuse(self, reason: Reason, detail: str | None, retry_after: int | None = None
               ) -> pb.ProcessingResponse:
        """An answer that ends the request before it is classified (bad request, slow body)."""
        self.outcome, self.reason = Outcome.REJECTED, reason
        self.policy = self.p.policy_hash()
        controller = self.p.controller
        controller.metrics.intake_rejections.labels(reason.value).inc()
        controller.refused(*self._owner(reason))
        return _immediate(reject(reason, None, retry_after, detail=detail), reason, self.limits)

    def _owner(self, reason: Reason) -> tuple[str, Reason, str | None]:
        """A refusal before classification as counted: the lane its headers give (``ANY_LANE`` when they
        leave several, or the request cannot be classified as sent) and its tenant (None: unknown)."""
        head = self.head
        if head is None or reason is Reason.BAD_REQUEST:
            return ANY_LANE, reason, None
        intake = self.p.intake
        lanes = intake.lanes(head.method, head.path, head.headers)
        return (lanes[0] if len(lanes) == 1 else ANY_LANE), reason, \
            intake.tenant(head.method, head.path, head.headers)

    def on_response_headers(self, message: pb.HttpHeaders) -> pb.ProcessingResponse:
        self.p.responses.received += 1
        self.status = _status_of(message)
        if not self.limits:
            return _RESPONSE_HEADERS_PASSTHROUGH
        return _RESPONSE_HEADERS(self.limits)

    def on_body(self, message: pb.HttpBody) -> pb.ProcessingResponse | None:
        """The answer to a body chunk, or None when the request is to be decided on this one."""
        self.waiting_body = False
        head = self.head
        if head is None or self.ticket is not None or self.outcome is not None:
            # Later chunks (not expected with BUFFERED_PARTIAL) pass untouched.
            return _BODY_PASSTHROUGH
        body = self.body = self.p.intake.read(head, message.body, message.end_of_stream)
        refusal = self.p.controller.machine.body_verdict(body)
        if refusal is not None:
            # Before any ticket: no slot to give back.
            return self.refuse(refusal.reason, refusal.detail)
        if body.stream and not body.usage_asked:
            self.raw_body = message.body
        return None

    def decide(self) -> Decision:
        """Classify, estimate and submit: admitted, rejected, or queued (then Controller.wait decides)."""
        assert self.head is not None
        arrival = self.p.intake.arrival(self.head, self.body)
        self.policy = self.p.policy_hash()
        self.model = arrival.facts.model
        self.cls = arrival.classification
        decision = self.p.controller.submit(arrival.lane, arrival.tenant, arrival.job, retry=arrival.retry)
        self.ticket = decision.ticket
        return decision

    def hold(self, decision: Decision) -> pb.ProcessingResponse:
        """Keep Envoy's per-message timer from firing while the request waits for a slot."""
        controller = self.p.controller
        hold = min(decision.ticket.deadline - controller.now() + HOLD_MARGIN_S,
                   controller.policy.capacity.max_hold)
        return pb.ProcessingResponse(override_message_timeout=Duration(
            seconds=int(hold), nanos=int((hold % 1) * 1e9)))

    def answer(self, decision: Decision, phase: str) -> pb.ProcessingResponse:
        """CONTINUE with the x-extproc-* headers, or the rejection, for a final decision."""
        self.outcome, self.reason, self.shadow = decision.outcome, decision.reason, decision.shadow
        self.saturation = decision.saturation
        if decision.outcome is not Outcome.ADMITTED:
            return self._reject(decision)
        t = decision.ticket
        headers: Headers = (
            ("x-extproc-lane", t.lane),
            ("x-extproc-tenant", t.tenant),
            ("x-extproc-queue-ms", str(round(t.queue_wait * 1000))),
            ("x-extproc-predicted-ms", str(round(t.predicted * 1000))),
        )
        if decision.shadow is not None:
            # Lets the backend's own logs show what enforcing would have done.
            would = decision.shadow.value + (f"; reason={decision.reason.value}" if decision.reason else "")
            headers += (("x-extproc-shadow", would),)
        head = self.head
        remove = self.remove
        if phase == "request_headers":
            # Decided on its headers: this answer carries the mode (a body's answer cannot change it).
            self.sampled = self.p.sample()
        sampled = self.sampled
        if sampled:
            self.p.responses.asked += 1
        else:
            self.p.responses.skipped += 1
        # Not sampled: the response headers never reach extproc, so the edge's x-ratelimit-* travel in
        # the metadata, for the proxy's route to add (sampled: on the response-headers answer, as ever).
        limits = _NO_LIMITS if sampled else self.limits
        # (The proxy's own x-extproc-usage-filter never reaches the backend: the shipped routes drop
        # it, so no request pays for removing it here.)
        usage = plan(self.p.controller.policy.ratelimit, t.tenant, head.path, head.headers,
                     self.body) if head is not None else None
        if (usage is None or not usage.record) and not remove:
            # (The usual case: an answer with nothing of its own. One carrying the edge's limits, whose
            # remaining count moves with every request, is built for it: kept, it would only push the
            # answers that do recur out of the cache.)
            key = (phase, headers, sampled, limits)
            return _ADMISSIONS(key) if not limits else _admission(key)
        response, common = _answer_in(phase, sampled)
        if usage is None or not usage.record:
            _continue(common, remove, headers)
            if limits:
                response.dynamic_metadata.update({NAMESPACE: limits_metadata(limits)})
            return response
        rewritten = None
        if usage.ask and phase == "request_body" and self.raw_body is not None and self.body is not None:
            try:
                rewritten = ask_for_usage(self.raw_body, self.body)
            except Exception:  # client input: never let it end the stream (the request goes on as sent)
                self.p.log.warning("could not ask for usage", request_id=self.request_id, exc_info=True)
        if rewritten is not None:
            common.body_mutation.body = rewritten
            # A compressed answer could not be read nor stripped: ask for it plain.
            remove = [*remove, "accept-encoding"]
        _continue(common, remove, headers)
        # What the edge charges the tenant when the response ends (an estimate from this if the
        # response reports no usage), and whether the proxy removes the usage event asked for here.
        body = self.body
        meta = admission_metadata(t.job.prompt_tokens, t.job.output_tokens,
                                  body.max_tokens if body is not None else None, t.predicted, time.time(),
                                  strip=rewritten is not None)
        if limits:
            meta.update(limits_metadata(limits))  # (beside the usage record, in the one namespace)
        response.dynamic_metadata.update({NAMESPACE: meta})
        return response

    def _reject(self, decision: Decision) -> pb.ProcessingResponse:
        reason = decision.reason or Reason.QUEUE_FULL
        effect = decision.saturation
        # The scheduler booked the client's return and reserved that retry in the retry budget; with
        # the schedule full or no room it says x-should-retry: false (the OpenAI SDKs obey it).
        rejection = reject(reason, decision.ticket.lane, decision.retry_after,
                           retry_after_ms=decision.retry_after_ms,
                           signal=effect.signal if effect is not None else None,
                           rule=effect.shed_by if effect is not None else None,
                           retry_allowed=decision.retry_allowed)
        return _immediate(rejection, reason, self.limits)

    def finish(self, *, aborted: bool) -> None:
        """Release the slot (exactly once) and write the request's one decision record."""
        pending = self.pending
        if pending is not None and not pending.done():
            pending.cancel()
        ticket = self.ticket
        controller = self.p.controller
        service_ms: int | None = None
        if self.waiting_body:
            controller.machine.body_came(self.client, id(self))
        status = self.status
        if ticket is not None:
            if ticket.admitted_at is not None and self.outcome is Outcome.ADMITTED:
                service_ms = round((controller.now() - ticket.admitted_at) * 1000)
            elif self.outcome is None:
                self.outcome = Outcome.CANCELLED
            # Only a successful response's time says how long such a request takes: a 400 or a 500
            # answered at once would teach the estimator that requests are nearly free. How the
            # stream ended says nothing more: Envoy ends it alike (EOF, then a reset that may race
            # ahead of it) for a finished response and for one whose client left mid-way.
            controller.release(ticket, learn=status is not None and 200 <= status < 300)
        if self.headers is None or self.edge_shed:
            return  # (shed at the edge, before any decision of ext_proc's: the edge logged it)
        if ticket is None and not aborted and self.outcome is None:
            # The stream ended normally without a decision. Either the client went away before
            # its body came (harmless: with Envoy's graceful close a departed client's stream ends
            # this way, not with a reset), or the filter ignored our body-mode override and the
            # request went upstream undecided: a steady share means allow_mode_override is off
            # (alert ExtprocUndecidedRequests).
            controller.metrics.stream_errors.labels("undecided").inc()
            self.p.log.warning("stream ended before a decision: client gone before its body, or the "
                               "ext_proc filter lacks allow_mode_override", request_id=self.request_id)
        self._record(self.headers, service_ms)

    def _record(self, headers: Mapping[str, str], service_ms: int | None) -> None:
        """Write the request's one decision record."""
        cls = self.cls
        ticket = self.ticket
        controller = self.p.controller
        fields: dict[str, Any] = {
            "request_id": self.request_id,
            # The sha256 of the policy file that decided it (``simulate --verify --policy`` matches it).
            "policy": self.policy,
            "lane": cls.lane if cls else None,
            "tenant": self.p.redactor.tenant(cls.tenant) if cls else None,
            "rule": cls.rule if cls else None,
            "outcome": self.outcome.value if self.outcome else "abandoned",
            "reason": self.reason.value if self.reason and self.shadow is None else None,
            "model": self.model,
            # What a replay needs to classify the request again: when it came, where to, and
            # the headers the policy trusts (never the others: they may carry credentials).
            "arrival": round(self.arrival, 3),
            "method": headers.get(":method", ""),
            "path": headers.get(":path", "").split("?", 1)[0],
            "status": self.status,
            # (credential-like values as keyed hashes: see core/redaction.py).
            "headers": self.p.redactor.headers(headers, self.p.controller.policy.trusted_headers),
        }
        if ticket is not None:
            job = ticket.job
            fields["queue_ms"] = round(ticket.queue_wait * 1000)
            fields["predicted_ms"] = round(ticket.predicted * 1000)
            fields["service_ms"] = service_ms
            fields["prompt_tokens"] = job.prompt_tokens
            fields["output_tokens"] = job.output_tokens
            if ticket.retry:
                fields["retry"] = True
            if ticket.first is not None:
                fields["claimed"] = True  # a retry that came back on its booked return
            if not self.sampled and self.outcome is Outcome.ADMITTED:
                # Its response headers were not asked for (--response-sample): why status is null.
                fields["sampled"] = False
        auto = controller.machine.auto
        if auto is not None:
            # The self-sized fleet limit in force when the request ended (shadow: the one computed).
            fields["capacity_limit"] = auto.limit
        if self.saturation is not None:
            fields["signal"] = self.saturation.signal
            fields["saturation_rule"] = self.saturation.shed_by
        if self.shadow is not None:
            fields["shadow"] = self.shadow.value
            fields["shadow_reason"] = self.reason.value if self.reason else None
        if self.body is not None and (self.body.note or self.body.invalid):
            fields["body"] = self.body.note or self.body.invalid  # (read in part, not at all, or refused)
        if self.remove:
            # Client-sent x-extproc-* headers extproc had to drop itself: a gateway that strips them
            # first (the shipped configs do) never lets one through.
            fields["stripped"] = self.remove
        self.p.records.info("decision", **fields)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, controller: Controller, *, log_key: bytes | None = None,
                 overload_after: float = 0.0, edge: RateLimitService | None = None,
                 policy_hash: Callable[[], str] = str, response_sample: int = 1) -> None:
        self.controller = controller
        #: Which admitted requests' response headers are asked for (one in ``response_sample``).
        self.sample = ResponseSample(response_sample)
        #: Admitted requests whose response headers were asked for or not, and those that came.
        self.responses: ResponseCounts = controller.metrics.responses
        #: The sha256 of the policy file in force (read as each request is decided).
        self.policy_hash = policy_hash
        #: Refuses at once what reaches extproc too late to be worth deciding (0: off).
        self.overload = OverloadGuard(overload_after)
        self._overload_logged = 0.0
        self.linger = Linger()
        # One key for the process's life: a value hashes alike before and after a reload.
        self._log_key = log_key or secrets.token_bytes(32)
        self.redactor = Redactor(controller.policy, self._log_key)
        # A bound logger of our own (made after logging is configured): the module-level proxy
        # would resolve itself again on each of the one-per-request decision lines.
        self.log: structlog.typing.FilteringBoundLogger = log.bind()
        #: The body reads waiting under their deadline.
        self._deadlines = Deadlines()
        #: Where the decision lines go: the one line per request, off structlog's chain (``log.Lines``).
        self.records = Lines("extproc.decision")
        #: The edge, judged here for a proxy that says so (x-extproc-edge) rather than in a rate limit
        #: call of its own (None: every arrival goes on to ext_proc's decision).
        self.edge = edge

    @property
    def intake(self) -> Intake:
        """The one intake of the policy in force (the machine's)."""
        return self.controller.machine.intake

    def reconfigure(self) -> None:
        self.redactor = Redactor(self.controller.policy, self._log_key)

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        # One flat async generator per stream: every message passes through here, and each level
        # of nested async generators would add its own resume/suspend cost to every message.
        request = _Request(self)
        controller = self.controller
        aborted = True
        messages = aiter(request_iterator)
        try:
            while True:
                # (The usual case inline: a coroutine per message shows in the profile.)
                message = await (self._next(request, messages) if request.waiting_body or request.pending
                                 else anext(messages, None))
                if message is None:
                    if request.waiting_body:  # the body did not come in time
                        request.waiting_body = False
                        late = controller.machine.body_timeout(request.client, id(request))
                        yield request.refuse(late, None)
                    break
                kind = message.WhichOneof("request")
                if kind == "request_headers" and self.overload.max_delay > 0 \
                        and self._too_late(request, message):
                    yield _OVERLOADED
                    break
                response = self._answer_to(request, kind, message)
                if response is _JUDGE_EDGE:
                    response = request.after_edge(await self._judge_edge(request))
                if response is None:
                    decision = request.decide()
                    held = False
                    while True:
                        if decision.outcome is Outcome.QUEUED:
                            if not held:
                                # (Never the edge's shadow verdict on this one: Envoy reads nothing
                                # but the timeout from it. The final answer carries it.)
                                yield request.hold(decision)
                                held = True
                            got = await self._held(decision, request, messages)
                            if got is None:
                                # The stream ended while the request was held: its client is gone
                                # (finish() cancels the ticket, as for a reset).
                                aborted = False
                                return
                            decision = got
                        if decision.outcome is Outcome.ADMITTED and controller.ledger is not None:
                            # Several replicas: the shared ledger has the last word on the slot.
                            decision = await controller.confirm(decision)
                            if decision.outcome is Outcome.QUEUED:
                                continue
                        break
                    response = request.answer(decision, kind)
                if request.edge_shadow is not None:
                    response = request.with_edge_shadow(response)
                yield response
            aborted = False
        except Exception:
            self.controller.metrics.stream_errors.labels("exception").inc()
            structlog.get_logger("extproc").exception("ext_proc stream failed")
            raise
        finally:
            # Runs on normal end, client reset (CancelledError) and errors alike.
            request.finish(aborted=aborted)
        if self.linger.wanted():
            await self._linger()

    async def _linger(self) -> None:
        """A few turns of the event loop before the final status (see ``Linger``)."""
        try:
            for _ in range(Linger.YIELDS):
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.linger.cut()
            self.controller.metrics.resets_after_close.inc()
            raise
        self.linger.calm()

    def _too_late(self, request: _Request, message: pb.ProcessingRequest) -> bool:
        """Whether a request's first message came beyond extproc's decision rate (``OverloadGuard``): it
        then gets a prebuilt refusal, and no decision record (its cost is what the guard saves);
        counted, and logged once in a while."""
        if request.head is not None or request.outcome is not None:
            return False
        if self.overload.admit(_arrival(message.request_headers), time.time()):
            return False
        request.outcome = Outcome.REJECTED
        self._overloaded()
        return True

    async def _next(self, request: _Request, messages: AsyncIterator[pb.ProcessingRequest]
                    ) -> pb.ProcessingRequest | None:
        """The stream's next message when it is not a plain read: the body awaited under its deadline,
        or the read begun while the request was held. None: the stream ended, or the body is late (then
        ``request.waiting_body`` is still true)."""
        if request.waiting_body:
            return await self._body(request, messages)
        pending = request.pending
        assert pending is not None
        request.pending = None
        return await pending

    def _judge_edge(self, request: _Request) -> Awaitable[Inline | None]:
        """The edge's judgement of the request's arrival, in process (the call itself, to be awaited)."""
        assert self.edge is not None
        return self.edge.judge_inline(request.edge_entries(), request.request_id)

    def _answer_to(self, request: _Request, kind: str | None, message: pb.ProcessingRequest
                   ) -> pb.ProcessingResponse | None:
        """The answer to one message; None when the request is to be decided now, ``_JUDGE_EDGE`` when
        the edge is to judge it first."""
        if kind == "request_headers":
            if request.head is not None or request.outcome is not None:
                # One request per stream: a second headers message (never sent by Envoy) must not
                # make a second ticket, which would leave the first one's slot behind.
                self.controller.metrics.stream_errors.labels("repeated_headers").inc()
                return _passthrough(kind)
            return request.on_headers(message.request_headers, _client_of(message))
        if kind == "request_body":
            if request.waiting_body:
                self.controller.machine.body_came(request.client, id(request))
            return request.on_body(message.request_body)
        if kind == "response_headers":
            return request.on_response_headers(message.response_headers)
        return _passthrough(kind)

    def _overloaded(self) -> None:
        controller = self.controller
        controller.metrics.intake_rejections.labels(Reason.OVERLOADED.value).inc()
        # Refused before its headers were read (what the guard saves): no lane, no tenant.
        controller.refused(ANY_LANE, Reason.OVERLOADED, None)
        now = time.monotonic()
        if now - self._overload_logged >= _OVERLOAD_LOG_EVERY:
            self._overload_logged = now
            self.log.warning("overloaded: requests reached extproc too late to be decided and were refused",
                             refused=self.overload.take_refused(),
                             after_ms=round(self.overload.max_delay * 1000))

    async def _held(self, decision: Decision, request: _Request, messages: AsyncIterator[pb.ProcessingRequest]
                    ) -> Decision | None:
        """Wait for a held request's slot, or for its stream to end first (None: the client left).

        Why the stream too: an Envoy that ends ext_proc streams gracefully (the shipped configs, see
        envoy/envoy.yaml's layered_runtime) half-closes the stream of a request whose client went away
        and waits for extproc's status, rather than resetting it; nothing would cancel this wait, and
        the request would keep its place until admitted. The read is not cancelled when the slot
        comes first (grpc.aio leaks a cancelled read, grpc/grpc#43360): it stays on the request, and
        the stream's next message is taken from it."""
        pending = request.pending
        if pending is None:
            pending = request.pending = asyncio.ensure_future(_next(messages))
        waiter = asyncio.ensure_future(self.controller.wait(decision.ticket))
        try:
            while not waiter.done():
                await asyncio.wait((waiter, pending), return_when=asyncio.FIRST_COMPLETED)
                if not waiter.done() and pending.done():
                    if pending.exception() is None and pending.result() is None:
                        return None  # (half-closed: the client is gone)
                    # (Anything else while held, never sent by Envoy, is read once the answer went.)
                    return await waiter
            return waiter.result()
        finally:
            if not waiter.done():
                waiter.cancel()

    async def _body(self, request: _Request, messages: AsyncIterator[pb.ProcessingRequest]
                    ) -> pb.ProcessingRequest | None:
        """The next message while a body is awaited; None if the stream ended or the body is late
        (then ``request.waiting_body`` is still true)."""
        # Read in this task under a deadline: a task of its own for the read (ensure_future + wait)
        # cost a Task, a future and an extra pass of the event loop on every request with a body; and
        # one timer for every read rather than one each (servers/deadlines.py).
        try:
            return await self._deadlines.within(self.controller.machine.body_timeout_s, anext(messages))
        except TimeoutError:
            return None
        except StopAsyncIteration:
            # The client left before its body came: it no longer counts against its cap.
            self.controller.machine.body_came(request.client, id(request))
            request.waiting_body = False
            return None


async def _next(messages: AsyncIterator[pb.ProcessingRequest]) -> pb.ProcessingRequest | None:
    """The stream's next message; None at its end."""
    try:
        return await anext(messages)
    except StopAsyncIteration:
        return None


def _arrival(message: pb.HttpHeaders) -> bytes | None:
    """The proxy's arrival stamp (core/overload.py), if it sent one."""
    for header in message.headers.headers:
        if header.key == ARRIVAL_HEADER:
            return header.raw_value or None
    return None


#: extproc beyond its decision rate: the same answer for every such request, built once; its status is
#: the proxy's overload shed's signal until the proxy turns it into the 503 clients get (core/overload.py).
_OVERLOADED = _immediate(replace(reject(Reason.OVERLOADED, None, 1), status=SHED_STATUS), Reason.OVERLOADED)
#: At most one log line in this many seconds about overload refusals.
_OVERLOAD_LOG_EVERY = 5.0


def _passthrough(kind: str | None) -> pb.ProcessingResponse:
    """An empty answer of the right kind for messages extproc does not act on (shared, never mutated)."""
    response = _PASSTHROUGH.get(kind)
    if response is None:
        response = _PASSTHROUGH[kind] = _empty_answer(kind)
    return response


def _empty_answer(kind: str | None) -> pb.ProcessingResponse:
    response = pb.ProcessingResponse()
    if kind in ("request_trailers", "response_trailers"):
        getattr(response, kind).SetInParent()
    elif kind in ("response_headers", "response_body", "request_body"):
        getattr(response, kind).response.SetInParent()
    return response


#: One prebuilt answer per message kind: ``kind`` is one of ProcessingRequest's few oneof names.
_PASSTHROUGH: dict[str | None, pb.ProcessingResponse] = {}
_BODY_PASSTHROUGH = _passthrough("request_body")
_RESPONSE_HEADERS_PASSTHROUGH = _passthrough("response_headers")

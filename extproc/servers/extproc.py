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

``response_trailer_mode: SEND`` keeps the stream open until the HTTP request
ends; the stream's end — normal, client reset, Envoy timeout — is the only
reliable "finished" signal, so the slot is released in ``finally``, once.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.duration_pb2 import Duration

from extproc.controller import Controller
from extproc.core.admission import Decision, Ticket
from extproc.core.body import BodyFacts, read_body
from extproc.core.classify import Classification, Classifier, RequestFacts
from extproc.core.decision import Outcome, Reason

HEADER_PREFIX = "x-extproc-"
#: Envoy must never time out a hold before extproc answers it: the override carries this margin.
HOLD_MARGIN_S = 2.0
_OVERWRITE = HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD



def _mode(request_body: ProcessingMode.BodySendMode.ValueType) -> ProcessingMode:
    # Every field spelled out: Envoy replaces the whole mode with an override.
    return ProcessingMode(
        request_header_mode=ProcessingMode.SEND,
        response_header_mode=ProcessingMode.SKIP,
        request_body_mode=request_body,
        response_body_mode=ProcessingMode.NONE,
        request_trailer_mode=ProcessingMode.SKIP,
        response_trailer_mode=ProcessingMode.SEND,
    )


#: For a request whose body is read: the first buffered chunk only, so a huge body never stalls.
BODY_MODE = _mode(ProcessingMode.BUFFERED_PARTIAL)
#: For a request decided on its headers: whatever the filter's static mode, skip the body.
NO_BODY_MODE = _mode(ProcessingMode.NONE)

log = structlog.get_logger("extproc.decision")


def _header(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)


def _headers_of(message: pb.HttpHeaders) -> dict[str, str]:
    out: dict[str, str] = {}
    for h in message.headers.headers:
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        key = h.key.lower()
        # Repeated headers are joined as HTTP allows; classification compares whole values.
        out[key] = f"{out[key]},{value}" if key in out else value
    return out


def error_body(reason: Reason, lane: str, retry_after: int | None) -> bytes:
    """An OpenAI-style error document, so SDKs show a useful message and back off."""
    message = reason.message
    if retry_after is not None:
        message += f" Retry after {retry_after} s."
    doc = {
        "error": {
            "message": message,
            "type": "rate_limit_exceeded" if reason.http_status == 429 else "service_unavailable",
            "param": None,
            "code": reason.value,
            "lane": lane,
        }
    }
    return json.dumps(doc, separators=(",", ":")).encode()


class _Request:
    """One HTTP request's life on one ext_proc stream."""

    def __init__(self, processor: ExternalProcessor) -> None:
        self.p = processor
        self.ticket: Ticket | None = None
        self.facts: RequestFacts | None = None
        self.body: BodyFacts | None = None
        self.cls: Classification | None = None
        self.outcome: Outcome | None = None
        self.reason: Reason | None = None
        self.remove: list[str] = []
        self.content_length: int | None = None

    async def on_headers(self, message: pb.HttpHeaders) -> AsyncIterator[pb.ProcessingResponse]:
        headers = _headers_of(message)
        classifier = self.p.classifier
        # Client-sent x-extproc-* headers are dropped before anything reads them, unless trusted.
        self.remove = [k for k in headers if k.startswith(HEADER_PREFIX) and not classifier.trusted(k)]
        for key in self.remove:
            del headers[key]
        model_header = self.p.controller.policy.estimation.model_header
        self.facts = RequestFacts(
            method=headers.get(":method", ""),
            path=headers.get(":path", ""),
            headers=headers,
            model=headers.get(model_header) if model_header else None,
            request_id=headers.get("x-request-id", ""),
        )
        try:
            self.content_length = int(headers.get("content-length", ""))
        except ValueError:
            self.content_length = None
        if self.p.controller.policy.needs_body and not message.end_of_stream:
            yield pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(response=self._common(admit=False)),
                mode_override=BODY_MODE,
            )
            return
        async for response in self._decide("request_headers"):
            yield response

    async def on_body(self, message: pb.HttpBody) -> AsyncIterator[pb.ProcessingResponse]:
        if self.facts is None or self.ticket is not None or self.outcome is not None:
            # Later chunks (not expected with BUFFERED_PARTIAL) pass untouched.
            yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse()))
            return
        limit = self.p.controller.policy.estimation.max_body_bytes
        complete = message.end_of_stream and len(message.body) <= limit
        self.body = read_body(message.body[:limit], complete, self.content_length)
        async for response in self._decide("request_body"):
            yield response

    async def _decide(self, phase: str) -> AsyncIterator[pb.ProcessingResponse]:
        assert self.facts is not None
        controller = self.p.controller
        body = self.body or BodyFacts()
        facts = self.facts
        if facts.model is None and body.model is not None:
            facts = self.facts = dataclasses.replace(facts, model=body.model)
        self.cls = self.p.classifier.classify(facts)
        job = controller.scheduler.estimator.job(
            facts.model, body.prompt_chars, body.prompt_tokens, body.max_tokens
        )
        decision = controller.submit(self.cls.lane, self.cls.tenant, job)
        self.ticket = decision.ticket
        if decision.outcome is Outcome.QUEUED:
            hold = min(decision.ticket.deadline - controller.now() + HOLD_MARGIN_S,
                       controller.policy.capacity.max_hold)
            yield pb.ProcessingResponse(override_message_timeout=Duration(
                seconds=int(hold), nanos=int((hold % 1) * 1e9)))
            decision = await controller.wait(decision.ticket)
        self.outcome, self.reason = decision.outcome, decision.reason
        if decision.outcome is Outcome.ADMITTED:
            common = self._common(admit=True, decision=decision)
            if phase == "request_headers":
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                            mode_override=NO_BODY_MODE)
            else:
                yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
        else:
            yield self._reject(decision)

    def _common(self, *, admit: bool, decision: Decision | None = None) -> pb.CommonResponse:
        mutation = pb.HeaderMutation(remove_headers=self.remove)
        if admit and decision is not None and self.cls is not None:
            t = decision.ticket
            mutation.set_headers.extend([
                _header("x-extproc-lane", t.lane),
                _header("x-extproc-tenant", t.tenant),
                _header("x-extproc-queue-ms", str(round(t.queue_wait * 1000))),
                _header("x-extproc-predicted-ms", str(round(t.predicted * 1000))),
            ])
        return pb.CommonResponse(status=pb.CommonResponse.CONTINUE, header_mutation=mutation)

    def _reject(self, decision: Decision) -> pb.ProcessingResponse:
        reason = decision.reason or Reason.QUEUE_FULL
        lane = decision.ticket.lane
        headers = [
            _header("content-type", "application/json"),
            _header("x-extproc-reason", reason.value),
            _header("x-extproc-lane", lane),
        ]
        if decision.retry_after is not None:
            headers.append(_header("retry-after", str(decision.retry_after)))
        return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
            status=HttpStatus(code=reason.http_status),
            headers=pb.HeaderMutation(set_headers=headers),
            body=error_body(reason, lane, decision.retry_after),
            details=f"extproc_{reason.value}",
        ))

    def finish(self, *, aborted: bool) -> None:
        """Release the slot (exactly once) and write the request's one decision record."""
        ticket = self.ticket
        controller = self.p.controller
        service_ms: int | None = None
        if ticket is not None:
            if ticket.admitted_at is not None and self.outcome is Outcome.ADMITTED:
                service_ms = round((controller.now() - ticket.admitted_at) * 1000)
            elif self.outcome is None:
                self.outcome = Outcome.CANCELLED
            controller.release(ticket, learn=not aborted)
        if self.facts is None:
            return
        if ticket is None and not aborted:
            # The stream ended normally without a decision: the body we asked for never came,
            # so the request went upstream unadmitted. Envoy's filter needs allow_mode_override.
            self.p.controller.metrics.stream_errors.labels("undecided").inc()
            log.error("request was not decided: set allow_mode_override: true on the ext_proc filter "
                      "(or request_body_mode: BUFFERED_PARTIAL)", request_id=self.facts.request_id)
        fields: dict[str, Any] = {
            "request_id": self.facts.request_id,
            "lane": self.cls.lane if self.cls else None,
            "tenant": self.cls.tenant if self.cls else None,
            "rule": self.cls.rule if self.cls else None,
            "outcome": self.outcome.value if self.outcome else "abandoned",
            "reason": self.reason.value if self.reason else None,
            "model": self.facts.model,
        }
        if ticket is not None:
            fields.update(
                queue_ms=round(ticket.queue_wait * 1000),
                predicted_ms=round(ticket.predicted * 1000),
                service_ms=service_ms,
                prompt_tokens=ticket.job.prompt_tokens,
                output_tokens=ticket.job.output_tokens,
            )
        if self.body is not None and self.body.note:
            fields["body"] = self.body.note
        log.info("decision", **fields)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self.classifier = Classifier(controller.policy)

    def reconfigure(self) -> None:
        self.classifier = Classifier(self.controller.policy)

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        request = _Request(self)
        aborted = True
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("request")
                if kind == "request_headers":
                    async for response in request.on_headers(message.request_headers):
                        yield response
                elif kind == "request_body":
                    async for response in request.on_body(message.request_body):
                        yield response
                else:
                    yield _passthrough(kind)
            aborted = False
        except Exception:
            self.controller.metrics.stream_errors.labels("exception").inc()
            structlog.get_logger("extproc").exception("ext_proc stream failed")
            raise
        finally:
            # Runs on normal end, client reset (CancelledError) and errors alike.
            request.finish(aborted=aborted)


def _passthrough(kind: str | None) -> pb.ProcessingResponse:
    """An empty answer of the right kind for messages extproc does not act on."""
    response = pb.ProcessingResponse()
    if kind in ("request_trailers", "response_trailers"):
        getattr(response, kind).SetInParent()
    elif kind in ("response_headers", "response_body", "request_body"):
        getattr(response, kind).response.SetInParent()
    return response


"""Property-based fuzzing of the ext_proc servicer over real gRPC on loopback.

Hypothesis sends arbitrary sequences of ext_proc messages — phases missing, repeated, out of
order; huge, repeated, malformed and non-UTF-8 headers; huge, truncated, compressed-looking or
non-JSON bodies — over one to four concurrent streams, each ended by a half-close or an early
cancel at a random point; the proxy's x-extproc-edge among the headers now and then (the edge then
judged in the stream, with a tenant request budget that runs out). Whatever comes: no exception
escapes the servicer, every stream ends, and once all have ended nothing is left queued or in
flight.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.struct_pb2 import Struct
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from extproc.controller import Controller
from extproc.localstack import free_port
from extproc.metrics import Metrics, RateLimitMetrics
from extproc.policy import Policy
from extproc.policy.ratelimit import RateLimit
from extproc.servers.extproc import ExternalProcessor
from extproc.servers.ratelimit import RateLimitService

# Deadlines and the body timeout are short, and a plan's longest pause outlasts them (PAUSES): every
# example reaches the timers' paths too, and sixty examples take seconds, not tens of them.
POLICY = Policy.model_validate({
    "lanes": [{"name": "a", "max_inflight": 2, "max_queued": 4, "deadline": "0.15s"},
              {"name": "b", "max_inflight": 1, "max_queued": 2, "deadline": "0.1s", "borrow": True}],
    "capacity": {"max_inflight": 3},
    "trusted_headers": ["x-extproc-client", "x-model"],
    "classification": {"default_lane": "a", "rules": [{"match": {"path_prefix": "/b"}, "lane": "b"}]},
    "tenants": {"header": "x-extproc-client"},
    "estimation": {"read_body": "always", "body_timeout": "0.15s", "max_slow_bodies": 2,
                   "model_header": "x-model", "max_body_bytes": 4096},
    "queueing": {"sjf_weight": 1},
})


class Server:
    """The real servicer and controller on a grpc.aio server, on an event loop of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port = free_port()
        self.metrics = Metrics(CollectorRegistry())
        self.edge_registry = CollectorRegistry()
        self.controller: Controller | None = None
        self.server: grpc.aio.Server | None = None
        self.errors: list[str] = []

    async def _start(self) -> None:
        self.controller = Controller(POLICY, self.metrics)
        self.controller.start()
        processor = ExternalProcessor(self.controller)
        # A budget that runs out at once: most judged arrivals are shed.
        edge_config = RateLimit.model_validate({"budgets": {"default": {"requests": 1, "per": "hour"}}})
        processor.edge = RateLimitService(self.controller.machine,
                                          RateLimitMetrics(self.edge_registry), lambda: edge_config)
        original = processor.Process

        async def guarded(requests: Any, context: Any) -> Any:
            try:
                async for response in original(requests, context):
                    yield response
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # an escape: the property fails on it
                self.errors.append(f"{type(exc).__name__}: {exc}")
                raise

        processor.Process = guarded  # type: ignore[method-assign]
        self.server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(processor, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()

    def run(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> Server:
        self.thread.start()
        self.run(self._start())
        return self

    def __exit__(self, *_: object) -> None:
        async def stop() -> None:
            assert self.server is not None
            assert self.controller is not None
            await self.server.stop(0)
            await self.controller.stop()

        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    from extproc import log

    log.configure("json", "error")  # thousands of odd requests: their decision lines are not the point
    with Server() as s:
        yield s


# -- messages ---------------------------------------------------------------------------------------

header_names = st.one_of(
    st.sampled_from([":method", ":path", ":authority", "content-length", "content-type", "content-encoding",
                     "x-extproc-client", "x-extproc-lane", "X-Extproc-Client", "x-model", "x-request-id",
                     "x-stainless-retry-count", ":status", "x_extproc_lane", "x-extproc-edge",
                     "x-extproc-edge", ""]),
    st.text(min_size=1, max_size=40),
)
header_values = st.one_of(
    st.sampled_from([b"POST", b"GET", b"/v1/chat/completions", b"/b/x", b"//b/../a/%63", b"acme", b"-1",
                     b"50", b"99999999999999999999", b"gzip", b"br", b"identity, identity", b"x-foo",
                     b"application/json", b"", b"1", b"1"]),
    st.binary(max_size=64),
    st.just(b"v" * 65_000),
    st.text(max_size=200).map(str.encode),
)


@st.composite
def headers(draw: st.DrawFn) -> pb.HttpHeaders:
    pairs = draw(st.lists(st.tuples(header_names, header_values), max_size=12))
    return pb.HttpHeaders(headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v) for k, v in pairs]),
                          end_of_stream=draw(st.booleans()))


bodies = st.one_of(
    st.sampled_from([b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}',
                     b'{"max_tokens": 1e400}', b"[" * 5000, b"\x1f\x8b\x08\x00garbage", b"not json", b"",
                     b'{"max_tokens": "abc"}', b'{"max_completion_tokens": 0, "max_tokens": "2000"}',
                     b'{"max_tokens": 1' + b"0" * 400 + b"}"]),
    st.binary(max_size=2048),
    st.just(b"x" * 1_100_000),
)


@st.composite
def message(draw: st.DrawFn) -> pb.ProcessingRequest:
    kind = draw(st.sampled_from(["request_headers", "request_headers", "request_body", "request_body",
                                 "request_trailers", "response_headers", "response_body", "response_trailers",
                                 "empty"]))
    out = pb.ProcessingRequest()
    if kind in ("request_headers", "response_headers"):
        getattr(out, kind).CopyFrom(draw(headers()))
    elif kind in ("request_body", "response_body"):
        getattr(out, kind).CopyFrom(pb.HttpBody(body=draw(bodies), end_of_stream=draw(st.booleans())))
    elif kind in ("request_trailers", "response_trailers"):
        getattr(out, kind).SetInParent()
    if draw(st.booleans()):
        attributes = Struct()
        address = draw(st.sampled_from(["127.0.0.1:1", "[::1]:2", "x", "1.2.3.4"]))
        attributes.update({"source.address": address})
        out.attributes["envoy.filters.http.ext_proc"].CopyFrom(attributes)
    return out


@dataclass
class Plan:
    messages: list[pb.ProcessingRequest]
    ending: str
    """"close" (half-close after the messages), "cancel" (cancel after ``cut`` of them)."""
    cut: int
    pause: float
    edge: bool
    """The proxy's x-extproc-edge on every request headers message (the edge judged in the stream)."""


#: Seconds between a plan's messages: mostly none, a short gap, or longer than every timer in POLICY.
PAUSES = [0.0, 0.0, 0.0, 0.025, 0.2]
plans = st.builds(Plan, st.lists(message(), max_size=6), st.sampled_from(["close", "cancel"]),
                  st.integers(min_value=0, max_value=6), st.sampled_from(PAUSES), st.booleans())


def told_to_judge(msg: pb.ProcessingRequest) -> pb.ProcessingRequest:
    out = pb.ProcessingRequest()
    out.CopyFrom(msg)
    out.request_headers.headers.headers.add(key="x-extproc-edge", raw_value=b"1")
    return out


async def play(port: int, plan: Plan) -> None:
    """One stream, as an Envoy that misbehaves would run it; returns once the stream is over."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        call = stub.Process()

        async def read() -> None:
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as exc:
                # Cancelled by us, or ended by the server: both are ends. Never "unknown" (an escape).
                codes.append(exc.code())
            except asyncio.CancelledError:
                # grpc.aio raises this in the reader of a call cancelled on this side.
                assert plan.ending == "cancel"

        codes: list[grpc.StatusCode] = []
        reader = asyncio.create_task(read())
        try:
            for i, msg in enumerate(plan.messages):
                if plan.ending == "cancel" and i >= plan.cut:
                    break
                await call.write(told_to_judge(msg) if plan.edge and msg.HasField("request_headers") else msg)
                if plan.pause:
                    await asyncio.sleep(plan.pause)
            if plan.ending == "cancel":
                call.cancel()
            else:
                await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the server ended the stream first (an immediate response)
        async with asyncio.timeout(15):
            await reader
        assert set(codes) <= {grpc.StatusCode.CANCELLED}, codes


async def until_idle(controller: Controller, within: float = 15.0) -> None:
    async with asyncio.timeout(within):
        while controller.machine.total_inflight or controller.machine.total_queued:  # noqa: ASYNC110
            await asyncio.sleep(0.02)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(streams=st.lists(plans, min_size=1, max_size=4))
def test_no_message_sequence_escapes_hangs_or_leaks(server: Server, streams: list[Plan]) -> None:
    async def scenario() -> None:
        await asyncio.gather(*(play(server.port, plan) for plan in streams))
        assert server.controller is not None
        await until_idle(server.controller)

    server.run(scenario())
    assert server.errors == []
    assert server.metrics.stream_errors.labels("exception")._value.get() == 0


def test_a_second_headers_message_makes_no_second_ticket(server: Server) -> None:
    """Found by the property above: a stream that sent request headers three times left a slot
    behind (each made a ticket; only the last was released)."""
    def request_headers(path: str) -> pb.ProcessingRequest:
        pairs = [(":method", b"POST"), (":path", path.encode())]
        headers = HeaderMap(headers=[HeaderValue(key=k, raw_value=v) for k, v in pairs])
        return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers, end_of_stream=True))

    plan = Plan([request_headers("/a"), request_headers("/b"), request_headers("/a")], "close", 0, 0.0, False)

    async def scenario() -> None:
        await play(server.port, plan)
        assert server.controller is not None
        await until_idle(server.controller, within=5)

    before = server.metrics.stream_errors.labels("repeated_headers")._value.get()
    server.run(scenario())
    assert server.metrics.stream_errors.labels("repeated_headers")._value.get() == before + 2


def test_the_edge_judged_in_the_stream_sheds_and_leaves_nothing(server: Server) -> None:
    """The plans above reach the edge (x-extproc-edge) as well: here one tenant's budget of one request
    an hour, spent by its first, sheds its second before any body; nothing is left behind, even when
    the stream goes on after its refusal (found by the property above: a body after the edge's 429
    made a ticket the stream's end never released)."""
    def arrival(tenant: bytes) -> pb.ProcessingRequest:
        pairs = [(":method", b"POST"), (":path", b"/v1/chat/completions"), ("x-extproc-client", tenant)]
        headers = HeaderMap(headers=[HeaderValue(key=k, raw_value=v) for k, v in pairs])
        return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers, end_of_stream=True))

    tenant = b"edge-probe"  # a tenant no hypothesis example names
    first = Plan([arrival(tenant)], "close", 0, 0.0, True)
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=b'{"max_tokens": 5}', end_of_stream=True))
    second = Plan([arrival(tenant), body], "close", 0, 0.0, True)
    sample = server.edge_registry.get_sample_value
    labels = {"lane": "a", "code": "over_limit", "reason": "tenant_request_budget", "shadow": "false"}
    shed_before = sample("extproc_ratelimit_decisions_total", labels) or 0.0

    async def scenario() -> None:
        await play(server.port, first)
        await play(server.port, second)
        assert server.controller is not None
        await until_idle(server.controller, within=5)

    server.run(scenario())
    assert (sample("extproc_ratelimit_decisions_total", labels) or 0.0) == shed_before + 1
    assert server.errors == []
    assert server.controller is not None
    assert (server.controller.machine.total_inflight, server.controller.machine.total_queued) == (0, 0)


def test_a_refused_body_and_an_absurd_token_limit_leave_nothing(server: Server) -> None:
    """A token limit the model servers refuse is a 400 before any ticket, even when the stream goes on
    after it; one 400 digits long (JSON allows it) is sized at max_output_tokens, not an overflow."""
    def request(body: bytes) -> list[pb.ProcessingRequest]:
        pairs = [(":method", b"POST"), (":path", b"/v1/chat/completions")]
        headers = HeaderMap(headers=[HeaderValue(key=k, raw_value=v) for k, v in pairs])
        return [pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers, end_of_stream=False)),
                pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]

    refused = Plan([*request(b'{"max_tokens": "abc"}'), *request(b"{}")[1:]], "close", 0, 0.0, False)
    absurd = Plan(request(b'{"max_tokens": 1' + b"0" * 400 + b"}"), "close", 0, 0.0, False)
    rejections = server.metrics.intake_rejections.labels("bad_request")
    before = rejections._value.get()

    async def scenario() -> None:
        await play(server.port, refused)
        await play(server.port, absurd)
        assert server.controller is not None
        await until_idle(server.controller, within=5)

    server.run(scenario())
    assert rejections._value.get() == before + 1
    assert server.errors == []
    assert server.metrics.stream_errors.labels("exception")._value.get() == 0

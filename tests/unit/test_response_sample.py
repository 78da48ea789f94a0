"""The response headers asked for on one admitted request in N (``extproc serve --response-sample``),
driven through the servicer without sockets, by a stand-in for Envoy that sends the response headers
only when the mode in force asks for them: which requests are asked, what the others carry instead
(the edge's x-ratelimit-* in dynamic metadata), what they learn and log, and that every slot comes
back once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry

from extproc.cli import build_parser
from extproc.controller import Controller
from extproc.core.decision import Ticket
from extproc.metrics import Metrics, RateLimitMetrics, ResponseCounts
from extproc.policy import Policy
from extproc.policy.ratelimit import RateLimit
from extproc.servers import extproc
from extproc.servers.extproc import LIMIT_KEYS, ExternalProcessor, ResponseSample, limits_metadata
from extproc.servers.ratelimit import RateLimitService

BODY = b'{"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}'

POLICY = {
    "lanes": [{"name": "interactive", "max_inflight": 100, "max_queued": 10, "deadline": "10s"}],
    "trusted_headers": ["x-extproc-client"],
    "classification": {"default_lane": "interactive"},
    "tenants": {"header": "x-extproc-client", "default": "anon"},
    "estimation": {"learning_rate": 0.5},
    "ratelimit": {"mode": "off"},
}


def policy(**changes: Any) -> Policy:
    return Policy.model_validate({**POLICY, **changes})


class Envoy:
    """One ext_proc filter in front of ``processor``: the static mode skips the response headers (as
    the shipped configs), an answer's ``mode_override`` replaces it; the response headers are sent
    when the mode in force asks for them, then the stream ends (an HTTP/1 upstream: no trailers)."""

    def __init__(self, processor: ExternalProcessor) -> None:
        self.processor = processor
        #: Response-headers messages sent to extproc.
        self.response_messages = 0

    async def request(self, *, tenant: str = "acme", body: bytes | None = BODY, status: int = 200,
                      edge: bool = False, before_end: asyncio.Event | None = None
                      ) -> list[pb.ProcessingResponse]:
        """One request's stream; ``before_end``: the response waits for it (the slot held till then)."""
        head = pb.ProcessingRequest()
        head.request_headers.end_of_stream = body is None
        for key, value in ((":method", "POST"), (":path", "/v1/chat/completions"),
                           ("x-extproc-client", tenant), ("x-extproc-usage-filter", "1"),
                           *((("x-extproc-edge", "1"),) if edge else ())):
            head.request_headers.headers.headers.add(key=key, raw_value=value.encode())
        answers: list[pb.ProcessingResponse] = []
        answered = asyncio.Event()
        mode = ProcessingMode(response_header_mode=ProcessingMode.SKIP, request_body_mode=ProcessingMode.NONE)

        async def answer_to(index: int) -> pb.ProcessingResponse:
            # (Envoy sends a message once the one before it is answered.)
            while len(answers) <= index:
                answered.clear()
                await answered.wait()
            return answers[index]

        async def messages() -> AsyncIterator[pb.ProcessingRequest]:
            nonlocal mode
            yield head
            first = await answer_to(0)
            if first.HasField("immediate_response"):
                return
            if first.HasField("mode_override"):
                mode = first.mode_override
            sent = 1
            if mode.request_body_mode == ProcessingMode.BUFFERED_PARTIAL and body is not None:
                message = pb.ProcessingRequest()
                message.request_body.body = body
                message.request_body.end_of_stream = True
                yield message
                if (await answer_to(sent)).HasField("immediate_response"):
                    return
                sent += 1
            if before_end is not None:
                await before_end.wait()
            if mode.response_header_mode == ProcessingMode.SEND:
                self.response_messages += 1
                message = pb.ProcessingRequest()
                message.response_headers.headers.headers.add(key=":status", raw_value=str(status).encode())
                yield message
                await answer_to(sent)

        async for answer in self.processor.Process(messages(), None):
            answers.append(answer)
            answered.set()
        return answers


class Stack:
    def __init__(self, the_policy: Policy, every: int, edge: RateLimit | None = None) -> None:
        self.registry = CollectorRegistry()
        self.controller = Controller(the_policy, Metrics(self.registry))
        self.processor = ExternalProcessor(self.controller, response_sample=every)
        if edge is not None:
            self.processor.edge = RateLimitService(self.controller.machine, RateLimitMetrics(self.registry),
                                                   lambda: edge)
        self.records: list[dict[str, Any]] = []
        self.processor.records = _Records(self.records)  # type: ignore[assignment]
        self.envoy = Envoy(self.processor)
        #: Each release's ``learn``, in order.
        self.learnt: list[bool] = []
        release = self.controller.release

        def recording(ticket: Ticket, *, learn: bool = True) -> None:
            self.learnt.append(learn)
            release(ticket, learn=learn)

        self.controller.release = recording  # type: ignore[method-assign]

    async def __aenter__(self) -> Stack:
        self.controller.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.controller.stop()

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


class _Records:
    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records

    def info(self, event: str, **fields: Any) -> None:
        self.records.append({"event": event, **fields})


def test_one_in_n_by_a_counter_the_first_asked() -> None:
    sample = ResponseSample(4)
    assert [sample() for _ in range(10)] == [True, False, False, False] * 2 + [True, False]
    every = ResponseSample()
    assert all(every() for _ in range(5))
    with pytest.raises(ValueError, match="1 or more"):
        ResponseSample(0)


def test_the_counts_are_exported_at_scrape_time() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    assert isinstance(metrics.responses, ResponseCounts)
    metrics.responses.asked, metrics.responses.skipped, metrics.responses.received = 2, 14, 2
    values = {kind: registry.get_sample_value("extproc_response_headers_total", {"kind": kind})
              for kind in ("asked", "skipped", "received")}
    assert values == {"asked": 2, "skipped": 14, "received": 2}


def test_the_unsampled_modes_skip_the_response_headers_and_only_them() -> None:
    for sampled, unsampled in ((extproc.BODY_MODE, extproc.BODY_MODE_UNSAMPLED),
                               (extproc.NO_BODY_MODE, extproc.NO_BODY_MODE_UNSAMPLED)):
        assert sampled.response_header_mode == ProcessingMode.SEND
        assert unsampled.response_header_mode == ProcessingMode.SKIP
        # Trailers stay asked for: they keep the stream, and with it the slot, to the request's end.
        assert unsampled.response_trailer_mode == ProcessingMode.SEND
        changed = ProcessingMode()
        changed.CopyFrom(unsampled)
        changed.response_header_mode = ProcessingMode.SEND
        assert changed == sampled
    assert extproc._READ_BODY_UNSAMPLED.mode_override == extproc.BODY_MODE_UNSAMPLED


def test_limits_metadata_names_each_header_once() -> None:
    limits = (("x-ratelimit-limit", '2, 2;w=60;name="tenant_requests"'), ("x-ratelimit-remaining", "1"),
              ("x-ratelimit-reset", "30"))
    assert limits_metadata(limits) == {"ratelimit_limit": '2, 2;w=60;name="tenant_requests"',
                                       "ratelimit_remaining": "1", "ratelimit_reset": "30"}
    assert set(LIMIT_KEYS) == {"x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset"}
    assert limits_metadata(()) == {}


@pytest.mark.parametrize("read_body", ["always", "never"])
async def test_one_in_n_gets_the_response_message_and_only_its_time_is_learnt(read_body: str) -> None:
    # read_body: the mode goes with the answer that asks for the body, or with the admission itself.
    async with Stack(policy(estimation={"learning_rate": 0.5, "read_body": read_body}), every=4) as stack:
        streams = [await stack.envoy.request() for _ in range(12)]
    assert stack.envoy.response_messages == 3
    modes = [s[0].mode_override for s in streams]
    asked = [m.response_header_mode == ProcessingMode.SEND for m in modes]
    assert asked == [True, False, False, False] * 3
    if read_body == "always":
        assert all(m.request_body_mode == ProcessingMode.BUFFERED_PARTIAL for m in modes)
        # The admission, on the body, changes no mode: that cannot be done there.
        assert not any(s[1].HasField("mode_override") for s in streams)
    # Every slot back once; only the sampled (their 2xx seen) taught the estimator.
    assert stack.controller.machine.total_inflight == 0
    assert stack.learnt == [True, False, False, False] * 3
    decisions = [r for r in stack.records if r["event"] == "decision"]
    assert [r["status"] for r in decisions] == [200, None, None, None] * 3
    assert ["sampled" in r for r in decisions] == [False, True, True, True] * 3
    assert all(r["sampled"] is False for r in decisions if "sampled" in r)
    assert all(r["outcome"] == "admitted" and r["service_ms"] is not None for r in decisions)
    assert {kind: stack.sample("extproc_response_headers_total", kind=kind)
            for kind in ("asked", "skipped", "received")} == {"asked": 3, "skipped": 9, "received": 3}


async def test_a_request_refused_on_its_body_took_its_turn_and_is_not_counted() -> None:
    # The mode goes with the answer that asks for the body, before the decision: a request refused on
    # its body took its turn (no response headers come for extproc's own refusal), and the counts are
    # of admitted requests only.
    async with Stack(policy(estimation={"read_body": "always"}), every=2) as stack:
        first = await stack.envoy.request()
        refused = await stack.envoy.request(body=b'{"max_tokens": "abc"}')
        third = await stack.envoy.request()
        fourth = await stack.envoy.request()
    assert refused[1].immediate_response.status.code == 400
    assert [s[0].mode_override.response_header_mode for s in (first, refused, third, fourth)] == [
        ProcessingMode.SEND, ProcessingMode.SKIP, ProcessingMode.SEND, ProcessingMode.SKIP]
    assert {kind: stack.sample("extproc_response_headers_total", kind=kind)
            for kind in ("asked", "skipped", "received")} == {"asked": 2, "skipped": 1, "received": 2}
    assert stack.controller.machine.total_inflight == 0


async def test_every_request_by_default_as_before() -> None:
    async with Stack(policy(), every=1) as stack:
        streams = [await stack.envoy.request() for _ in range(3)]
    assert stack.envoy.response_messages == 3
    assert stack.learnt == [True] * 3
    for answers in streams:
        assert answers[0].mode_override == extproc.BODY_MODE  # (the policy reads bodies that come)
        assert not any(a.HasField("dynamic_metadata") for a in answers)
    assert all("sampled" not in r for r in stack.records)


async def test_a_failed_response_teaches_nothing_sampled_or_not() -> None:
    async with Stack(policy(), every=2) as stack:
        for _ in range(4):
            await stack.envoy.request(status=503)
    assert stack.learnt == [False] * 4
    assert [r["status"] for r in stack.records] == [503, None, 503, None]


EDGE = RateLimit.model_validate({"budgets": {"default": {"requests": 100, "per": "hour"}}})


async def test_not_sampled_the_edges_limits_ride_in_the_metadata_sampled_on_the_response() -> None:
    async with Stack(policy(ratelimit={"budgets": {"default": {"requests": 100, "per": "hour"}}}), every=2,
                  edge=EDGE) as stack:
        sampled = await stack.envoy.request(edge=True, body=None)
        unsampled = await stack.envoy.request(edge=True, body=None)
    heads, answered = sampled
    assert heads.mode_override.response_header_mode == ProcessingMode.SEND
    assert not heads.HasField("dynamic_metadata")
    on_response = {h.header.key: h.header.raw_value.decode()
                   for h in answered.response_headers.response.header_mutation.set_headers}
    assert on_response["x-ratelimit-remaining"] == "99"
    [admitted] = unsampled
    assert admitted.mode_override.response_header_mode == ProcessingMode.SKIP
    record = dict(admitted.dynamic_metadata["extproc"])
    assert int(record.pop("ratelimit_reset")) > int(on_response["x-ratelimit-reset"])  # (2 taken now)
    assert record == {"ratelimit_limit": '100, 100;w=3600;name="tenant_requests"',
                      "ratelimit_remaining": "98"}
    assert stack.controller.machine.total_inflight == 0


async def test_not_sampled_with_a_body_the_limits_ride_on_the_admission_not_the_body_ask() -> None:
    # The body's answer may still refuse it (an ImmediateResponse carries the limits itself): the
    # metadata goes on the admission only.
    async with Stack(policy(estimation={"read_body": "always"},
                         ratelimit={"budgets": {"default": {"requests": 100, "per": "hour"}}}),
                  every=2, edge=EDGE) as stack:
        await stack.envoy.request(edge=True)
        ask, admitted = await stack.envoy.request(edge=True)
    assert ask.mode_override == extproc.BODY_MODE_UNSAMPLED
    assert not ask.HasField("dynamic_metadata")
    assert admitted.dynamic_metadata["extproc"]["ratelimit_remaining"] == "98"


async def test_a_token_budget_needs_no_response_message_its_record_keeps_both() -> None:
    # The charge is the proxy's (usage filter, rate limit call at stream end), from what the admission
    # recorded: an unsampled admission records it as ever, beside the edge's limits.
    budgets = {"budgets": {"default": {"requests": 100, "tokens": 10_000, "per": "hour"}}}
    async with Stack(policy(ratelimit=budgets), every=8, edge=RateLimit.model_validate(budgets)) as stack:
        await stack.envoy.request(edge=True)
        [admitted] = await stack.envoy.request(edge=True, body=None)
    record = dict(admitted.dynamic_metadata["extproc"])
    assert {"prompt_tokens", "output_tokens", "service_ms", "admitted_ms"} <= set(record)
    assert {"ratelimit_limit", "ratelimit_remaining", "ratelimit_reset"} <= set(record)
    assert admitted.mode_override.response_header_mode == ProcessingMode.SKIP


async def test_a_client_that_resets_mid_response_unsampled_frees_its_slot_once() -> None:
    async with Stack(policy(), every=8) as stack:
        await stack.envoy.request()  # (the sampled one)
        never = asyncio.Event()
        task = asyncio.create_task(stack.envoy.request(before_end=never))
        for _ in range(200):
            if stack.controller.machine.total_inflight == 1:
                break
            await asyncio.sleep(0.005)
        assert stack.controller.machine.total_inflight == 1
        task.cancel()  # the client goes away while its response streams: Envoy resets the stream
        with pytest.raises(asyncio.CancelledError):
            await task
        after = await stack.envoy.request()
    assert stack.controller.machine.total_inflight == 0
    assert stack.learnt == [True, False, False]
    assert after[0].mode_override.response_header_mode == ProcessingMode.SKIP
    decisions = [r for r in stack.records if r["event"] == "decision"]
    assert len(decisions) == 3
    assert decisions[1]["status"] is None


def test_the_flag_and_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).response_sample == 1
    assert parser.parse_args(["serve", "--response-sample", "8"]).response_sample == 8
    monkeypatch.setenv("EXTPROC_RESPONSE_SAMPLE", "16")
    assert build_parser().parse_args(["serve"]).response_sample == 16
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--response-sample", "0"])


def test_the_demo_and_outcomes_runs_take_the_sample_for_their_extproc() -> None:
    import argparse

    from extproc.sim import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert parser.parse_args([]).response_sample == 1
    assert parser.parse_args(["--response-sample", "8"]).response_sample == 8
    with pytest.raises(SystemExit):
        parser.parse_args(["--response-sample", "0"])


async def test_answers_carrying_the_edges_limits_are_not_kept_in_the_shared_cache() -> None:
    # Their remaining count moves with every request: kept, each would push out an answer that recurs.
    from extproc.servers import extproc as servicer
    servicer._ADMISSIONS._kept.clear()
    async with Stack(policy(ratelimit={"budgets": {"default": {"requests": 100, "per": "hour"}}}), every=8,
                  edge=EDGE) as stack:
        streams = [await stack.envoy.request(edge=True, body=None) for _ in range(8)]
    unsampled = [s[0] for s in streams[1:]]
    assert [a.dynamic_metadata["extproc"]["ratelimit_remaining"] for a in unsampled] == \
        [str(n) for n in range(98, 91, -1)]
    # Only the sampled one's answer, which carries no limits, is kept.
    assert [key[3] for key in servicer._ADMISSIONS._kept] == [()]

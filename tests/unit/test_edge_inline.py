"""The edge judged in the ext_proc headers phase (x-extproc-edge), driven through the servicer without
sockets: the answers Envoy's ratelimit filter would give, rendered by ext_proc."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ratelimit.v3 import rls_pb2 as rls
from prometheus_client import CollectorRegistry

from extproc.controller import Controller
from extproc.core.decision import Rejection
from extproc.core.machine import UNLIMITED, Check
from extproc.metrics import Metrics, RateLimitMetrics
from extproc.policy import Policy
from extproc.policy.ratelimit import RateLimit
from extproc.servers.extproc import _READ_BODY, ExternalProcessor, _edge_shed, _ratelimit_headers
from extproc.servers.ratelimit import RateLimitService

Limit = rls.RateLimitResponse.RateLimit
BODY = b'{"model": "m", "max_tokens": 10, "stream": true, "messages": [{"role": "user", "content": "hi"}]}'


def check(limit: int, remaining: int, unit: str | None = None, name: str = "", reset: float = 0.0) -> Check:
    return Check(False, None, name, limit, unit, remaining, reset)


def test_ratelimit_headers_as_envoys_draft_03() -> None:
    assert _ratelimit_headers([
        check(4, 3),  # a lane's places: no unit, so no window in the quota policy
        check(2, 1, "minute", "tenant_requests", 29.2),
        check(100, 50, "hour", "tenant_tokens", 1800),
        check(0, UNLIMITED),  # no limit: skipped
    ]) == (
        ("x-ratelimit-limit", '2, 2;w=60;name="tenant_requests", 100;w=3600;name="tenant_tokens"'),
        ("x-ratelimit-remaining", "1"),
        ("x-ratelimit-reset", "30"),  # whole seconds, rounded up, as the service reports them
    )
    assert _ratelimit_headers([check(2, 2)]) == (
        ("x-ratelimit-limit", "2"), ("x-ratelimit-remaining", "2"), ("x-ratelimit-reset", "0"))
    assert _ratelimit_headers([check(2**40, 2**40, reset=math.inf)]) == (
        ("x-ratelimit-limit", str(UNLIMITED)), ("x-ratelimit-remaining", str(UNLIMITED)),
        ("x-ratelimit-reset", "0"))
    assert _ratelimit_headers([]) == ()


def test_edge_shed_is_the_filters_429() -> None:
    rejection = Rejection(429, (("retry-after", "7"), ("content-type", "application/json")), b'{"error": {}}')
    shed = _edge_shed(rejection, (("x-ratelimit-remaining", "0"),)).immediate_response
    assert shed.status.code == 429
    assert shed.details == "request_rate_limited"
    assert shed.grpc_status.status == 8  # RESOURCE_EXHAUSTED, as rate_limited_as_resource_exhausted
    assert shed.body == b'{"error": {}}'
    headers = [(h.header.key, h.header.raw_value) for h in shed.headers.set_headers]
    assert headers == [("x-envoy-ratelimited", b"true"), ("retry-after", b"7"),
                       ("content-type", b"application/json"), ("x-ratelimit-remaining", b"0")]


def test_the_response_headers_answer_is_built_once_per_distinct_limits() -> None:
    from extproc.servers import extproc

    answers = extproc._RESPONSE_HEADERS
    one = _ratelimit_headers([check(4, 3)])
    assert answers(one) is answers(_ratelimit_headers([check(4, 3)]))
    other = answers(_ratelimit_headers([check(4, 2)]))
    assert headers_of(other.response_headers.response.header_mutation)["x-ratelimit-remaining"] == "2"
    for remaining in range(answers.KEPT + 5):  # (client load decides how many: bounded)
        answers(_ratelimit_headers([check(10**6, remaining)]))
    assert 0 < len(answers) <= answers.KEPT


def test_an_admission_with_nothing_of_its_own_is_one_shared_answer() -> None:
    from extproc.servers import extproc

    headers = (("x-extproc-lane", "interactive"), ("x-extproc-tenant", "acme"), ("x-extproc-queue-ms", "0"),
               ("x-extproc-predicted-ms", "1200"))
    body = extproc._ADMISSIONS(("request_body", headers, True, ()))
    assert body is extproc._ADMISSIONS(("request_body", tuple(headers), True, ()))
    assert body.request_body.response.status == pb.CommonResponse.CONTINUE
    assert headers_of(body.request_body.response.header_mutation) == dict(headers)
    assert not body.HasField("dynamic_metadata")
    heads = extproc._ADMISSIONS(("request_headers", headers, True, ()))
    assert heads is not body
    assert heads.mode_override == extproc.NO_BODY_MODE
    assert headers_of(heads.request_headers.response.header_mutation) == dict(headers)
    # Its response headers sampled out: the mode skips them, and the edge's limits ride in the metadata.
    limits = _ratelimit_headers([check(4, 3)])
    unsampled = extproc._ADMISSIONS(("request_headers", headers, False, limits))
    assert unsampled is extproc._ADMISSIONS(("request_headers", headers, False, limits))
    assert unsampled.mode_override == extproc.NO_BODY_MODE_UNSAMPLED
    assert dict(unsampled.dynamic_metadata["extproc"]) == {
        "ratelimit_limit": "4", "ratelimit_remaining": "3", "ratelimit_reset": "0"}
    plain = extproc._ADMISSIONS(("request_headers", headers, False, ()))
    assert plain.mode_override == extproc.NO_BODY_MODE_UNSAMPLED
    assert not plain.HasField("dynamic_metadata")


async def test_an_admission_that_records_usage_has_its_own_answer() -> None:
    # A tenant with a token budget: its admission carries the metadata its charge needs, and its body
    # rewritten to ask for usage; another tenant's is the shared answer, with neither.
    budgets = {"budgets": {"tenants": {"acme": {"tokens": 1000, "per": "minute"}}}}
    policy = Policy.model_validate({**POLICY.model_dump(mode="json", exclude_unset=True),
                                    "ratelimit": budgets})
    stack = Stack(policy, RateLimit.model_validate(budgets))
    stack.controller.start()
    try:
        plain = await stack.stream(tenant="globex")
        budgeted = await stack.stream(tenant="acme")
        again = await stack.stream(tenant="acme")
    finally:
        await stack.controller.stop()
    assert "extproc" not in plain[1].dynamic_metadata.fields
    assert not plain[1].request_body.response.HasField("body_mutation")
    assert budgeted[1].dynamic_metadata["extproc"]["strip_usage"] == "1"
    assert budgeted[1].request_body.response.body_mutation.body.endswith(b'"include_usage":true}}')
    assert budgeted[1] is not again[1]


_WINDOWS = {Limit.SECOND: 1, Limit.MINUTE: 60, Limit.HOUR: 3600, Limit.DAY: 86400}


def envoy_reads(answer: rls.RateLimitResponse) -> tuple[tuple[str, str], ...]:
    """What Envoy's ratelimit filter (DRAFT_VERSION_03) adds for a call's answer: the response's
    x-ratelimit-* headers, and on OVER_LIMIT the service's headers before them."""
    least = None
    policy = ""
    for status in answer.statuses:
        if not status.HasField("current_limit"):
            continue
        if least is None or status.limit_remaining < least.limit_remaining:
            least = status
        window = _WINDOWS.get(status.current_limit.unit, 0)
        if window:
            policy += f", {status.current_limit.requests_per_unit};w={window}"
            if status.current_limit.name:
                policy += f';name="{status.current_limit.name}"'
    limits = () if least is None else (
        ("x-ratelimit-limit", f"{least.current_limit.requests_per_unit}{policy}"),
        ("x-ratelimit-remaining", str(least.limit_remaining)),
        ("x-ratelimit-reset", str(least.duration_until_reset.seconds)))
    if answer.overall_code != rls.RateLimitResponse.OVER_LIMIT:
        return limits
    return (("x-envoy-ratelimited", "true"),
            *((h.key, h.raw_value.decode() or h.value) for h in answer.response_headers_to_add), *limits)


@pytest.mark.parametrize("mode", ["enforce", "shadow"])
async def test_judged_inline_the_edge_answers_as_its_call_does(mode: str) -> None:
    # Twins on one virtual clock: one judged by the rate limit call, the other inline, arrival by arrival.
    now = [100.0]
    config = RateLimit.model_validate({"mode": mode, "budgets": {
        "default": {"requests": 3, "per": "minute", "tokens": 1000}, "tenants": {"globex": {"requests": 1,
                                                                                         "per": "hour"}}}})
    policy = Policy.model_validate({**POLICY.model_dump(mode="json", exclude_unset=True),
                                    "lanes": [{"name": "interactive", "max_inflight": 1, "max_queued": 2,
                                               "deadline": "10s"}]})
    twins = []
    for _ in range(2):
        controller = Controller(policy, Metrics(CollectorRegistry()), clock=lambda: now[0],
                                rng=random.Random(1), edge_rng=random.Random(2))
        twins.append(RateLimitService(controller.machine, RateLimitMetrics(CollectorRegistry()),
                                      lambda: config, clock=lambda: now[0]))
    call, inline = twins
    seen = set()
    for i, tenant in enumerate(["acme", "acme", "globex", "acme", "globex", "acme", "acme", "initech"]):
        now[0] += 7.3
        entries = {"method": "POST", "path": "/v1/chat/completions", "x-extproc-client": tenant}
        request = rls.RateLimitRequest(domain=config.domain)
        add = request.descriptors.add().entries.add
        add(key="generic_key", value=config.request_descriptor)
        for key, value in entries.items():
            add(key=key, value=value)
        answer = call.decide(request)
        judged = await inline.judge_inline(entries, f"r{i}")
        assert judged is not None
        limits = _ratelimit_headers([judged.status] if judged.status is not None else [])
        if judged.shed is not None:
            mine = (("x-envoy-ratelimited", "true"), *judged.shed.headers, *limits)
            assert answer.raw_body == judged.shed.body
        else:
            mine = limits
        assert mine == envoy_reads(answer)
        shadow = answer.dynamic_metadata.fields.get("shadow")
        assert judged.shadow == (shadow.string_value if shadow is not None else None)
        seen.add("shed" if judged.shed is not None else "shadow" if judged.shadow else "ok")
    assert seen == ({"ok", "shed"} if mode == "enforce" else {"ok", "shadow"})


class Stack:
    """A controller, its ext_proc servicer and its edge, answering streams of messages."""

    def __init__(self, policy: Policy, edge: RateLimit) -> None:
        self.registry = CollectorRegistry()
        self.controller = Controller(policy, Metrics(self.registry))
        self.processor = ExternalProcessor(self.controller)
        self.config = edge
        self.edge = RateLimitService(self.controller.machine, RateLimitMetrics(self.registry),
                                     lambda: self.config)
        self.processor.edge = self.edge

    async def stream(self, *, proxy_says: bool = True, tenant: str = "acme", with_body: bool = True,
                     judged: bool = False, hold: asyncio.Event | None = None,
                     holding: asyncio.Event | None = None,
                     body_comes: bool = True) -> list[pb.ProcessingResponse]:
        # hold: the response headers come only once it is set (the slot is held till then; holding is
        # set when that wait begins); body_comes False (with a body announced): the body never comes, and
        # the stream stays open until ext_proc answers;
        head = pb.ProcessingRequest()
        head.request_headers.end_of_stream = not with_body
        for k, v in ((":method", "POST"), (":path", "/v1/chat/completions"),
                     ("content-length", str(len(BODY))), ("x-extproc-client", tenant),
                     ("x-extproc-usage-filter", "1"),
                     *((("x-extproc-edge", "1"),) if proxy_says else ()),
                     *((("x-extproc-edge-judged", "1"),) if judged else ())):
            head.request_headers.headers.headers.add(key=k, raw_value=v.encode())
        body = pb.ProcessingRequest()
        body.request_body.body = BODY
        body.request_body.end_of_stream = True
        response = pb.ProcessingRequest()
        response.response_headers.headers.headers.add(key=":status", raw_value=b"200")
        sent = [head] if not body_comes else [head, body, response] if with_body else [head, response]
        answers: list[pb.ProcessingResponse] = []
        answered = asyncio.Event()

        async def messages() -> AsyncIterator[pb.ProcessingRequest]:
            # Each message once the one before is answered, as Envoy sends them (a hold's timeout
            # override is no answer: nothing more comes while a request is held); none after a refusal.
            for i, message in enumerate(sent):
                while i and (len(answers) < i or answers[-1].HasField("override_message_timeout")):
                    answered.clear()
                    await answered.wait()
                if answers and answers[-1].HasField("immediate_response"):
                    return
                if message is response and hold is not None:
                    if holding is not None:
                        holding.set()
                    await hold.wait()
                yield message
            if not body_comes and not answers[-1].HasField("immediate_response"):
                await asyncio.Event().wait()  # (the stream stays open, silent)

        async for answer in self.processor.Process(messages(), None):
            answers.append(answer)
            answered.set()
        return answers

    async def once(self, **how: Any) -> list[pb.ProcessingResponse]:
        """One stream on a started controller, stopped again after."""
        self.controller.start()
        try:
            return await self.stream(**how)
        finally:
            await self.controller.stop()

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


POLICY = Policy.model_validate({
    "lanes": [{"name": "interactive", "max_inflight": 4, "max_queued": 4, "deadline": "10s"}],
    "trusted_headers": ["x-extproc-client"],
    "classification": {"default_lane": "interactive"},
    "tenants": {"header": "x-extproc-client", "default": "anon"},
    "estimation": {"read_body": "always"},
    "ratelimit": {"budgets": {"default": {"tokens": 1000, "per": "minute"}}},
})


def headers_of(mutation: Any) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


async def test_the_proxys_word_has_ext_proc_judge_the_edge_and_answer_as_the_filter() -> None:
    stack = Stack(POLICY, RateLimit.model_validate({"budgets": {"default": {"requests": 1, "per": "hour"}}}))
    stack.controller.start()
    try:
        first = await stack.stream()
        second = await stack.stream()
        globex = await stack.stream(tenant="globex")
        unjudged = await stack.stream(proxy_says=False)
    finally:
        await stack.controller.stop()
    # Admitted: the body read and decided as ever, the proxy's words left for the route to drop;
    # the response's headers carry the edge's x-ratelimit-* (the ratelimit filter's, before).
    heads, decided, response = first
    assert heads.mode_override.request_body_mode  # the body asked for
    assert not heads.request_headers.response.header_mutation.remove_headers
    assert headers_of(decided.request_body.response.header_mutation)["x-extproc-lane"] == "interactive"
    assert headers_of(response.response_headers.response.header_mutation) == {
        "x-ratelimit-limit": '1, 1;w=3600;name="tenant_requests"', "x-ratelimit-remaining": "0",
        "x-ratelimit-reset": "3600"}
    # The budget spent: the edge's 429 at once, before any body, and no ticket taken.
    [shed] = second
    refusal = shed.immediate_response
    assert refusal.status.code == 429
    sent = headers_of(refusal.headers)
    assert sent["x-envoy-ratelimited"] == "true"
    assert sent["x-extproc-reason"] == "tenant_request_budget"
    assert sent["x-ratelimit-remaining"] == "0"
    assert int(sent["retry-after"]) >= 1
    assert len(globex) == 3  # another tenant's budget
    # Without the proxy's word nothing is judged here (a proxy whose ratelimit filter calls).
    assert len(unjudged) == 3
    assert not unjudged[2].response_headers.response.header_mutation.set_headers
    assert stack.sample("extproc_ratelimit_decisions_total", lane="interactive", code="ok", reason="none",
                        shadow="false") == 2
    assert stack.sample("extproc_ratelimit_decisions_total", lane="interactive", code="over_limit",
                        reason="tenant_request_budget", shadow="false") == 1
    assert stack.controller.machine.total_inflight == 0


async def test_shadow_verdict_joins_the_admission_record() -> None:
    # Shadow mode: the would-be shed goes on, its verdict in the "extproc" metadata beside what a
    # token charge needs (a request decided on its headers: both on one answer, neither lost).
    stack = Stack(POLICY, RateLimit.model_validate({"mode": "shadow", "budgets": {
        "default": {"requests": 1, "per": "hour", "tokens": 1000}}}))
    stack.controller.start()
    try:
        first = await stack.stream(with_body=False)
        second = await stack.stream(with_body=False)
        read = await stack.stream()
    finally:
        await stack.controller.stop()
    assert "edge_shadow" not in first[0].dynamic_metadata["extproc"]
    record = second[0].dynamic_metadata["extproc"]
    assert record["edge_shadow"] == "tenant_request_budget"
    assert "admitted_ms" in record
    assert headers_of(second[0].request_headers.response.header_mutation)["x-extproc-lane"] == "interactive"
    # With a body to read, the verdict rides on the first answer (a shared one, copied), once.
    marked = [a.dynamic_metadata["extproc"]["edge_shadow"] for a in read
              if "extproc" in a.dynamic_metadata.fields and "edge_shadow" in a.dynamic_metadata["extproc"]]
    assert marked == ["tenant_request_budget"]
    assert "edge_shadow" in read[0].dynamic_metadata["extproc"]
    assert not _READ_BODY.HasField("dynamic_metadata")  # the shared answer itself is never marked


async def test_a_failing_edge_lets_the_request_on() -> None:
    stack = Stack(POLICY, RateLimit())

    def broken() -> RateLimit:
        raise RuntimeError("no policy")

    stack.edge.config = broken
    answers = await stack.once()
    assert len(answers) == 3
    assert headers_of(answers[1].request_body.response.header_mutation)["x-extproc-lane"] == "interactive"
    assert stack.sample("extproc_ratelimit_errors_total") == 1


@pytest.mark.parametrize(("mode", "judged"), [("off", False), ("enforce", True)])
async def test_an_edge_that_is_off_or_already_judged_judges_nothing(mode: str, judged: bool) -> None:
    # judged: the rate limit call judged this arrival already (its x-extproc-edge-judged mark).
    stack = Stack(POLICY, RateLimit.model_validate({"mode": mode}))
    answers = await stack.once(judged=judged)
    assert len(answers) == 3
    assert not answers[2].response_headers.response.header_mutation.set_headers
    assert stack.sample("extproc_ratelimit_decisions_total", lane="interactive", code="ok", reason="none",
                        shadow="false") == 0


async def test_ext_procs_own_refusals_carry_the_edges_limits() -> None:
    # The ratelimit filter in front of ext_proc put x-ratelimit-* on every response that passed it,
    # ext_proc's refusals included: judged inline, a hold's expiry and a late body's 408 carry them.
    policy = Policy.model_validate({**POLICY.model_dump(mode="json", exclude_unset=True),
                                    "lanes": [{"name": "interactive", "max_inflight": 1, "max_queued": 1,
                                               "deadline": "200ms"}],
                                    "estimation": {"read_body": "always", "body_timeout": "50ms"}})
    stack = Stack(policy, RateLimit.model_validate({"budgets": {"default": {"requests": 4, "per": "hour"}}}))
    stack.controller.start()
    release, holding = asyncio.Event(), asyncio.Event()
    try:
        async with asyncio.timeout(10):  # (a regression fails here rather than hanging)
            holder = asyncio.create_task(stack.stream(hold=release, holding=holding))
            await holding.wait()  # admitted, its slot taken
            assert stack.controller.machine.total_inflight == 1
            expired = await stack.stream()  # past the edge (the queue has room), then its deadline passes
            release.set()
            held = await holder
            ask, late = await stack.stream(body_comes=False)
    finally:
        release.set()
        await stack.controller.stop()
    assert len(held) == 3
    *_, hold, refusal = expired
    assert hold.HasField("override_message_timeout")
    assert (refusal.immediate_response.status.code, refusal.immediate_response.details) == (
        429, "extproc_deadline_expired")
    sent = headers_of(refusal.immediate_response.headers)
    assert "x-envoy-ratelimited" not in sent  # ext_proc's refusal, not the edge's shed
    # The fewest remaining when it was judged: the lane's places (1 in flight + 1 queued, the holder's
    # taken: 1 left), not its tenant's budget (4 an hour, 2 taken: 2 left).
    assert (sent["x-ratelimit-limit"], sent["x-ratelimit-remaining"]) == ("2", "1")
    assert ask.mode_override.request_body_mode  # the body asked for, and never sent
    assert (late.immediate_response.status.code, late.immediate_response.details) == (
        408, "extproc_body_timeout")
    # Judged with the lane free again (2 left) and its tenant's budget at 1 left: the budget's.
    late_sent = headers_of(late.immediate_response.headers)
    assert late_sent["x-ratelimit-limit"] == '4, 4;w=3600;name="tenant_requests"'
    assert late_sent["x-ratelimit-remaining"] == "1"
    assert 2690 <= int(late_sent["x-ratelimit-reset"]) <= 2700  # 3 of 4 to refill at 900 s each
    assert stack.controller.machine.total_inflight == 0

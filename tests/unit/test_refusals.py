"""One count of refusals: every request extproc refuses — at the edge, at intake, or by the scheduler —
is counted once in inference_admission_decisions_total{outcome="rejected"} and once in
inference_admission_rejections_total, by lane (``*`` when no single lane owns it) and by tenant, and
its record carries Envoy's request id and the policy's hash. Driven through the real servicers and
controller, without sockets."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry

from extproc.controller import Controller, named_tenants
from extproc.core.decision import ANY_LANE, Outcome, Reason
from extproc.core.estimate import Job
from extproc.metrics import OTHER_TENANT, Metrics, RateLimitMetrics
from extproc.policy import Policy
from extproc.policy.ratelimit import RateLimit
from extproc.servers.ratelimit import RateLimitService
from tests.unit.test_edge_inline import Stack
from tests.unit.test_ratelimit_service import OK, OVER, arrival, request

POLICY = Policy.model_validate({
    "lanes": [{"name": "interactive", "max_inflight": 4, "max_queued": 4, "deadline": "10s"},
              {"name": "batch", "max_inflight": 1, "max_queued": 0, "deadline": "10s"}],
    "trusted_headers": ["x-extproc-client"],
    "classification": {"default_lane": "interactive",
                       "rules": [{"match": {"path_prefix": "/m", "models": ["big"]}, "lane": "batch"}]},
    "tenants": {"header": "x-extproc-client", "default": "anon", "weights": {"acme": 2}},
    "estimation": {"read_body": "always", "body_timeout": "50ms"},
    "ratelimit": {"budgets": {"tenants": {"free": {"requests": 1, "per": "hour"}}}},
})
HASH = "ab" * 32


class Recorder:
    """A bound logger's stand-in that keeps what it was told (capture_logs misses a cached logger)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.records.append({"event": event, **fields})

    warning = error = exception = info

    def of(self, event: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["event"] == event]


def wired(policy: Policy = POLICY) -> tuple[Stack, Recorder]:
    """The servicer and its edge wired as ``App`` wires them (refusals counted, the policy's hash)."""
    stack = Stack(policy, policy.ratelimit)
    stack.edge.refused = stack.controller.refused
    stack.edge.policy_hash = stack.processor.policy_hash = lambda: HASH
    recorder = Recorder()
    stack.processor.log = stack.processor.records = stack.edge.log = recorder  # type: ignore[assignment]
    return stack, recorder


def by_lane(stack: Stack, name: str) -> dict[tuple[str, ...], float]:
    """A counter's samples, by their label values."""
    out: dict[tuple[str, ...], float] = {}
    for family in stack.registry.collect():
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sample.labels.values())] = sample.value
    return out


def assert_every_rejection_is_a_decision(stack: Stack) -> None:
    rejected: dict[str, float] = {}
    for (lane, _), n in by_lane(stack, "inference_admission_rejections_total").items():
        rejected[lane] = rejected.get(lane, 0) + n
    decided = {lane: n for (lane, outcome), n in by_lane(stack, "inference_admission_decisions_total").items()
               if outcome == "rejected"}
    assert rejected == decided


async def repeated_header(stack: Stack) -> list[pb.ProcessingResponse]:
    """A stream whose tenant header comes twice: refused before it can be classified."""
    head = pb.ProcessingRequest()
    head.request_headers.end_of_stream = True
    for k, v in ((":method", "POST"), (":path", "/v1/chat/completions"), ("x-request-id", "twice-1"),
                 ("x-extproc-client", "acme"), ("x-extproc-client", "globex")):
        head.request_headers.headers.headers.add(key=k, raw_value=v.encode())

    async def messages() -> AsyncIterator[pb.ProcessingRequest]:
        yield head

    return [answer async for answer in stack.processor.Process(messages(), None)]


async def test_edge_sheds_and_intake_refusals_count_with_the_schedulers() -> None:
    stack, recorder = wired()
    stack.controller.start()
    try:
        assert len(await stack.stream(tenant="free")) == 3  # its budget's one request
        [shed] = await stack.stream(tenant="free")  # the edge: its budget is spent
        assert shed.immediate_response.details == "request_rate_limited"
        [_, late] = await stack.stream(tenant="zeta", body_comes=False)  # the body never comes
        assert late.immediate_response.status.code == 408
        [twice] = await repeated_header(stack)
        assert twice.immediate_response.status.code == 400
    finally:
        await stack.controller.stop()
    rejections = by_lane(stack, "inference_admission_rejections_total")
    assert rejections == {("interactive", "tenant_request_budget"): 1, ("interactive", "body_timeout"): 1,
                          (ANY_LANE, "bad_request"): 1}
    assert_every_rejection_is_a_decision(stack)
    # By tenant: the policy's by name (a budget names "free"), the rest together.
    assert by_lane(stack, "extproc_tenant_requests_total") == {("free",): 2, (OTHER_TENANT,): 2}
    assert by_lane(stack, "extproc_tenant_rejections_total") == {
        ("free", "tenant_request_budget"): 1, (OTHER_TENANT, "body_timeout"): 1,
        (OTHER_TENANT, "bad_request"): 1}
    # The live view's rates count them too (the state document's reject_per_s).
    recent = stack.controller.recent.summary(stack.controller.now())
    assert recent["interactive"].reject_per_s > 0
    assert recent[ANY_LANE].reject_per_s > 0
    # Every record says which policy decided it; the edge's carries the request id Envoy logs.
    [edge] = recorder.of("edge_shed")
    assert edge["policy"] == HASH
    assert edge["request_id"] == ""  # (this stream sent none; see the next test)
    records = recorder.of("decision")
    assert [r["outcome"] for r in records] == ["admitted", "rejected", "rejected"]
    assert all(r["policy"] == HASH for r in records)
    assert records[2]["request_id"] == "twice-1"


async def test_an_edge_shed_joins_the_proxys_log_by_request_id_both_ways() -> None:
    stack, recorder = wired()
    # Judged in ext_proc: the request's own x-request-id.
    answer = await stack.edge.judge_inline({"method": "POST", "path": "/v1/chat/completions",
                                            "x-extproc-client": "free"}, "rid-inline-1")
    assert answer is not None
    answer = await stack.edge.judge_inline({"method": "POST", "path": "/v1/chat/completions",
                                            "x-extproc-client": "free"}, "rid-inline-2")
    assert answer is not None
    assert answer.shed is not None
    # A rate limit call (--edge call): the descriptor's request_id entry.
    call = stack.edge.decide(request({**arrival(x_extproc_client="free"), "request_id": "rid-call-3"}))
    assert call.overall_code == call.OVER_LIMIT
    assert [r["request_id"] for r in recorder.of("edge_shed")] == ["rid-inline-2", "rid-call-3"]
    # Never classified as a header, never part of what the edge remembers of an arrival.
    assert all("request_id" not in r["headers"] for r in recorder.of("edge_shed"))
    assert len(stack.controller.machine._edge._arrivals) == 1
    rejections = by_lane(stack, "inference_admission_rejections_total")
    assert rejections == {("interactive", "tenant_request_budget"): 2}
    assert_every_rejection_is_a_decision(stack)


def test_a_shed_that_could_land_in_several_lanes_is_counted_in_lane_star() -> None:
    registry = CollectorRegistry()
    controller = Controller(POLICY, Metrics(registry))
    config = RateLimit.model_validate({"budgets": {"default": {"requests": 1, "per": "hour"}}})
    service = RateLimitService(controller.machine, RateLimitMetrics(registry), lambda: config,
                               refused=controller.refused)
    path = "/m/v1/chat/completions"  # its model (in the body, unseen here) decides its lane
    assert service.decide(request(arrival(path=path))).overall_code == OK
    assert service.decide(request(arrival(path=path))).overall_code == OVER
    assert registry.get_sample_value("inference_admission_rejections_total",
                                     {"lane": ANY_LANE, "reason": "tenant_request_budget"}) == 1
    assert registry.get_sample_value("inference_admission_decisions_total",
                                     {"lane": ANY_LANE, "outcome": "rejected"}) == 1
    assert registry.get_sample_value("extproc_ratelimit_decisions_total", {
        "lane": ANY_LANE, "code": "over_limit", "reason": "tenant_request_budget", "shadow": "false"}) == 1


def test_shadow_sheds_refuse_nothing_and_count_no_refusal() -> None:
    registry = CollectorRegistry()
    controller = Controller(POLICY, Metrics(registry))
    config = RateLimit.model_validate({"mode": "shadow",
                                       "budgets": {"default": {"requests": 1, "per": "hour"}}})
    service = RateLimitService(controller.machine, RateLimitMetrics(registry), lambda: config,
                               refused=controller.refused)
    for _ in range(3):
        assert service.decide(request(arrival())).overall_code == OK
    assert registry.get_sample_value("inference_admission_rejections_total",
                                     {"lane": "interactive", "reason": "tenant_request_budget"}) is None


def test_the_schedulers_refusals_count_by_lane_and_tenant_and_never_outnumber_decisions() -> None:
    now = [0.0]
    registry = CollectorRegistry()
    policy = Policy.model_validate({**POLICY.model_dump(mode="json", exclude_unset=True),
                                    "retry_budget": {"ratio": 0.0, "min_per_second": 0.0}})
    controller = Controller(policy, Metrics(registry), clock=lambda: now[0], rng=random.Random(3))
    job = Job(model=None, prompt_tokens=10, output_tokens=10)
    decisions = [controller.submit("batch", "acme", job) for _ in range(3)]  # 1 slot, no queue
    assert [d.outcome for d in decisions] == [Outcome.ADMITTED, Outcome.REJECTED, Outcome.REJECTED]
    assert controller.submit("interactive", "zeta", job, retry=True).outcome is Outcome.REJECTED
    controller.drain()
    assert controller.submit("interactive", "acme", job).reason is Reason.DRAINING
    sample = registry.get_sample_value
    assert sample("inference_admission_rejections_total", {"lane": "batch", "reason": "queue_full"}) == 2
    assert sample("inference_admission_rejections_total",
                  {"lane": "interactive", "reason": "retry_budget"}) == 1
    assert sample("extproc_tenant_requests_total", {"tenant": "acme"}) == 4
    assert sample("extproc_tenant_rejections_total", {"tenant": "acme", "reason": "queue_full"}) == 2
    assert sample("extproc_tenant_rejections_total", {"tenant": "acme", "reason": "draining"}) == 1
    assert sample("extproc_tenant_rejections_total", {"tenant": OTHER_TENANT, "reason": "retry_budget"}) == 1
    for lane in ("batch", "interactive"):
        refused = sum(s.value for f in registry.collect() for s in f.samples
                      if s.name == "inference_admission_rejections_total" and s.labels["lane"] == lane)
        assert refused == sample("inference_admission_decisions_total", {"lane": lane, "outcome": "rejected"})
    controller.release(decisions[0].ticket)


def test_the_tenants_a_policy_names_are_its_weights_default_budgets_and_rule_matches() -> None:
    policy = Policy.model_validate({**POLICY.model_dump(mode="json", exclude_unset=True),
                                    "classification": {"default_lane": "interactive", "rules": [
                                        {"match": {"tenants": ["vip"]}, "lane": "batch"}]}})
    assert named_tenants(policy) == {"anon", "acme", "free", "vip"}
    # A reload renames: a tenant the new policy does not name is counted as the rest.
    registry = CollectorRegistry()
    controller = Controller(POLICY, Metrics(registry))
    controller.reconfigure(policy)
    assert controller.metrics.tenant("vip") == "vip"
    assert controller.metrics.tenant("someone") == controller.metrics.tenant(None) == OTHER_TENANT


def test_a_paused_lane_has_a_gauge_of_its_own() -> None:
    registry = CollectorRegistry()
    controller = Controller(POLICY, Metrics(registry))
    assert registry.get_sample_value("extproc_lane_paused", {"lane": "batch"}) == 0
    controller.pause("batch")
    assert registry.get_sample_value("extproc_lane_paused", {"lane": "batch"}) == 1
    assert registry.get_sample_value("extproc_lane_paused", {"lane": "interactive"}) == 0
    controller.resume("batch")
    assert registry.get_sample_value("extproc_lane_paused", {"lane": "batch"}) == 0

"""The rate limit service, called directly with request protos: edge shed, budgets, shadow mode."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest
from envoy.extensions.common.ratelimit.v3.ratelimit_pb2 import RateLimitDescriptor
from envoy.service.ratelimit.v3 import rls_pb2 as pb
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from extproc.controller import Controller
from extproc.core.classify import Classifier, RequestFacts
from extproc.core.decision import Reason
from extproc.core.drain import Told
from extproc.core.edge import ANY_LANE, LanePressure, SchedulerPressure
from extproc.core.estimate import Job
from extproc.core.machine import Machine
from extproc.core.retry import retry_after
from extproc.metrics import Metrics, RateLimitMetrics
from extproc.policy import Policy
from extproc.policy.ratelimit import RateLimit
from extproc.policy.schema import ratelimit_problems
from extproc.servers.ratelimit import RateLimitService

OK = pb.RateLimitResponse.OK
OVER = pb.RateLimitResponse.OVER_LIMIT
Unit = pb.RateLimitResponse.RateLimit

POLICY: dict[str, Any] = {
    "lanes": [
        {"name": "interactive", "priority": 100, "max_inflight": 2, "max_queued": 4, "deadline": "10s"},
        {"name": "batch", "priority": 10, "max_inflight": 2, "max_queued": 0, "deadline": "30s"},
        {"name": "spare", "max_inflight": 2, "max_queued": 2, "deadline": "5s", "borrow": True,
         "max_borrow": 1},
        {"name": "gone", "max_inflight": 1, "deadline": "5s", "closed": True},
    ],
    "trusted_headers": ["x-tenant-id", "x-lane"],
    "classification": {
        "default_lane": "interactive",
        "lane_header": "x-lane",
        "rules": [
            {"match": {"path_prefix": "/batch"}, "lane": "batch"},
            {"match": {"path_prefix": "/spare"}, "lane": "spare"},
            {"match": {"path_prefix": "/gone"}, "lane": "gone"},
            {"match": {"path_prefix": "/m", "models": ["big"]}, "lane": "batch"},
        ],
    },
    "tenants": {"header": "x-tenant-id", "default": "anon"},
    "retry_after": {"min": 1, "max": 30, "jitter": 0},
}


def make_policy(**changes: Any) -> Policy:
    return Policy.model_validate({**POLICY, **changes})


class FakePressure:
    """The scheduler's load as a test sets it: idle lanes unless told otherwise."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.lanes: dict[str, LanePressure] = {
            lane.name: LanePressure(queued=0, max_queued=lane.max_queued, inflight=0, limit=lane.max_inflight,
                                    closed=lane.closed)
            for lane in policy.lanes
        }
        self.drain = 7.0
        self.drained: list[str] = []
        self.rng = random.Random(0)

    def lane(self, name: str) -> LanePressure | None:
        return self.lanes.get(name)

    def drain_s(self, lane: str) -> float:
        self.drained.append(lane)
        return self.drain

    def retry_after(self, lane: str, reason: Reason, drain: float, tenant: str) -> Told:
        # As a scheduler that has not measured a completion rate yet: its drain, jittered.
        config = self.policy.retry_after
        return Told(retry_after(drain if reason.retry_helps else config.max, config, self.rng))

    def claimable(self, lane: str, tenant: str) -> bool:
        return False

    def load(self, lane: str, *, inflight: int | None = None, queued: int = 0, **extra: Any) -> None:
        """Set a lane's load; a slot is free (as the scheduler would say) while it is under its limit
        and not paused, unless the test says otherwise (``slot_free=``: borrowing)."""
        current = self.lanes[lane]
        running = current.limit if inflight is None else inflight
        extra.setdefault("slot_free", running < current.limit and not extra.get("paused", False))
        self.lanes[lane] = replace(current, inflight=running, queued=queued, **extra)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Rig:
    def __init__(self, config: RateLimit | None = None, policy: Policy | None = None) -> None:
        self.registry = CollectorRegistry()
        self.metrics = RateLimitMetrics(self.registry)
        self.pressure = FakePressure(policy or make_policy())
        self.config = config or RateLimit()
        self.clock = Clock()
        self.service = RateLimitService(self.machine(), self.metrics, lambda: self.config, clock=self.clock)

    def machine(self) -> Machine:
        """A machine whose edge reads this rig's pressure (fresh budgets)."""
        return Machine(self.pressure.policy, pressure=self.pressure, edge_rng=random.Random(1))

    def ask(self, *descriptors: Mapping[str, str] | tuple[Mapping[str, str], int], domain: str = "extproc",
            hits: int = 0) -> pb.RateLimitResponse:
        return self.service.decide(request(*descriptors, domain=domain, hits=hits))

    def sample(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


def request(*descriptors: Mapping[str, str] | tuple[Mapping[str, str], int], domain: str = "extproc",
            hits: int = 0) -> pb.RateLimitRequest:
    out = pb.RateLimitRequest(domain=domain, hits_addend=hits)
    for item in descriptors:
        entries, addend = item if isinstance(item, tuple) else (item, None)
        descriptor = RateLimitDescriptor(
            entries=[RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries.items()])
        if addend is not None:
            descriptor.hits_addend.value = addend
        out.descriptors.append(descriptor)
    return out


def arrival(path: str = "/v1/chat/completions", method: str = "POST", **headers: str) -> dict[str, str]:
    return {"generic_key": "gpu_inference", "method": method, "path": path,
            **{k.replace("_", "-"): v for k, v in headers.items()}}


def usage(tokens: int, **headers: str) -> tuple[dict[str, str], int]:
    return ({"generic_key": "gpu_inference_tokens", **{k.replace("_", "-"): v for k, v in headers.items()}},
            tokens)


def headers_of(response: pb.RateLimitResponse) -> dict[str, str]:
    return {h.key: h.value for h in response.response_headers_to_add}


def budgets(**default: Any) -> RateLimit:
    return RateLimit.model_validate({"budgets": {"default": default}})


# -- lane pressure --------------------------------------------------------------------------


def test_idle_lane_is_ok_with_its_room_in_the_status() -> None:
    rig = Rig()
    response = rig.ask(arrival())
    assert response.overall_code == OK
    [status] = response.statuses
    assert status.code == OK
    # interactive: 2 slots + 4 queue places, no unit (places, not a rate).
    assert (status.current_limit.requests_per_unit, status.current_limit.unit) == (6, Unit.UNKNOWN)
    assert status.current_limit.name == "lane:interactive"
    assert status.limit_remaining == 6
    assert status.duration_until_reset.seconds == 0
    assert not response.response_headers_to_add
    assert not response.raw_body
    assert rig.pressure.drained == []  # the drain estimate is only computed for a full lane
    assert rig.sample("extproc_ratelimit_decisions_total", lane="interactive", code="ok", reason="none",
                      shadow="false") == 1


def test_remaining_counts_free_slots_and_queue_places() -> None:
    rig = Rig()
    rig.pressure.load("interactive", queued=3)
    [status] = rig.ask(arrival()).statuses
    assert status.code == OK
    assert status.limit_remaining == 1


def test_full_queue_and_no_free_slot_is_over_limit_with_retry_after_and_a_json_body() -> None:
    rig = Rig()
    rig.pressure.load("interactive", queued=4)
    response = rig.ask(arrival())
    assert response.overall_code == OVER
    [status] = response.statuses
    assert status.code == OVER
    assert status.limit_remaining == 0
    assert status.duration_until_reset.seconds == 7  # the drain estimate
    headers = headers_of(response)
    assert headers["retry-after"] == "7"
    assert headers["x-extproc-reason"] == "queue_full"
    assert headers["x-extproc-lane"] == "interactive"
    assert headers["content-type"] == "application/json"
    assert "x-should-retry" not in headers  # a retry after retry-after may well succeed
    error = json.loads(response.raw_body)["error"]
    assert error == {"message": "The inference queue for this lane is full. Retry after 7 s.",
                     "type": "rate_limit_exceeded", "param": None, "code": "queue_full",
                     "lane": "interactive"}
    assert rig.pressure.drained == ["interactive"]
    assert rig.sample("extproc_ratelimit_decisions_total", lane="interactive", code="over_limit",
                      reason="queue_full", shadow="false") == 1


def test_full_queue_with_a_free_slot_is_ok() -> None:
    rig = Rig()
    rig.pressure.load("interactive", inflight=1, queued=4)
    assert rig.ask(arrival()).overall_code == OK


@pytest.mark.parametrize(("drain", "expected"), [(0.0, 1), (float("inf"), 1), (float("nan"), 1),
                                                 (500.0, 30), (12.2, 13)])
def test_retry_after_is_bounded_whole_seconds(drain: float, expected: int) -> None:
    rig = Rig()
    rig.pressure.load("interactive", queued=4)
    rig.pressure.drain = drain
    response = rig.ask(arrival())
    assert headers_of(response)["retry-after"] == str(expected)


def test_a_lane_shed_says_the_scheduler_s_retry_after() -> None:
    # The lane's Retry-After is the scheduler's (its drain and jitter): the edge passes it on.
    policy = make_policy(retry_after={"min": 1, "max": 60, "jitter": 0.5})
    seen = set()
    for seed in range(20):
        rig = Rig(policy=policy)
        rig.pressure.rng = random.Random(seed)
        rig.pressure.load("interactive", queued=4)
        rig.pressure.drain = 20.0
        seen.add(int(headers_of(rig.ask(arrival()))["retry-after"]))
    assert len(seen) > 3
    assert all(10 <= s <= 30 for s in seen)


def test_queue_share_sheds_before_the_queue_is_full() -> None:
    rig = Rig(RateLimit(queue_share=0.5))
    rig.pressure.load("interactive", queued=1)
    assert rig.ask(arrival()).overall_code == OK
    rig.pressure.load("interactive", queued=2)
    response = rig.ask(arrival())
    assert response.overall_code == OVER
    assert response.statuses[0].current_limit.requests_per_unit == 4  # 2 slots + half of 4 places


def test_lane_without_a_queue_is_over_when_its_slots_are_full() -> None:
    rig = Rig()
    rig.pressure.load("batch", inflight=1)
    assert rig.ask(arrival("/batch/x")).overall_code == OK
    rig.pressure.load("batch")
    response = rig.ask(arrival("/batch/x"))
    assert response.overall_code == OVER
    assert headers_of(response)["x-extproc-lane"] == "batch"


def test_a_borrowing_lane_is_shed_only_when_it_cannot_borrow() -> None:
    rig = Rig()
    # Its own slots full, its queue full: whether it may borrow is the scheduler's call.
    rig.pressure.load("spare", queued=2, slot_free=True)  # idle slots elsewhere
    assert rig.ask(arrival("/spare")).overall_code == OK
    rig.pressure.load("spare", queued=2, slot_free=False)  # none it may take
    assert rig.ask(arrival("/spare")).overall_code == OVER


def test_closed_lane_says_retrying_will_not_help() -> None:
    rig = Rig()
    response = rig.ask(arrival("/gone"))
    assert response.overall_code == OVER
    headers = headers_of(response)
    assert headers["x-extproc-reason"] == "lane_closed"
    assert headers["x-should-retry"] == "false"
    assert headers["retry-after"] == "30"  # the policy's longest
    assert rig.pressure.drained == []


def test_paused_lane_is_shed_once_its_queue_is_full() -> None:
    rig = Rig()
    rig.pressure.load("interactive", inflight=0, queued=3, paused=True)
    assert rig.ask(arrival()).overall_code == OK  # ext_proc holds it until the lane resumes
    rig.pressure.load("interactive", inflight=0, queued=4, paused=True)
    assert headers_of(rig.ask(arrival()))["x-extproc-reason"] == "queue_full"


def test_closed_lane_by_the_pressure_view_is_closed() -> None:
    rig = Rig()
    rig.pressure.load("interactive", inflight=0, closed=True)
    assert headers_of(rig.ask(arrival()))["x-extproc-reason"] == "lane_closed"


def test_a_full_queue_still_takes_a_tenant_below_its_fair_share() -> None:
    rig = Rig()
    rig.pressure.load("interactive", queued=4, tenants={"acme": 3, "globex": 1})
    # ext_proc would push out one of acme's places for initech (and for globex: 3 > 2).
    assert rig.ask(arrival(x_tenant_id="initech")).overall_code == OK
    assert rig.ask(arrival(x_tenant_id="globex")).overall_code == OK
    response = rig.ask(arrival(x_tenant_id="acme"))
    assert headers_of(response)["x-extproc-reason"] == "queue_full"
    rig.pressure.load("interactive", queued=4, tenants={"acme": 2, "globex": 2})
    assert rig.ask(arrival(x_tenant_id="globex")).overall_code == OVER


def test_fair_shares_follow_tenant_weights() -> None:
    policy = make_policy(tenants={"header": "x-tenant-id", "default": "anon", "weights": {"acme": 4}})
    rig = Rig(policy=policy)
    rig.pressure.load("interactive", queued=4, tenants={"acme": 3, "globex": 1})
    # acme's 3 places weigh 0.75 each against globex's 2 after queueing: acme keeps its places.
    assert rig.ask(arrival(x_tenant_id="globex")).overall_code == OVER
    assert rig.ask(arrival(x_tenant_id="initech")).overall_code == OVER
    rig.pressure.load("interactive", queued=4, tenants={"globex": 4})
    assert rig.ask(arrival(x_tenant_id="acme")).overall_code == OK


def test_a_paused_lane_holds_requests_even_in_shadow_mode() -> None:
    rig = Rig()
    rig.pressure.load("interactive", inflight=0, queued=4, paused=True, shadow=True)
    assert rig.ask(arrival()).overall_code == OVER


def test_lane_shed_by_saturation_says_retrying_will_not_help() -> None:
    rig = Rig()
    rig.pressure.load("interactive", inflight=0, shed_by="kv_cache", signal="vllm:kv_cache_usage_perc")
    response = rig.ask(arrival())
    assert response.overall_code == OVER
    headers = headers_of(response)
    assert headers["x-extproc-reason"] == "saturated"
    assert headers["x-should-retry"] == "false"
    assert "saturated" in json.loads(response.raw_body)["error"]["message"]


def test_saturation_shed_can_be_left_to_ext_proc() -> None:
    rig = Rig(RateLimit(shed_saturated=False))
    rig.pressure.load("interactive", inflight=0, shed_by="kv_cache")
    assert rig.ask(arrival()).overall_code == OK


def test_lane_unknown_to_the_pressure_view_is_not_shed() -> None:
    rig = Rig()
    del rig.pressure.lanes["interactive"]
    response = rig.ask(arrival())
    assert response.overall_code == OK
    assert not response.statuses[0].HasField("current_limit")


# -- classification at the edge --------------------------------------------------------------


def test_edge_classifies_like_ext_proc() -> None:
    policy = make_policy()
    classifier = Classifier(policy)
    rig = Rig(policy=policy)
    for lane in ("interactive", "batch", "spare"):
        rig.pressure.load(lane, queued=rig.pressure.lanes[lane].max_queued)
    rig.pressure.total = LanePressure(queued=6, max_queued=6, inflight=8, limit=8)  # nothing to borrow
    cases = [
        ("/v1/chat/completions", {}),
        ("/batch/jobs", {"x-tenant-id": "acme"}),
        ("/spare?x=1", {}),
        ("/v1/chat/completions", {"x-lane": "batch"}),
        ("/batch/jobs", {"x-lane": "no-such-lane"}),
    ]
    for path, headers in cases:
        expected = classifier.classify(RequestFacts("POST", path, headers))
        response = rig.ask({**arrival(path), **headers})
        assert headers_of(response)["x-extproc-lane"] == expected.lane, (path, headers)


def test_untrusted_headers_choose_nothing() -> None:
    policy = make_policy(trusted_headers=["x-tenant-id"], classification={
        "default_lane": "interactive", "rules": [{"match": {"path_prefix": "/batch"}, "lane": "batch"}]})
    rig = Rig(policy=policy)
    rig.pressure.load("interactive", queued=4)
    # x-lane is not trusted by this policy: the request stays in interactive, which is full.
    assert headers_of(rig.ask({**arrival(), "x-lane": "batch"}))["x-extproc-lane"] == "interactive"


def test_descriptor_keys_are_case_insensitive_header_names() -> None:
    rig = Rig()
    rig.pressure.load("batch")
    response = rig.ask({**arrival(), "X-Lane": "batch"})
    assert headers_of(response)["x-extproc-lane"] == "batch"


def test_lane_that_depends_on_the_model_is_shed_only_if_every_candidate_is() -> None:
    rig = Rig()
    rig.pressure.load("batch")  # /m with model big → batch (full); any other model → interactive
    response = rig.ask(arrival("/m/v1/chat/completions"))
    assert response.overall_code == OK
    assert response.statuses[0].current_limit.name == "lane:interactive"
    assert rig.sample("extproc_ratelimit_decisions_total", lane=ANY_LANE, code="ok", reason="none",
                      shadow="false") == 1
    rig.pressure.load("interactive", queued=4)
    response = rig.ask(arrival("/m/v1/chat/completions"))
    assert response.overall_code == OVER
    assert "x-extproc-lane" not in headers_of(response)
    assert json.loads(response.raw_body)["error"]["lane"] is None  # the model decides it, unknown here


def test_model_header_makes_the_lane_certain() -> None:
    policy = make_policy(trusted_headers=["x-tenant-id", "x-lane", "x-model"],
                         estimation={"model_header": "x-model"})
    rig = Rig(policy=policy)
    rig.pressure.load("batch")
    response = rig.ask({**arrival("/m/x"), "x-model": "big"})
    assert response.overall_code == OVER
    assert headers_of(response)["x-extproc-lane"] == "batch"
    assert rig.ask({**arrival("/m/x"), "x-model": "small"}).overall_code == OK


def test_a_policy_reload_takes_effect_on_the_next_call() -> None:
    rig = Rig()
    rig.pressure.load("batch")
    assert rig.ask(arrival("/v1/x")).overall_code == OK
    rig.pressure.policy = make_policy(classification={"default_lane": "batch"})
    assert headers_of(rig.ask(arrival("/v1/x")))["x-extproc-lane"] == "batch"


# -- tenant budgets -----------------------------------------------------------------------------


def test_request_budget_runs_out_and_refills() -> None:
    rig = Rig(budgets(requests=2, per="minute"))
    first, second, third = (rig.ask(arrival(x_tenant_id="acme")) for _ in range(3))
    assert [r.overall_code for r in (first, second, third)] == [OK, OK, OVER]
    # The tightest limit is reported: the tenant's 2 a minute, not the lane's 6 places.
    assert (second.statuses[0].current_limit.requests_per_unit, second.statuses[0].current_limit.unit) == (
        2, Unit.MINUTE)
    assert second.statuses[0].limit_remaining == 0
    assert third.statuses[0].duration_until_reset.seconds == 30  # one request back at 2 a minute
    headers = headers_of(third)
    assert headers["x-extproc-reason"] == "tenant_request_budget"
    assert headers["retry-after"] == "30"
    assert "x-should-retry" not in headers
    assert rig.ask(arrival(x_tenant_id="globex")).overall_code == OK  # another tenant, its own budget
    rig.clock.now += 30
    assert rig.ask(arrival(x_tenant_id="acme")).overall_code == OK
    assert rig.ask(arrival(x_tenant_id="acme")).overall_code == OVER


def test_requests_without_a_tenant_share_the_default_tenants_budget() -> None:
    rig = Rig(budgets(requests=1))
    assert rig.ask(arrival()).overall_code == OK
    assert rig.ask(arrival(x_tenant_id="")).overall_code == OVER  # blank: the default tenant, anon


def test_per_tenant_budget_replaces_the_default() -> None:
    config = RateLimit.model_validate({"budgets": {"default": {"requests": 1},
                                                   "tenants": {"acme": {"requests": 3, "per": "second"}}}})
    rig = Rig(config)
    assert [rig.ask(arrival(x_tenant_id="acme")).overall_code for _ in range(4)] == [OK, OK, OK, OVER]
    assert [rig.ask(arrival(x_tenant_id="globex")).overall_code for _ in range(2)] == [OK, OVER]


def test_burst_sizes_the_bucket() -> None:
    rig = Rig(budgets(requests=2, burst=2.0))
    assert [rig.ask(arrival()).overall_code for _ in range(5)] == [OK] * 4 + [OVER]


def test_hits_addend_takes_that_many_requests() -> None:
    rig = Rig(budgets(requests=5))
    assert rig.ask((arrival(), 4)).overall_code == OK
    assert rig.ask((arrival(), 2)).overall_code == OVER
    assert rig.ask(arrival(), hits=1).overall_code == OK  # request-level hits_addend
    assert rig.ask(arrival()).overall_code == OVER


def test_a_request_shed_for_its_lane_costs_its_tenant_nothing() -> None:
    rig = Rig(budgets(requests=1))
    rig.pressure.load("interactive", queued=4)
    for _ in range(3):
        assert headers_of(rig.ask(arrival()))["x-extproc-reason"] == "queue_full"
    rig.pressure.load("interactive", inflight=0)
    assert rig.ask(arrival()).overall_code == OK


def test_the_longest_wait_gives_the_reason_and_retry_after() -> None:
    rig = Rig(budgets(requests=1, per="hour"))
    rig.ask(arrival())
    rig.pressure.load("interactive", queued=4)
    rig.pressure.drain = 3.0
    response = rig.ask(arrival())
    headers = headers_of(response)
    assert headers["x-extproc-reason"] == "tenant_request_budget"  # an hour beats 3 s
    assert headers["retry-after"] == "30"


def test_token_usage_at_stream_end_puts_the_tenant_in_debt() -> None:
    rig = Rig(budgets(tokens=1000, per="minute"))
    assert rig.ask(arrival(x_tenant_id="acme")).overall_code == OK
    report = rig.ask(usage(2500, x_tenant_id="acme"))
    assert report.overall_code == OK  # the response already happened
    assert [s.code for s in report.statuses] == [OK]
    assert rig.sample("extproc_ratelimit_usage_tokens_total") == 2500
    assert rig.sample("extproc_ratelimit_usage_reports_total") == 1
    refused = rig.ask(arrival(x_tenant_id="acme"))
    assert refused.overall_code == OVER
    assert headers_of(refused)["x-extproc-reason"] == "tenant_token_budget"
    status = refused.statuses[0]
    assert (status.current_limit.requests_per_unit, status.current_limit.unit) == (1000, Unit.MINUTE)
    # 1501 tokens short of one at 1000 a minute: 90.06 s.
    assert status.duration_until_reset.seconds == 91
    assert rig.ask(arrival(x_tenant_id="globex")).overall_code == OK
    rig.clock.now += 91
    assert rig.ask(arrival(x_tenant_id="acme")).overall_code == OK


def test_usage_reports_without_tokens_or_a_token_budget_charge_nothing() -> None:
    rig = Rig(budgets(requests=100))
    rig.ask(usage(0))
    assert rig.sample("extproc_ratelimit_usage_reports_total") == 0
    rig.ask(usage(500))
    assert rig.sample("extproc_ratelimit_usage_tokens_total") == 500
    assert rig.service.machine.budget_sizes()["tokens"] == 0


def test_usage_reports_take_request_level_hits_too() -> None:
    rig = Rig(budgets(tokens=100))
    rig.ask({"generic_key": "gpu_inference_tokens"}, hits=150)
    assert rig.ask(arrival()).overall_code == OVER


def finished(usage: str = "none", *, prompt: str = "none", output: str = "none", service_ms: str = "none",
             admitted_ms: str = "none", **headers: str) -> dict[str, str]:
    """The usage descriptor of the shipped configs: every entry present, "none" where Envoy had no value."""
    return {"generic_key": "gpu_inference_tokens", **{k.replace("_", "-"): v for k, v in headers.items()},
            "usage": usage, "prompt_tokens": prompt, "output_tokens": output, "service_ms": service_ms,
            "admitted_ms": admitted_ms}


def test_the_usage_the_proxy_read_is_charged_and_its_entries_are_not_headers() -> None:
    rig = Rig(budgets(tokens=1000, per="minute"))
    rig.service.wall = lambda: 1000.0
    assert rig.ask(finished("1200", prompt="100", output="50", service_ms="1000", admitted_ms="999000",
                            x_tenant_id="acme")).overall_code == OK
    assert rig.sample("extproc_ratelimit_usage_tokens_total") == 1200
    assert rig.sample("extproc_ratelimit_usage_reports_total") == 1
    assert rig.sample("extproc_ratelimit_usage_estimates_total") == 0
    assert rig.ask(arrival(x_tenant_id="acme")).overall_code == OVER
    assert rig.ask(arrival(x_tenant_id="globex")).overall_code == OK


def test_a_response_without_usage_is_charged_the_estimate_from_its_admission() -> None:
    rig = Rig(budgets(tokens=1000, per="minute"))
    rig.service.wall = lambda: 1000.0
    # Admitted 2 s ago, sized 4 s: the prompt and half the output.
    rig.ask(finished(prompt="600", output="1000", service_ms="4000", admitted_ms="998000",
                     x_tenant_id="acme"))
    assert rig.sample("extproc_ratelimit_usage_estimates_total") == 1
    assert rig.sample("extproc_ratelimit_usage_estimated_tokens_total") == 1100
    assert rig.sample("extproc_ratelimit_usage_reports_total") == 0
    assert rig.ask(arrival(x_tenant_id="acme")).overall_code == OVER


def test_a_response_extproc_never_admitted_charges_nothing() -> None:
    rig = Rig(budgets(tokens=1000, per="minute"))
    rig.ask(finished(x_tenant_id="acme"))
    assert rig.sample("extproc_ratelimit_usage_estimates_total") == 0
    assert rig.sample("extproc_ratelimit_usage_unknown_total") == 1
    assert rig.service.machine.budget_sizes()["tokens"] == 0


def test_a_smaller_max_tenants_after_a_reload_shrinks_the_tables() -> None:
    rig = Rig(budgets(requests=10))
    for i in range(5):
        rig.ask(arrival(x_tenant_id=f"t{i}"))
    assert rig.sample("extproc_ratelimit_tenants", budget="requests") == 5
    rig.config = RateLimit.model_validate({"budgets": {"default": {"requests": 10}, "max_tenants": 2}})
    rig.ask(arrival(x_tenant_id="t9"))
    assert rig.service.machine.budget_sizes()["requests"] == 2
    assert rig.sample("extproc_ratelimit_tenants", budget="requests") == 2


# -- modes, shape of the answer, mismatched configs ---------------------------------------------


def test_shadow_mode_decides_and_counts_but_answers_ok() -> None:
    rig = Rig(RateLimit(mode="shadow"))
    rig.pressure.load("interactive", queued=4)
    response = rig.ask(arrival())
    assert response.overall_code == OK
    [status] = response.statuses
    assert status.code == OK
    assert not status.HasField("current_limit")  # no x-ratelimit-* headers either
    assert not response.response_headers_to_add
    assert not response.raw_body
    assert response.dynamic_metadata["shadow"] == "queue_full"
    assert rig.sample("extproc_ratelimit_decisions_total", lane="interactive", code="over_limit",
                      reason="queue_full", shadow="true") == 1
    rig.pressure.load("interactive", inflight=0)
    response = rig.ask(arrival())
    assert "shadow" not in response.dynamic_metadata
    assert rig.sample("extproc_ratelimit_decisions_total", lane="interactive", code="ok", reason="none",
                      shadow="true") == 1


def test_shadow_mode_takes_budget_as_enforcement_would() -> None:
    rig = Rig(RateLimit.model_validate({"mode": "shadow", "budgets": {"default": {"requests": 2}}}))
    assert [rig.ask(arrival()).overall_code for _ in range(4)] == [OK] * 4
    assert rig.sample("extproc_ratelimit_decisions_total", lane="interactive", code="over_limit",
                      reason="tenant_request_budget", shadow="true") == 2


def test_a_lane_that_only_observes_is_never_blocked_at_the_edge() -> None:
    rig = Rig(budgets(requests=1))
    rig.pressure.load("interactive", queued=4, shadow=True)
    response = rig.ask(arrival())
    assert response.overall_code == OK
    assert response.dynamic_metadata["shadow"] == "queue_full"
    assert rig.ask(arrival()).overall_code == OK  # nor by its tenant's budget
    assert rig.sample("extproc_ratelimit_decisions_total", lane="interactive", code="over_limit",
                      reason="queue_full", shadow="true") == 2


def test_a_request_that_may_land_in_an_observing_lane_is_not_blocked() -> None:
    rig = Rig()
    rig.pressure.load("batch", shadow=True)
    rig.pressure.load("interactive", queued=4)
    assert rig.ask(arrival("/m/v1/chat/completions")).overall_code == OK


def test_off_answers_ok_without_deciding() -> None:
    rig = Rig(RateLimit.model_validate({"mode": "off", "budgets": {"default": {"requests": 1}}}))
    rig.pressure.load("interactive", queued=4)
    response = rig.ask(arrival(), arrival())
    assert response.overall_code == OK
    assert [s.code for s in response.statuses] == [OK, OK]
    assert rig.sample("extproc_ratelimit_decisions_total", lane="interactive", code="ok", reason="none",
                      shadow="false") == 0


def test_another_domain_is_answered_ok_and_counted() -> None:
    rig = Rig()
    rig.pressure.load("interactive", queued=4)
    response = rig.ask(arrival(), domain="someone-else")
    assert response.overall_code == OK
    assert [s.code for s in response.statuses] == [OK]
    assert rig.sample("extproc_ratelimit_ignored_total", kind="unknown_domain") == 1


def test_unknown_descriptors_are_answered_ok_and_counted() -> None:
    rig = Rig()
    rig.pressure.load("interactive", queued=4)
    response = rig.ask({"generic_key": "something_else", "path": "/"}, {"remote_address": "10.0.0.1"})
    assert response.overall_code == OK
    assert len(response.statuses) == 2
    assert rig.sample("extproc_ratelimit_ignored_total", kind="unknown_descriptor") == 2


def test_one_status_per_descriptor_in_order() -> None:
    rig = Rig()
    rig.pressure.load("batch")
    response = rig.ask(arrival(), usage(10), arrival("/batch"))
    assert [s.code for s in response.statuses] == [OK, OK, OVER]
    assert response.overall_code == OVER
    assert headers_of(response)["x-extproc-lane"] == "batch"


def test_configured_descriptor_names_and_domain() -> None:
    rig = Rig(RateLimit(domain="gw", request_descriptor="llm", usage_descriptor="llm_tokens"))
    rig.pressure.load("interactive", queued=4)
    assert rig.ask({**arrival(), "generic_key": "llm"}, domain="gw").overall_code == OVER
    assert rig.ask(arrival(), domain="gw").overall_code == OK  # gpu_inference is not ours here


def test_an_error_is_counted_and_raised_so_envoy_applies_its_failure_mode() -> None:
    rig = Rig()

    def broken(lane: str) -> LanePressure | None:
        raise RuntimeError("scheduler gone")

    rig.pressure.lane = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="scheduler gone"):
        asyncio.run(rig.service.ShouldRateLimit(request(arrival()), None))  # type: ignore[arg-type]
    assert rig.sample("extproc_ratelimit_errors_total") == 1


def test_should_rate_limit_answers_like_decide() -> None:
    rig = Rig()
    rig.pressure.load("interactive", queued=4)
    response = asyncio.run(rig.service.ShouldRateLimit(request(arrival()), None))  # type: ignore[arg-type]
    assert response.overall_code == OVER


def test_one_reason_vocabulary_knows_when_retrying_helps() -> None:
    from extproc.core.decision import Reason

    assert {r for r in Reason if not r.retry_helps} == {
        Reason.LANE_CLOSED, Reason.SATURATED, Reason.RETRY_BUDGET, Reason.BAD_REQUEST,
        Reason.UNSUPPORTED_ENCODING}
    assert all(r.message.endswith(".") for r in Reason)


# -- the adapter on a real Controller -------------------------------------------------------------


async def test_controller_pressure_reads_the_live_scheduler() -> None:
    policy = make_policy()
    controller = Controller(policy, Metrics(CollectorRegistry()), rng=random.Random(1))
    pressure = SchedulerPressure(controller.machine._scheduler, controller.now)
    job = Job(model=None, prompt_tokens=10, output_tokens=100)
    decisions = [controller.submit("interactive", "acme", job) for _ in range(5)]
    assert [d.outcome.value for d in decisions] == ["admitted"] * 2 + ["queued"] * 3
    lane = pressure.lane("interactive")
    assert lane == LanePressure(queued=3, max_queued=4, inflight=2, limit=2, slot_free=False,
                                tenants={"acme": 3})
    assert pressure.lane("gone") == LanePressure(queued=0, max_queued=0, inflight=0, limit=1, slot_free=False,
                                                 closed=True)
    assert pressure.lane("no-such-lane") is None
    assert pressure.lane("spare").slot_free  # type: ignore[union-attr]
    assert pressure.drain_s("interactive") > 0
    assert pressure.policy is policy
    controller.reconfigure(make_policy(shadow=True))
    assert pressure.lane("interactive") == LanePressure(queued=3, max_queued=4, inflight=2, limit=2,
                                                        slot_free=False, shadow=True, tenants={"acme": 3})
    controller.reconfigure(policy)
    controller.pause("interactive")
    assert pressure.lane("interactive").paused  # type: ignore[union-attr]
    controller.resume("interactive")
    rig_metrics = RateLimitMetrics(CollectorRegistry())
    service = RateLimitService(controller.machine, rig_metrics, RateLimit)
    assert service.decide(request(arrival())).overall_code == OK  # one queue place left
    controller.submit("interactive", "acme", job)
    assert service.decide(request(arrival(x_tenant_id="acme"))).overall_code == OVER
    # Another tenant would push out one of acme's four places in ext_proc: the edge lets it through.
    assert service.decide(request(arrival(x_tenant_id="globex"))).overall_code == OK
    for decision in decisions:
        controller.release(decision.ticket)


# -- the policy model ------------------------------------------------------------------------------


def test_policy_defaults() -> None:
    config = RateLimit()
    assert (config.mode, config.domain, config.queue_share) == ("enforce", "extproc", 1.0)
    assert (config.request_descriptor, config.usage_descriptor) == ("gpu_inference", "gpu_inference_tokens")
    assert not config.budgets.any
    assert config.budgets.of("anyone") == config.budgets.default


@pytest.mark.parametrize(("data", "loc"), [
    ({"mode": "loud"}, ("mode",)),
    ({"queue_share": 0}, ("queue_share",)),
    ({"queue_share": 1.5}, ("queue_share",)),
    ({"domain": "has space"}, ("domain",)),
    ({"budgets": {"default": {"requests": 0}}}, ("budgets", "default", "requests")),
    ({"budgets": {"default": {"tokens": 5_000_000_000}}}, ("budgets", "default", "tokens")),
    ({"budgets": {"default": {"per": "week"}}}, ("budgets", "default", "per")),
    ({"budgets": {"default": {"burst": 0}}}, ("budgets", "default", "burst")),
    ({"budgets": {"max_tenants": 0}}, ("budgets", "max_tenants")),
    ({"budgets": {"tenants": {"acme": {"rps": 3}}}}, ("budgets", "tenants", "acme", "rps")),
    ({"shadow": True}, ("shadow",)),
])
def test_policy_refuses_bad_values(data: dict[str, Any], loc: tuple[str, ...]) -> None:
    with pytest.raises(ValidationError) as info:
        RateLimit.model_validate(data)
    assert info.value.errors()[0]["loc"] == loc


def test_problems_of_a_sound_policy_are_none() -> None:
    config = RateLimit.model_validate({"budgets": {"tenants": {"acme": {"requests": 3}}}})
    assert ratelimit_problems(config, make_policy().tenants) == []


def test_problems_name_each_key() -> None:
    config = RateLimit.model_validate({
        "request_descriptor": "same", "usage_descriptor": "same",
        "budgets": {"tenants": {"x" * 40: {"requests": 3}, "anon": {"requests": 1}, "acme": {"requests": 2}}},
    })
    no_header = make_policy(tenants={"default": "anon", "max_tenant_length": 32}, trusted_headers=["x-lane"])
    found = ratelimit_problems(config, no_header.tenants)
    assert found == [
        "ratelimit.usage_descriptor: equals request_descriptor ('same'); token reports could not be told "
        "from requests",
        f"ratelimit.budgets.tenants.{'x' * 40}: longer than tenants.max_tenant_length (32); tenant names "
        "are cut to that length, so this budget could never apply",
        "ratelimit.budgets.tenants.acme: no tenants.header is set, so every request is tenant 'anon' and "
        "this budget could never apply",
    ]


def test_the_edge_remembers_few_small_arrivals_and_never_a_client_sized_one() -> None:
    rig = Rig()
    edge = rig.service.machine._edge
    for i in range(3):
        rig.ask(arrival(path=f"/v1/chat/completions?n={i}"))  # the query classifies nothing
    assert len(edge._arrivals) == 1
    rig.ask(arrival(path="/v1/" + "x" * 5000))  # a client-chosen path of 5 kB: judged, not kept
    assert len(edge._arrivals) == 1
    assert rig.ask(arrival(path="/v1/" + "x" * 5000)).overall_code == OK

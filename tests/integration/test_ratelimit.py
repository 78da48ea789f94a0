"""The edge shed through a real Envoy, both ways it can be judged: by extproc's rate limit service
in a call of the ratelimit filter's own (``--edge call``), and by ext_proc in its headers phase
(``inline``, shipped); and a proxy that says both (``both``: the arrival descriptor and
x-extproc-edge, as while a fleet rolls over), where the call judges and ext_proc, told so by the
x-extproc-edge-judged header the call adds, judges nothing twice. Every test runs every way and
expects the same answers.

Envoy runs the shipped config (ratelimit → ext_proc → router); extproc's rate limit
service and ext_proc servicer share one real gRPC server and one real Controller in this
process, so a test can see the scheduler's state and change the ``ratelimit`` policy
between requests. The upstream, also in this process, holds a request until the test
lets it go (no sleeps to line requests up) and reports token usage when asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from prometheus_client import CollectorRegistry

from extproc.bootstrap import EDGE_HEADER, STRIP_FILTER
from extproc.controller import Controller
from extproc.localstack import Stack, envoy_config, free_port
from extproc.metrics import Metrics, RateLimitMetrics
from extproc.policy import Policy
from extproc.policy.ratelimit import RateLimit
from extproc.servers.extproc import ExternalProcessor
from extproc.servers.ratelimit import RateLimitService, add_to_server
from tests.integration.conftest import LogRecords, as_tenant, serve_http, until

pytestmark = pytest.mark.envoy

POLICY = Policy.model_validate({
    "lanes": [{"name": "interactive", "max_inflight": 1, "max_queued": 1, "deadline": "20s"}],
    "capacity": {"max_hold": "60s"},
    "trusted_headers": ["x-extproc-client"],
    "classification": {"default_lane": "interactive"},
    "tenants": {"header": "x-extproc-client", "default": "anon"},
    # share 1: the lane's one slot may go to returns (a 4 s request fits its allowance).
    "retry_after": {"min": 1, "max": 30, "jitter": 0, "share": 1},
})
CHAT = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class Upstream:
    """Echoes what it got; ``x-test-hold: NAME`` waits for ``release(NAME)``; ``x-test-usage: N``
    reports N tokens in the body's ``usage``, as a model server would."""

    holds: dict[str, asyncio.Event] = field(default_factory=dict)
    seen: int = 0

    def hold(self, name: str) -> asyncio.Event:
        return self.holds.setdefault(name, asyncio.Event())

    def release(self, name: str) -> None:
        self.hold(name).set()

    async def handle(self, request: web.Request) -> web.Response:
        self.seen += 1
        await request.read()
        name = request.headers.get("x-test-hold")
        if name:
            await self.hold(name).wait()
        seen = {k.lower(): v for k, v in request.headers.items()}
        answer: dict[str, Any] = {"path": request.path, "headers": seen}
        if "x-test-usage" in request.headers:
            answer["usage"] = {"total_tokens": int(request.headers["x-test-usage"])}
        return web.json_response(answer)


@dataclass
class Live:
    """The ``ratelimit`` policy the service reads on every call: a test may swap it."""

    config: RateLimit
    #: Reading it fails (an edge that breaks).
    broken: bool = False

    def read(self) -> RateLimit:
        if self.broken:
            raise RuntimeError("the edge's policy cannot be read")
        return self.config


@dataclass
class Edge:
    mode: str
    url: str
    admin: str
    controller: Controller
    registry: CollectorRegistry
    upstream: Upstream
    stack: Stack
    live: Live
    #: What the edge and ext_proc logged (each record: its event and fields).
    records: list[dict[str, Any]] = field(default_factory=list)

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def envoy_stat(self, name: str) -> int:
        text = httpx.get(f"{self.admin}/stats?filter=^{name}$", timeout=5).text
        return int(text.split(":")[1]) if ":" in text else 0


MakeEdge = Callable[..., Awaitable[Edge]]


@pytest.fixture(params=["call", "inline", "both"])
def edge_mode(request: pytest.FixtureRequest) -> str:
    mode: str = request.param
    return mode


@pytest.fixture
async def make_edge(tmp_path: Path, edge_mode: str) -> AsyncIterator[MakeEdge]:
    mode = edge_mode
    async with AsyncExitStack() as exits:
        async def make(config: RateLimit | None = None, *, rls: bool = True,
                       rls_port: int | None = None) -> Edge:
            registry = CollectorRegistry()
            # The service reads `live`; ext_proc its controller's policy (which says whether to record
            # what it admitted for a token charge): both start from the same budgets.
            policy = POLICY if config is None else POLICY.model_copy(update={"ratelimit": config})
            controller = Controller(policy, Metrics(registry), rng=random.Random(3))
            controller.start()
            exits.push_async_callback(controller.stop)
            server = grpc.aio.server()
            records: list[dict[str, Any]] = []
            processor = ExternalProcessor(controller, policy_hash=lambda: POLICY_HASH)
            processor.log = processor.records = LogRecords(records)  # type: ignore[assignment]
            ext_proc_grpc.add_ExternalProcessorServicer_to_server(processor, server)
            live = Live(config or RateLimit())
            if rls:
                # Wired as App wires it: its sheds counted as every refusal is.
                service = RateLimitService(controller.machine, RateLimitMetrics(registry), live.read,
                                           refused=controller.refused, policy_hash=lambda: POLICY_HASH)
                service.log = LogRecords(records)  # type: ignore[assignment]
                add_to_server(service, server)
                if mode != "call":
                    processor.edge = service
            grpc_port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            exits.push_async_callback(server.stop, None)

            upstream = Upstream()
            upstream_port = await serve_http(exits, upstream.handle)

            def point_rls_elsewhere(doc: dict[str, Any]) -> None:
                if mode == "both":  # the call form, and the proxy's word that ext_proc judges as well
                    listener = doc["static_resources"]["listeners"][0]
                    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
                    strip = next(f for f in hcm["http_filters"] if f["name"] == STRIP_FILTER)
                    strip["typed_config"]["mutations"]["request_mutations"].append({"append": {
                        "header": {"key": EDGE_HEADER, "value": "1"},
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}})
                if rls_port is None:
                    return
                clusters = doc["static_resources"]["clusters"]
                cluster = next(c for c in clusters if c["name"] == "extproc_ratelimit")
                endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
                endpoint["address"]["socket_address"]["port_value"] = rls_port

            listen, admin = free_port(), free_port()
            stack = Stack(tmp_path)
            exits.push_async_callback(asyncio.to_thread, stack.stop)
            await asyncio.to_thread(stack.envoy, envoy_config(listen, admin, upstream_port, grpc_port,
                                                              tweak=point_rls_elsewhere,
                                                              edge="inline" if mode == "inline" else "call"))
            return Edge(mode, f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{admin}", controller, registry,
                        upstream, stack, live, records)

        yield make


POLICY_HASH = "5e" * 32


async def access_log(edge: Edge, count: int) -> list[dict[str, Any]]:
    """Envoy's access log records, once it has written ``count`` of them (it flushes every 0.2 s)."""
    envoy = next(p for p in edge.stack.processes if p.name == "envoy")
    deadline = time.monotonic() + 10
    while True:
        lines = []
        for line in envoy.output().splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    lines.append(json.loads(line))
        lines = [line for line in lines if "request_id" in line and "status" in line]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        await asyncio.sleep(0.1)


def budgets(**default: Any) -> RateLimit:
    return RateLimit.model_validate({"budgets": {"default": default}})


async def test_full_lane_is_shed_at_the_edge_with_429_retry_after_and_ratelimit_headers(
        make_edge: MakeEdge) -> None:
    edge = await make_edge()
    scheduler = edge.controller.machine
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
        idle = await client.post("/v1/chat/completions", json=CHAT)
        assert idle.status_code == 200
        # The lane's room: 1 slot + 1 queue place; no window, since it is not a rate.
        assert (idle.headers["x-ratelimit-limit"], idle.headers["x-ratelimit-remaining"]) == ("2", "2")

        def held(name: str) -> asyncio.Task[httpx.Response]:
            return asyncio.create_task(client.post("/v1/chat/completions", json=CHAT,
                                                   headers={"x-test-hold": name}))

        busy = held("a")
        await until(lambda: scheduler.total_inflight == 1, "the first request to be admitted")
        queued = held("b")
        await until(lambda: scheduler.total_queued == 1, "the second request to be queued")
        seen = edge.upstream.seen

        shed = await client.post("/v1/chat/completions", json=CHAT)
        # Shed before ext_proc: neither it nor the upstream saw the request.
        assert edge.upstream.seen == seen

        edge.upstream.release("a")
        edge.upstream.release("b")
        assert (await busy).status_code == 200
        assert (await queued).status_code == 200
    assert shed.status_code == 429
    assert shed.headers["x-envoy-ratelimited"] == "true"
    assert 1 <= int(shed.headers["retry-after"]) <= 30
    assert shed.headers["x-ratelimit-limit"] == "2"
    assert shed.headers["x-ratelimit-remaining"] == "0"
    assert shed.headers["x-ratelimit-reset"].isdigit()
    assert shed.headers["x-extproc-reason"] == "queue_full"
    assert shed.headers["x-extproc-lane"] == "interactive"
    assert shed.headers["content-type"] == "application/json"
    assert "x-should-retry" not in shed.headers
    error = shed.json()["error"]
    assert (error["code"], error["type"]) == ("queue_full", "rate_limit_exceeded")
    assert error["lane"] == "interactive"
    # One count of refusals: the edge's shed is the lane's rejection as much as ext_proc's would be.
    assert edge.sample("extproc_ratelimit_decisions_total", lane="interactive", code="over_limit",
                       reason="queue_full", shadow="false") == 1
    assert edge.sample("inference_admission_rejections_total", lane="interactive", reason="queue_full") == 1
    assert edge.sample("inference_admission_decisions_total", lane="interactive", outcome="rejected") == 1


async def test_shadow_mode_passes_everything_and_counts(make_edge: MakeEdge) -> None:
    edge = await make_edge(RateLimit.model_validate({"mode": "shadow",
                                                     "budgets": {"default": {"requests": 1}}}))
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
        responses = [await client.post("/v1/chat/completions", json=CHAT, headers=as_tenant("acme"))
                     for _ in range(3)]
    assert [r.status_code for r in responses] == [200, 200, 200]
    for r in responses:
        assert "x-envoy-ratelimited" not in r.headers
        assert "x-ratelimit-limit" not in r.headers
    assert edge.sample("extproc_ratelimit_decisions_total", lane="interactive", code="over_limit",
                       reason="tenant_request_budget", shadow="true") == 2
    assert edge.sample("extproc_ratelimit_decisions_total", lane="interactive", code="ok", reason="none",
                       shadow="true") == 1
    # The would-be shed reaches Envoy's access log through the filter's dynamic metadata (the local
    # stacks' Envoy writes it out every 0.2 s; stopping it to flush it was no good: Envoy 1.40 sometimes
    # crashes on SIGTERM before it writes).
    envoy = next(p for p in edge.stack.processes if p.name == "envoy")
    deadline = time.monotonic() + 10
    for _ in range(100):
        if envoy.output().count('"edge_shadow":"tenant_request_budget"') >= 2 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert envoy.output().count('"edge_shadow":"tenant_request_budget"') == 2


async def test_tenant_request_budget_runs_out(make_edge: MakeEdge) -> None:
    edge = await make_edge(budgets(requests=2, per="minute"))
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
        acme = [await client.post("/v1/chat/completions", json=CHAT, headers=as_tenant("acme"))
                for _ in range(3)]
        globex = await client.post("/v1/chat/completions", json=CHAT, headers=as_tenant("globex"))
    assert [r.status_code for r in acme] == [200, 200, 429]
    # The tightest limit, with its window and name (draft 03 quota policy syntax).
    assert acme[0].headers["x-ratelimit-limit"] == '2, 2;w=60;name="tenant_requests"'
    assert acme[0].headers["x-ratelimit-remaining"] == "1"
    refused = acme[2]
    assert refused.headers["x-extproc-reason"] == "tenant_request_budget"
    assert refused.headers["retry-after"] == "30"
    assert refused.headers["x-ratelimit-remaining"] == "0"
    assert refused.json()["error"]["code"] == "tenant_request_budget"
    assert globex.status_code == 200


async def test_a_hot_reloaded_tenant_budget_refuses_visibly_and_each_429_joins_extprocs_log(
        make_edge: MakeEdge) -> None:
    edge = await make_edge()
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
        before = [await client.post("/v1/chat/completions", json=CHAT, headers=as_tenant("free"))
                  for _ in range(2)]
        # A reload gives tenant "free" a budget: the edge reads it at the next call, ext_proc its policy.
        config = RateLimit.model_validate({"budgets": {"tenants": {"free": {"requests": 2,
                                                                            "per": "minute"}}}})
        edge.live.config = config
        edge.controller.reconfigure(POLICY.model_copy(update={"ratelimit": config}))
        after = [await client.post("/v1/chat/completions", json=CHAT, headers=as_tenant("free"))
                 for _ in range(6)]
    assert [r.status_code for r in before + after] == [200] * 4 + [429] * 4
    # One count: the edge's own counter, the lane's rejections and decisions, the tenant's.
    assert edge.sample("extproc_ratelimit_decisions_total", lane="interactive", code="over_limit",
                       reason="tenant_request_budget", shadow="false") == 4
    assert edge.sample("inference_admission_rejections_total", lane="interactive",
                       reason="tenant_request_budget") == 4
    assert edge.sample("inference_admission_decisions_total", lane="interactive", outcome="rejected") == 4
    assert edge.sample("inference_admission_decisions_total", lane="interactive", outcome="admitted") == 4
    assert edge.sample("extproc_tenant_rejections_total", tenant="free", reason="tenant_request_budget") == 4
    # By name once the policy names the tenant (its budget); before, with every tenant it does not name.
    assert edge.sample("extproc_tenant_requests_total", tenant="free") == 6
    assert edge.sample("extproc_tenant_requests_total", tenant="(other)") == 2
    # One record per request that joins: every 429 in Envoy's access log is an edge_shed record of
    # extproc's by request id, every 200 a decision record; each says which policy decided it.
    logged = await access_log(edge, 8)
    by_status: dict[int, set[str]] = {}
    for line in logged:
        by_status.setdefault(int(line["status"]), set()).add(line["request_id"])
    sheds = [r for r in edge.records if r["event"] == "edge_shed"]
    decisions = [r for r in edge.records if r["event"] == "decision"]
    assert len(by_status[429]) == len(sheds) == 4
    assert {r["request_id"] for r in sheds} == by_status[429]
    assert {r["request_id"] for r in decisions} == by_status[200]
    assert {r["policy"] for r in sheds + decisions} == {POLICY_HASH}


async def test_tokens_reported_at_stream_end_spend_the_tenant_token_budget(make_edge: MakeEdge) -> None:
    edge = await make_edge(budgets(tokens=100, per="minute"))
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
        first = await client.post("/v1/chat/completions", json=CHAT,
                                  headers={**as_tenant("acme"), "x-test-usage": "500"})
        assert first.status_code == 200
        # Envoy reports the usage after the response, in a second call at stream end.
        await until(lambda: edge.sample("extproc_ratelimit_usage_tokens_total") == 500, "the usage report")
        refused = await client.post("/v1/chat/completions", json=CHAT, headers=as_tenant("acme"))
        other = await client.post("/v1/chat/completions", json=CHAT, headers=as_tenant("globex"))
    assert refused.status_code == 429
    assert refused.headers["x-extproc-reason"] == "tenant_token_budget"
    assert refused.headers["x-ratelimit-limit"] == '100, 100;w=60;name="tenant_tokens"'
    assert other.status_code == 200
    # A response without usage reports nothing; the one ext_proc admitted is charged an estimate,
    # the one the edge shed nothing.
    await until(lambda: edge.sample("extproc_ratelimit_usage_estimates_total") == 1, "the estimate")
    assert edge.sample("extproc_ratelimit_usage_reports_total") == 1


@pytest.mark.parametrize("down", ["unimplemented", "unreachable"])
async def test_requests_pass_when_the_rate_limit_service_is_down(make_edge: MakeEdge, down: str,
                                                                 edge_mode: str) -> None:
    if edge_mode == "inline":
        pytest.skip("no rate limit call to fail: see test_requests_pass_when_the_edge_fails_in_ext_proc")
    if down == "unimplemented":
        # An extproc that serves ext_proc but not the rate limit service answers UNIMPLEMENTED.
        edge = await make_edge(rls=False)
    else:
        edge = await make_edge(rls_port=free_port())
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
        responses = [await client.post("/v1/chat/completions", json=CHAT) for _ in range(3)]
    assert [r.status_code for r in responses] == [200, 200, 200]
    # ext_proc still decided every request.
    assert all(r.json()["headers"]["x-extproc-lane"] == "interactive" for r in responses)
    assert edge.envoy_stat("cluster.inference_backend.ratelimit.failure_mode_allowed") == 3
    # Told to judge as well, ext_proc judged the arrivals the failed call could not mark.
    judged = edge.sample("extproc_ratelimit_decisions_total", lane="interactive", code="ok", reason="none",
                         shadow="false")
    assert judged == (3 if edge_mode == "both" and down == "unreachable" else 0)


async def test_requests_pass_when_the_edge_fails_in_ext_proc(make_edge: MakeEdge, edge_mode: str) -> None:
    # The edge judged in ext_proc fails as the rate limit call did: the request goes on to ext_proc's
    # own decision, and the failure is counted and logged (here: the policy it reads raises).
    edge = await make_edge(budgets(requests=1, per="hour"))
    edge.live.broken = True
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
        responses = [await client.post("/v1/chat/completions", json=CHAT) for _ in range(3)]
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert all(r.json()["headers"]["x-extproc-lane"] == "interactive" for r in responses)
    assert all("x-ratelimit-limit" not in r.headers for r in responses)
    # Told both ways, each request fails twice: the call's (unmarked), then ext_proc's own.
    assert edge.sample("extproc_ratelimit_errors_total") == (6 if edge_mode == "both" else 3)
    if edge_mode != "inline":
        assert edge.envoy_stat("cluster.inference_backend.ratelimit.failure_mode_allowed") == 3


async def test_health_route_never_asks_the_rate_limit_service(make_edge: MakeEdge) -> None:
    edge = await make_edge(budgets(requests=1))
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
        health = [await client.get("/health") for _ in range(3)]
        inference = await client.post("/v1/chat/completions", json=CHAT)
    assert [r.status_code for r in health] == [200, 200, 200]
    assert all("x-ratelimit-limit" not in r.headers for r in health)
    assert inference.status_code == 200
    assert edge.sample("extproc_ratelimit_decisions_total", lane="interactive", code="ok", reason="none",
                       shadow="false") == 1


async def test_a_policy_change_applies_to_the_next_request(make_edge: MakeEdge) -> None:
    edge = await make_edge()
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        edge.live.config = budgets(requests=1, per="hour")
        statuses = [(await client.post("/v1/chat/completions", json=CHAT)).status_code for _ in range(2)]
    assert statuses == [200, 429]
    assert edge.sample("extproc_ratelimit_decisions_total", lane="interactive", code="over_limit",
                       reason="tenant_request_budget", shadow="false") == 1
    if edge.mode != "inline":
        assert edge.envoy_stat("cluster.inference_backend.ratelimit.over_limit") == 1

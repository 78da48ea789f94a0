"""The response headers asked for on one admitted request in N (``extproc serve --response-sample``),
through a real Envoy with the shipped config (the edge judged in the ext_proc headers phase): how
many response-headers messages reach extproc (counted by extproc and by Envoy), that every response
still carries one set of the edge's x-ratelimit-* headers (from ext_proc's answer to the response
headers when asked for, from the route configuration and extproc's metadata when not), that every
slot comes back, once, however the request ends, and that token budgets are charged all the same.

extproc's servicers run in this process on one real gRPC server (as in test_ratelimit.py), so a
test sees the controller and wraps its ``release``; the upstream, also here, holds a response
mid-way when told to.
"""

from __future__ import annotations

import asyncio
import random
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

from extproc.controller import Controller
from extproc.core.decision import Ticket
from extproc.localstack import Stack, envoy_config, free_port
from extproc.metrics import Metrics, RateLimitMetrics
from extproc.policy import Policy
from extproc.servers.extproc import ExternalProcessor
from extproc.servers.ratelimit import RateLimitService, add_to_server
from tests.integration.conftest import Env, LogRecords, as_tenant, serve_http, until

pytestmark = pytest.mark.envoy

LIMITS = ("x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset")
CHAT = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
#: A request budget that never runs out in a test, per tenant: every response has limits, and its
#: remaining count (fewer than the lane's 128 places) is the one they report.
BUDGETS = {"budgets": {"default": {"requests": 100, "per": "hour"}}}


def policy(read_body: str = "never", ratelimit: dict[str, Any] | None = None) -> Policy:
    return Policy.model_validate({
        "lanes": [{"name": "interactive", "max_inflight": 64, "max_queued": 64, "deadline": "20s"}],
        "capacity": {"max_hold": "60s"},
        "trusted_headers": ["x-extproc-client"],
        "classification": {"default_lane": "interactive"},
        "tenants": {"header": "x-extproc-client", "default": "anon"},
        "estimation": {"read_body": read_body, "learning_rate": 0.5},
        "ratelimit": ratelimit or BUDGETS,
    })


@dataclass
class Upstream:
    """Echoes; ``x-test-hold: NAME`` sends the status line and a first chunk, then waits for
    ``release(NAME)`` before the rest; ``x-test-own-limit`` answers with an x-ratelimit-limit of its
    own; ``x-test-usage: N`` reports N tokens in the body, as a model server would; a path ending in
    ``/reset`` closes the connection unanswered."""

    holds: dict[str, asyncio.Event] = field(default_factory=dict)

    def hold(self, name: str) -> asyncio.Event:
        return self.holds.setdefault(name, asyncio.Event())

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        if request.path.endswith("/reset"):
            assert request.transport is not None
            request.transport.abort()
            return web.Response(status=500)
        headers = {}
        if "x-test-own-limit" in request.headers:
            headers["x-ratelimit-limit"] = "backend"
        name = request.headers.get("x-test-hold")
        if name:
            response = web.StreamResponse(headers={**headers, "content-type": "application/json"})
            await response.prepare(request)
            await response.write(b'{"first": "chunk", ')
            await self.hold(name).wait()
            await response.write(b'"rest": true}')
            await response.write_eof()
            return response
        body: dict[str, Any] = {"path": request.path}
        if "x-test-usage" in request.headers:
            body["usage"] = {"total_tokens": int(request.headers["x-test-usage"])}
        return web.json_response(body, headers=headers)


@dataclass
class Setup:
    url: str
    admin: str
    controller: Controller
    registry: CollectorRegistry
    upstream: Upstream
    #: Each release of a slot: the ticket's id and whether it taught the estimator.
    releases: list[tuple[int, bool]]
    records: list[dict[str, Any]]

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def envoy_stat(self, name: str) -> int:
        text = httpx.get(f"{self.admin}/stats?filter=^{name}$", timeout=5).text
        return int(text.split(":")[1]) if ":" in text else 0

    @property
    def responses(self) -> dict[str, float]:
        return {kind: self.sample("extproc_response_headers_total", kind=kind)
                for kind in ("asked", "skipped", "received")}


Make = Callable[..., Awaitable[Setup]]


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Make]:
    async with AsyncExitStack() as exits:
        async def start(every: int, the_policy: Policy | None = None) -> Setup:
            the_policy = the_policy or policy()
            registry = CollectorRegistry()
            controller = Controller(the_policy, Metrics(registry), rng=random.Random(3))
            releases: list[tuple[int, bool]] = []
            release = controller.release

            def counted(ticket: Ticket, *, learn: bool = True) -> None:
                releases.append((ticket.id, learn))
                release(ticket, learn=learn)

            controller.release = counted  # type: ignore[method-assign]
            controller.start()
            exits.push_async_callback(controller.stop)
            server = grpc.aio.server()
            records: list[dict[str, Any]] = []
            processor = ExternalProcessor(controller, response_sample=every)
            processor.records = LogRecords(records)  # type: ignore[assignment]
            # The edge judged in ext_proc, as shipped: its x-ratelimit-* on every response.
            edge = RateLimitService(controller.machine, RateLimitMetrics(registry),
                                    lambda: controller.policy.ratelimit, refused=controller.refused)
            processor.edge = edge
            ext_proc_grpc.add_ExternalProcessorServicer_to_server(processor, server)
            add_to_server(edge, server)
            grpc_port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            exits.push_async_callback(server.stop, None)

            upstream = Upstream()
            upstream_port = await serve_http(exits, upstream.handle)

            listen, admin = free_port(), free_port()
            stack = Stack(tmp_path)
            exits.push_async_callback(asyncio.to_thread, stack.stop)
            await asyncio.to_thread(stack.envoy, envoy_config(listen, admin, upstream_port, grpc_port))
            return Setup(f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{admin}", controller, registry,
                         upstream, releases, records)

        yield start


def one_set_of_limits(response: httpx.Response) -> dict[str, str]:
    """The response's x-ratelimit-* headers, each of which it must carry exactly once."""
    for name in LIMITS:
        assert len(response.headers.get_list(name)) == 1, (name, response.headers.get_list(name))
    return {name: response.headers[name] for name in LIMITS}


async def test_one_in_n_requests_asks_for_the_response_headers_and_every_response_has_its_limits(
        make: Make) -> None:
    setup = await make(every=4)
    async with httpx.AsyncClient(base_url=setup.url, timeout=30) as client:
        responses = [await client.post("/v1/chat/completions", json=CHAT, headers=as_tenant("acme"))
                     for _ in range(24)]
    assert [r.status_code for r in responses] == [200] * 24
    limits = [one_set_of_limits(r) for r in responses]
    # Judged at each arrival: the tenant's budget, one fewer each time, asked for or not.
    assert [int(x["x-ratelimit-remaining"]) for x in limits] == list(range(99, 75, -1))
    assert {x["x-ratelimit-limit"] for x in limits} == {'100, 100;w=3600;name="tenant_requests"'}
    await until(lambda: setup.controller.machine.total_inflight == 0, "every slot back")
    await until(lambda: len(setup.releases) == 24, "every release")
    # One in 4 asked for, and only those sent by Envoy: its messages are the request headers of
    # each request (bodies not read here; no trailers from an HTTP/1 upstream) and the response
    # headers of the sampled ones.
    assert setup.responses == {"asked": 6, "skipped": 18, "received": 6}
    assert setup.envoy_stat("http.inference.ext_proc.streams_started") == 24
    assert setup.envoy_stat("http.inference.ext_proc.stream_msgs_sent") == 24 + 6
    # Every slot released once; only the sampled taught the estimator.
    assert len({ticket for ticket, _ in setup.releases}) == 24
    assert sum(learn for _, learn in setup.releases) == 6
    decisions = [r for r in setup.records if r["event"] == "decision"]
    assert sorted(r["status"] for r in decisions if r["status"] is not None) == [200] * 6
    assert all(r.get("sampled") is False for r in decisions if r["status"] is None)


async def test_concurrent_requests_a_bounded_share_asked_and_no_slot_left(make: Make) -> None:
    setup = await make(every=8, the_policy=policy(read_body="always"))
    async with httpx.AsyncClient(base_url=setup.url, timeout=30,
                                 limits=httpx.Limits(max_connections=32)) as client:
        responses = await asyncio.gather(*(
            client.post("/v1/chat/completions", json=CHAT, headers=as_tenant("acme" if i % 2 else "globex"))
            for i in range(80)))
    assert [r.status_code for r in responses] == [200] * 80
    for r in responses:
        one_set_of_limits(r)
    await until(lambda: setup.controller.machine.total_inflight == 0, "every slot back")
    await until(lambda: len(setup.releases) == 80, "every release")
    assert len({ticket for ticket, _ in setup.releases}) == 80
    # 1 in 8 by a counter: exactly 10 of 80 asked, however the requests interleaved.
    assert setup.responses == {"asked": 10, "skipped": 70, "received": 10}


async def test_every_request_asked_still_carries_one_set_of_limits(make: Make) -> None:
    # --response-sample 1 (the default): ext_proc's answer to the response headers sets them, no
    # metadata is written, and the route configuration adds nothing of its own.
    setup = await make(every=1)
    async with httpx.AsyncClient(base_url=setup.url, timeout=30) as client:
        responses = [await client.post("/v1/chat/completions", json=CHAT, headers=as_tenant("acme"))
                     for _ in range(5)]
        own = await client.post("/v1/chat/completions", json=CHAT,
                                headers={**as_tenant("acme"), "x-test-own-limit": "1"})
    assert [one_set_of_limits(r)["x-ratelimit-remaining"] for r in responses] == \
        ["99", "98", "97", "96", "95"]
    # A backend's own header of that name is replaced, as the ratelimit filter's were.
    assert one_set_of_limits(own)["x-ratelimit-limit"].startswith("100, ")
    await until(lambda: len(setup.releases) == 6, "every release")
    assert setup.responses == {"asked": 6, "skipped": 0, "received": 6}


async def test_unsampled_the_route_replaces_a_backends_header_and_reaches_envoys_own_replies(
        make: Make) -> None:
    setup = await make(every=100)
    async with httpx.AsyncClient(base_url=setup.url, timeout=30) as client:
        first = await client.post("/v1/chat/completions", json=CHAT, headers=as_tenant("acme"))  # asked
        own = await client.post("/v1/chat/completions", json=CHAT,
                                headers={**as_tenant("acme"), "x-test-own-limit": "1"})
        # Admitted, and then the upstream is gone: Envoy's own 503, after the admission's metadata.
        reset = await client.post("/v1/reset", json=CHAT, headers=as_tenant("acme"))
        health = await client.get("/health")
    one_set_of_limits(first)
    assert one_set_of_limits(own)["x-ratelimit-limit"].startswith("100, ")
    assert reset.status_code == 503
    assert one_set_of_limits(reset)["x-ratelimit-remaining"] == "97"
    # Never decided by extproc (ext_proc off on the route): no limits at all.
    assert all(name not in health.headers for name in LIMITS)
    await until(lambda: len(setup.releases) == 3, "every release")
    assert setup.responses == {"asked": 1, "skipped": 2, "received": 1}


async def test_a_token_budget_is_charged_without_the_response_message(make: Make) -> None:
    # The charge needs nothing from the response-headers message: the proxy reads the usage (the
    # extproc.usage filter) and sends it at stream end with what the admission recorded.
    budgets = {"budgets": {"default": {"requests": 100, "tokens": 1_000, "per": "hour"}}}
    setup = await make(every=8, the_policy=policy(ratelimit=budgets))
    async with httpx.AsyncClient(base_url=setup.url, timeout=30) as client:
        asked = await client.post("/v1/chat/completions", json=CHAT,
                                  headers={**as_tenant("acme"), "x-test-usage": "100"})
        skipped = await client.post("/v1/chat/completions", json=CHAT,
                                    headers={**as_tenant("acme"), "x-test-usage": "250"})
        await until(lambda: setup.sample("extproc_ratelimit_usage_tokens_total") == 350, "both charges")
        unreported = await client.post("/v1/chat/completions", json=CHAT, headers=as_tenant("acme"))
        await until(lambda: setup.sample("extproc_ratelimit_usage_estimates_total") == 1, "the estimate")
    for r in (asked, skipped, unreported):
        assert r.status_code == 200
        one_set_of_limits(r)
    assert setup.sample("extproc_ratelimit_usage_reports_total") == 2
    assert setup.responses == {"asked": 1, "skipped": 2, "received": 1}


async def test_a_client_that_resets_mid_response_unsampled_frees_its_slot_once(make: Make) -> None:
    setup = await make(every=8)
    async with httpx.AsyncClient(base_url=setup.url, timeout=30) as client:
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200  # (the asked one)
        async with client.stream("POST", "/v1/chat/completions", json=CHAT,
                                 headers={"x-test-hold": "cut"}) as response:
            assert response.status_code == 200
            one_set_of_limits(response)  # (the headers came before the body: from the route)
            await until(lambda: setup.controller.machine.total_inflight == 1, "the streaming request")
            # The client leaves with the response half sent: Envoy resets the HTTP stream, then ext_proc's.
        await until(lambda: setup.controller.machine.total_inflight == 0, "its slot back")
        setup.upstream.hold("cut").set()
        after = await client.post("/v1/chat/completions", json=CHAT)
    assert after.status_code == 200
    await until(lambda: len(setup.releases) == 3, "every release")
    ids = [ticket for ticket, _ in setup.releases]
    assert len(set(ids)) == 3  # each slot released once
    assert [learn for _, learn in setup.releases] == [True, False, False]
    await asyncio.sleep(0.2)  # (a second release of the cut one would come now, if ever)
    assert len(setup.releases) == 3
    assert setup.responses == {"asked": 1, "skipped": 2, "received": 1}
    cut = [r for r in setup.records if r["event"] == "decision"][1]
    assert (cut["outcome"], cut["status"], cut["sampled"]) == ("admitted", None, False)


SERVE_POLICY = """
version: 1
lanes:
  - {name: default, max_inflight: 8, max_queued: 8, deadline: 10s}
classification: {default_lane: default}
"""


def test_extproc_serve_takes_the_flag(make_env: Callable[..., Env]) -> None:
    env = make_env(SERVE_POLICY, extproc_args=("--response-sample", "4"))
    for _ in range(8):
        assert httpx.post(f"{env.url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
    env.wait_idle()
    assert {kind: env.metric("extproc_response_headers_total", kind=kind)
            for kind in ("asked", "skipped", "received")} == {"asked": 2, "skipped": 6, "received": 2}
    extproc = next(p for p in env.stack.processes if p.name == "extproc")
    assert '"response_sample": 4' in extproc.output()

"""The admin API over gRPC (extproc.api.admin.v1.Admin) on a real extproc behind a real Envoy.

The same state as ``GET /admin/state``, the same operations, under the same token; refused to
browsers; on its own loopback port, never on the ext_proc port Envoy talks to. Server reflection
there, read with grpcio-reflection's own descriptor database client, under the same token.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import grpc
import httpx
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf.message_factory import GetMessageClass
from grpc_reflection.v1alpha import reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from extproc.api.admin.v1 import admin_pb2 as pb
from extproc.api.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc.api.document import from_document, to_document
from extproc.operations import STATE_VERSION
from tests.integration.conftest import Env, shared_env

SERVICE = "extproc.api.admin.v1.Admin"

pytestmark = pytest.mark.envoy

POLICY = """
lanes:
  - {name: a, priority: 10, max_inflight: 2, max_queued: 100, deadline: 20s}
  - {name: b, max_inflight: 1, max_queued: 10, deadline: 20s}
capacity: {max_hold: 60s}
classification:
  default_lane: a
  rules: [{match: {path_prefix: /b}, lane: b}]
tenants: {weights: {acme: 2}}
estimation:
  default: {prefill_ms_per_token: 0, decode_ms_per_token: 1, overhead_ms: 10}
  default_max_tokens: 10
  learning_rate: 0
"""
T = TypeVar("T")


def call(address: str, method: str, request: Any, token: str | None = None,
         metadata: tuple[tuple[str, str], ...] = ()) -> Any:
    """One unary call on the admin API (a fresh channel each time, as a CLI would)."""

    async def run() -> Any:
        md = (("authorization", f"Bearer {token}"),) if token else ()
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.AdminStub(channel)
            return await getattr(stub, method)(request, metadata=md + metadata, timeout=5)

    return _run(run())


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def code_of(fn: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        fn()
    code: grpc.StatusCode = info.value.code()
    return code


def post(env: Env, path: str = "/v1/x", delay_ms: int = 0) -> httpx.Response:
    return httpx.post(env.url + path, json={"max_tokens": 10}, headers={"x-test-delay-ms": str(delay_ms)},
                      timeout=30)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """One stack with POLICY for the tests that change nothing in it (the others make their own)."""
    with shared_env(tmp_path_factory, "admin", POLICY) as environment:
        yield environment


def wait_for(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_get_state_is_the_document_the_http_port_serves(env: Env) -> None:
    with ThreadPoolExecutor(3) as pool:
        running = [pool.submit(post, env, "/v1/x", 800) for _ in range(3)]
        wait_for(lambda: env.metric("inference_pending_requests", lane="a") == 1, "one request to queue")
        state = call(env.admin_grpc, "GetState", pb.GetStateRequest())
        doc = httpx.get(env.admin_url + "/admin/state", timeout=5).json()
        assert [r.result().status_code for r in running] == [200] * 3
    assert isinstance(state, pb.State)
    assert state.version == STATE_VERSION
    a = next(lane for lane in state.lanes if lane.name == "a")
    assert (a.inflight, a.limit, a.queued) == (2, 2, 1)
    assert [lane.name for lane in state.lanes] == ["a", "b"]  # priority first
    (tenant,) = [t for t in state.tenants if t.name == "acme"]
    assert tenant.weight == 2.0  # weighed by the policy, listed though nothing of it queues
    # Field for field the HTTP document, but for the moments they were taken at.
    http_state = from_document(doc, pb.State)
    for moving in ("time", "uptime_s"):
        state.ClearField(moving)  # type: ignore[arg-type]
        http_state.ClearField(moving)  # type: ignore[arg-type]
    for lane in [*state.lanes, *http_state.lanes]:
        for field in ("admit_per_s", "reject_per_s", "wait_p50_s", "wait_p95_s"):
            lane.ClearField(field)  # type: ignore[arg-type]
    assert to_document(state) == to_document(http_state)


def test_pause_resume_drain_undrain_and_reload(make_env: Callable[..., Env]) -> None:
    env = make_env(POLICY, extproc_args=("--watch-interval", "0"))
    address = env.admin_grpc
    assert call(address, "Pause", pb.PauseRequest(lane="a")) == pb.PauseResponse(lane="a", paused=True)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(post, env)
        wait_for(lambda: env.metric("inference_pending_requests", lane="a") == 1, "the request to queue")
        assert next(lane for lane in call(address, "GetState", pb.GetStateRequest()).lanes
                    if lane.name == "a").paused
        time.sleep(0.3)
        assert not held.done()
        call(address, "Resume", pb.ResumeRequest(lane="a"))
        assert held.result().status_code == 200
    with pytest.raises(grpc.aio.AioRpcError) as info:
        call(address, "Pause", pb.PauseRequest(lane="nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "unknown lane 'nope'" in (info.value.details() or "")

    assert call(address, "Drain", pb.DrainRequest()).draining is True
    r = post(env)
    assert (r.status_code, r.headers["x-extproc-reason"]) == (503, "draining")
    assert call(address, "Undrain", pb.UndrainRequest()).draining is False
    assert post(env).status_code == 200

    env.policy.write_text(POLICY.replace("max_inflight: 2", "max_inflight: zero"))
    bad = call(address, "Reload", pb.ReloadRequest())
    assert (bad.ok, bad.changed) == (False, False)
    assert "lanes[0].max_inflight" in bad.problems[0]
    assert list(call(address, "GetState", pb.GetStateRequest()).policy.last_error) == list(bad.problems)
    env.policy.write_text(POLICY.replace("max_inflight: 2", "max_inflight: 3"))
    good = call(address, "Reload", pb.ReloadRequest())
    assert (good.ok, good.changed, list(good.problems)) == (True, True, [])
    wait_for(lambda: env.metric("inference_inflight_limit", lane="a") == 3, "the new limit")


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class Bearer(grpc.StreamStreamClientInterceptor):  # type: ignore[misc]
    """Sends ``authorization: Bearer <token>`` on a plain channel's streams (reflection is one)."""

    def __init__(self, token: str) -> None:
        self.token = token

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        metadata = [*(details.metadata or ()), ("authorization", f"Bearer {self.token}")]
        return continuation(_Details(details.method, details.timeout, metadata, details.credentials,
                                     details.wait_for_ready, details.compression), requests)


@contextlib.contextmanager
def reflected(address: str, token: str | None = None) -> Iterator[tuple[list[str], DescriptorPool]]:
    """The services reflection lists on ``address``, and a pool that reads descriptors from it."""
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(
            grpc.intercept_channel(channel, Bearer(token)) if token else channel)
        yield sorted(database.get_services()), DescriptorPool(database)


def test_reflection_describes_the_admin_api_well_enough_to_call_it(env: Env) -> None:
    with reflected(env.admin_grpc) as (services, pool):
        assert services == [SERVICE, "grpc.reflection.v1alpha.ServerReflection"]
        admin = pool.FindServiceByName(SERVICE)
        state = pool.FindMessageTypeByName("extproc.api.admin.v1.State")
    assert [m.name for m in admin.methods] == ["GetState", "Reload", "Drain", "Undrain", "Pause", "Resume"]
    assert [f.name for f in state.fields] == [f.name for f in pb.State.DESCRIPTOR.fields]
    # What a generic client does: messages built from the reflected descriptors alone, no .proto.
    method = admin.methods_by_name["GetState"]
    request, reply = GetMessageClass(method.input_type), GetMessageClass(method.output_type)
    with grpc.insecure_channel(env.admin_grpc) as channel:
        get = channel.unary_unary(f"/{SERVICE}/GetState", request_serializer=request.SerializeToString,
                                  response_deserializer=reply.FromString)
        answer = get(request(), timeout=5)
    assert [lane.name for lane in answer.lanes] == ["a", "b"]
    assert answer.version == STATE_VERSION


async def _silent_reflection_stream(address: str) -> grpc.StatusCode:
    """Open reflection's stream and read before writing anything: the code the call ends with."""
    async with grpc.aio.insecure_channel(address) as channel:
        stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(timeout=5)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await stream.read()
        code: grpc.StatusCode = await stream.code()
        return code


def test_with_a_token_every_call_needs_it(make_env: Callable[..., Env],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXTPROC_ADMIN_TOKEN", "s3cret")
    env = make_env(POLICY)
    address = env.admin_grpc
    assert code_of(lambda: call(address, "GetState", pb.GetStateRequest())) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: call(address, "Drain", pb.DrainRequest(), token="wrong")) == (
        grpc.StatusCode.UNAUTHENTICATED)
    assert call(address, "GetState", pb.GetStateRequest(), token="s3cret").draining is False
    # The refused drain changed nothing.
    assert post(env).status_code == 200
    # Reflection too: nothing of the API is listed or described without the token.
    for token in (None, "wrong"):
        with pytest.raises(grpc.RpcError) as info, reflected(address, token):
            pass
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    # Refused at once, as a stream: a client that reads before it writes is not left waiting.
    assert _run(_silent_reflection_stream(address)) == grpc.StatusCode.UNAUTHENTICATED
    with reflected(address, "s3cret") as (services, pool):
        assert SERVICE in services
        assert pool.FindServiceByName(SERVICE).methods_by_name["Drain"].output_type.name == "DrainResponse"


def test_browsers_are_refused(env: Env) -> None:
    address = env.admin_grpc
    # A grpc-web proxy passes a page's Origin on: refused, and the drain did not happen.
    for metadata in ((("origin", "https://evil.example"),), (("sec-fetch-site", "cross-site"),)):
        assert code_of(lambda md=metadata: call(address, "Drain", pb.DrainRequest(), metadata=md)) == (
            grpc.StatusCode.PERMISSION_DENIED)
    assert post(env).status_code == 200
    # What a page can send at all (HTTP/1.1, its own Host, a simple POST) gets no answer a browser reads.
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"POST /extproc.api.admin.v1.Admin/Drain HTTP/1.1\r\nHost: evil.example\r\n"
                  b"Origin: https://evil.example\r\nContent-Type: text/plain\r\nContent-Length: 0\r\n\r\n")
        s.settimeout(5)
        try:
            reply = s.recv(4096)
        except (TimeoutError, ConnectionResetError):
            reply = b""
    assert not reply.startswith(b"HTTP/"), reply[:200]  # an HTTP/2 SETTINGS frame at most
    assert post(env).status_code == 200  # not drained


def test_the_admin_api_is_not_on_the_port_envoy_talks_to(env: Env) -> None:
    assert code_of(lambda: call(f"127.0.0.1:{env.extproc_grpc}", "Drain", pb.DrainRequest())) == (
        grpc.StatusCode.UNIMPLEMENTED)
    assert post(env).status_code == 200


def test_off_loopback_without_a_token_or_a_bad_address_refuses_to_start(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    base = [sys.executable, "-m", "extproc", "serve", "--policy", str(policy), "--grpc", "127.0.0.1:0",
            "--http", "127.0.0.1:0", "--admin", "127.0.0.1:0"]
    result = subprocess.run([*base, "--admin-grpc", "0.0.0.0:0"], capture_output=True, text=True, timeout=30,
                            env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 3
    assert "0.0.0.0:0 is not on loopback: set a token" in result.stderr
    result = subprocess.run([*base, "--admin-grpc", "nonsense"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "--admin-grpc" in result.stderr

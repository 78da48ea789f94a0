"""extproc must never be the outage: its faults cost new admissions at most, never a running request.

A real Envoy with the shipped config, the real ``extproc serve`` and an upstream that streams
slow responses (a generation). extproc is killed, restarted and stalled under them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from extproc.core.decision import Reason, error_body
from extproc.localstack import envoy_config, free_port, wait_http
from tests.integration.conftest import Env, as_tenant

pytestmark = pytest.mark.envoy

POLICY = """
lanes:
  - {name: a, max_inflight: 2, max_queued: 20, deadline: 20s}
capacity: {max_hold: 300s}
trusted_headers: [x-extproc-client]
classification: {default_lane: a}
tenants: {header: x-extproc-client}
estimation:
  default: {prefill_ms_per_token: 0, decode_ms_per_token: 1, overhead_ms: 10}
  default_max_tokens: 10
  learning_rate: 0.5
  read_body: always
  body_timeout: 1s
  max_slow_bodies: 3
queueing: {sjf_weight: 0}
ratelimit: {mode: "off"}
"""
#: POLICY's lane deadline: a held request's ext_proc timer is stretched to about this (its hold).
DEADLINE_S = 20.0
#: POLICY's estimation.body_timeout.
BODY_TIMEOUT_S = 1.0


def message_timeout_s() -> float:
    """The shipped Envoy config's ext_proc message_timeout (seconds)."""
    config = envoy_config(1, 2, 3, 4)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    return float(ext_proc["typed_config"]["message_timeout"].removesuffix("s"))


def stream(env: Env, chunks: int, gap_ms: int, timeout: float = 60) -> tuple[int, bytes]:
    """A streamed "generation": its status and everything received, however it ended."""
    received = b""
    try:
        with httpx.stream("POST", env.url + "/v1/chat/completions", json={"max_tokens": 10},
                          headers={"x-test-stream": f"{chunks}:{gap_ms}"}, timeout=timeout) as r:
            for piece in r.iter_raw():
                received += piece
            return r.status_code, received
    except httpx.HTTPError:
        return -1, received


def extproc_process(env: Env) -> int:
    (process,) = [p for p in env.stack.processes if p.name == "extproc"]
    return process.popen.pid


def wait_until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def restart(env: Env) -> None:
    """Start extproc again on the same gRPC port (Envoy's cluster names it; it reconnects on its own),
    its HTTP and admin listeners on fresh ports: a port the killed one freed is anyone's meanwhile (a
    CI run saw another connection take the admin port before the restart could bind it)."""
    http, admin = free_port(), free_port()
    env.stack.processes[:] = [p for p in env.stack.processes if p.name != "extproc"]
    env.stack.extproc(env.policy, env.extproc_grpc, http, "--log-format", "json", admin=admin)
    env.metrics_url, env.admin_url = f"http://127.0.0.1:{http}/metrics", f"http://127.0.0.1:{admin}"


def test_sigkill_cuts_no_running_generation_and_new_requests_get_a_useful_503(
        make_env: Callable[..., Env]) -> None:
    env = make_env(POLICY)
    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(stream, env, 30, 100) for _ in range(2)]   # ~3 s each, both slots
        wait_until(lambda: env.metric("inference_inflight_requests", lane="a") == 2, "two generations")
        held = pool.submit(lambda: httpx.post(env.url + "/v1/x", json={}, timeout=30))
        wait_until(lambda: env.metric("inference_pending_requests", lane="a") == 1, "one held request")
        time.sleep(0.5)  # the generations are streaming
        os.kill(extproc_process(env), signal.SIGKILL)
        killed = time.monotonic()
        # The held request is answered at once, with the configured failure mode's useful answer:
        # Envoy sees its stream die, rather than waiting for the hold extproc stretched its timer to
        # (the lane's deadline). Half of that leaves a busy machine all the room it needs.
        answer = held.result()
        assert time.monotonic() - killed < DEADLINE_S / 2
        down = httpx.post(env.url + "/v1/x", json={}, headers=as_tenant("acme"), timeout=10)
        for r in (answer, down):
            assert r.status_code == 503
            assert r.headers["retry-after"] == "5"
            assert r.headers["x-extproc-reason"] == "unavailable"
            assert r.content == error_body(Reason.UNAVAILABLE, None, 5)
        # Every running generation streams on to its clean end.
        for f in running:
            status, body = f.result()
            assert status == 200
            assert body.count(b"data: ") == 31
            assert body.endswith(b"data: [DONE]\n\n")
        restart(env)
        # Picks up at once: nothing leaked, nothing counted twice.
        assert httpx.post(env.url + "/v1/x", json={}, timeout=10).status_code == 200
        assert env.metric("inference_inflight_requests", lane="a") == 0


def test_without_a_store_a_restarted_extproc_does_not_count_generations_from_before(
        make_env: Callable[..., Env]) -> None:
    """The documented over-admission window: a fresh extproc knows nothing of what its
    predecessor admitted, so until those generations end the backend may see up to twice the
    limit. Never a cut generation; the window closes when the old ones end."""
    env = make_env(POLICY)
    httpx.get(env.upstream_url + "/stats", timeout=5)  # resets the peak
    with ThreadPoolExecutor(8) as pool:
        old = [pool.submit(stream, env, 40, 100) for _ in range(2)]  # ~4 s
        wait_until(lambda: env.metric("inference_inflight_requests", lane="a") == 2, "two generations")
        os.kill(extproc_process(env), signal.SIGKILL)
        restart(env)
        new: list[Future[tuple[int, bytes]]] = [pool.submit(stream, env, 10, 100) for _ in range(3)]
        results = [f.result() for f in old + new]
    assert [status for status, _ in results] == [200] * 5
    assert all(body.endswith(b"data: [DONE]\n\n") for _, body in results)
    # Two old generations plus the new limit of two: the window's figure at this limit.
    peak = httpx.get(env.upstream_url + "/stats", timeout=5).json()["peak"]
    assert peak == 4
    env.wait_idle()


def test_a_stalled_extproc_delays_nothing_that_runs_and_refuses_new_requests_after_the_message_timeout(
        make_env: Callable[..., Env]) -> None:
    env = make_env(POLICY)
    pid = extproc_process(env)
    timeout = message_timeout_s()
    with ThreadPoolExecutor(4) as pool:
        running = pool.submit(stream, env, 20, 100)
        wait_until(lambda: env.metric("inference_inflight_requests", lane="a") == 1, "a generation")
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            r = httpx.post(env.url + "/v1/x", json={}, timeout=20 * timeout)
            waited = time.monotonic() - started
            status, body = running.result()
        finally:
            os.kill(pid, signal.SIGCONT)
    assert (r.status_code, r.headers["x-extproc-reason"]) == (503, "unavailable")
    # Refused once Envoy's message_timeout passed (then the gate), not sooner (100 ms for the clocks)
    # and not by any longer timer: the client would have waited twenty times as long.
    assert timeout - 0.1 <= waited < 5 * timeout
    assert status == 200
    assert body.endswith(b"data: [DONE]\n\n")
    env.wait_idle()


def test_only_successful_responses_teach_the_estimator(make_env: Callable[..., Env]) -> None:
    env = make_env(POLICY)

    def predicted(status: int = 200, delay_ms: int = 0) -> int:
        # The echo upstream shows what extproc predicted, whatever status it answers with.
        r = httpx.post(env.url + "/v1/x", json={"max_tokens": 10}, timeout=10,
                       headers={"x-test-status": str(status), "x-test-delay-ms": str(delay_ms)})
        assert r.status_code == status
        return int(r.json()["headers"]["x-extproc-predicted-ms"])

    # A burst of fast failures (400 and 500, answered at once) teaches nothing: every one of
    # them is predicted from the policy's prior, 10 ms overhead + 10 tokens × 1 ms.
    assert [predicted(status) for status in (400, 500) * 5] == [20] * 10
    # Slow successes do.
    for _ in range(3):
        predicted(200, delay_ms=300)
        env.wait_idle()  # learned when its stream ends, just after the response
    assert predicted(400) > 40
    env.wait_idle()


def _announce_and_stall(url: str, length: int = 50) -> socket.socket:
    """A client that sends headers announcing a body, then nothing."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(f"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {length}\r\n\r\n".encode())
    return sock


def test_a_body_that_never_comes_gets_408_and_frees_its_stream(make_env: Callable[..., Env]) -> None:
    env = make_env(POLICY)
    sock = _announce_and_stall(env.url)
    try:
        started = time.monotonic()
        reply = sock.recv(65536)
        waited = time.monotonic() - started
    finally:
        sock.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert b"x-extproc-reason: body_timeout" in head
    assert json.loads(body)["error"]["code"] == "body_timeout"
    # Answered when the body timeout passed (100 ms for the clocks), not by any longer timer (the
    # socket's own is 10 s, Envoy's stream idle timeout 600 s).
    assert BODY_TIMEOUT_S - 0.1 <= waited < 5 * BODY_TIMEOUT_S
    assert env.metric("extproc_intake_rejections_total", reason="body_timeout") == 1
    assert env.metric("inference_inflight_requests", lane="a") == 0


def test_one_client_may_hold_only_so_many_slow_bodies(make_env: Callable[..., Env]) -> None:
    policy = POLICY.replace("body_timeout: 1s", "body_timeout: 20s")
    env = make_env(policy)
    stalled = [_announce_and_stall(env.url) for _ in range(3)]
    try:
        # A body counts as slow a second after its headers (SlowBodies.SLOW_S). The first refusal
        # is awaited rather than slept for: a busy machine may hand the headers over late.
        time.sleep(1.0)
        answers: list[httpx.Response] = []

        def refused() -> bool:
            answers.append(httpx.post(env.url + "/v1/x", json={}, timeout=10))
            return answers[-1].status_code != 200

        wait_until(refused, "the slow bodies to count")
        r = answers[-1]
        assert (r.status_code, r.headers["x-extproc-reason"]) == (429, "slow_bodies")
        assert int(r.headers["retry-after"]) >= 1
    finally:
        for sock in stalled:
            sock.close()
    # Once they are gone, the client is served again.
    wait_until(lambda: httpx.post(env.url + "/v1/x", json={}, timeout=10).status_code == 200, "service")


def test_a_gzip_body_is_read_for_its_max_tokens(make_env: Callable[..., Env]) -> None:
    import gzip

    env = make_env(POLICY.replace("learning_rate: 0.5", "learning_rate: 0"))
    body = gzip.compress(json.dumps({"max_tokens": 500, "messages": []}).encode())
    r = httpx.post(env.url + "/v1/x", content=body, timeout=10,
                   headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert r.status_code == 200
    assert r.json()["headers"]["x-extproc-predicted-ms"] == "510"


def test_a_repeated_tenant_header_is_a_400_never_a_merged_tenant(make_env: Callable[..., Env]) -> None:
    def gateway_sets_it_twice(config: dict[str, object]) -> None:
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]  # type: ignore[index]
        filters = hcm["http_filters"]
        twice = [{"append": {"header": {"key": "x-extproc-client", "value": v},
                             "append_action": "APPEND_IF_EXISTS_OR_ADD"}} for v in ("acme", "globex")]
        filters.insert(1, {"name": "gateway-twice", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": twice}}})

    env = make_env(POLICY, tweak=gateway_sets_it_twice)
    before = httpx.get(env.upstream_url + "/stats", timeout=5).json()["total"]
    r = httpx.post(env.url + "/v1/x", json={}, timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "bad_request"
    assert "x-extproc-client" in r.json()["error"]["message"]
    assert httpx.get(env.upstream_url + "/stats", timeout=5).json()["total"] == before


def test_the_health_route_keeps_working_while_extproc_is_down(make_env: Callable[..., Env]) -> None:
    env = make_env(POLICY)
    os.kill(extproc_process(env), signal.SIGKILL)
    assert httpx.get(env.url + "/health", timeout=10).status_code == 200
    wait_http(env.url + "/health")
    assert httpx.post(env.url + "/v1/x", json={}, timeout=10).status_code == 503
    assert free_port()  # the machine is fine


@pytest.mark.parametrize("which", ["envoy.yaml", "compose.yaml", "istio-gateway", "istio-sidecar"])
def test_every_shipped_config_keeps_generations_and_fails_new_requests_closed(
        tmp_path: Path, which: str) -> None:
    """The same fault against each shipped config (compose's on loopback, the Istio patches on a
    stand-in bootstrap): SIGKILL extproc while a generation streams."""
    import sys

    from extproc.localstack import Stack
    from tests.integration.conftest import UPSTREAM
    from tests.integration.test_probes import render

    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    stack = Stack(tmp_path)
    try:
        upstream = free_port()
        stack.start("upstream", [sys.executable, str(UPSTREAM), str(upstream)])
        wait_http(f"http://127.0.0.1:{upstream}/stats", proc=stack.processes[-1].popen)
        grpc, http = free_port(), free_port()
        extproc = stack.extproc(policy, grpc, http)
        listen, admin = free_port(), free_port()
        stack.envoy(render(which, listen, admin, upstream, grpc))
        url = f"http://127.0.0.1:{listen}"

        streaming = threading.Event()

        def generation() -> tuple[int, bytes]:
            with httpx.stream("POST", url + "/v1/chat/completions", json={}, timeout=30,
                              headers={"x-test-stream": "12:100"}) as r:
                received = b""
                for piece in r.iter_raw():
                    received += piece
                    streaming.set()
                return r.status_code, received

        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(generation)
            # Killed once the generation streams (a fixed sleep could kill it before it started).
            assert streaming.wait(20)
            os.kill(extproc.popen.pid, signal.SIGKILL)
            down = httpx.post(url + "/v1/chat/completions", json={}, timeout=10)
            status, body = running.result()
        assert status == 200
        assert body.endswith(b"data: [DONE]\n\n")
        assert (down.status_code, down.headers["x-extproc-reason"], down.headers["retry-after"]) == (
            503, "unavailable", "5")
        assert down.json()["error"]["code"] == "unavailable"
    finally:
        stack.stop()

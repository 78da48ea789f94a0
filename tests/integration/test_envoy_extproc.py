"""extproc behind a real Envoy, in front of a real upstream, all over loopback."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.conftest import Env, as_tenant, shared_env, start_env

pytestmark = pytest.mark.envoy

POLICY = """
version: 1
lanes:
  - name: interactive
    priority: 100
    max_inflight: 1
    max_queued: 2
    deadline: 6s
  - name: tight
    priority: 50
    max_inflight: 1
    max_queued: 10
    deadline: 1s
  - name: best-effort
    max_inflight: 4
    max_queued: 4
    deadline: 2s
capacity: {max_hold: 60s}
trusted_headers: [x-extproc-client]
classification:
  default_lane: best-effort
  rules:
    - {match: {path_prefix: /interactive}, lane: interactive}
    - {match: {path_prefix: /tight}, lane: tight}
tenants: {header: x-extproc-client, default: anon}
estimation:
  default: {prefill_ms_per_token: 0, decode_ms_per_token: 1, overhead_ms: 10}
  default_max_tokens: 100
  learning_rate: 0
  occupancy_slowdown: 0
# These tests are about ext_proc's decisions; the edge shed has its own (test_ratelimit.py).
ratelimit: {mode: "off"}
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with shared_env(tmp_path_factory, "stack", POLICY) as environment:
        yield environment


@pytest.fixture(autouse=True)
def _idle_between_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "env" in request.fixturenames:
        request.getfixturevalue("env").wait_idle()


def chat(max_tokens: int = 10, **extra: object) -> dict[str, object]:
    return {"model": "m", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hi"}], **extra}


def post(env: Env, path: str, body: object = None, *, delay_ms: int = 0, timeout: float = 30,
         headers: dict[str, str] | None = None) -> httpx.Response:
    h = {"x-test-delay-ms": str(delay_ms), **(headers or {})}
    return httpx.post(env.url + path, json=chat() if body is None else body, headers=h, timeout=timeout)


def until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait for a state the next step needs (a fixed sleep would bet on the machine's speed)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def running(env: Env, lane: str, count: int = 1) -> None:
    until(lambda: env.metric("inference_inflight_requests", lane=lane) == count, f"{count} running in {lane}")


def queued(env: Env, lane: str, count: int = 1) -> None:
    until(lambda: env.metric("inference_pending_requests", lane=lane) == count, f"{count} queued in {lane}")


def test_admit_adds_headers_upstream(env: Env) -> None:
    r = post(env, "/interactive/v1/chat/completions", headers=as_tenant("acme"))
    assert r.status_code == 200
    seen = r.json()["headers"]
    assert seen["x-extproc-lane"] == "interactive"
    assert seen["x-extproc-tenant"] == "acme"
    assert seen["x-extproc-queue-ms"] == "0"
    # 10 ms overhead + 10 requested tokens x 1 ms, from the policy's prior.
    assert seen["x-extproc-predicted-ms"] == "20"
    assert env.metric("inference_admission_decisions_total", lane="interactive", outcome="admitted") >= 1


def test_second_request_is_held_then_served_with_queue_time(env: Env) -> None:
    with ThreadPoolExecutor(2) as pool:
        first_sent = time.monotonic()
        first = pool.submit(post, env, "/interactive/a", delay_ms=1500)
        running(env, "interactive")
        second_sent = time.monotonic()
        second = pool.submit(post, env, "/interactive/b")
        queued(env, "interactive")
        seen_queued = time.monotonic()  # (it arrived before this)
        assert env.metric("inference_inflight_requests", lane="interactive") == 1
        r1, r2 = first.result(), second.result()
        second_took = time.monotonic() - second_sent
    assert r1.status_code == 200
    assert r2.status_code == 200
    queued_ms = int(r2.json()["headers"]["x-extproc-queue-ms"])
    # It waited at least from its arrival (before it was seen queued) until the first one's 1.5 s had
    # run out (they began after the first was sent): admitted at once it would show 0. The time it
    # reports is time its client saw pass. (5 ms: the header's rounding.)
    assert (first_sent + 1.5 - seen_queued) * 1000 - 5 <= queued_ms <= second_took * 1000
    assert env.metric("inference_queue_wait_seconds_count", lane="interactive") >= 2


def test_hold_longer_than_message_timeout_succeeds(env: Env) -> None:
    # Envoy's message_timeout is 1 s: this request waits ~2.5 s for its slot.
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, env, "/interactive/a", delay_ms=2800)
        running(env, "interactive")
        second = pool.submit(post, env, "/interactive/b")
        r1, r2 = first.result(), second.result()
    assert r1.status_code == 200
    assert r2.status_code == 200, r2.text
    assert int(r2.json()["headers"]["x-extproc-queue-ms"]) > 1000  # held past the message_timeout


def test_queue_full_gives_429_with_retry_after_and_json(env: Env) -> None:
    with ThreadPoolExecutor(4) as pool:
        busy = pool.submit(post, env, "/interactive/a", delay_ms=1500)
        running(env, "interactive")
        waiting = [pool.submit(post, env, "/interactive/q") for _ in range(2)]
        queued(env, "interactive", 2)
        r = post(env, "/interactive/over")
        for f in [busy, *waiting]:
            assert f.result().status_code == 200
    assert r.status_code == 429
    assert 1 <= int(r.headers["retry-after"]) <= 30
    assert r.headers["x-extproc-reason"] == "queue_full"
    error = r.json()["error"]
    assert error["code"] == "queue_full"
    assert error["type"] == "rate_limit_exceeded"
    assert "Retry after" in error["message"]
    assert env.metric("inference_admission_rejections_total", lane="interactive", reason="queue_full") >= 1


def test_unmeetable_deadline_rejected_at_once(env: Env) -> None:
    with ThreadPoolExecutor(2) as pool:
        # Predicted 5 s of work in the only slot of a lane whose deadline is 1 s.
        busy = pool.submit(post, env, "/tight/a", chat(max_tokens=5000), delay_ms=1500)
        running(env, "tight")
        queued_before = env.metric("inference_admission_decisions_total", lane="tight", outcome="queued")
        r = post(env, "/tight/b")
        assert busy.result().status_code == 200
    assert r.status_code == 429
    assert r.headers["x-extproc-reason"] == "deadline_unmeetable"
    # At once: refused on arrival, never queued (a count, where a stopwatch would time the machine).
    assert env.metric("inference_admission_decisions_total", lane="tight", outcome="queued") == queued_before


def test_deadline_expires_while_queued(env: Env) -> None:
    with ThreadPoolExecutor(2) as pool:
        busy = pool.submit(post, env, "/tight/a", delay_ms=2500)
        running(env, "tight")
        queued_before = env.metric("inference_admission_decisions_total", lane="tight", outcome="queued")
        started = time.monotonic()
        r = post(env, "/tight/b")
        waited = time.monotonic() - started
        # Refused when its 1 s deadline passed (100 ms for the clocks), while the slot's holder still
        # ran: not when the slot freed, which would have admitted it.
        assert not busy.done()
        assert busy.result().status_code == 200
    assert r.status_code == 429
    assert r.headers["x-extproc-reason"] == "deadline_expired"
    queued_after = env.metric("inference_admission_decisions_total", lane="tight", outcome="queued")
    assert queued_after == queued_before + 1
    assert waited >= 0.9


def test_client_disconnect_while_held_frees_the_entry(env: Env) -> None:
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(post, env, "/interactive/a", delay_ms=1500)
        running(env, "interactive")
        with pytest.raises(httpx.ReadTimeout):
            post(env, "/interactive/gone", timeout=0.5)
        queued(env, "interactive", 0)  # its entry goes with its client
        assert busy.result().status_code == 200
    env.wait_idle()
    assert env.metric("inference_admission_decisions_total", lane="interactive", outcome="cancelled") >= 1
    assert post(env, "/interactive/next").status_code == 200


def test_upstream_reset_releases_the_slot(env: Env) -> None:
    r = post(env, "/interactive/reset", delay_ms=100)
    assert r.status_code in (502, 503)
    env.wait_idle()
    assert post(env, "/interactive/after").status_code == 200


def test_non_json_and_huge_bodies_do_not_break_anything(env: Env) -> None:
    r = httpx.post(env.url + "/interactive/x", content=b"\xff not json {", timeout=10)
    assert r.status_code == 200
    huge = json.dumps(chat(max_tokens=7, messages=[{"role": "user", "content": "x" * 3_000_000}]))
    r = httpx.post(env.url + "/interactive/x", content=huge.encode(), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200
    # The whole body reaches the upstream although only its first part was read.
    assert r.json()["body_bytes"] == len(huge)
    assert r.json()["headers"]["x-extproc-lane"] == "interactive"
    deep = b"[" * 200_000
    assert httpx.post(env.url + "/interactive/x", content=deep, timeout=10).status_code == 200


def test_client_chosen_lane_header_is_stripped_and_ignored(env: Env) -> None:
    r = post(env, "/other", headers={"x-extproc-lane": "interactive", "x-extproc-queue-ms": "999"})
    seen = r.json()["headers"]
    assert seen["x-extproc-lane"] == "best-effort"
    assert seen["x-extproc-queue-ms"] == "0"


def test_metrics_and_health(env: Env) -> None:
    text = httpx.get(env.metrics_url).text
    for name in ("inference_queue_wait_seconds_bucket", "inference_pending_requests",
                 "inference_inflight_requests", "inference_admission_decisions_total",
                 "inference_admission_rejections_total"):
        assert name in text
    base = env.metrics_url.rsplit("/", 1)[0]
    assert httpx.get(base + "/healthz").status_code == 200
    assert httpx.get(base + "/readyz").status_code == 200
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{env.extproc_grpc}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="envoy.service.ext_proc.v3.ExternalProcessor"), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


TRUSTING = POLICY.replace(
    "trusted_headers: [x-extproc-client]", "trusted_headers: [x-extproc-client, x-extproc-lane]"
).replace("default_lane: best-effort", "default_lane: best-effort\n  lane_header: x-extproc-lane")


def _gateway_sets_lane(config: dict[str, Any]) -> None:
    """A gateway that derives the lane itself (here from x-gw-lane, standing in for an authenticated
    claim) and sets it after the strip of client x-extproc-* headers."""
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters = hcm["http_filters"]
    strip = next(i for i, f in enumerate(filters) if f["name"] == "extproc.strip_client_headers")
    filters.insert(strip + 1, {
        "name": "gateway-lane",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"append": {
                "header": {"key": "x-extproc-lane", "value": "%REQ(x-gw-lane)%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}}]},
        },
    })


def test_a_lane_header_the_gateway_sets_is_honoured_and_a_client_copy_is_not(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(TRUSTING)
    stack, env = start_env(tmp_path, policy, tweak=_gateway_sets_lane)
    try:
        r = post(env, "/other", headers={"x-gw-lane": "interactive"})
        assert r.json()["headers"]["x-extproc-lane"] == "interactive"
        # The client's own x-extproc-lane is gone before the gateway (or extproc) reads anything.
        r = post(env, "/other", headers={"x-extproc-lane": "interactive"})
        assert r.json()["headers"]["x-extproc-lane"] == "best-effort"
    finally:
        stack.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("loop", ["auto", "asyncio"])
def test_shutdown_answers_queued_with_503_and_lets_inflight_finish(tmp_path: Path, loop: str,
                                                                   sig: int) -> None:
    # On either event loop (auto: uvloop's, a dependency everywhere but Windows), on Kubernetes' SIGTERM
    # and on Ctrl-C's SIGINT.
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    stack, env = start_env(tmp_path, policy, extproc_args=("--event-loop", loop))
    try:
        with ThreadPoolExecutor(2) as pool:
            busy = pool.submit(post, env, "/interactive/a", delay_ms=1500)
            running(env, "interactive")
            held = pool.submit(post, env, "/interactive/b")
            queued(env, "interactive")
            extproc = next(p for p in stack.processes if p.name == "extproc")
            extproc.popen.send_signal(sig)
            r = held.result()
            assert r.status_code == 503
            assert r.headers["x-extproc-reason"] == "draining"
            assert busy.result().status_code == 200
        assert extproc.popen.wait(10) == 0
        assert '"event": "stopped"' in extproc.output()
        assert f'"event_loop": "{"uvloop" if loop == "auto" else "asyncio"}"' in extproc.output()
    finally:
        stack.stop()


def test_bad_policy_at_start_exits_non_zero_with_a_clear_error(tmp_path: Path) -> None:
    policy = tmp_path / "bad.yaml"
    policy.write_text(POLICY.replace("max_inflight: 1", "max_inflight: 0", 1))
    result = subprocess.run(
        [sys.executable, "-m", "extproc", "serve", "--policy", str(policy), "--grpc", "127.0.0.1:0",
         "--http", "127.0.0.1:0", "--admin", "127.0.0.1:0",
         "--admin-grpc", "127.0.0.1:0"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert f"{policy}:6: lanes[0].max_inflight" in result.stderr
    assert "greater than or equal to 1" in result.stderr


def test_port_in_use_exits_non_zero(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "extproc", "serve", "--policy", str(policy), "--grpc", "127.0.0.1:0",
             "--http", f"127.0.0.1:{port}", "--admin", "127.0.0.1:0",
         "--admin-grpc", "127.0.0.1:0"],
            capture_output=True, text=True, timeout=30)
    assert result.returncode == 3
    assert "cannot listen for HTTP" in result.stderr


HEADERS_ONLY = POLICY + "queueing: {sjf_weight: 0}\n"


def test_policy_without_body_needs_decides_on_headers(make_env: Callable[..., Env]) -> None:
    env = make_env(HEADERS_ONLY)
    body = json.dumps(chat(max_tokens=5000)).encode()
    r = httpx.post(env.url + "/interactive/x", content=body, timeout=10)
    seen = r.json()
    assert r.status_code == 200
    assert seen["body_bytes"] == len(body)
    # No body read: the prediction uses default_max_tokens (100), not the body's 5000.
    assert seen["headers"]["x-extproc-predicted-ms"] == "110"
    assert env.metric("extproc_stream_errors_total", kind="undecided") == 0


#: A model rule (a readable body naming model m goes to interactive), and a largest job of 3000 tokens.
UNREADABLE = POLICY.replace(
    "    - {match: {path_prefix: /interactive}, lane: interactive}\n",
    "    - {match: {models: [m]}, lane: interactive}\n",
).replace("  default_max_tokens: 100\n", "  default_max_tokens: 100\n  max_output_tokens: 3000\n")


def decision_of(env: Env, request_id: str) -> dict[str, Any]:
    """The decision record extproc logged for the request with ``request_id`` (written when its
    stream ends, just after the response)."""
    extproc = next(p for p in env.stack.processes if p.name == "extproc")

    def records() -> list[dict[str, Any]]:
        lines = [line for line in extproc.output().splitlines()
                 if line.startswith("{") and request_id in line]
        return [r for r in map(json.loads, lines)
                if r.get("event") == "decision" and r["request_id"] == request_id]

    until(lambda: bool(records()), f"the decision record of {request_id}")
    return records()[0]


@pytest.mark.parametrize("encoding", ["identity, identity", "x-foo", "GZIP2", "identity;q=1"])
def test_a_body_extproc_cannot_read_is_sized_as_the_largest_job(make_env: Callable[..., Env],
                                                                  encoding: str) -> None:
    env = make_env(UNREADABLE)
    body = json.dumps(chat(max_tokens=10)).encode()
    plain = httpx.post(env.url + "/x", content=body, timeout=10, headers={"content-type": "application/json"})
    assert plain.status_code == 200
    seen = plain.json()["headers"]
    assert (seen["x-extproc-lane"], seen["x-extproc-predicted-ms"]) == ("interactive", "20")
    r = httpx.post(env.url + "/x", content=body, timeout=10,
                   headers={"content-type": "application/json", "content-encoding": encoding,
                            "x-request-id": "unread-1"})
    # The upstream ignores the encoding and serves it in full; extproc could not read the body, so it
    # sized it as the largest job (10 ms + 3000 tokens × 1 ms), not the 10 tokens it asks nor the
    # default 100, and classified it as a request naming no model (the default lane).
    assert r.status_code == 200
    assert r.json()["body_bytes"] == len(body)
    seen = r.json()["headers"]
    assert (seen["x-extproc-lane"], seen["x-extproc-predicted-ms"]) == ("best-effort", "3010")
    record = decision_of(env, "unread-1")
    assert (record["outcome"], record["output_tokens"], record["model"]) == ("admitted", 3000, None)
    assert repr(encoding.lower()) in record["body"]


def test_a_body_extproc_cannot_read_is_refused_when_the_policy_says_so(make_env: Callable[..., Env]) -> None:
    env = make_env(UNREADABLE.replace("  max_output_tokens: 3000\n",
                                      "  max_output_tokens: 3000\n  unreadable_body: refuse\n"))
    before = httpx.get(env.upstream_url + "/stats", timeout=5).json()["total"]
    r = httpx.post(env.url + "/x", content=json.dumps(chat()).encode(), timeout=10,
                   headers={"content-type": "application/json", "content-encoding": "x-foo",
                            "x-request-id": "refused-1"})
    assert r.status_code == 415
    assert (r.headers["x-extproc-reason"], r.headers["x-should-retry"]) == ("unsupported_encoding", "false")
    assert "retry-after" not in r.headers
    error = r.json()["error"]
    assert (error["code"], error["type"]) == ("unsupported_encoding", "invalid_request_error")
    assert "'x-foo'" in error["message"]
    # Refused where body refusals are: the intake's count, the decision record, and no slot taken.
    assert env.metric("extproc_intake_rejections_total", reason="unsupported_encoding") == 1
    record = decision_of(env, "refused-1")
    assert (record["outcome"], record["reason"]) == ("rejected", "unsupported_encoding")
    assert "queue_ms" not in record
    assert httpx.get(env.upstream_url + "/stats", timeout=5).json()["total"] == before
    assert env.metric("inference_inflight_requests", lane="best-effort") == 0
    # A readable body still goes through.
    assert httpx.post(env.url + "/x", json=chat(), timeout=10).status_code == 200


def test_a_token_limit_the_model_servers_refuse_is_a_400(env: Env) -> None:
    before = env.metric("extproc_intake_rejections_total", reason="bad_request")
    r = post(env, "/interactive/x", chat(max_tokens="abc"), headers={"x-request-id": "bad-limit-1"})  # type: ignore[arg-type]
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "bad_request"
    assert "max_tokens 'abc'" in r.json()["error"]["message"]
    assert env.metric("extproc_intake_rejections_total", reason="bad_request") == before + 1
    record = decision_of(env, "bad-limit-1")
    assert (record["outcome"], record["reason"]) == ("rejected", "bad_request")
    assert record["body"].startswith("max_tokens 'abc'")
    # Written as the servers' lax reading takes them: "2000" and 2000.0 are 2000 (10 + 2000 × 1 ms).
    for written in ("2000", 2000.0):
        seen = post(env, "/interactive/x", chat(max_tokens=written)).json()["headers"]  # type: ignore[arg-type]
        assert seen["x-extproc-predicted-ms"] == "2010"


LEARNING = POLICY.replace("learning_rate: 0", "learning_rate: 0.5")


def test_observed_service_times_teach_the_estimate(make_env: Callable[..., Env]) -> None:
    env = make_env(LEARNING)
    first = int(post(env, "/interactive/x").json()["headers"]["x-extproc-predicted-ms"])
    for _ in range(4):
        assert post(env, "/interactive/x", delay_ms=400).status_code == 200
    later = int(post(env, "/interactive/x").json()["headers"]["x-extproc-predicted-ms"])
    assert first == 20
    # 400 ms observed for 10 requested tokens: the learned cost moves toward 40 ms/token.
    assert later >= 150


def test_decision_log_replays_in_the_simulator(env: Env, tmp_path: Path) -> None:
    for i in range(5):
        r = post(env, f"/interactive/{i}", chat(max_tokens=40), headers=as_tenant("acme"))
        assert r.status_code == 200
    extproc = next(p for p in env.stack.processes if p.name == "extproc")
    # A request's record is written when its ext_proc stream ends, just after the response.
    deadline = time.monotonic() + 10
    while True:
        log_text = extproc.output()
        records = [r for r in (json.loads(line) for line in log_text.splitlines() if line.startswith("{"))
                   if r.get("event") == "decision"]
        if (records and records[-1]["path"] == "/interactive/4") or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    last = records[-1]
    assert last["path"] == "/interactive/4"
    assert last["method"] == "POST"
    assert last["headers"] == {"x-extproc-client": "acme"}  # trusted headers only
    assert last["output_tokens"] == 40
    log_file = tmp_path / "decisions.log"
    log_file.write_text(log_text)
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    result = subprocess.run(
        [sys.executable, "-m", "extproc", "simulate", "--policy", str(policy), "--trace", str(log_file),
         "--profile", "test", "--time-scale", "0.1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"{len(records)} requests" in result.stdout
    assert "interactive" in result.stdout

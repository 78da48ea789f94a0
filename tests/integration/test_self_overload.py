"""extproc overloaded itself: a request that reaches it too late is refused at once with its own
answer, and the proxy's overload shed refuses new requests while 503s are common, with the same
answer, before they cost extproc a stream. Real `extproc serve`, real Envoy, real gRPC."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import httpx
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc import bootstrap
from extproc.core.decision import Reason, error_body
from extproc.core.overload import ARRIVAL_HEADER, SHED_STATUS
from extproc.localstack import Stack
from tests.integration.conftest import Env, shared_env, start_env

pytestmark = [pytest.mark.envoy]

POLICY = """\
version: 1
lanes:
  - {name: interactive, max_inflight: 64, max_queued: 64, deadline: 5s}
classification: {default_lane: interactive}
estimation: {read_body: never}
"""
OVERLOADED = error_body(Reason.OVERLOADED, None, 1)
#: The shed's sampling window (envoy/envoy.yaml, filter 3b).
SAMPLING_WINDOW = 1.0


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with shared_env(tmp_path_factory, "self-overload", POLICY) as environment:
        yield environment


def headers_message(arrival: bytes | None) -> pb.ProcessingRequest:
    pairs = [(":method", b"POST"), (":path", b"/v1/chat/completions"), ("x-request-id", b"probe")]
    if arrival is not None:
        pairs.append(("x-extproc-arrival", arrival))
    headers = HeaderMap(headers=[HeaderValue(key=k, raw_value=v) for k, v in pairs])
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers, end_of_stream=True))


async def first_answer(port: int, arrival: bytes | None) -> pb.ProcessingResponse:
    """What extproc answers to one request's headers, sent as Envoy sends them (then half-closed)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(headers_message(arrival))
        answer = await asyncio.wait_for(call.read(), timeout=10)
        await call.done_writing()
        while await call.read() != grpc.aio.EOF:  # the stream's end: the slot, if any, is released
            pass
        assert isinstance(answer, pb.ProcessingResponse)
        return answer


def stamp(delay: float) -> bytes:
    return f"{time.time() - delay:.3f}".encode()


def test_a_request_that_reaches_extproc_too_late_gets_its_own_503_at_once(env: Env) -> None:
    refused = env.metric("extproc_intake_rejections_total", reason="overloaded")
    # On time (the guard learns the proxy's clock from these): decided and admitted.
    for _ in range(3):
        answer = asyncio.run(first_answer(env.extproc_grpc, stamp(0)))
        assert answer.WhichOneof("response") == "request_headers"
    # Five seconds after the proxy stamped them, one after another: the first ones are decided (late
    # ones all at once may be what a pause left behind), and once every request has come late for
    # twice --overload-after (a standing queue), the next is refused, never decided.
    kinds = []
    while "immediate_response" not in kinds:
        answer = asyncio.run(first_answer(env.extproc_grpc, stamp(5)))
        kinds.append(answer.WhichOneof("response"))
        assert len(kinds) < 1000, "never refused"
    assert kinds[0] == "request_headers"
    immediate = answer.immediate_response
    got = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    # (529 as far as the proxy's extproc.overload_status filter, which turns it into a 503.)
    assert immediate.status.code == SHED_STATUS
    assert got["x-extproc-reason"] == "overloaded"
    assert got["retry-after"] == "1"
    assert got["content-type"] == "application/json"
    assert immediate.body == OVERLOADED
    assert immediate.details == "extproc_overloaded"
    assert env.metric("extproc_intake_rejections_total", reason="overloaded") == refused + 1
    # No stamp, or one that is not a time: extproc cannot tell, so it decides.
    for arrival in (None, b"yesterday", b"nan"):
        answer = asyncio.run(first_answer(env.extproc_grpc, arrival))
        assert answer.WhichOneof("response") == "request_headers", arrival
    assert env.metric("extproc_intake_rejections_total", reason="overloaded") == refused + 1
    env.wait_idle()


def test_a_client_cannot_forge_the_stamp_and_the_backend_never_sees_it(env: Env) -> None:
    answer = httpx.post(env.url + "/v1/chat/completions", json={"model": "m"},
                        headers={"x-extproc-arrival": "1.000"}, timeout=10)
    assert answer.status_code == 200, answer.text
    seen = answer.json()["headers"]
    assert not any(name.startswith("x-extproc-arrival") for name in seen)
    assert seen["x-extproc-lane"] == "interactive"


def stamp_from_the_client(config: dict[str, Any]) -> None:
    """A test proxy whose arrival stamp is the client's x-test-arrival: a test can make requests reach
    extproc as late as it likes, without having to overload anything."""
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (strip,) = [f for f in hcm["http_filters"] if f["name"] == bootstrap.STRIP_FILTER]
    for mutation in strip["typed_config"]["mutations"]["request_mutations"]:
        header = mutation.get("append", {}).get("header", {})
        if header.get("key") == ARRIVAL_HEADER:
            header["value"] = "%REQ(X-TEST-ARRIVAL)%"


@pytest.fixture(scope="module")
def late(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    workdir = tmp_path_factory.mktemp("late")
    policy = workdir / "policy.yaml"
    policy.write_text(POLICY)
    stack: Stack
    stack, environment = start_env(workdir, policy, tweak=stamp_from_the_client)
    try:
        yield environment
    finally:
        stack.stop()


def send(env: Env, n: int, late_by: float = 0.0) -> list[httpx.Response]:
    with httpx.Client(timeout=10) as client:
        return [client.post(env.url + "/v1/chat/completions", json={"model": "m"},
                            headers={"x-test-arrival": stamp(late_by).decode()}) for _ in range(n)]


def reasons(answers: list[httpx.Response]) -> dict[str | None, int]:
    counts: dict[str | None, int] = {}
    for a in answers:
        key = a.headers.get("x-extproc-reason") if a.status_code != 200 else None
        counts[key] = counts.get(key, 0) + 1
    return counts


def until(check: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_while_extproc_answers_overloaded_the_proxy_sheds_before_it_and_then_recovers(late: Env) -> None:
    """Requests that reach extproc late are refused there as overloaded; the proxy's shed then refuses
    most of the next ones itself (extproc never sees them), with the same answer; once requests come
    on time again and the shed's window has passed, every request is admitted."""
    assert reasons(send(late, 5)) == {None: 5}  # on time: the guard learns the clock
    refused = late.metric("extproc_intake_rejections_total", reason="overloaded")
    answers = send(late, 150, late_by=5)
    # The first 0.2 s of late ones are decided (it might have been a burst), then refused.
    decided = next(i for i, a in enumerate(answers) if a.status_code != 200)
    assert decided >= 1
    assert reasons(answers[decided:]) == {"overloaded": 150 - decided}, reasons(answers)
    assert 150 - decided >= 50
    for answer in answers[decided:]:
        # Never the 529 that carries extproc's refusal as far as the shed: what clients get is a 503.
        assert answer.status_code == 503
        assert answer.headers["retry-after"] == "1"
        assert answer.content == OVERLOADED
    by_extproc = late.metric("extproc_intake_rejections_total", reason="overloaded") - refused
    # extproc refused some itself; the shed refused the most of them before they reached extproc.
    assert 1 <= by_extproc <= (150 - decided) / 2, (by_extproc, decided)
    time.sleep(2 * SAMPLING_WINDOW)  # the shed remembers one sampling window of answers
    assert reasons(send(late, 30)) == {None: 30}
    late.wait_idle()


def test_a_drains_503s_never_make_the_proxy_shed(late: Env) -> None:
    """Only extproc's "overloaded" counts: a drained replica's 503s (or a backend's) are answered as
    they are, every one by extproc."""
    draining = late.metric("inference_admission_rejections_total", lane="interactive", reason="draining")
    httpx.post(late.admin_url + "/admin/drain", timeout=5).raise_for_status()
    try:
        answers = send(late, 100)
    finally:
        httpx.post(late.admin_url + "/admin/undrain", timeout=5).raise_for_status()
    assert reasons(answers) == {"draining": 100}
    until(lambda: late.metric("inference_admission_rejections_total", lane="interactive", reason="draining")
          == draining + 100)
    with httpx.Client(timeout=10) as client:
        failing = [client.post(late.url + "/v1/chat/completions", json={}, headers={
            "x-test-status": "503", "x-test-arrival": stamp(0).decode()}) for _ in range(50)]
    assert [a.status_code for a in failing] == [503] * 50
    assert not any(a.headers.get("x-extproc-reason") for a in failing)
    assert reasons(send(late, 10)) == {None: 10}
    late.wait_idle()

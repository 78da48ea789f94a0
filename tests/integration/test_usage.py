"""Token budgets charged from the usage the model server really reports, through a real Envoy.

The stack is the shipped one: the simulated backend (which, like vLLM, reports usage only in
the body, and in a stream only when asked), ``extproc serve`` and Envoy with envoy/envoy.yaml.
Clients are the real OpenAI SDK (streaming, with and without ``include_usage``) and httpx
(a stream cut short). What was charged is read from extproc's own counters.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from extproc.localstack import Process, Stack, envoy_config, free_port, wait_http
from tests.integration.conftest import DEMO_KEYS, Env, metric, shared_env
from tests.integration.upstream import USAGE_BODIES, usage_body

pytestmark = pytest.mark.envoy

POLICY = """
version: 1
lanes:
  - {name: interactive, max_inflight: 4, max_queued: 16, deadline: 10s}
capacity: {max_inflight: 4, max_hold: 300s}
trusted_headers: [x-extproc-client]
classification: {default_lane: interactive}
tenants: {header: x-extproc-client, default: anonymous}
ratelimit:
  budgets:
    default: {tokens: 1000000, per: minute}
    tenants:
      free: {tokens: 60, per: minute}
"""
PROMPT = [{"role": "user", "content": "tell me something " * 8}]


@dataclass
class Usage:
    url: str
    metrics: str
    stack: Stack
    extproc: Process
    envoy: Process

    def sample(self, name: str) -> float:
        return metric(self.metrics, name)

    def reported(self) -> tuple[float, float]:
        """(responses that reported usage, their tokens)."""
        return (self.sample("extproc_ratelimit_usage_reports_total"),
                self.sample("extproc_ratelimit_usage_tokens_total"))

    def estimated(self) -> tuple[float, float]:
        return (self.sample("extproc_ratelimit_usage_estimates_total"),
                self.sample("extproc_ratelimit_usage_estimated_tokens_total"))

    def wait_for(self, predicate: Callable[[], bool], what: str, within_s: float = 10.0) -> None:
        """Envoy charges a response in a call of its own after the stream ends: wait for it."""
        deadline = time.monotonic() + within_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.02)

    def client(self, tenant: str = "acme") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=DEMO_KEYS[tenant], max_retries=0, timeout=30)


def start_gateway(tmp_path: Path) -> Iterator[Usage]:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    stack = Stack(tmp_path)
    try:
        backend = free_port()
        stack.start("backend", [sys.executable, "-m", "extproc", "sim", "backend", "--profile", "test",
                                "--listen", f"127.0.0.1:{backend}", "--stream-interval", "0.02",
                                "--log-level", "warning"])
        wait_http(f"http://127.0.0.1:{backend}/health", proc=stack.processes[-1].popen)
        grpc, http = free_port(), free_port()
        extproc = stack.extproc(policy, grpc, http)
        listen, admin = free_port(), free_port()
        envoy = stack.envoy(envoy_config(listen, admin, backend, grpc))
        yield Usage(f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{http}/metrics", stack, extproc, envoy)
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Usage]:
    """One stack for the tests that leave it running: each counts what it caused (counters after
    minus before), and waits for its own charges before it ends."""
    yield from start_gateway(tmp_path_factory.mktemp("gateway"))


@pytest.fixture
def own_gateway(tmp_path: Path) -> Iterator[Usage]:
    """A stack of the test's own (it kills a part of it, or needs the estimator untaught)."""
    yield from start_gateway(tmp_path)


def test_a_streaming_sdk_client_that_did_not_ask_is_charged_what_it_used_and_never_sees_the_event(
        gateway: Usage) -> None:
    (reports, charged), estimated = gateway.reported(), gateway.estimated()
    chunks = list(gateway.client().chat.completions.create(
        model="sim-test", messages=PROMPT, max_tokens=24, stream=True))  # type: ignore[arg-type]
    # Every chunk is one the client asked for: none with empty choices, none carrying usage.
    assert chunks
    assert all(c.choices for c in chunks)
    assert all(getattr(c, "usage", None) is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    gateway.wait_for(lambda: gateway.reported()[0] == reports + 1, "the usage report")
    # The backend's own count (asked for on the client's behalf): 24 generated + the prompt.
    tokens = gateway.reported()[1] - charged
    asked = list(gateway.client().chat.completions.create(
        model="sim-test", messages=PROMPT, max_tokens=24, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}))
    gateway.wait_for(lambda: gateway.reported()[0] == reports + 2, "the second usage report")
    final = asked[-1]
    assert final.choices == []
    assert final.usage is not None
    assert final.usage.completion_tokens == 24
    assert tokens == final.usage.total_tokens  # the same request, charged the same
    assert gateway.reported()[1] - charged == 2 * final.usage.total_tokens
    assert gateway.estimated() == estimated


def test_a_non_streamed_answer_is_charged_from_its_json_body(gateway: Usage) -> None:
    reports, charged = gateway.reported()
    answer = gateway.client().chat.completions.create(model="sim-test", messages=PROMPT,  # type: ignore[arg-type]
                                                      max_tokens=7)
    assert answer.usage is not None
    gateway.wait_for(lambda: gateway.reported()[0] == reports + 1, "the usage report")
    assert gateway.reported()[1] - charged == answer.usage.total_tokens


def test_a_spent_token_budget_refuses_the_tenants_next_request(gateway: Usage) -> None:
    free = gateway.client("free")  # no other test sends as this tenant
    reports, _ = gateway.reported()
    list(free.chat.completions.create(model="sim-test", messages=PROMPT, max_tokens=40,  # type: ignore[arg-type]
                                      stream=True))
    gateway.wait_for(lambda: gateway.reported()[0] == reports + 1, "the usage report")
    with pytest.raises(openai.RateLimitError) as refused:
        free.chat.completions.create(model="sim-test", messages=PROMPT, max_tokens=5)  # type: ignore[arg-type]
    assert refused.value.response.headers["x-extproc-reason"] == "tenant_token_budget"
    # Another tenant is not touched.
    assert gateway.client("acme").chat.completions.create(
        model="sim-test", messages=PROMPT, max_tokens=5).choices  # type: ignore[arg-type]


def test_a_stream_cut_short_is_charged_an_estimate_of_what_it_used(own_gateway: Usage) -> None:
    # Its own stack: what the estimator learned from other tests' requests would change the 6 s.
    gateway = own_gateway
    body = {"model": "sim-test", "messages": PROMPT, "max_tokens": 400, "stream": True}
    headers = {"authorization": f"Bearer {DEMO_KEYS['acme']}"}
    reported, (estimates, estimated) = gateway.reported(), gateway.estimated()
    sent = time.monotonic()
    with httpx.Client(timeout=30) as client, client.stream("POST", gateway.url + "/v1/chat/completions",
                                                           json=body, headers=headers) as response:
        assert response.status_code == 200
        started = time.monotonic()
        for _ in response.iter_lines():
            if time.monotonic() - started > 1.0:
                break  # the client leaves a second in, long before the 400th token
        left = time.monotonic()
    gateway.wait_for(lambda: gateway.estimated()[0] == estimates + 1, "the estimate")
    charged_by = time.monotonic()
    tokens = gateway.estimated()[1] - estimated
    # The prompt (36 tokens at extproc's 4 characters a token), and the part of the 400 sized at
    # 6 s (15 ms a token, the policy's default) that its running time stands for: at least from its
    # answer to the client's leaving, at most from sending it to seeing the charge (measured here,
    # not a fixed second or three that a busy machine could stretch); a token either way for rounding.
    assert 36 + 400 * (left - started) / 6 - 1 <= tokens <= 36 + 400 * (charged_by - sent) / 6 + 1
    assert gateway.reported() == reported


def test_streams_run_on_without_their_usage_event_when_extproc_dies_mid_way(own_gateway: Usage) -> None:
    body = {"model": "sim-test", "messages": PROMPT, "max_tokens": 60, "stream": True}
    headers = {"authorization": f"Bearer {DEMO_KEYS['acme']}"}
    events: list[str] = []
    with httpx.Client(timeout=30) as client, client.stream("POST", own_gateway.url + "/v1/chat/completions",
                                                           json=body, headers=headers) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 1:
                    own_gateway.extproc.stop(sig=9)
    assert events[-1] == "[DONE]"
    docs = [json.loads(e) for e in events[:-1]]
    assert sum(len(d["choices"][0]["delta"].get("content", "")) > 0 for d in docs) >= 1
    # The proxy still removed the usage event extproc asked for before it died.
    assert all((d["choices"] and "usage" not in d) or d.get("usage") is None for d in docs)
    assert docs[-1]["choices"][0]["finish_reason"] == "length"


BUDGET_POLICY = POLICY.replace("lanes:", "estimation: {read_body: always}\nlanes:")


@pytest.fixture(scope="module")
def budget_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """One stack with BUDGET_POLICY for the tests below: each counts what it caused."""
    with shared_env(tmp_path_factory, "budgets", BUDGET_POLICY) as env:
        yield env


def _charged(env: Env, counter: str, at_least: float) -> None:
    deadline = time.monotonic() + 10
    while env.metric(counter) < at_least:
        assert time.monotonic() < deadline, f"{counter} never reached {at_least}"
        time.sleep(0.05)


@pytest.mark.parametrize(("kind", "source"), [("big", "reported"), ("garbage", "estimated")])
def test_bodies_whose_usage_is_hard_to_read_pass_whole_and_are_charged(
        budget_env: Env, kind: str, source: str) -> None:
    env = budget_env
    counter = {"reported": "extproc_ratelimit_usage_reports_total",
               "estimated": "extproc_ratelimit_usage_estimates_total"}[source]
    charges, tokens = env.metric(counter), env.metric("extproc_ratelimit_usage_tokens_total")
    _, pieces = USAGE_BODIES[kind]
    headers = {"authorization": f"Bearer {DEMO_KEYS['acme']}", "x-test-usage-body": kind}
    response = httpx.post(env.url + "/v1/chat/completions", json={"model": "m", "stream": True},
                          headers=headers, timeout=30)
    assert response.status_code == 200
    assert response.content == b"".join(pieces)  # not a byte changed, nothing buffered away
    _charged(env, counter, charges + 1)
    if source == "reported":
        assert env.metric("extproc_ratelimit_usage_tokens_total") - tokens == 99


def test_a_usage_event_cut_anywhere_across_two_reads_is_counted_and_removed(budget_env: Env) -> None:
    env = budget_env
    reports, tokens, estimates = (env.metric(f"extproc_ratelimit_usage_{name}_total")
                                  for name in ("reports", "tokens", "estimates"))
    headers = {"authorization": f"Bearer {DEMO_KEYS['acme']}"}
    _, whole = usage_body("split:1")
    usage_event = whole[1] + whole[2]
    # Cuts at its start, inside "choices", and at every byte from just before "total_tokens" to
    # past its count: a count cut anywhere is still read; the event is still removed.
    count = usage_event.index(b'"total_tokens"')
    cuts = [1, 20, usage_event.index(b"[]") + 1, *range(count - 1, usage_event.index(b"7}}") + 2)]
    for cut in cuts:
        response = httpx.post(env.url + "/v1/chat/completions", json={"model": "m", "stream": True},
                              headers={**headers, "x-test-usage-body": f"split:{cut}"}, timeout=30)
        assert response.status_code == 200
        # extproc asked for usage on the client's behalf (its body says stream): the event is gone.
        assert response.content == whole[0] + whole[3], cut
    _charged(env, "extproc_ratelimit_usage_reports_total", reports + len(cuts))
    assert env.metric("extproc_ratelimit_usage_tokens_total") - tokens == 7 * len(cuts)
    assert env.metric("extproc_ratelimit_usage_estimates_total") == estimates


def test_a_crlf_stream_loses_its_usage_event_too(budget_env: Env) -> None:
    env = budget_env
    reports = env.metric("extproc_ratelimit_usage_reports_total")
    headers = {"authorization": f"Bearer {DEMO_KEYS['acme']}", "x-test-usage-body": "crlf"}
    response = httpx.post(env.url + "/v1/chat/completions", json={"model": "m", "stream": True},
                          headers=headers, timeout=30)
    _, pieces = USAGE_BODIES["crlf"]
    assert response.content == pieces[0] + pieces[2]
    _charged(env, "extproc_ratelimit_usage_reports_total", reports + 1)


def test_an_error_answer_to_a_rewritten_stream_reaches_its_client_whole(budget_env: Env) -> None:
    # The model server refuses the request with a JSON error (no event stream): nothing is held back.
    env = budget_env
    headers = {"authorization": f"Bearer {DEMO_KEYS['acme']}", "x-test-status": "400"}
    response = httpx.post(env.url + "/v1/chat/completions", json={"model": "m", "stream": True},
                          headers=headers, timeout=30)
    assert response.status_code == 400
    echoed = response.json()
    assert echoed["path"] == "/v1/chat/completions"
    # The upstream got the rewritten request, and not the proxy's word to extproc.
    assert "x-extproc-usage-filter" not in echoed["headers"]
    assert "accept-encoding" not in echoed["headers"]


WORKLOAD = """
model: sim-test
arrivals: {process: poisson, rate: 6}
lengths: {kind: fixed, output: 12, prompt_mean: 40}
classes:
  - {name: interactive, tenants: {acme: 1}, keys: {acme: sk-demo-acme}, stream: true}
client: {kind: none, timeout: 30s}
"""


def test_sim_load_clients_that_do_not_ask_for_usage_are_charged_what_the_backend_reported(
        gateway: Usage, tmp_path: Path) -> None:
    spec = tmp_path / "workload.yaml"
    spec.write_text(WORKLOAD)
    (reports, charged), estimated = gateway.reported(), gateway.estimated()
    out = tmp_path / "load.json"
    trace = tmp_path / "sent.jsonl"
    result = subprocess.run([sys.executable, "-m", "extproc", "sim", "load", "--target", gateway.url,
                             "--workload", str(spec), "--duration", "2", "--no-usage", "--json", str(out),
                             "--write-trace", str(trace)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    sent = [json.loads(line) for line in trace.read_text().splitlines()]
    assert sent
    assert not any(r["include_usage"] for r in sent)
    ok = sum(1 for r in json.loads(out.read_text())["results"] if r["status"] == 200)
    assert ok == len(sent) >= 3
    gateway.wait_for(lambda: gateway.reported()[0] == reports + ok, "a usage report per request")
    # 12 tokens generated and the backend's count of the prompt, for every one of them.
    assert gateway.reported()[1] - charged >= ok * 12
    assert gateway.estimated() == estimated


def test_without_a_token_budget_a_request_makes_one_rate_limit_call_not_two(
        make_env: Callable[..., Env]) -> None:
    # Nothing to charge: the usage descriptor is not even sent (its admission entry has no default).
    env = make_env(POLICY.split("ratelimit:")[0])
    for _ in range(3):
        response = httpx.post(env.url + "/v1/chat/completions", json={"model": "m", "stream": True},
                              headers={"authorization": f"Bearer {DEMO_KEYS['acme']}"}, timeout=30)
        assert response.status_code == 200
    deadline = time.monotonic() + 5
    while env.metric("extproc_ratelimit_decisions_total", lane="interactive", code="ok", reason="none",
                     shadow="false") < 3:
        assert time.monotonic() < deadline, "the edge never judged the three arrivals"
        time.sleep(0.05)
    time.sleep(0.3)  # a stream-end call would come right after the response
    assert env.metric("extproc_ratelimit_usage_unknown_total") == 0
    assert env.metric("extproc_ratelimit_usage_reports_total") == 0

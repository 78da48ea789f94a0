"""The simulated backend over real HTTP on loopback, read by the official ``openai`` client."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from aiohttp import web
from openai.types.chat import ChatCompletion

from extproc.localstack import free_port
from extproc.sim.backend import add_arguments, build_app, serve
from extproc.sim.profiles import TEST

SCALE = 0.1  # TEST steps of 10–16 ms become 1–1.6 ms
STEP_1 = TEST.step_seconds(1) * SCALE
VLLM_METRICS = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
)


class Server:
    """The backend app on an ephemeral loopback port, in a thread with its own event loop."""

    def __init__(self, handler_cancellation: bool = True, scale: float = SCALE) -> None:
        self.handler_cancellation = handler_cancellation
        self.scale = scale
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="sim-backend", daemon=True)
        self.runner: web.AppRunner | None = None
        self.port = 0
        self._http: httpx.Client | None = None

    @property
    def http(self) -> httpx.Client:
        if self._http is None:
            self._http = httpx.Client(base_url=self.url, timeout=5)
        return self._http

    async def _start(self) -> None:
        # `serve` runs with handler_cancellation (a client that hangs up cancels its handler);
        # without it the handlers notice on their own, a little later.
        self.runner = web.AppRunner(build_app(TEST, time_scale=self.scale, seed=1), access_log=None,
                                    handler_cancellation=self.handler_cancellation, shutdown_timeout=1.0)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)

    def stop(self) -> None:
        if self._http is not None:
            self._http.close()
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metric(self, name: str) -> float:
        text = self.http.get("/metrics").text
        match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
        assert match, f"{name} not in /metrics"
        return float(match.group(1))


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server()
    s.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=10) as c:
        yield c


def wait_until(predicate: object, timeout: float = 3.0) -> bool:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_streaming_chat_parses_with_the_openai_client(client: openai.OpenAI) -> None:
    started = time.monotonic()
    stream = client.chat.completions.create(
        model="sim-test", messages=[{"role": "user", "content": "x" * 400}], max_tokens=30, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    elapsed = time.monotonic() - started
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert len(text.split()) == 30
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (100, 30)
    # The engine, not a sleep, sets the pace: 30 tokens cannot come faster than 30 batch-one steps.
    assert elapsed >= 30 * STEP_1


def test_streaming_completions_parse_with_the_openai_client(client: openai.OpenAI) -> None:
    stream = client.completions.create(model="sim-test", prompt="hello " * 50, max_tokens=12, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks).count(" ") == 12
    assert chunks[-1].choices[0].finish_reason == "length"


def test_non_streaming_answers_carry_usage(client: openai.OpenAI) -> None:
    prompt = "y" * 123
    chat = client.chat.completions.create(model="sim-test", messages=[{"role": "user", "content": prompt}],
                                          max_completion_tokens=7)
    assert chat.usage is not None
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (math.ceil(123 / 4), 7)
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 7
    assert chat.choices[0].message.content is not None
    assert len(chat.choices[0].message.content.split()) == 7
    assert chat.choices[0].finish_reason == "length"

    legacy = client.completions.create(model="sim-test", prompt=[1, 2, 3, 4, 5], max_tokens=3)
    assert legacy.usage is not None
    assert (legacy.usage.prompt_tokens, legacy.usage.completion_tokens) == (5, 3)


def test_without_max_tokens_the_length_is_sampled(server: Server) -> None:
    async def ask() -> list[ChatCompletion]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as c:
            return await asyncio.gather(*(
                c.chat.completions.create(model="sim-test", messages=[{"role": "user", "content": "hi"}])
                for _ in range(3)
            ))

    lengths = set()
    for answer in asyncio.run(ask()):
        assert answer.usage is not None
        assert answer.choices[0].finish_reason == "stop"
        lengths.add(answer.usage.completion_tokens)
    assert all(1 <= n <= TEST.max_model_len - 1 for n in lengths)
    assert len(lengths) > 1


def test_models_and_health(client: openai.OpenAI, server: Server) -> None:
    assert [m.id for m in client.models.list()] == ["sim-test"]
    assert server.http.get("/health").status_code == 200


@pytest.mark.parametrize(("body", "message"), [
    (b"not json{", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"messages": "hi"}', "'messages' must be a non-empty array"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}', "'max_tokens' must be"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}', "n=1"),
    (b"\xff\xfe", "not valid JSON"),
    # 10,000 levels deep: the JSON parser recurses per level.
    (b"[" * 10_000 + b"]" * 10_000, "nested too deeply"),
    (b'{"messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", "nested too deeply"),
])
def test_bad_bodies_get_400_with_an_openai_error(server: Server, body: bytes, message: str) -> None:
    response = server.http.post("/v1/chat/completions", content=body,
                                headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"]
    assert error["type"] == "invalid_request_error"


def test_too_long_a_request_is_a_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024 tokens"):
        client.completions.create(model="sim-test", prompt="z" * 4000, max_tokens=100)


def test_unknown_paths_and_methods_get_json_errors(server: Server) -> None:
    response = server.http.get("/v1/nope")
    assert response.status_code == 404
    assert "error" in response.json()
    assert server.http.get("/v1/completions").status_code == 405


def test_metrics_have_vllm_names_and_see_the_queue(server: Server) -> None:
    queued_before = server.metric("vllm:request_queue_time_seconds_sum")

    async def burst() -> None:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as c:
            await asyncio.gather(*(c.completions.create(model="sim-test", prompt="q" * 40, max_tokens=40)
                                   for _ in range(2 * TEST.max_running)))

    asyncio.run(burst())
    text = server.http.get("/metrics").text
    for name in VLLM_METRICS:
        pattern = rf'^{re.escape(name)}(_count)?{{[^}}]*model_name="sim-test"'
        assert re.search(pattern, text, re.MULTILINE), name
    # Twice as many requests as slots: half of them waited in the engine's own queue.
    assert server.metric("vllm:request_queue_time_seconds_sum") > queued_before
    assert server.metric("vllm:num_requests_running") == 0
    assert 0 <= server.metric("vllm:kv_cache_usage_perc") <= 1


@pytest.mark.parametrize("handler_cancellation", [True, False])
@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_is_cancelled_in_the_engine(stream: bool, handler_cancellation: bool) -> None:
    server = Server(handler_cancellation, scale=0.2)
    server.start()
    try:
        long = 900 * TEST.step_seconds(1) * server.scale  # ≈ 1.8 s if it ran to the end
        body = {"model": "sim-test", "prompt": "a", "max_tokens": 900, "stream": stream}
        payload = json.dumps(body).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(head + payload)
            assert wait_until(lambda: server.metric("vllm:num_requests_running") == 1, timeout=10)
        # Out of the engine, and cancelled there: a request that ran to its end would count as a
        # finished one (a count, where a stopwatch against its length would time the machine too).
        assert wait_until(lambda: server.metric("vllm:num_requests_running") == 0, timeout=5 * long)
        assert server.metric("vllm:e2e_request_latency_seconds_count") == 0
    finally:
        server.stop()


RUNNER = ("import argparse, sys\nfrom extproc.sim import backend\np = argparse.ArgumentParser()\n"
          "backend.add_arguments(p)\nsys.exit(backend.run(p.parse_args(sys.argv[1:])))")


def test_run_serves_until_sigterm() -> None:
    port = free_port()
    args = [sys.executable, "-c", RUNNER, "--profile", "test", "--listen", f"127.0.0.1:{port}",
            "--time-scale", "0.1", "--seed", "3"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        assert wait_until(up, timeout=8), "the backend did not come up"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


def test_serve_on_a_busy_port_raises_and_run_says_so() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=r"(?i)address already in use"):
            asyncio.run(serve("127.0.0.1", port, "test", 0.1, 0, None))
        with pytest.raises(ValueError, match="unknown profile"):
            asyncio.run(serve("127.0.0.1", port, "nope", 0.1, 0, None))
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        with pytest.raises(SystemExit):
            parser.parse_args(["--time-scale", "0"])
        with pytest.raises(SystemExit):
            parser.parse_args(["--listen", "nowhere"])

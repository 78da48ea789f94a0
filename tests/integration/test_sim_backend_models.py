"""The engine models unlike vLLM's, served by the simulated backend over real HTTP on loopback.

``llama-8b-l40s-tgi`` streams an event per 8 tokens and exports the Prometheus client's default
buckets; ``llama-13b-a100-v0`` fills its KV cache and preempts. Both carry vLLM's metric names.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from aiohttp import web

from extproc.sim.backend import add_arguments, build_app
from extproc.sim.dynamics import PROMETHEUS_DEFAULT, VLLM, Histograms
from extproc.sim.profiles import LLAMA_8B_L40S_TGI, LLAMA_13B_A100_V0, Profile
from tests.integration.test_backend_capacity import le
from tests.integration.test_sim_backend import Server

#: Every name the backend exports for a vLLM-like one, the ITL histogram under both of vLLM's names.
VLLM_NAMES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
)


class ModelServer(Server):
    """The backend serving ``profile`` (at ``scale``) on an ephemeral loopback port."""

    def __init__(self, profile: Profile, scale: float) -> None:
        super().__init__(scale=scale)
        self.profile = profile

    async def _start(self) -> None:
        app = build_app(self.profile, time_scale=self.scale, seed=1)
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]

    def buckets(self, name: str) -> dict[str, float]:
        """The ``le`` → cumulative count of histogram ``name``."""
        text = self.http.get("/metrics").text
        return {le(labels): float(value) for labels, value in
                re.findall(rf"^{re.escape(name)}_bucket{{([^}}]*)}} (\S+)$", text, re.MULTILINE)}


@pytest.fixture(scope="module")
def tgi() -> Iterator[ModelServer]:
    s = ModelServer(LLAMA_8B_L40S_TGI, scale=0.05)
    s.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def v0() -> Iterator[ModelServer]:
    s = ModelServer(LLAMA_13B_A100_V0, scale=0.02)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def stream_events(server: ModelServer, max_tokens: int) -> list[dict[str, object]]:
    """The JSON events of one streamed chat completion, as sent (``[DONE]`` left out)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


@pytest.mark.parametrize("max_tokens", [30, 24, 1])
def test_the_tgi_like_server_streams_an_event_per_8_tokens(tgi: ModelServer, max_tokens: int) -> None:
    events = stream_events(tgi, max_tokens)
    content = [e for e in events if e["choices"]]
    words = [len(e["choices"][0]["delta"]["content"].split()) for e in content]  # type: ignore[index]
    # The first token alone, as soon as it exists; then 8 a time; the last event carries the rest.
    expected = [1] + [8] * ((max_tokens - 1) // 8) + ([(max_tokens - 1) % 8] if (max_tokens - 1) % 8 else [])
    assert words == expected
    reasons = [e["choices"][0]["finish_reason"] for e in content]  # type: ignore[index]
    assert reasons == [None] * (len(content) - 1) + ["length"]
    assert events[-1]["usage"] == {"prompt_tokens": 100, "completion_tokens": max_tokens,
                                   "total_tokens": 100 + max_tokens}


def test_the_openai_client_reads_the_chunked_stream(tgi: ModelServer) -> None:
    with openai.OpenAI(base_url=f"{tgi.url}/v1", api_key="x", max_retries=0, timeout=30) as client:
        chunks = list(client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=17, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 17
    assert chunks[0].choices[0].delta.role == "assistant"


def exported(server: ModelServer, histograms: Histograms) -> None:
    """After some traffic, every vLLM name is on /metrics, and each histogram has these buckets."""
    async def traffic() -> None:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                                      timeout=30) as c:
            await asyncio.gather(*(c.completions.create(model="m", prompt="q" * 400, max_tokens=20)
                                   for _ in range(6)))

    asyncio.run(traffic())
    text = server.http.get("/metrics").text
    model = re.escape(server.profile.model)
    for name in VLLM_NAMES:
        assert re.search(rf'^{re.escape(name)}{{[^}}]*model_name="{model}"', text, re.MULTILINE), name
    for name, bounds in (("vllm:time_to_first_token_seconds", histograms.ttft),
                         ("vllm:inter_token_latency_seconds", histograms.itl),
                         ("vllm:time_per_output_token_seconds", histograms.itl),
                         ("vllm:e2e_request_latency_seconds", histograms.request),
                         ("vllm:request_queue_time_seconds", histograms.request)):
        buckets = server.buckets(name)
        assert set(buckets) == {*(str(b) for b in bounds), "+Inf"}, name
        assert buckets["+Inf"] >= 6


def test_the_tgi_like_server_exports_vllm_names_with_coarse_buckets(tgi: ModelServer) -> None:
    exported(tgi, PROMETHEUS_DEFAULT)
    # Coarser than vLLM's where the TTFT target sits: nothing between 1 s and 2.5 s.
    assert {"1.0", "2.5"} <= set(tgi.buckets("vllm:time_to_first_token_seconds"))
    assert "1.5" not in tgi.buckets("vllm:e2e_request_latency_seconds")


def test_the_v0_server_exports_vllm_names_and_buckets(v0: ModelServer) -> None:
    exported(v0, VLLM)


def test_the_v0_server_preempts_when_its_cache_fills_and_every_answer_completes(v0: ModelServer) -> None:
    # 16 prompts of 2,000 tokens fit its 50k-token cache; their 2,000-token answers do not.
    before = v0.metric("vllm:num_preemptions_total")

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=v0.url, timeout=60) as http:
            answers = await asyncio.gather(*(
                http.post("/v1/completions", json={"model": "m", "prompt": "p" * 8000, "max_tokens": 2000})
                for _ in range(16)))
        assert all(a.status_code == 200 for a in answers)
        return [a.json()["usage"]["completion_tokens"] for a in answers]

    assert asyncio.run(burst()) == [2000] * 16
    assert v0.metric("vllm:num_preemptions_total") > before
    assert v0.metric("vllm:num_requests_running") == 0
    assert v0.metric("vllm:kv_cache_usage_perc") == 0


def test_the_new_models_are_offered_on_the_command_line() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for name in ("llama-8b-l40s-tgi", "llama-13b-a100-v0"):
        assert parser.parse_args(["--profile", name]).profile == name

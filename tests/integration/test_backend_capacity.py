"""The simulated backend's capacity schedule and inter-token latency histogram, over real HTTP on loopback."""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import httpx
import pytest
from aiohttp import web

from extproc.sim.backend import ITL_BUCKETS, add_arguments, build_app
from extproc.sim.profiles import TEST, Profile, get_profile
from tests.integration.test_sim_backend import RUNNER, Server, wait_until

SCALE = 0.1
ITL_NAMES = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")


class ScheduledServer(Server):
    """The backend with a capacity schedule (and any profile)."""

    def __init__(self, schedule: Sequence[tuple[float, float]], profile: Profile = TEST) -> None:
        super().__init__(scale=SCALE)
        self.schedule = tuple(schedule)
        self.profile = profile
        self.started = 0.0

    async def _start(self) -> None:
        app = build_app(self.profile, time_scale=self.scale, seed=1, capacity_schedule=self.schedule)
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
        self.started = time.monotonic()
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]

    def series(self, name: str) -> dict[str, float]:
        """Every sample of ``name`` (a histogram's _bucket, say) by its label text."""
        text = self.http.get("/metrics").text
        return {labels: float(value) for labels, value in
                re.findall(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.MULTILINE)}


def le(labels: str) -> str:
    match = re.search(r'le="([^"]+)"', labels)
    assert match, labels
    return match.group(1)


@pytest.fixture
def halved() -> Iterator[ScheduledServer]:
    s = ScheduledServer([(0.0, 1.0), (0.5, 0.5)])
    s.start()
    try:
        yield s
    finally:
        s.stop()


def complete(server: Server, n: int, max_tokens: int) -> None:
    async def burst() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            answers = await asyncio.gather(*(
                http.post("/v1/completions", json={"model": "sim-test", "prompt": "q" * 40,
                                                   "max_tokens": max_tokens})
                for _ in range(n)))
        assert all(a.status_code == 200 for a in answers)

    asyncio.run(burst())


def test_the_fraction_gauge_follows_the_schedule_and_the_batch_shrinks(halved: ScheduledServer) -> None:
    assert halved.metric("sim_capacity_fraction") == 1.0
    assert 'sim_capacity_fraction{model_name="sim-test"}' in halved.http.get("/metrics").text
    assert wait_until(lambda: halved.metric("sim_capacity_fraction") == 0.5, timeout=5)
    assert time.monotonic() - halved.started >= 0.5  # not before its time
    # At half capacity TEST runs two sequences, not four: a burst of four leaves two waiting.
    seen: list[tuple[float, float]] = []

    def two_and_two() -> bool:
        seen.append((halved.metric("vllm:num_requests_running"), halved.metric("vllm:num_requests_waiting")))
        return seen[-1] == (2, 2)

    async def load_and_watch() -> bool:
        async with httpx.AsyncClient(base_url=halved.url, timeout=10) as http:
            calls = [asyncio.create_task(http.post("/v1/completions", json={
                "model": "sim-test", "prompt": "q" * 40, "max_tokens": 400})) for _ in range(4)]
            found = await asyncio.to_thread(wait_until, two_and_two, 3.0)
            answers = await asyncio.gather(*calls)
        assert all(a.status_code == 200 for a in answers)
        return found

    assert asyncio.run(load_and_watch()), seen
    assert all(running <= 2 for running, _ in seen)


def test_inter_token_latency_histograms_count_every_token_after_the_first(halved: ScheduledServer) -> None:
    complete(halved, 3, 30)
    for name in ITL_NAMES:
        buckets = halved.series(f"{name}_bucket")
        assert len(buckets) == len(ITL_BUCKETS) + 1
        assert all('model_name="sim-test"' in labels for labels in buckets)
        assert {le(labels) for labels in buckets} == {*map(str, ITL_BUCKETS), "+Inf"}
        assert halved.metric(f"{name}_count") == 3 * 29
        counts = [buckets[labels] for labels in sorted(buckets, key=lambda labels: float(le(labels)))]
        assert counts == sorted(counts)  # cumulative
        assert counts[-1] == 3 * 29
    # Engine seconds, time-scaled: a TEST step is 10–16 ms, 1–1.6 ms at this scale (twice that
    # when halved); the 10-token prefills sharing a step add next to nothing.
    mean = halved.metric("vllm:inter_token_latency_seconds_sum") / halved.metric(
        "vllm:inter_token_latency_seconds_count")
    assert TEST.step_seconds(1) * SCALE <= mean < 2 * TEST.step_seconds(TEST.max_running) * SCALE * 1.1
    assert halved.metric("vllm:inter_token_latency_seconds_sum") == halved.metric(
        "vllm:time_per_output_token_seconds_sum")


def test_a_schedule_with_a_later_first_entry_starts_at_full_capacity() -> None:
    server = ScheduledServer([(30.0, 0.25)])
    server.start()
    try:
        assert server.metric("sim_capacity_fraction") == 1.0
        complete(server, 2, 5)
        assert server.metric("vllm:inter_token_latency_seconds_count") == 2 * 4
    finally:
        server.stop()


def test_an_immediate_entry_applies_before_the_first_request() -> None:
    server = ScheduledServer([(0.0, 0.25)])
    server.start()
    try:
        assert server.metric("sim_capacity_fraction") == 0.25
    finally:
        server.stop()


@pytest.mark.parametrize(("schedule", "message"), [
    ("0:1,0:0.5", "times must be strictly increasing"),
    ("0:1.5", "fraction must be in (0, 1]"),
    ("soon:0.5", "T and F must be numbers"),
    ("", "capacity schedule is empty"),
])
def test_a_bad_schedule_is_a_usage_error(schedule: str, message: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--capacity-schedule", schedule])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --capacity-schedule: capacity schedule" in err
    assert message in err


def test_the_command_line_refuses_a_bad_schedule_with_exit_2() -> None:
    proc = subprocess.run([sys.executable, "-c", RUNNER, "--profile", "test", "--capacity-schedule",
                           "10:1,5:0.5"], capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 2
    assert "entry 2 '5:0.5': times must be strictly increasing (the entry before is at 10s)" in proc.stderr


def test_the_l4_profile_is_offered_and_served() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--profile", "llama-8b-l4", "--capacity-schedule", "0:1,60:0.5,120:1"])
    assert args.profile == "llama-8b-l4"
    assert args.capacity_schedule == ((0.0, 1.0), (60.0, 0.5), (120.0, 1.0))
    assert parser.parse_args([]).capacity_schedule == ()
    server = ScheduledServer([(0.0, 0.5)], profile=get_profile("llama-8b-l4"))
    server.start()
    try:
        models = server.http.get("/v1/models").json()
        assert models["data"][0]["max_model_len"] == 8192
        assert models["data"][0]["id"] == "meta-llama/Llama-3.1-8B-Instruct"
        assert server.metric("sim_capacity_fraction") == 0.5
        response = server.http.post("/v1/completions", json={"prompt": "x" * 400, "max_tokens": 3})
        assert response.json()["usage"]["completion_tokens"] == 3
    finally:
        server.stop()

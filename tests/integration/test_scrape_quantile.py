"""Latency percentiles from real /metrics pages: a histogram that changes between scrapes, read by the hub.

An aiohttp server on 127.0.0.1 serves two engines' pages (``/a/metrics``, ``/b/metrics``)
with vLLM's histogram names and whatever bucket counts a test sets; a real
:class:`~extproc.signals.hub.SignalHub` scrapes both every 200 ms and reads the p95 of the
last two seconds. Then the same against the simulated backend, whose histograms come from
requests it really serves. Every wait is bounded; nothing asserts how fast anything is.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from prometheus_client import CollectorRegistry

from extproc.core.saturation import Reading
from extproc.policy.signals import Signal, Signals
from extproc.signals.hub import SignalHub
from extproc.signals.scrape import HistogramWindow, names_of, parse_page
from extproc.sim.backend import build_app
from extproc.sim.profiles import TEST

WAIT_S = 10.0
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
LE = ("0.1", "0.5", "1.0", "+Inf")


class Engines:
    """Two engines' /metrics: per engine and histogram, cumulative counts per bucket of ``LE``."""

    def __init__(self) -> None:
        zero = (0.0, 0.0, 0.0, 0.0)
        # Engine a has served for a while: counts from before the hub starts are its baseline,
        # not observations of any window.
        self.counts: dict[str, dict[str, tuple[float, ...]]] = {
            "a": {TTFT: (100_000.0,) * 4, ITL: zero}, "b": {TTFT: zero, ITL: zero}}
        self.other_model = 500.0
        self.url = ""
        self._runner: web.AppRunner | None = None

    def add(self, engine: str, name: str, bucket: int, observations: float) -> None:
        """``observations`` more in bucket ``LE[bucket]`` (so in it and every bucket above)."""
        counts = list(self.counts[engine][name])
        for i in range(bucket, len(LE)):
            counts[i] += observations
        self.counts[engine][name] = tuple(counts)

    def page(self, engine: str) -> str:
        lines = ['# HELP vllm:num_requests_waiting Number of requests waiting to be processed.',
                 '# TYPE vllm:num_requests_waiting gauge',
                 'vllm:num_requests_waiting{engine="0",model_name="llama"} 0.0']
        for name, counts in self.counts[engine].items():
            lines += [f"# HELP {name} A histogram.", f"# TYPE {name} histogram"]
            for le, count in zip(LE, counts, strict=True):
                lines.append(f'{name}_bucket{{engine="0",le="{le}",model_name="llama"}} {count}')
            lines.append(f'{name}_count{{engine="0",model_name="llama"}} {counts[-1]}')
            lines.append(f'{name}_sum{{engine="0",model_name="llama"}} 1.0')
        # Another model on the same engine, always slow: the label matcher keeps it out.
        lines.append(f'{TTFT}_bucket{{engine="0",le="+Inf",model_name="other"}} {self.other_model}')
        return "\n".join(lines) + "\n"

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.page(request.match_info["engine"]),
                            content_type="text/plain", charset="utf-8")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/{engine}/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def engines() -> AsyncIterator[Engines]:
    e = Engines()
    await e.start()
    try:
        yield e
    finally:
        await e.stop()


class Hub:
    """A started hub and the readings of its rounds."""

    def __init__(self, signals: dict[str, Any]) -> None:
        self.registry = CollectorRegistry()
        self.rounds = 0
        self.hub = SignalHub(Signals.model_validate(signals), self.registry, time.monotonic, self._on_change)

    def _on_change(self, readings: Mapping[str, Reading], now: float) -> None:
        self.rounds += 1

    def reading(self, name: str) -> Reading | None:
        return self.hub.readings().get(name)

    def value(self, name: str) -> float | None:
        reading = self.reading(name)
        return reading.value if reading is not None and reading.error is None else None

    async def until(self, what: str, predicate: Callable[[], bool]) -> None:
        deadline = time.monotonic() + WAIT_S
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {WAIT_S:g}s: {what}; readings {self.hub.readings()}")
            await asyncio.sleep(0.05)


@pytest.fixture
async def hub(engines: Engines) -> AsyncIterator[Hub]:
    h = Hub({
        "sources": {"engines": {"scrape": {
            "targets": [f"{engines.url}/a/metrics", f"{engines.url}/b/metrics"],
            "interval": "200ms", "timeout": "150ms"}}},
        "read": {
            "ttft_p95": {"source": "engines", "preset": "ttft_seconds", "quantile": 0.95, "window": "2s",
                         "labels": {"model_name": "llama"}, "stale_after": "10s"},
            "itl_p50": {"source": "engines", "metric": ITL, "quantile": 0.5, "window": "2s"},
            "waiting": {"source": "engines", "preset": "waiting_requests"},
        },
    })
    h.hub.start()
    try:
        yield h
    finally:
        await h.hub.stop()


def near(value: float | None, expected: float) -> bool:
    return value is not None and abs(value - expected) < 1e-9


async def test_percentiles_follow_the_histograms_between_scrapes(engines: Engines, hub: Hub) -> None:
    await hub.until("a few rounds", lambda: hub.rounds >= 3)
    await hub.until("the idle window is no data", lambda: (
        (reading := hub.reading("ttft_p95")) is not None and (reading.error or "").startswith("no_data: ")))
    assert hub.value("waiting") == 0.0  # a gauge on the same pages is read as before

    # a: 50 first tokens in (0.5, 1]; b: 50 in (0.1, 0.5]. Summed: the 95th of 100 is 90 % into (0.5, 1].
    engines.add("a", TTFT, 2, 50)
    engines.add("b", TTFT, 1, 50)
    engines.other_model += 1000  # another model's: excluded by the label matcher
    engines.add("a", ITL, 0, 30)  # ITL: 30 + 10 tokens; the median is the 20th, 2/3 into [0, 0.1]
    engines.add("b", ITL, 1, 10)
    await hub.until("the p95 of both engines is read", lambda: near(hub.value("ttft_p95"), 0.5 + 0.5 * 0.9))
    await hub.until("the p50 is read", lambda: near(hub.value("itl_p50"), 0.1 * 20 / 30))
    exported = hub.registry.get_sample_value("extproc_signal_value", {"signal": "ttft_p95"})
    assert exported == pytest.approx(0.95)

    # Engine a restarts: its counts start over (below the 100000 before), 10000 fast first tokens
    # since. Those count as observations (a reset is not a negative increase) and outnumber the
    # 100 above, if they are still in the window: the p95 falls into the first bucket.
    engines.counts["a"][TTFT] = (10_000.0,) * 4
    await hub.until("the restart's observations dominate", lambda: 0 < (hub.value("ttft_p95") or 1) <= 0.1)

    # Nothing more happens: once the window has passed, there is no p95, and no error but no_data.
    await hub.until("the window empties", lambda: (hub.reading("ttft_p95") or Reading(None, None)).error == (
        "no_data: no observations of vllm:time_to_first_token_seconds_bucket{model_name=\"llama\"} or "
        "sglang:time_to_first_token_seconds_bucket{model_name=\"llama\"} or "
        "trtllm_time_to_first_token_seconds_bucket{model_name=\"llama\"} in the last 2s"))
    reading = hub.reading("ttft_p95")
    assert reading is not None
    assert reading.value is not None  # the last good value is kept beside the error
    assert reading.value <= 0.1
    assert (hub.registry.get_sample_value(
        "extproc_signal_errors_total", {"signal": "ttft_p95", "kind": "no_data"}) or 0) >= 1
    assert hub.registry.get_sample_value("extproc_scrape_target_up",
                                         {"source": "engines", "target": f"{engines.url}/a/metrics"}) == 1


@pytest.fixture
async def backend() -> AsyncIterator[str]:
    runner = web.AppRunner(build_app(TEST, time_scale=1.0, seed=1), access_log=None,
                           handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_the_presets_read_the_simulated_backends_latency_histograms(backend: str) -> None:
    h = Hub({
        "sources": {"engine": {"scrape": {"targets": [f"{backend}/metrics"], "interval": "200ms",
                                          "timeout": "150ms"}}},
        "read": {
            "ttft_p95": {"source": "engine", "preset": "ttft_seconds", "quantile": 0.95, "window": "30s"},
            "itl_p95": {"source": "engine", "preset": "inter_token_latency_seconds", "quantile": 0.95,
                        "window": "30s"},
        },
    })
    h.hub.start()
    try:
        await h.until("the baseline round", lambda: h.rounds >= 2)
        async with aiohttp.ClientSession() as client:
            async def complete() -> None:
                async with client.post(f"{backend}/v1/completions", json={
                        "model": "sim-test", "prompt": "x" * 200, "max_tokens": 16}) as response:
                    assert response.status == 200
                    await response.read()

            async with asyncio.timeout(WAIT_S):
                await asyncio.gather(*(complete() for _ in range(4)))
        await h.until("both percentiles are read",
                      lambda: h.value("ttft_p95") is not None and h.value("itl_p95") is not None)
        for name in ("ttft_p95", "itl_p95"):
            value = h.value(name)
            assert value is not None
            assert 0 < value < 60, (name, value)
    finally:
        await h.hub.stop()


# -- the same arithmetic as Prometheus ------------------------------------------------------------------

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"

#: Per scenario, per target: the cumulative bucket counts (le of ``LE``) scraped once a minute.
SCENARIOS: dict[str, dict[str, list[tuple[float, ...]]]] = {
    "two_targets": {"a": [(0, 0, 0, 0), (3, 10, 12, 12), (5, 20, 40, 41)],
                    "b": [(0, 0, 0, 0), (0, 1, 1, 5), (2, 2, 30, 30)]},
    "restart": {"a": [(0, 100, 100, 100), (0, 110, 115, 115), (4, 4, 6, 6)],
                "b": [(1, 1, 1, 1), (2, 2, 2, 2), (3, 9, 9, 9)]},
    "in_inf": {"a": [(0, 0, 0, 0), (1, 1, 1, 50), (1, 1, 2, 90)]},
}


def test_the_window_answers_what_prometheus_answers(tmp_path: Path) -> None:
    """histogram_quantile(q, sum by (le) (increase(x_bucket[2m]))) on promtool's PromQL engine, over
    samples at both ends of the range (so Prometheus extrapolates nothing), equals the window's value."""
    series: list[dict[str, str]] = []
    checks: list[dict[str, Any]] = []
    for scenario, targets in SCENARIOS.items():
        for target, rounds in targets.items():
            for i, le in enumerate(LE):
                series.append({"series": f'{scenario}_bucket{{target="{target}",le="{le}"}}',
                               "values": " ".join(f"{counts[i]:g}" for counts in rounds)})
        for q in (0.25, 0.5, 0.9, 0.95, 0.99):
            window = HistogramWindow(Signal.model_validate(
                {"source": "s", "metric": scenario, "quantile": q, "window": "2m"}))
            value = None
            for minute in range(3):
                text = "".join(
                    f'{scenario}_bucket{{target="{target}",le="{le}"}} {rounds[minute][i]:g}\n'
                    for target, rounds in targets.items() for i, le in enumerate(LE))
                window.observe(minute * 60.0, {"t": parse_page(text, names_of([window.signal]))})
                value = window.value()
            assert value is not None
            checks.append({"expr": f"histogram_quantile({q}, sum by (le) (increase({scenario}_bucket[2m])))",
                           "eval_time": "2m", "exp_samples": [{"labels": "{}", "value": value}]})
    tests = tmp_path / "quantiles.yml"
    tests.write_text(yaml.safe_dump({"evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": series, "promql_expr_test": checks}]}))
    done = subprocess.run([PROMTOOL, "test", "rules", str(tests)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr

"""Signals from a real Prometheus and real /metrics pages, through the hub into saturation rules.

A tiny exporter in this process serves ``kueue_pending_workloads`` with the values a test
sets; a real ``prometheus`` (Debian's /usr/bin/prometheus) scrapes it every 500 ms; the
hub queries Prometheus every 200 ms. The simulated backend is scraped directly for the
engine presets. Every wait is bounded; nothing asserts how fast anything is.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from extproc.core.saturation import Change, Reading, Saturation
from extproc.localstack import free_port
from extproc.metrics import SaturationCollector
from extproc.policy.signals import Signals
from extproc.signals.hub import SignalHub
from extproc.sim.backend import build_app
from extproc.sim.profiles import TEST
from tests.integration.kueue_exporter import PENDING, QUEUE, Exporter, Prometheus

#: Generous bounds for "eventually": a scrape (0.5 s) plus a poll (0.2 s) is the expected delay.
WAIT_S = 10.0


# -- real servers (kueue_exporter.py; the exporter fixture is in conftest.py) -------------------------


@pytest.fixture(scope="module")
def prometheus(exporter: Exporter, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    p = Prometheus(tmp_path_factory.mktemp("prometheus"), exporter)
    p.start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(autouse=True)
def _reset(exporter: Exporter) -> None:
    exporter.pending = {QUEUE: 0.0}


# -- the hub, wired as the controller wires it ------------------------------------------------------


class Wired:
    """A hub feeding a Saturation after every round, with the gauges of both on one registry."""

    def __init__(self, signals: dict[str, Any]) -> None:
        self.config = Signals.model_validate(signals)
        self.registry = CollectorRegistry()
        self.saturation = Saturation(self.config)
        self.changes: list[Change] = []
        self.rounds = 0
        self.hub = SignalHub(self.config, self.registry, time.monotonic, self._on_change)
        self.registry.register(SaturationCollector(self.saturation, time.monotonic))

    def _on_change(self, readings: Mapping[str, Reading], now: float) -> None:
        self.rounds += 1
        self.changes.extend(self.saturation.update(readings, now))

    def value(self, name: str) -> float | None:
        reading = self.hub.readings().get(name)
        return reading.value if reading is not None else None

    def error(self, name: str) -> str | None:
        reading = self.hub.readings().get(name)
        return reading.error if reading is not None else None

    def sample(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)

    def active(self, rule: str) -> bool:
        return {state.name: state.active for state in self.saturation.rules(time.monotonic())}[rule]

    async def until(self, what: str, predicate: Callable[[], bool], within: float = WAIT_S) -> None:
        deadline = time.monotonic() + within
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {within:g}s: {what}; readings {self.hub.readings()}")
            await asyncio.sleep(0.05)

    async def rounds_pass(self, count: int) -> None:
        target = self.rounds + count
        await self.until(f"{count} more poll rounds", lambda: self.rounds >= target)


@pytest.fixture
async def wired() -> AsyncIterator[Callable[[dict[str, Any]], Wired]]:
    made: list[Wired] = []

    def make(signals: dict[str, Any]) -> Wired:
        w = Wired(signals)
        w.hub.start()
        made.append(w)
        return w

    yield make
    for w in made:
        await w.hub.stop()


async def scraped(prometheus: Prometheus, promql: str, value: float) -> None:
    """Wait until Prometheus has scraped what the exporter serves now (``promql`` answers ``value``)."""
    deadline = time.monotonic() + WAIT_S
    async with aiohttp.ClientSession() as client:
        while True:
            async with client.get(f"{prometheus.url}/api/v1/query", params={"query": promql}) as response:
                result = (await response.json())["data"]["result"]
            if result and float(result[0]["value"][1]) == value:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"Prometheus did not scrape {promql} == {value:g}: {result}")
            await asyncio.sleep(0.1)


def prom_source(url: str, interval: str = "200ms", timeout: str = "150ms") -> dict[str, Any]:
    return {"prometheus": {"url": url, "interval": interval, "timeout": timeout}}


# -- Prometheus ---------------------------------------------------------------------------------------


async def test_pending_workloads_drive_a_rule_with_hysteresis(
        prometheus: Prometheus, exporter: Exporter, wired: Callable[[dict[str, Any]], Wired]) -> None:
    w = wired({
        "sources": {"prom": prom_source(prometheus.url)},
        "read": {"kueue_pending": {"source": "prom", "query": PENDING, "stale_after": "5s"}},
        "saturation": [{"name": "kueue-backlog", "signal": "kueue_pending", "above": 10, "below": 5,
                        "min_active": "1s", "shed": ["best-effort"], "shrink": {"batch": 0.5}}],
    })
    exporter.pending[QUEUE] = 3
    await w.until("the value 3 is read", lambda: w.value("kueue_pending") == 3)
    assert not w.active("kueue-backlog")
    assert w.sample("extproc_signal_value", signal="kueue_pending") == 3
    assert w.sample("extproc_signal_stale", signal="kueue_pending") == 0
    age = w.sample("extproc_signal_age_seconds", signal="kueue_pending")
    assert age is not None
    assert 0 <= age < 5
    assert w.sample("extproc_saturation_active", rule="kueue-backlog", signal="kueue_pending") == 0

    # Raise the backlog: best-effort is shed, batch's limit halves.
    exporter.pending[QUEUE] = 12
    await w.until("the rule activates", lambda: w.active("kueue-backlog"))
    assert w.saturation.effect("best-effort").shed_by == "kueue-backlog"
    assert w.saturation.effect("best-effort").signal == "kueue_pending"
    assert w.saturation.effect("batch").limit(8) == 4
    assert w.sample("extproc_saturation_active", rule="kueue-backlog", signal="kueue_pending") == 1
    assert w.sample("extproc_saturation_shed", lane="best-effort") == 1
    assert w.sample("extproc_saturation_limit_factor", lane="batch") == 0.5

    # Lower it into the band between below and above: the rule holds, however long.
    exporter.pending[QUEUE] = 7
    await w.until("the value 7 is read", lambda: w.value("kueue_pending") == 7)
    settled = time.monotonic() + 1.5  # past min_active, with several rounds at 7
    await w.until("time passes", lambda: time.monotonic() > settled)
    assert w.active("kueue-backlog")

    # Below `below`: admission resumes. One activation, one release: no flapping.
    exporter.pending[QUEUE] = 2
    await w.until("the rule releases", lambda: not w.active("kueue-backlog"))
    assert w.saturation.effect("best-effort").shed_by is None
    assert [(c.rule, c.active) for c in w.changes] == [("kueue-backlog", True), ("kueue-backlog", False)]
    assert w.changes[0].why == "kueue_pending = 12 > above 10"
    assert w.changes[1].why == "kueue_pending = 2 < below 5"


async def test_prometheus_stopped_applies_each_signals_stale_policy(
        exporter: Exporter, tmp_path: Path, wired: Callable[[dict[str, Any]], Wired]) -> None:
    own = Prometheus(tmp_path, exporter)  # this test stops it, so it gets one of its own
    own.start()
    try:
        w = wired({
            "sources": {"prom": prom_source(own.url)},
            "read": {
                "fail_open": {"source": "prom", "query": PENDING, "stale_after": "1s", "on_stale": "ignore"},
                "fail_closed": {"source": "prom", "query": PENDING, "stale_after": "1s",
                                "on_stale": "saturated"},
            },
            "saturation": [
                {"name": "open", "signal": "fail_open", "above": 10, "min_active": "1h", "shed": ["a"]},
                {"name": "closed", "signal": "fail_closed", "above": 100, "shed": ["b"]},
            ],
        })
        exporter.pending[QUEUE] = 12
        await w.until("the first rule activates", lambda: w.active("open"))
        assert not w.active("closed")
    finally:
        own.stop()

    await w.until("the failure is counted", lambda: (w.sample(
        "extproc_signal_errors_total", signal="fail_open", kind="unreachable") or 0) >= 1)
    assert (w.error("fail_closed") or "").startswith("unreachable: cannot reach")
    assert w.value("fail_open") == 12  # the last good value is kept beside the error

    # Once stale: "ignore" releases its rule despite min_active, "saturated" sets its rule.
    await w.until("the stale policies apply", lambda: not w.active("open") and w.active("closed"))
    assert w.sample("extproc_signal_stale", signal="fail_open") == 1
    assert w.saturation.effect("a").shed_by is None
    assert w.saturation.effect("b").shed_by == "closed"
    whys = {c.rule: c.why for c in w.changes if c.stale}
    assert whys == {"open": "signal fail_open is stale (on_stale: ignore)",
                    "closed": "signal fail_closed is stale (on_stale: saturated)"}
    # The hub keeps polling (and failing) without raising.
    before = w.sample("extproc_signal_errors_total", signal="fail_open", kind="unreachable") or 0
    await w.rounds_pass(3)
    assert (w.sample("extproc_signal_errors_total", signal="fail_open", kind="unreachable") or 0) > before


async def test_each_kind_of_failure_is_counted_and_good_signals_stay_fresh(
        prometheus: Prometheus, exporter: Exporter, wired: Callable[[dict[str, Any]], Wired]) -> None:
    exporter.pending = {QUEUE: 4, "inference-batch": 9}
    await scraped(prometheus, 'count(kueue_pending_workloads{status="active"})', 2)
    await scraped(prometheus, PENDING, 4)
    nobody = f"http://127.0.0.1:{free_port()}"
    w = wired({
        "sources": {
            "prom": prom_source(prometheus.url, timeout="190ms"),
            "down": prom_source(nobody),
            "slow": prom_source(f"{exporter.url}/slow", interval="300ms", timeout="200ms"),
            "error": prom_source(f"{exporter.url}/error"),
            "garbage": prom_source(f"{exporter.url}/garbage"),
        },
        "read": {
            "good": {"source": "prom", "query": PENDING},
            "typo": {"source": "prom", "query": "sum(kueue_pending_workloads"},
            "several": {"source": "prom", "query": 'kueue_pending_workloads{status="active"}'},
            "absent": {"source": "prom", "query": "sum(no_such_metric_anywhere)"},
            "nan": {"source": "prom", "query": "0/0"},
            "range": {"source": "prom", "query": "kueue_pending_workloads[1m]"},
            "down": {"source": "down", "query": "up"},
            "slow": {"source": "slow", "query": "up"},
            "error": {"source": "error", "query": "up"},
            "garbage": {"source": "garbage", "query": "up"},
        },
    })
    expected = {
        "typo": ("query_error", "unclosed left parenthesis"),
        "several": ("query_error", "returned 2 series"),
        "absent": ("no_data", "no series"),
        "nan": ("no_data", "NaN"),
        "range": ("query_error", "range vector"),
        "down": ("unreachable", "cannot reach"),
        "slow": ("timeout", "within 0.2s"),
        "error": ("http_status", "HTTP 500"),
        "garbage": ("bad_response", "not JSON"),
    }

    def all_failed() -> bool:
        return all(w.sample("extproc_signal_errors_total", signal=name, kind=kind) for name, (kind, _) in
                   expected.items())

    await w.until("every failure is counted", all_failed)
    await w.until("the good signal is read", lambda: w.value("good") == 4)
    for name, (kind, text) in expected.items():
        error = w.error(name) or ""
        assert error.startswith(f"{kind}: "), (name, error)
        assert text in error, (name, error)
        assert w.value(name) is None
        assert w.sample("extproc_signal_value", signal=name) is None
    assert w.sample("extproc_signal_stale", signal="good") == 0
    assert w.error("good") is None


async def test_reconfigure_restarts_changed_sources_and_forgets_changed_signals(
        prometheus: Prometheus, exporter: Exporter, wired: Callable[[dict[str, Any]], Wired]) -> None:
    exporter.pending = {QUEUE: 6, "inference-batch": 1}
    first = {
        "sources": {"prom": prom_source(prometheus.url), "gone": prom_source(f"http://127.0.0.1:{free_port()}")},
        "read": {
            "pending": {"source": "prom", "query": PENDING},
            "other": {"source": "prom", "query": PENDING.replace(QUEUE, "inference-batch")},
            "broken": {"source": "gone", "query": "up"},
        },
    }
    w = wired(first)
    await w.until("both are read", lambda: w.value("pending") == 6 and w.value("other") == 1)
    await w.until("the dead source failed", lambda: w.error("broken") is not None)

    second = dict(first, sources={"prom": prom_source(prometheus.url, interval="300ms")}, read={
        "pending": first["read"]["pending"],
        "other": {"source": "prom", "query": "sum(kueue_pending_workloads{status=\"inadmissible\"})"},
    })
    w.hub.reconfigure(Signals.model_validate(second))
    assert w.value("other") is None  # another query under the same name starts over
    assert "broken" not in w.hub.readings()
    assert w.sample("extproc_signal_stale", signal="broken") is None
    assert w.sample("extproc_signal_errors_total", signal="broken", kind="unreachable") is None
    await w.until("the new query is read", lambda: w.value("other") == 200)
    assert w.value("pending") == 6


async def test_a_failing_on_change_callback_does_not_stop_polling(
        prometheus: Prometheus, exporter: Exporter) -> None:
    calls: list[float] = []
    three = asyncio.Event()

    def broken(readings: Mapping[str, Reading], now: float) -> None:
        calls.append(now)
        if len(calls) >= 3:
            three.set()
        raise RuntimeError("a bug in the caller")

    config = Signals.model_validate({"sources": {"prom": prom_source(prometheus.url)},
                                     "read": {"pending": {"source": "prom", "query": PENDING}}})
    hub = SignalHub(config, CollectorRegistry(), on_change=broken)
    hub.start()
    try:
        with pytest.raises(RuntimeError, match="already started"):
            hub.start()
        async with asyncio.timeout(WAIT_S):
            await three.wait()
        assert calls == sorted(calls)
    finally:
        await hub.stop()
    await hub.stop()  # stopping twice is harmless


# -- scraping model servers directly --------------------------------------------------------------------


@pytest.fixture
async def backend() -> AsyncIterator[web.AppRunner]:
    runner = web.AppRunner(build_app(TEST, time_scale=1.0, seed=1), access_log=None,
                           handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner
    finally:
        await runner.cleanup()


async def test_the_kv_cache_preset_reads_the_simulated_backend(
        backend: web.AppRunner, wired: Callable[[dict[str, Any]], Wired]) -> None:
    url = f"http://127.0.0.1:{backend.addresses[0][1]}"
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    w = wired({
        "sources": {"engines": {"scrape": {"targets": [f"{url}/metrics", dead], "interval": "200ms",
                                           "timeout": "150ms"}}},
        "read": {
            "kv": {"source": "engines", "preset": "kv_cache_usage", "stale_after": "1s",
                   "on_stale": "saturated"},
            "waiting": {"source": "engines", "preset": "waiting_requests", "stale_after": "1s"},
            "running": {"source": "engines", "metric": "vllm:num_requests_running", "labels":
                        {"model_name": "sim-test"}, "stale_after": "1s"},
        },
        "saturation": [{"name": "kv-full", "signal": "kv", "above": 0.9, "shed": ["best-effort"]}],
    })
    await w.until("the idle backend is read", lambda: w.value("kv") == 0.0 and w.value("running") == 0.0)
    assert w.value("waiting") == 0.0
    assert w.sample("inference_kv_cache_utilization", signal="kv") == 0.0
    assert w.sample("inference_kv_cache_utilization", signal="waiting") is None  # not a KV signal
    # One target down does not fail the signal; it shows as a target that is not up.
    assert w.sample("extproc_scrape_target_up", source="engines", target=f"{url}/metrics") == 1
    assert w.sample("extproc_scrape_target_up", source="engines", target=dead) == 0
    assert w.error("kv") is None

    # A long request fills part of the KV cache while it runs; hanging up frees it.
    async with aiohttp.ClientSession() as client:
        request = asyncio.ensure_future(client.post(f"{url}/v1/completions", json={
            "model": "sim-test", "prompt": "x" * 2000, "max_tokens": 500}))
        try:
            await w.until("the request shows in the KV cache", lambda: (w.value("kv") or 0) > 0.2)
            assert w.value("running") == 1
            kv = w.sample("inference_kv_cache_utilization", signal="kv")
            assert kv is not None
            assert 0.2 < kv < 1
        finally:
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
    await w.until("the freed cache is read", lambda: w.value("kv") == 0.0)

    # Every target down: an error, the last value kept, then stale, and fail closed.
    await backend.cleanup()
    await w.until("the failure is seen",
                  lambda: (w.error("kv") or "").startswith("unreachable: all 2 targets"))
    assert w.value("kv") == 0.0
    await w.until("the signal goes stale", lambda: w.sample("extproc_signal_stale", signal="kv") == 1)
    assert w.sample("inference_kv_cache_utilization", signal="kv") is None
    await w.until("fail closed", lambda: w.active("kv-full"))
    assert w.saturation.effect("best-effort").shed_by == "kv-full"


# -- hurried rounds (the self-sized limit's start) ------------------------------------------------------


@pytest.fixture
async def counted() -> AsyncIterator[tuple[str, list[float]]]:
    """An engine's /metrics page that notes when each fetch came (vLLM's names, one running)."""
    fetches: list[float] = []

    async def metrics(_: web.Request) -> web.Response:
        fetches.append(time.monotonic())
        return web.Response(text='vllm:num_requests_running{model_name="m"} 1\n'
                                 'vllm:num_requests_waiting{model_name="m"} 0\n')

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/metrics", fetches
    finally:
        await runner.cleanup()


async def test_a_hurried_scrape_source_reads_again_after_a_quarter_interval_not_prometheus(
        prometheus: Prometheus, counted: tuple[str, list[float]],
        wired: Callable[[dict[str, Any]], Wired]) -> None:
    """``hurry`` ends a scrape source's wait early, but no sooner than a quarter of its interval after
    its last round began, however often it is asked; a Prometheus source is not hurried (what it
    answers changes only on Prometheus' own scrapes), nor is an unknown one."""
    url, fetches = counted
    await scraped(prometheus, PENDING, 0)
    w = wired({
        "sources": {"engines": {"scrape": {"targets": [url], "interval": "8s", "timeout": "500ms"}},
                    "prom": prom_source(prometheus.url, interval="60s", timeout="1s")},
        "read": {"running": {"source": "engines", "preset": "running_requests"},
                 "pending": {"source": "prom", "query": PENDING}},
    })
    await w.until("both sources are read", lambda: w.value("running") == 1 and w.value("pending") == 0)
    assert len(fetches) == 1
    pending = w.hub.readings()["pending"].updated_at
    # Asked every 20 ms: the engines are read again long before their 8 s interval is out, but a
    # quarter of it (2 s) apart at most often, not once per ask (the margins on both sides are
    # seconds: an HTTP fetch's jitter, or a busy machine's, cannot cross them).
    began = time.monotonic()
    while len(fetches) < 3:
        assert time.monotonic() - began < WAIT_S, fetches
        w.hub.hurry({"engines", "prom", "no-such-source"})
        await asyncio.sleep(0.02)
    elapsed = time.monotonic() - began
    gaps = [later - earlier for earlier, later in itertools.pairwise(fetches)]
    assert all(1.5 < gap < 8 for gap in gaps), gaps
    assert len(fetches) - 1 <= elapsed / 2.0 + 1
    assert w.hub.readings()["pending"].updated_at == pending  # Prometheus: its 60 s interval


async def test_hurrying_a_source_whose_targets_are_down_or_a_stopped_hub_is_harmless() -> None:
    """A hurried scrape source whose only target refuses connections fails each round quickly: it is
    counted and logged as any failure, polled no more often than a quarter of its interval, and the
    hub stops cleanly; hurrying a stopped hub, or a source a reload removed, does nothing."""
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    rounds: list[float] = []
    config = Signals.model_validate({
        "sources": {"engines": {"scrape": {"targets": [dead], "interval": "2s", "timeout": "200ms"}}},
        "read": {"running": {"source": "engines", "preset": "running_requests", "stale_after": "4s"}}})
    registry = CollectorRegistry()
    hub = SignalHub(config, registry, on_change=lambda _, now: rounds.append(now))
    hub.start()
    try:
        began = time.monotonic()
        while len(rounds) < 4:
            assert time.monotonic() - began < WAIT_S, rounds
            hub.hurry({"engines"})
            await asyncio.sleep(0.02)
        assert all(later - earlier > 0.45 for earlier, later in itertools.pairwise(rounds)), rounds
        reading = hub.readings()["running"]
        assert reading.value is None
        assert (reading.error or "").startswith("unreachable")
        assert (registry.get_sample_value("extproc_signal_errors_total",
                                          {"signal": "running", "kind": "unreachable"}) or 0) >= 4
        # A reload that removes the source: hurrying it is a no-op, and nothing polls it any more.
        hub.reconfigure(Signals.model_validate({}))
        hub.hurry({"engines"})
        count = len(rounds)
        await asyncio.sleep(0.6)
        assert len(rounds) == count
    finally:
        await hub.stop()
    hub.hurry({"engines"})  # stopped: nothing to wake, nothing started
    assert len(rounds) == count

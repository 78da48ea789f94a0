"""The self-sizing limit live: a real sim backend's /metrics, a real ``extproc serve``, a real Envoy.

The backend is the small ``test`` profile (four sequences at once), so a limit above four makes
its own queue grow: the limit must grow from ``min`` while it holds the load back, fall when the
engine queues, and, once the backend is killed (its signals go stale), hold and then decay to
``min`` and say so; a backend back on the same port makes the signals fresh again. Waits are
bounded; nothing asserts speed.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from extproc.localstack import Process, Stack, envoy_config, free_port, stack, wait_http
from tests.integration.conftest import as_tenant, metric

pytestmark = pytest.mark.envoy

POLICY = """
lanes:
  - {name: chat, max_inflight: 100, max_queued: 200, deadline: 30s}
classification: {default_lane: chat}
capacity:
  max_inflight: auto
  max_hold: 60s
  auto:
    min: 2
    max: 64
    interval: 500ms
    cooldown: 1s
    stale_hold: 2s
    signals: {waiting: engine_waiting}
    target: {queue: 0}
signals:
  sources:
    engine: {scrape: {targets: ["http://127.0.0.1:8000/metrics"], interval: 250ms, timeout: 200ms}}
  read:
    engine_waiting: {source: engine, preset: waiting_requests, stale_after: 1s}
ratelimit: {mode: "off"}
"""

WAIT_S = 20.0


class Rig:
    def __init__(self, s: Stack, backend: int, admin: str, metrics: str, url: str) -> None:
        self.stack, self.backend_port, self.admin, self.metrics, self.url = s, backend, admin, metrics, url
        self.backend: Process | None = None

    def start_backend(self) -> None:
        self.backend = self.stack.start("backend", [
            sys.executable, "-m", "extproc", "sim", "backend", "--profile", "test", "--time-scale", "1",
            "--listen", f"127.0.0.1:{self.backend_port}", "--log-level", "warning", "--seed", "1"])
        wait_http(f"http://127.0.0.1:{self.backend_port}/health", proc=self.backend.popen)

    def auto(self) -> dict[str, Any]:
        state = httpx.get(f"{self.admin}/admin/state", timeout=5).json()
        auto: dict[str, Any] = state["capacity"]["auto"]
        assert state["capacity"]["limit"] == auto["limit"]  # enforced, not shadow
        return auto

    def wait_for(self, check: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_S
        auto = self.auto()
        while time.monotonic() < deadline:
            auto = self.auto()
            if check(auto):
                return auto
            time.sleep(0.1)
        raise AssertionError(f"{what}: not within {WAIT_S}s; last state {auto}")


def rigged(s: Stack, tmp_path: Path, policy_text: str) -> Rig:
    """A sim backend, extproc with ``policy_text`` (its engine at that backend) and Envoy, on ``s``."""
    backend = free_port()
    r = Rig(s, backend, "", "", "")
    r.start_backend()
    policy = tmp_path / "policy.in.yaml"
    policy.write_text(policy_text)
    grpc, http, admin = free_port(), free_port(), free_port()
    s.extproc(s.policy_for(policy, backend), grpc, http, "--log-format", "json", admin=admin)
    listen, envoy_admin = free_port(), free_port()
    s.envoy(envoy_config(listen, envoy_admin, backend, grpc))
    r.admin, r.metrics, r.url = (f"http://127.0.0.1:{admin}", f"http://127.0.0.1:{http}/metrics",
                                 f"http://127.0.0.1:{listen}")
    return r


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    with stack(tmp_path) as s:
        yield rigged(s, tmp_path, POLICY)


def load(url: str, clients: int, seconds: float) -> list[int]:
    """``clients`` threads sending chat completions back to back for ``seconds``; their statuses."""
    statuses: list[int] = []
    stop = time.monotonic() + seconds

    def client() -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            while time.monotonic() < stop:
                r = http.post("/v1/chat/completions", headers=as_tenant("acme"), json={
                    "model": "sim-test", "max_tokens": 40,
                    "messages": [{"role": "user", "content": "hello " * 20}]})
                statuses.append(r.status_code)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    return statuses


def test_the_limit_finds_the_engines_concurrency_then_decays_when_its_signals_die(rig: Rig) -> None:
    start = rig.wait_for(lambda a: a["signals"].get("waiting") is not None, "a first engine reading")
    assert (start["limit"], start["min"], start["max"], start["mode"]) == (2, 2, 64, "enforce")
    seen: list[int] = []
    sampling = True

    def sample() -> None:
        while sampling:
            seen.append(rig.auto()["limit"])
            time.sleep(0.1)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        statuses = load(rig.url, clients=12, seconds=8.0)
    finally:
        sampling = False
        sampler.join(10)
    assert statuses
    assert set(statuses) <= {200, 429, 503}, set(statuses)
    assert statuses.count(200) > 20
    # It grew from min while it held the load back, and fell when the engine's own queue grew:
    # the engine runs four at once, so the limit ends near four, not at the sixty-four allowed.
    assert max(seen) > 4, seen
    assert metric(rig.metrics, "extproc_capacity_limit_moves_total", reason="headroom") > 0
    assert metric(rig.metrics, "extproc_capacity_limit_moves_total", reason="engine_queue") > 0
    assert max(seen[len(seen) // 2:]) <= 16, seen
    assert metric(rig.metrics, "extproc_capacity_limit", mode="enforce") == rig.auto()["limit"]

    # The backend dies: its signal goes stale; the limit holds for stale_hold, then decays to min.
    assert rig.backend is not None
    rig.backend.stop()
    rig.wait_for(lambda a: a["stale"], "stale signals")
    assert metric(rig.metrics, "extproc_capacity_signals_stale") == 1
    ended = rig.wait_for(lambda a: a["limit"] == 2, "a decay to min")
    assert ended["reason"] == "stale"
    assert "decaying to min 2" in ended["why"]
    assert metric(rig.metrics, "extproc_capacity_limit_moves_total", reason="stale") > 0

    # Back on the same port: fresh again, and the limit may grow once more.
    rig.start_backend()
    rig.wait_for(lambda a: not a["stale"], "fresh signals")
    assert metric(rig.metrics, "extproc_capacity_signals_stale") == 0


def hurried() -> str:
    """POLICY with three lanes and engines read every 8 s (waiting and running)."""
    data = yaml.safe_load(POLICY)
    chat = {**data["lanes"][0], "priority": 10, "max_inflight": 80}
    data["lanes"] = [chat, *({"name": name, "max_inflight": 10, "max_queued": 10, "deadline": "30s"}
                             for name in ("batch", "bulk"))]
    data["capacity"]["auto"].update(interval="8s", signals={"waiting": "engine_waiting",
                                                            "running": "engine_running"})
    data["signals"]["sources"]["engine"]["scrape"].update(interval="8s", timeout="1s")
    data["signals"]["read"] = {f"engine_{role}": {"source": "engine", "preset": f"{role}_requests",
                                                  "stale_after": "20s"} for role in ("waiting", "running")}
    return str(yaml.safe_dump(data))


def test_a_start_at_a_few_slots_per_lane_reads_its_engines_again_within_the_interval(tmp_path: Path) -> None:
    """Requests held back at a few slots per lane (three lanes, from 2) bring the engines' next scrape
    forward to a quarter of its 8 s interval, so the start doubles several times within one interval
    (up to three hurried readings in 6 s of load, two doublings asked): with a reading every 8 s, none
    comes in that time, and a load that overran by up to 2 s still ends before the next."""
    with stack(tmp_path) as s:
        rig = rigged(s, tmp_path, hurried())
        first = rig.wait_for(lambda a: a["signals"].get("running") is not None, "a first engine reading")
        assert first["limit"] == 2
        # Load starts just after a reading; 6 s of it is less than one interval.
        statuses = load(rig.url, clients=12, seconds=6.0)
        assert statuses.count(200) > 0
        moves = metric(rig.metrics, "extproc_capacity_limit_moves_total", reason="headroom")
        assert moves >= 2, rig.auto()
        assert rig.auto()["limit"] >= 8

"""The closed loop end to end: a real Prometheus's Kueue backlog sheds best-effort through a real Envoy.

An exporter in this process serves ``kueue_pending_workloads``; a real Prometheus scrapes
it every 500 ms; extproc (a real ``extproc serve``) queries Prometheus every 200 ms and
decides; requests go through a real Envoy. Waits are bounded; nothing asserts speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from extproc.api.admin.v1 import admin_pb2 as pb
from extproc.api.document import from_document
from tests.integration.conftest import Env
from tests.integration.kueue_exporter import PENDING, QUEUE, Exporter, Prometheus

pytestmark = pytest.mark.envoy

WAIT_S = 15.0


def policy(prometheus_url: str, on_stale: str = "saturated") -> str:
    return f"""
lanes:
  - {{name: interactive, priority: 10, max_inflight: 4, max_queued: 10, deadline: 5s}}
  - {{name: best-effort, max_inflight: 4, max_queued: 10, deadline: 5s}}
classification:
  default_lane: best-effort
  rules: [{{match: {{path_prefix: /interactive}}, lane: interactive}}]
signals:
  sources:
    prom: {{prometheus: {{url: "{prometheus_url}", interval: 200ms, timeout: 200ms}}}}
  read:
    kueue_pending:
      source: prom
      query: '{PENDING}'
      stale_after: 3s
      on_stale: {on_stale}
  saturation:
    - name: kueue-backlog
      signal: kueue_pending
      above: 10
      below: 5
      min_active: 1s
      shed: [best-effort]
"""


@pytest.fixture
def prometheus(exporter: Exporter, tmp_path: Path) -> Iterator[Prometheus]:
    exporter.pending = {QUEUE: 0.0}
    workdir = tmp_path / "prometheus"
    workdir.mkdir()
    p = Prometheus(workdir, exporter)
    p.start()
    try:
        yield p
    finally:
        p.stop()


def best_effort(env: Env) -> httpx.Response:
    return httpx.post(env.url + "/v1/x", json={"max_tokens": 5}, timeout=10)


def until(what: str, check: Callable[[], bool], within: float = WAIT_S) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within:g}s: {what}")
        time.sleep(0.1)


def statuses_for(env: Env, seconds: float) -> set[int]:
    seen = set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seen.add(best_effort(env).status_code)
        time.sleep(0.1)
    return seen


def test_a_kueue_backlog_sheds_best_effort_with_the_signal_named_and_recovers_without_flapping(
        make_env: Callable[..., Env], exporter: Exporter, prometheus: Prometheus) -> None:
    env = make_env(policy(prometheus.url))
    until("a first reading", lambda: env.metric("extproc_signal_value", signal="kueue_pending") == 0
          and env.metric("extproc_signal_stale", signal="kueue_pending") == 0)
    assert best_effort(env).status_code == 200

    exporter.pending = {QUEUE: 12.0}
    until("best-effort to be shed", lambda: best_effort(env).status_code == 429)
    r = best_effort(env)
    assert r.status_code == 429
    assert r.headers["x-extproc-reason"] == "saturated"
    assert r.headers["x-extproc-signal"] == "kueue_pending"
    assert r.headers["x-extproc-rule"] == "kueue-backlog"
    assert r.headers["x-should-retry"] == "false"
    assert "kueue_pending" in r.json()["error"]["message"]
    # Interactive is not shed.
    assert httpx.post(env.url + "/interactive/x", json={"max_tokens": 5}, timeout=10).status_code == 200
    assert env.metric("extproc_saturation_rejections_total", lane="best-effort", rule="kueue-backlog",
                      signal="kueue_pending") >= 2
    assert env.metric("extproc_saturation_active", rule="kueue-backlog", signal="kueue_pending") == 1

    # Between the thresholds: stays shed (hysteresis), for longer than min_active.
    exporter.pending = {QUEUE: 7.0}
    until("the reading to follow", lambda: env.metric("extproc_signal_value", signal="kueue_pending") == 7)
    assert statuses_for(env, 2.0) == {429}

    # Below `below`: admission resumes, and stays resumed.
    exporter.pending = {QUEUE: 2.0}
    until("admission to resume", lambda: best_effort(env).status_code == 200)
    assert statuses_for(env, 1.5) == {200}
    state = from_document(httpx.get(env.admin_url + "/admin/state", timeout=5).json(), pb.State)
    (rule,) = state.saturation
    assert (rule.rule, rule.active, rule.value) == ("kueue-backlog", False, 2.0)
    (signal,) = state.signals
    assert (signal.name, signal.stale) == ("kueue_pending", False)


def test_prometheus_gone_applies_the_declared_stale_policy(
        make_env: Callable[..., Env], prometheus: Prometheus) -> None:
    env = make_env(policy(prometheus.url, on_stale="saturated"))
    until("a first reading", lambda: env.metric("extproc_signal_stale", signal="kueue_pending") == 0
          and env.metric("extproc_signal_value", signal="kueue_pending") == 0)
    assert best_effort(env).status_code == 200
    prometheus.stop()
    # Fail closed: once the signal is stale (3 s), best-effort is shed as if saturated.
    until("the stale signal to shed best-effort", lambda: best_effort(env).status_code == 429)
    assert env.metric("extproc_signal_stale", signal="kueue_pending") == 1
    assert env.metric("extproc_signal_errors_total", signal="kueue_pending", kind="unreachable") >= 1
    assert best_effort(env).headers["x-extproc-signal"] == "kueue_pending"
    # The SRE switches the signal to fail open with a hot reload: admission resumes at once.
    env.policy.write_text(policy(prometheus.url, on_stale="ignore"))
    until("the reload to release the rule", lambda: best_effort(env).status_code == 200)
    assert statuses_for(env, 1.0) == {200}
    assert httpx.get(env.metrics_url.replace("/metrics", "/readyz"), timeout=5).status_code == 200

"""What the simulator decides is what the live service decided: a live run's decision log, replayed.

The demo's stack — the simulated 70B backend at time scale 0.1, Envoy with the shipped config,
``extproc serve`` with the demo policy and its default JSON log — under the chatbot workload at
35 req/s (about 1.5x the engine's capacity) for 20 s; then ``extproc simulate --trace LOG
--verify`` on the log extproc wrote.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from extproc.localstack import ROOT, Stack
from extproc.sim.load import run as run_load
from extproc.sim.workload import generate, load_spec

pytestmark = pytest.mark.e2e

POLICY = ROOT / "examples" / "demo-policy.yaml"


def test_the_simulator_decides_as_the_live_service_did(tmp_path: Path) -> None:
    stack = Stack(tmp_path)
    try:
        gateway = stack.gateway(POLICY, "llama-70b-2xh100", 0.1, backend_args=["--log-level", "warning"],
                                extproc_args=["--log-level", "info"])
        extproc = gateway.extproc
        assert extproc is not None
        spec = load_spec(ROOT / "examples" / "workloads" / "chatbot.yaml")
        spec = spec.model_copy(update={"arrivals": spec.arrivals.model_copy(update={"rate": 35.0})})
        # 20 s: about 700 arrivals, overload enough for every kind of decision (holds, both deadline
        # rejections); 30 s proved no more and took 10 s longer.
        requests = generate(spec, 20.0, seed=5)
        results = asyncio.run(run_load(gateway.url, requests, spec.client, seed=5, drain_timeout=40))
        assert sum(1 for r in results if r.status == 200) > 300
    finally:
        stack.stop()  # extproc writes its last records as its streams end
    log = tmp_path / "decisions.log"
    log.write_text(extproc.output())
    out = tmp_path / "verify.json"
    result = subprocess.run(
        [sys.executable, "-m", "extproc", "simulate", "--policy", str(POLICY), "--trace", str(log),
         "--verify", "--profile", "llama-70b-2xh100", "--time-scale", "0.1", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    print(result.stdout)
    verify = json.loads(out.read_text())["verify"]
    assert verify["requests"] >= 500
    assert verify["lane_agreement"] == 1.0
    assert verify["tenant_agreement"] == 1.0
    assert verify["outcome_agreement"] >= 0.9


def test_a_console_log_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    log.write_text("2026-12-03 10:00:00 [info     ] decision   lane=a outcome=admitted\n")
    result = subprocess.run(
        [sys.executable, "-m", "extproc", "simulate", "--policy", str(POLICY), "--trace", str(log),
         "--verify"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "console-format log" in result.stderr
    assert "--log-format json" in result.stderr

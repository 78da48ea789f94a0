"""A public trace replayed live: ``extproc sim load --trace`` through the demo's stack.

The simulated 70B backend at time scale 0.1, Envoy with the shipped config and ``extproc serve``
with the demo policy; an excerpt of the Azure 2023 conversation trace (tests/data/traces, with its
attribution) played at 30 requests/s as the chatbot workload's classes. Then the decision log
extproc wrote replays in the simulator (its own format, detected). A malformed line stops the
replay naming it, or is skipped and counted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.localstack import ROOT, Process, Stack

pytestmark = pytest.mark.e2e

POLICY = ROOT / "examples" / "demo-policy.yaml"
CHATBOT = ROOT / "examples" / "workloads" / "chatbot.yaml"
AZURE = ROOT / "tests" / "data" / "traces" / "azure-2023-conv-excerpt.csv"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Process, Stack]]:
    """One demo stack for the module. The bad-line test only reads through it; the replay test,
    last, stops it (extproc writes its last records as its streams end) and counts at least its own
    requests in the log."""
    stack = Stack(tmp_path_factory.mktemp("demo"))
    try:
        gateway = stack.gateway(POLICY, "llama-70b-2xh100", 0.1, backend_args=["--log-level", "warning"],
                                extproc_args=["--log-level", "info"])
        assert gateway.extproc is not None
        yield gateway.url, gateway.extproc, stack
    finally:
        stack.stop()


def load(target: str, trace: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "extproc", "sim", "load", "--target", target, "--trace", str(trace),
         "--workload", str(CHATBOT), "--rate", "30", "--drain-timeout", "30", "--json", str(out), *extra],
        capture_output=True, text=True, timeout=240)


def test_a_bad_line_stops_the_live_replay_naming_it_or_is_skipped(
        demo: tuple[str, Process, Stack], tmp_path: Path) -> None:
    target, _, _ = demo
    lines = AZURE.read_text().splitlines()[:41]
    lines[30] = "2023-11-16 18:16:00.0000000,lots,3"
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join(lines) + "\n")
    result = load(target, bad, tmp_path / "bad.json")
    assert result.returncode == 2
    assert "bad.csv:31: not an Azure trace row" in result.stderr
    assert "Traceback" not in result.stderr
    skipped = load(target, bad, tmp_path / "skipped.json", "--skip-bad")
    assert skipped.returncode == 0, skipped.stderr
    assert "skipped 1 malformed lines" in skipped.stderr
    assert json.loads((tmp_path / "skipped.json").read_text())["requests"] == 39


def test_a_public_trace_replays_live_and_its_decision_log_replays_offline(
        demo: tuple[str, Process, Stack], tmp_path: Path) -> None:
    target, extproc, stack = demo
    out = tmp_path / "load.json"
    result = load(target, AZURE, out, "--max-requests", "150")
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    assert doc["requests"] == 150
    assert doc["trace"]["format"] == "azure"
    assert doc["trace"]["speedup"] > 1  # 300 requests in ~84 s, played at 30/s
    statuses = [r["status"] for r in doc["results"]]
    assert statuses.count(200) > 100, statuses
    assert {"interactive", "batch", "best-effort"} <= set(doc["classes"])
    served = {r["output_tokens"] for r in doc["results"] if r["status"] == 200}
    assert {44, 109, 55} & served  # the trace's own answer lengths
    stack.stop()  # extproc writes its last records as its streams end
    log = tmp_path / "decisions.log"
    log.write_text(extproc.output())
    sim_out = tmp_path / "sim.json"
    replayed = subprocess.run(
        [sys.executable, "-m", "extproc", "simulate", "--policy", str(POLICY), "--trace", str(log),
         "--json", str(sim_out)], capture_output=True, text=True, timeout=300)
    assert replayed.returncode == 0, replayed.stderr
    sim = json.loads(sim_out.read_text())
    assert sim["trace"]["format"] == "decision-log"
    assert sim["requests"] >= 150  # every attempt the live service decided

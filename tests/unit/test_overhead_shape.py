"""bench/overhead.py's figures and targets, computed from made-up runs (no process started): the keys
tools read, the targets as a map of value, bound and met."""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def overhead() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_overhead", ROOT / "bench" / "overhead.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_the_targets_are_a_map_of_value_bound_and_met() -> None:
    bench = overhead()
    out = bench.dry_run([200, 500], 3)
    assert list(out["targets"]) == ["cpu", "throughput", "p50_500", "p99_500", "replicas_3", "sampled_cpu",
                                    "sampled_throughput", "redis_p99"]
    for target in out["targets"].values():
        assert set(target) == {"value", "bound", "met"}
    cpu, tput = out["cpu_us_per_request"], out["throughput_req_per_s"]
    assert out["targets"]["cpu"]["value"] == round(cpu["extproc_edge"] / cpu["noop_response"], 3)
    assert out["targets"]["cpu"]["bound"] == 1.1
    assert out["targets"]["throughput"]["value"] == round(tput["extproc_edge"] / tput["noop_response"], 3)
    edge, floor = out["added_ms_500"]["extproc_edge"], out["added_ms_500"]["noop_response"]
    assert out["targets"]["p99_500"]["value"] == round(edge["p99"] / floor["p99"], 3)
    # The response message sampled, against the bare no-op (which asks for no response headers either).
    assert out["targets"]["sampled_cpu"]["value"] == round(cpu["extproc_edge_sampled"] / cpu["noop"], 3)
    assert out["targets"]["sampled_cpu"]["bound"] == 1.2
    assert out["targets"]["sampled_throughput"]["value"] == round(
        tput["extproc_edge_sampled"] / tput["noop"], 3)
    assert out["targets_met"] is False


def test_a_target_whose_configuration_did_not_run_is_not_judged() -> None:
    bench = overhead()
    rates = [200, 500]
    summary = {}
    for key in bench.CONFIGS:
        if key == "extproc_edge_sampled":  # (--configs without it)
            continue
        cfg = bench.Config(key, 0, 0)
        for phase in [*map(str, rates), "closed"]:
            cfg.runs.setdefault(phase, []).append(bench._made_up_run(key, phase, 0))
        summary[key] = bench.summarize(cfg, rates)
    out = bench.compare(summary, rates, [])
    # Nothing to judge, rather than a guess; and it does not count as a target missed.
    assert out["targets"]["sampled_cpu"] == {"value": None, "bound": 1.2, "met": None}
    assert out["targets"]["sampled_throughput"] == {"value": None, "bound": 0.6, "met": None}
    assert out["targets"]["cpu"]["value"] is not None


def test_the_sampled_configuration_asks_extproc_for_one_response_in_eight() -> None:
    bench = overhead()
    assert bench.RESPONSE_SAMPLE == 8
    assert bench.CONFIGS.index("extproc_edge_sampled") == bench.CONFIGS.index("extproc_edge") + 1
    assert "--response-sample 8" in bench.DESCRIPTIONS["extproc_edge_sampled"]
    flags = bench.serve_flags("extproc_edge_sampled", "info")
    assert flags[flags.index("--response-sample") + 1] == "8"
    # Every other extproc asks for every response, whatever the environment says.
    for key in ("extproc_only", "extproc_edge_call", "extproc_edge", "extproc_edge_redis", "replicas_3"):
        flags = bench.serve_flags(key, "info")
        assert flags[flags.index("--response-sample") + 1] == "1"


def test_replica_efficiency_is_the_median_of_each_repetitions_ratio() -> None:
    bench = overhead()
    out = bench.dry_run([200, 500], 3)
    by_rep = out["replica_efficiency_by_rep"]["3"]
    assert len(by_rep) == 3
    assert len(set(by_rep.values())) > 1  # (the made-up replicas cost more each repetition)
    assert out["replica_efficiency"]["3"] == round(statistics.median(by_rep.values()), 3)
    assert out["targets"]["replicas_3"]["value"] == out["replica_efficiency"]["3"]

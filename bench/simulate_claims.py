"""Claims checked with the offline simulator (the live scheduling core on a virtual clock).

1. SJF's tail gains: the chatbot mix (50- and 2000-token answers) at 1.5x capacity
   through the demo policy with first-come-first-served queues (sjf_weight 0) versus
   its slack-weighted SJF queues, overall and per length class. Long jobs must not be
   starved: their p99 under SJF at most 1.5x FIFO's. Also, for one lane with a long
   deadline under sustained overload, what sjf_weight costs long jobs.
2. Overload: 0.7x-2x capacity, no admission control vs FIFO with a queue cap vs
   the demo policy: interactive p99 TTFT, goodput, rejections.
3. Speed: 100,000 requests through the demo policy, wall time.
4. Fidelity: the simulator's p50/p99 TTFT for the demo's workload against the live
   `extproc demo` run recorded in bench/results/demo.json (same seed, load, duration).
5. A real trace: the README's `extproc simulate --trace bench/data/azure-2023-conv.csv --load 1.5`
   commands, run as written, with the demo policy and with the self-sizing one (TRACES).
6. The self-sizing limit's live runs, simulated: each profile bench/adaptive.py ran live (recorded in
   bench/results/adaptive.json), the same requests (its seeds and more, its seconds of arrivals,
   its time scale) through the simulator, auto against the same best static limit. A live ratio
   moves from run to run; this one does not, and it says whether a live shortfall is the limit's
   (the simulator shows it too) or the run's noise (LIVE_SEEDS).

    .venv/bin/python bench/simulate_claims.py [--quick] [--live-only]

Writes bench/results/simulate_claims.json and .png, and each trace replay's JSON and PNG
(bench/results/trace_azure.json, trace_azure_auto.json). `make claims` runs it (about two minutes),
then checks every figure the README and docs/ quote against its results file (bench/claims.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from extproc.policy import Policy, load_policy
from extproc.sim.profiles import get_profile
from extproc.sim.report import Result, Slo, fmt_seconds, grouped, length_class, summarise
from extproc.sim.simulate import Simulator, capacity_rps, fifo_policy
from extproc.sim.workload import Client, TrafficClass, generate, load_spec

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PROFILE = get_profile("llama-70b-2xh100")
TIME_SCALE = 0.1
#: Seeds of each live profile's simulated twin (claim 6 in the docstring): the live runs' seeds
#: (1, 2, 3 by default) and more.
LIVE_SEEDS = 8
#: Trace replays: results name → the `extproc simulate` arguments (run from the checkout's root) that
#: write it with --json and --plot.
TRACES: dict[str, tuple[str, ...]] = {
    name: ("--policy", policy, "--workload", "examples/workloads/chatbot.yaml",
           "--trace", "bench/data/azure-2023-conv.csv", "--load", "1.5")
    for name, policy in (("trace_azure", "examples/demo-policy.yaml"),
                         ("trace_azure_auto", "examples/auto-policy.yaml"))
}


def one_lane(sjf_weight: float) -> Policy:
    return Policy.model_validate({
        "lanes": [{"name": "chat", "max_inflight": 64, "max_queued": 512, "deadline": "120s"}],
        "classification": {"default_lane": "chat"},
        "queueing": {"sjf_weight": sjf_weight},
        "estimation": {"default": {"prefill_ms_per_token": 0.01, "decode_ms_per_token": 3, "overhead_ms": 5},
                       "learning_rate": 0.05},
        "retry_after": {"max": 10},
    })


def without_sjf(policy: Policy) -> Policy:
    """The same policy with first-come-first-served queues in every lane."""
    doc = policy.model_dump()
    for lane in doc["lanes"]:
        lane["sjf_weight"] = 0.0
    doc["queueing"]["sjf_weight"] = 0.0
    return Policy.model_validate(doc)


def _pcts(rows: list[Result], slos: dict[str, Slo]) -> dict[str, Any]:
    s = summarise(rows, slos, 1.0)
    return {"requests": s.requests, "ok": s.ok, "rejected_finally": s.rejected, "met_slo": s.met_slo,
            "queue_wait": s.queue_wait, "ttft": s.ttft, "e2e": s.e2e}


def _by_length(results: list[Result], slos: dict[str, Slo]) -> dict[str, Any]:
    out = {"all": _pcts(results, slos)}
    for length in ("short", "long"):
        out[length] = _pcts([r for r in results if length_class(r) == length], slos)
    return out


def sjf_claim(duration: float, seed: int) -> dict[str, Any]:
    """The demo policy with FIFO queues vs with its slack-weighted SJF queues, at 1.5x."""
    spec = load_spec(ROOT / "examples" / "workloads" / "chatbot.yaml")
    rate = capacity_rps(PROFILE, TIME_SCALE, spec) * 1.5
    spec = spec.model_copy(update={"arrivals": spec.arrivals.model_copy(update={"rate": rate})})
    slos = {c.name: Slo(c.slo.ttft, c.slo.e2e) for c in spec.classes}
    requests = generate(spec, duration, seed)
    sim = Simulator(PROFILE, time_scale=TIME_SCALE, client=spec.client, seed=seed)
    policy = load_policy(ROOT / "examples" / "demo-policy.yaml")
    out: dict[str, Any] = {"rate_rps": rate, "requests": len(requests)}
    out["fifo"] = _by_length(sim.run(requests, without_sjf(policy)).results, slos)
    out["sjf"] = _by_length(sim.run(requests, policy).results, slos)
    fifo_long, sjf_long = out["fifo"]["long"]["e2e"]["p99"], out["sjf"]["long"]["e2e"]["p99"]
    out["long_p99_e2e_sjf_over_fifo"] = sjf_long / fifo_long if fifo_long and sjf_long else None
    return out


def sjf_sensitivity(duration: float, seed: int) -> dict[str, Any]:
    """One lane with a long (120 s) deadline under sustained 1.5x overload, by sjf_weight.

    Here nothing but the rank's cap bounds a long job's wait, so this shows what
    sjf_weight costs long jobs when deadlines do not.
    """
    spec = load_spec(ROOT / "examples" / "workloads" / "chatbot.yaml")
    spec = spec.model_copy(update={
        "classes": (TrafficClass(name="chat", path="/v1/chat/completions"),),
        "client": Client(kind="none", timeout=600),
    })
    rate = capacity_rps(PROFILE, TIME_SCALE, spec) * 1.5
    spec = spec.model_copy(update={"arrivals": spec.arrivals.model_copy(update={"rate": rate})})
    slos = {"chat": Slo(1.0, 120.0)}
    requests = generate(spec, duration, seed)
    sim = Simulator(PROFILE, time_scale=TIME_SCALE, client=spec.client, seed=seed)
    out: dict[str, Any] = {}
    for weight in (0.0, 1.0, 4.0):
        out[f"sjf_weight={weight:g}"] = _by_length(sim.run(requests, one_lane(weight)).results, slos)
    return out


def overload(duration: float, seed: int, loads: list[float]) -> list[dict[str, Any]]:
    base = load_spec(ROOT / "examples" / "workloads" / "chatbot.yaml")
    policy = load_policy(ROOT / "examples" / "demo-policy.yaml")
    capacity = capacity_rps(PROFILE, TIME_SCALE, base)
    slos = {c.name: Slo(c.slo.ttft, c.slo.e2e) for c in base.classes}
    rows = []
    for load in loads:
        arrivals = base.arrivals.model_copy(update={"rate": capacity * load})
        spec = base.model_copy(update={"arrivals": arrivals})
        requests = generate(spec, duration, seed)
        sim = Simulator(PROFILE, time_scale=TIME_SCALE, client=spec.client, seed=seed)
        row: dict[str, Any] = {"load": load, "requests": len(requests)}
        for name, p in (("none", None), ("fifo_cap", fifo_policy(policy)), ("policy", policy)):
            results = sim.run(requests, p).results
            lanes = grouped(results, slos, duration)
            overall = summarise(results, slos, duration)
            row[name] = {
                "interactive_ttft_p99": lanes["interactive"].ttft.get("p99"),
                "interactive_goodput_rps": lanes["interactive"].goodput_rps,
                "goodput_rps": overall.goodput_rps, "rejection_rate": overall.rejection_rate,
                "attempts_per_request": overall.retry_amplification,
            }
        rows.append(row)
    return rows


def speed(seed: int) -> dict[str, Any]:
    spec = load_spec(ROOT / "examples" / "workloads" / "chatbot.yaml")
    rate = capacity_rps(PROFILE, TIME_SCALE, spec) * 1.2
    spec = spec.model_copy(update={"arrivals": spec.arrivals.model_copy(update={"rate": rate})})
    requests = generate(spec, 100_000 / rate, seed)
    sim = Simulator(PROFILE, time_scale=TIME_SCALE, client=spec.client, seed=seed)
    started = time.perf_counter()
    run = sim.run(requests, load_policy(ROOT / "examples" / "demo-policy.yaml"))
    elapsed = time.perf_counter() - started
    return {"requests": len(requests), "events": run.events, "seconds": round(elapsed, 2),
            "requests_per_second": round(len(requests) / elapsed)}


def fidelity() -> dict[str, Any] | None:
    """Simulate what `extproc demo` ran live and compare TTFT percentiles lane by lane."""
    live_path = RESULTS / "demo.json"
    if not live_path.exists():
        return None
    live = json.loads(live_path.read_text())
    spec = load_spec(ROOT / "examples" / "workloads" / "chatbot.yaml")
    spec = spec.model_copy(update={"arrivals": spec.arrivals.model_copy(update={"rate": live["rate_rps"]})})
    requests = generate(spec, live["duration_s"], live["seed"])
    assert len(requests) == live["requests"], "the demo's workload changed since demo.json was recorded"
    slos = {c.name: Slo(c.slo.ttft, c.slo.e2e) for c in spec.classes}
    sim = Simulator(PROFILE, time_scale=live["time_scale"], client=spec.client, seed=live["seed"])
    policy = load_policy(ROOT / "examples" / "demo-policy.yaml")
    out: dict[str, Any] = {}
    for run_name, p in (("no admission control", None), ("with extproc", policy)):
        lanes = grouped(sim.run(requests, p).results, slos, live["duration_s"])
        for lane, summary in lanes.items():
            got = live["runs"][run_name]["classes"][lane]["ttft"]
            for q in ("p50", "p99"):
                simulated, measured = summary.ttft.get(q), got.get(q)
                ratio = simulated / measured if simulated and measured else None
                out[f"{run_name} / {lane} / TTFT {q}"] = {
                    "simulated": simulated, "live": measured, "ratio": ratio,
                    "within_20pct": ratio is not None and 0.8 <= ratio <= 1.25,
                }
    return out


def adaptive_live_in_sim(seeds: int = LIVE_SEEDS) -> dict[str, Any] | None:
    """Each live profile of bench/results/adaptive.json run again in the simulator (claim 6): per seed,
    auto's goodput over the best static limit's on the same requests (``ratios``; ``ratio`` their
    median, ``live_ratio`` the live runs'), and the interactive lane's first attempts refused and
    served late (summed over the seeds, as adaptive.json sums its runs)."""
    path = RESULTS / "adaptive.json"
    if not path.exists():
        return None
    import adaptive  # bench/adaptive.py: the live runs' workload, limits and counts, one definition

    policy = load_policy(adaptive.AUTO)
    out: dict[str, Any] = {}
    for live in json.loads(path.read_text())["profiles"]:
        if live["mode"] != "live":
            continue
        name, time_scale, seconds = live["name"], live["time_scale"], live["duration_s"]
        best, ran = live["best_static"], {run["seed"] for run in live["runs"]}
        each = []
        for seed in range(adaptive.SEED, adaptive.SEED + seeds):
            spec, requests = adaptive.workload("chatbot", name, time_scale, seconds, seed=seed)
            recorded = next((run for run in live["runs"] if run["seed"] == seed), None)
            assert recorded is None or recorded["requests"] == len(requests), \
                f"{name}'s workload changed since adaptive.json was recorded"
            sim = Simulator(get_profile(name), time_scale=time_scale, client=spec.client, seed=seed)
            auto = sim.run(requests, policy).results
            fixed = sim.run(requests, adaptive.static(policy, best)).results
            each.append({"seed": seed, **adaptive.versus(auto, fixed, spec, seconds)})
        ratios = [run["ratio"] for run in each]
        known = [run["ratio"] for run in each if run["ratio"] is not None]
        on_live_seeds = [run["ratio"] for run in each if run["ratio"] is not None and run["seed"] in ran]
        out[name] = {"time_scale": time_scale, "duration_s": seconds, "best_static": best,
                     "seeds": [run["seed"] for run in each], "ratios": ratios,
                     "ratio": adaptive.median(known) if known else None,
                     "ratio_live_seeds": adaptive.median(on_live_seeds) if on_live_seeds else None,
                     "live_ratio": live["ratio"], "live_ratios": live["ratios"],
                     **{key: {who: sum(run[key][who] for run in each) for who in ("auto", "best_static")}
                        for key in ("interactive_refused", "interactive_late")}}
    return out


def trace_replays() -> None:
    """Each of TRACES as its command line says, writing its JSON and PNG."""
    for name, arguments in TRACES.items():
        outputs = ("--json", f"bench/results/{name}.json", "--plot", f"bench/results/{name}.png")
        print(f"\nextproc simulate {' '.join(arguments + outputs)}", flush=True)
        subprocess.run([sys.executable, "-m", "extproc", "simulate", *arguments, *outputs], cwd=ROOT,
                       check=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--live-only", action="store_true",
                        help="run claim 6 alone (about 30 s) and print it; write nothing (a quick check of a "
                             "change to the self-sizing limit against the live runs' requests)")
    args = parser.parse_args()
    if args.live_only:
        _report_live(adaptive_live_in_sim())
        return 0
    duration = 120.0 if args.quick else 600.0
    loads = [0.7, 1.0, 1.5, 2.0]
    started = time.monotonic()
    doc: dict[str, Any] = {
        "benchmark": "simulate_claims",
        "command": " ".join([".venv/bin/python bench/simulate_claims.py", *sys.argv[1:]]),
        "machine": {"nproc": os.cpu_count(), "python": platform.python_version(),
                    "date": time.strftime("%Y-%m-%d %H:%M:%S")},
        "parameters": {"profile": PROFILE.name, "time_scale": TIME_SCALE, "duration_s": duration,
                       "seed": args.seed},
        "sjf_vs_fifo": sjf_claim(duration, args.seed),
        "sjf_weight_sensitivity_one_lane": sjf_sensitivity(min(duration, 120.0), args.seed),
        "overload": overload(duration, args.seed, loads),
        "speed": speed(args.seed),
        "fidelity_vs_live_demo": fidelity(),
        "adaptive_live_in_sim": adaptive_live_in_sim(),
    }
    doc["elapsed_s"] = round(time.monotonic() - started, 1)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "simulate_claims.json").write_text(json.dumps(doc, indent=1))
    _report(doc)
    _plot(doc, RESULTS / "simulate_claims.png")
    trace_replays()
    return 0


def _report(doc: dict[str, Any]) -> None:
    sjf = doc["sjf_vs_fifo"]
    print("demo policy, FIFO queues -> slack-weighted SJF, chatbot mix at 1.5x "
          f"({sjf['requests']} requests):")
    for group in ("all", "short", "long"):
        f, s = sjf["fifo"][group], sjf["sjf"][group]
        print(f"  {group:<6} TTFT p99 {fmt_seconds(f['ttft']['p99'])} -> {fmt_seconds(s['ttft']['p99'])}   "
              f"E2E p99 {fmt_seconds(f['e2e']['p99'])} -> {fmt_seconds(s['e2e']['p99'])}   "
              f"served {f['ok']} -> {s['ok']} of {f['requests']}")
    print(f"  long jobs' E2E p99, SJF / FIFO = {sjf['long_p99_e2e_sjf_over_fifo']:.2f} (must be <= 1.5)")
    print("one lane, 120 s deadline, sustained 1.5x (long jobs' E2E p99 by sjf_weight):")
    for name, groups in doc["sjf_weight_sensitivity_one_lane"].items():
        long_p99, short_p99 = groups["long"]["e2e"]["p99"], groups["short"]["e2e"]["p99"]
        print(f"  {name:<14} long {fmt_seconds(long_p99)}  short {fmt_seconds(short_p99)}")
    print("overload (interactive TTFT p99 / goodput all lanes):")
    for row in doc["overload"]:
        cells = "   ".join(
            f"{name} {fmt_seconds(row[name]['interactive_ttft_p99'])} / {row[name]['goodput_rps']:.1f}/s"
            for name in ("none", "fifo_cap", "policy")
        )
        print(f"  {row['load']:>3}x  {cells}")
    sp = doc["speed"]
    print(f"speed: {sp['requests']} requests in {sp['seconds']}s ({sp['requests_per_second']}/s)")
    if doc["fidelity_vs_live_demo"]:
        print("simulator vs live demo (TTFT):")
        for key, v in doc["fidelity_vs_live_demo"].items():
            ratio = "-" if v["ratio"] is None else f"{v['ratio']:.2f}"
            sim, live = fmt_seconds(v["simulated"]), fmt_seconds(v["live"])
            print(f"  {key:<48} sim {sim}  live {live}  ratio {ratio}")
    _report_live(doc["adaptive_live_in_sim"])


def _report_live(twin: dict[str, Any] | None) -> None:
    if not twin:
        return
    print("self-sizing limit's live runs, simulated (auto / best static goodput, median; live):")
    for name, v in twin.items():
        refused, late = v["interactive_refused"], v["interactive_late"]
        print(f"  {name:<20} sim {v['ratio']} over {len(v['seeds'])} seeds ({v['ratio_live_seeds']} "
              f"over the live runs' seeds)  live {v['live_ratio']}  interactive refused "
              f"{refused['auto']}/{refused['best_static']}, late {late['auto']}/{late['best_static']}")


def _plot(doc: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    sjf = doc["sjf_vs_fifo"]
    groups = ["all", "short", "long"]
    for i, name in enumerate(("fifo", "sjf")):
        ax1.bar([g + i * 0.4 for g in range(3)], [sjf[name][g]["e2e"]["p99"] or 0 for g in groups], 0.4,
                label=name.upper())
    ax1.set_xticks([g + 0.2 for g in range(3)], groups)
    ax1.set_ylabel("E2E p99 (s)")
    ax1.set_title("one lane at 1.5x: FIFO vs slack-weighted SJF")
    ax1.legend()
    loads = [row["load"] for row in doc["overload"]]
    for name, style in (("none", "o--"), ("fifo_cap", "^:"), ("policy", "s-")):
        ax2.plot(loads, [row[name]["goodput_rps"] for row in doc["overload"]], style, label=name)
    ax2.set_xlabel("offered load (x capacity)")
    ax2.set_ylabel("goodput (requests/s meeting SLO)")
    ax2.set_title("overload, simulated")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

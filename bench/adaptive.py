"""Self-sizing capacity (capacity.max_inflight: auto) against the best hand-set limit.

For each engine profile, the chatbot workload at 1.5x the engine's capacity runs through
examples/auto-policy.yaml twice in the simulator: with its self-sizing limit, and with every
static limit of a sweep (the same policy sized at N slots). The best static N is what an SRE
would have had to find by hand; `ratio` is auto's goodput over that best static's. Profiles:
llama-70b-2xh100 (x0.1), llama-8b-h100 (x1), llama-8b-l4 (x1: one small GPU, little KV cache),
and the 70B with a long-prompt variant of the workload (mean prompt 3,000 tokens).

The step: the engine runs at full capacity, then half (slots, KV cache and step speed), then
full again (sim backend --capacity-schedule). `settle_s_down`/`settle_s_up`: seconds after each
change until the limit stays within +-10 % of the value it ends that phase with;
`interactive_ttft_p99_during_s`: interactive TTFT p99 of requests arriving from the first change
to the end. `step` is simulated seconds; `step_live` the same step live (Envoy + extproc + the
simulated backend, llama-70b-2xh100 at x0.1, wall-clock seconds, the limit read from
/admin/state every 0.5 s).

Live (Envoy + extproc + sim backend), only auto and the simulator's best static run, on
llama-70b-2xh100 at x0.1 and llama-8b-h100 at x1, same requests for both.

    .venv/bin/python bench/adaptive.py [--quick] [--no-live]

Writes bench/results/adaptive.json and bench/results/adaptive.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from extproc import localstack
from extproc.core.capacity import size
from extproc.policy import Policy, load_policy
from extproc.sim.load import run as run_load
from extproc.sim.profiles import get_profile
from extproc.sim.report import Result, Slo, summarise
from extproc.sim.simulate import Run, Simulator, capacity_rps
from extproc.sim.workload import Request, WorkloadSpec, generate, load_spec

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
AUTO = ROOT / "examples" / "auto-policy.yaml"
WORKLOAD = ROOT / "examples" / "workloads" / "chatbot.yaml"
LOAD = 1.5
SEED = 1
PROFILES = [("llama-70b-2xh100", 0.1, "chatbot"), ("llama-8b-h100", 1.0, "chatbot"),
            ("llama-8b-l4", 1.0, "chatbot"), ("llama-70b-2xh100", 0.1, "long-prompt")]
SWEEP = [8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512]


def workload(variant: str, profile: str, time_scale: float, duration: float
             ) -> tuple[WorkloadSpec, list[Request]]:
    spec = load_spec(WORKLOAD)
    if variant == "long-prompt":
        spec = spec.model_copy(update={"lengths": spec.lengths.model_copy(update={"prompt_mean": 3000})})
    rate = capacity_rps(get_profile(profile), time_scale, spec) * LOAD
    spec = spec.model_copy(update={"arrivals": spec.arrivals.model_copy(update={"rate": rate})})
    return spec, generate(spec, duration, SEED)


def slos(spec: WorkloadSpec) -> dict[str, Slo]:
    return {c.name: Slo(c.slo.ttft, c.slo.e2e) for c in spec.classes}


def goodput(results: list[Result], spec: WorkloadSpec, duration: float) -> float:
    return summarise(results, slos(spec), duration).goodput_rps


def static(policy: Policy, n: int) -> Policy:
    """The auto policy with a hand-set limit of ``n`` (lanes keep their shares)."""
    sized = size(policy, n)
    return sized.model_copy(update={"capacity": sized.capacity.model_copy(update={"auto": None})})


def sim_profile(policy: Policy, name: str, time_scale: float, variant: str, duration: float
                ) -> dict[str, Any]:
    spec, requests = workload(variant, name, time_scale, duration)
    profile = get_profile(name)
    sim = Simulator(profile, time_scale=time_scale, client=spec.client, seed=SEED)
    sweep = {}
    for n in SWEEP:
        if n > 2 * profile.max_running:
            break
        sweep[n] = goodput(sim.run(requests, static(policy, n)).results, spec, duration)
    auto_run = sim.run(requests, policy)
    auto = goodput(auto_run.results, spec, duration)
    best = max(sweep, key=lambda n: sweep[n])
    limits = [limit for _, limit, _, _ in auto_run.timeline]
    return {"name": name if variant == "chatbot" else f"{name}/{variant}", "mode": "sim",
            "time_scale": time_scale, "rate": round(spec.arrivals.rate, 2), "requests": len(requests),
            "best_static": best, "best_static_goodput": round(sweep[best], 3), "auto_goodput": round(auto, 3),
            "ratio": round(auto / sweep[best], 3) if sweep[best] else None,
            "sweep": {str(n): round(g, 3) for n, g in sweep.items()},
            "auto_limit_median": sorted(limits)[len(limits) // 2] if limits else None}


def settle(timeline: list[tuple[float, int]], start: float, end: float) -> float | None:
    """Seconds after ``start`` until the limit stays within +-10 % of its value at ``end``."""
    phase = [(t, limit) for t, limit in timeline if start <= t <= end]
    if not phase:
        return None
    final = phase[-1][1]
    settled_at = start
    for t, limit in phase:
        if abs(limit - final) > 0.1 * final:
            settled_at = t
    return round(settled_at - start, 2)


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3)


def ttft_p99_from(results: list[Result], since: float) -> float | None:
    # A request that got no first token (rejected in the end, timed out) is not in the percentile;
    # goodput counts it as a miss.
    return p99([r.ttft for r in results if r.cls == "interactive" and r.at >= since and r.ttft is not None])


def sim_step(policy: Policy, duration: float) -> tuple[dict[str, Any], Run, float]:
    third = duration / 3
    spec, requests = workload("chatbot", "llama-70b-2xh100", 0.1, duration)
    sim = Simulator(get_profile("llama-70b-2xh100"), time_scale=0.1, client=spec.client, seed=SEED,
                    capacity_schedule=((0.0, 1.0), (third, 0.5), (2 * third, 1.0)))
    run = sim.run(requests, policy)
    timeline = [(t, limit) for t, limit, _, _ in run.timeline]
    return {"settle_s_down": settle(timeline, third, 2 * third),
            "settle_s_up": settle(timeline, 2 * third, duration),
            "interactive_ttft_p99_during_s": ttft_p99_from(run.results, third),
            "schedule": f"0:1,{third:g}:0.5,{2 * third:g}:1", "duration_s": duration}, run, third


# -- live ---------------------------------------------------------------------------------------


async def _sample(admin: int, out: list[tuple[float, int]], t0: float, stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            try:
                async with session.get(f"http://127.0.0.1:{admin}/admin/state",
                                       timeout=aiohttp.ClientTimeout(total=2)) as response:
                    state = await response.json()
                out.append((time.monotonic() - t0, int(state["capacity"]["limit"])))
            except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)


async def _drive(url: str, requests: list[Request], spec: WorkloadSpec, admin: int, drain: float
                 ) -> tuple[list[Result], list[tuple[float, int]]]:
    limits: list[tuple[float, int]] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample(admin, limits, time.monotonic(), stop))
    try:
        results = await run_load(url, requests, spec.client, seed=SEED, drain_timeout=drain)
    finally:
        stop.set()
        await sampler
    return results, limits


def live_run(policy_file: Path, profile: str, time_scale: float, requests: list[Request],
             spec: WorkloadSpec, workdir: Path, drain: float, schedule: str | None = None
             ) -> tuple[list[Result], list[tuple[float, int]]]:
    with localstack.stack(workdir) as s:
        workdir.mkdir(parents=True, exist_ok=True)
        backend = localstack.free_port()
        s.start("backend", [sys.executable, "-m", "extproc", "sim", "backend", "--profile", profile,
                            "--time-scale", str(time_scale), "--listen", f"127.0.0.1:{backend}",
                            "--stream-interval", "0.1", "--log-level", "warning", "--seed", str(SEED),
                            *(["--capacity-schedule", schedule] if schedule else [])])
        localstack.wait_http(f"http://127.0.0.1:{backend}/health", proc=s.processes[-1].popen)
        grpc, http, admin = localstack.free_port(), localstack.free_port(), localstack.free_port()
        s.extproc(s.policy_for(policy_file, backend), grpc, http, "--log-level", "warning",
                  "--seed", str(SEED), admin=admin)
        listen, envoy_admin = localstack.free_port(), localstack.free_port()
        s.envoy(localstack.envoy_config(listen, envoy_admin, backend, grpc))
        return asyncio.run(_drive(f"http://127.0.0.1:{listen}", requests, spec, admin, drain))


def write_static(policy: Policy, n: int, path: Path) -> Path:
    path.write_text(yaml.safe_dump(static(policy, n).model_dump(mode="json", exclude_none=True)),
                    encoding="utf-8")
    load_policy(path)  # must be a valid policy file
    return path


def live(policy: Policy, sims: list[dict[str, Any]], duration: float, drain: float, workdir: Path
         ) -> list[dict[str, Any]]:
    out = []
    for name, time_scale in (("llama-70b-2xh100", 0.1), ("llama-8b-h100", 1.0)):
        best = next(p["best_static"] for p in sims if p["name"] == name)
        spec, requests = workload("chatbot", name, time_scale, duration)
        static_file = write_static(policy, best, workdir / f"static-{name}.yaml")
        print(f"live {name}: static {best}", file=sys.stderr)
        static_results, _ = live_run(static_file, name, time_scale, requests, spec,
                                     workdir / f"{name}-static", drain)
        print(f"live {name}: auto", file=sys.stderr)
        auto_results, limits = live_run(AUTO, name, time_scale, requests, spec, workdir / f"{name}-auto",
                                        drain)
        g_static, g_auto = goodput(static_results, spec, duration), goodput(auto_results, spec, duration)
        out.append({"name": name, "mode": "live", "time_scale": time_scale,
                    "rate": round(spec.arrivals.rate, 2), "requests": len(requests), "best_static": best,
                    "best_static_goodput": round(g_static, 3), "auto_goodput": round(g_auto, 3),
                    "ratio": round(g_auto / g_static, 3) if g_static else None,
                    "auto_limit_last": limits[-1][1] if limits else None})
    return out


def live_step(policy_file: Path, duration: float, drain: float, workdir: Path
              ) -> tuple[dict[str, Any], list[tuple[float, int]]]:
    third = duration / 3
    schedule = f"0:1,{third:g}:0.5,{2 * third:g}:1"
    spec, requests = workload("chatbot", "llama-70b-2xh100", 0.1, duration)
    print("live step", file=sys.stderr)
    results, limits = live_run(policy_file, "llama-70b-2xh100", 0.1, requests, spec, workdir / "step",
                               drain, schedule)
    return {"settle_s_down": settle(limits, third, 2 * third),
            "settle_s_up": settle(limits, 2 * third, duration),
            "interactive_ttft_p99_during_s": ttft_p99_from(results, third), "schedule": schedule,
            "duration_s": duration}, limits


def plot(run: Run, third: float, live_limits: list[tuple[float, int]] | None, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    t = [x[0] for x in run.timeline]
    axes[0].plot(t, [x[1] for x in run.timeline], label="auto limit (simulator)")
    if live_limits:
        axes[0].plot([x[0] for x in live_limits], [x[1] for x in live_limits], label="auto limit (live)",
                     alpha=0.7)
    axes[0].set_ylabel("in-flight limit")
    axes[1].plot(t, [x[2] for x in run.timeline], label="engine waiting")
    axes[1].plot(t, [x[3] for x in run.timeline], label="engine running")
    axes[1].set_ylabel("requests")
    inter = sorted((r.at, r.ttft) for r in run.results if r.cls == "interactive" and r.ttft is not None)
    axes[2].scatter([a for a, _ in inter], [b for _, b in inter], s=2)
    axes[2].set_ylabel("interactive TTFT (s)")
    axes[2].set_xlabel("seconds")
    for ax in axes:
        ax.axvspan(third, 2 * third, color="grey", alpha=0.15)
        ax.legend(loc="upper right") if ax is not axes[2] else None
    fig.suptitle("capacity: auto through a full -> half -> full engine (llama-70b-2xh100 x0.1)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter runs (a smoke test)")
    parser.add_argument("--no-live", action="store_true", help="the simulator only")
    parser.add_argument("--out", default=str(RESULTS / "adaptive"))
    args = parser.parse_args()
    policy = load_policy(AUTO)
    sim_duration = 120.0 if args.quick else 300.0
    started = time.perf_counter()
    sims = []
    for name, time_scale, variant in PROFILES:
        print(f"sim {name} {variant}", file=sys.stderr)
        sims.append(sim_profile(policy, name, time_scale, variant, sim_duration))
    step, step_run, third = sim_step(policy, sim_duration)
    doc: dict[str, Any] = {
        "benchmark": "adaptive", "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "parameters": {"load": LOAD, "seed": SEED, "policy": "examples/auto-policy.yaml",
                       "workload": "examples/workloads/chatbot.yaml", "sim_duration_s": sim_duration},
        "profiles": sims, "step": step,
    }
    live_limits = None
    if not args.no_live:
        with tempfile.TemporaryDirectory(prefix="adaptive-") as tmp:
            live_duration, drain = (30.0, 15.0) if args.quick else (60.0, 25.0)
            doc["profiles"] = sims + live(policy, sims, live_duration, drain, Path(tmp))
            doc["step_live"], live_limits = live_step(AUTO, 45.0 if args.quick else 90.0, drain, Path(tmp))
    doc["elapsed_s"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(step_run, third, live_limits, out.with_suffix(".png"))
    for p in doc["profiles"]:
        print(f"{p['mode']:4} {p['name']:32} best static {p['best_static']:4} "
              f"goodput {p['best_static_goodput']:7.2f}  auto {p['auto_goodput']:7.2f}  ratio {p['ratio']}")
    print("step", json.dumps(doc["step"]))
    if "step_live" in doc:
        print("step_live", json.dumps(doc["step_live"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

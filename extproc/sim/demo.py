"""The local demo: the same overload twice, without and with extproc, side by side.

Starts the simulated GPU backend, then runs one workload at a multiple of the
backend's capacity through Envoy straight to the backend (no admission control)
and through Envoy + extproc. The backend is restarted between the runs so both
start from an idle engine. Prints one table and writes a JSON summary and a PNG
(time to first token over the run, both runs). Every process started is
stopped at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc import localstack
from extproc.settings import positive_int
from extproc.sim.load import progress_printer
from extproc.sim.load import run as run_load
from extproc.sim.profiles import get_profile
from extproc.sim.report import Result, Slo, Summary, fmt_seconds, grouped, side_by_side, summarise
from extproc.sim.simulate import capacity_rps
from extproc.sim.workload import Request, WorkloadSpec, generate, load_spec

ROOT = localstack.ROOT


@dataclass
class RunResult:
    name: str
    results: list[Result]
    classes: dict[str, Summary]
    overall: Summary


def run_once(name: str, args: argparse.Namespace, requests: list[Request], spec: WorkloadSpec,
             workdir: Path, with_extproc: bool) -> RunResult:
    with localstack.stack(workdir / name) as s:
        schedule = ["--capacity-schedule", args.capacity_schedule] if args.capacity_schedule else []
        # A policy that scrapes the engine (signals, capacity: auto) reads this run's backend.
        gateway = s.gateway(args.policy if with_extproc else None, args.profile, args.time_scale,
                            backend_args=["--stream-interval", "0.1", "--log-level", "warning",
                                          "--seed", str(args.seed), *schedule],
                            extproc_args=["--log-level", "warning", "--seed", str(args.seed),
                                          "--response-sample", str(args.response_sample)])
        progress = progress_printer(name, len(requests))
        results = asyncio.run(run_load(gateway.url, requests, spec.client, seed=args.seed,
                                       drain_timeout=args.drain, progress=progress))
        if sys.stderr.isatty():
            print(file=sys.stderr)
    slos = {c.name: Slo(c.slo.ttft, c.slo.e2e) for c in spec.classes}
    return RunResult(name, results, grouped(results, slos, args.duration),
                     summarise(results, slos, args.duration))


def table(baseline: RunResult, extproc: RunResult) -> str:
    return side_by_side({run.name: (run.classes, run.overall) for run in (baseline, extproc)})


def plot(baseline: RunResult, extproc: RunResult, path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for ax, run in zip(axes, (baseline, extproc), strict=True):
        # Interactive last, so that it is drawn on top.
        for cls, color in (("best-effort", "tab:gray"), ("batch", "tab:orange"), ("interactive", "tab:blue")):
            ok = [r for r in run.results if r.cls == cls and r.ok and r.ttft is not None]
            ax.scatter([r.at for r in ok], [r.ttft for r in ok], s=4, alpha=0.5, color=color, label=cls)
        rejected = [r.at for r in run.results if r.status in (429, 503)]
        if rejected:
            ax.scatter(rejected, [0.003] * len(rejected), s=9, marker="|", color="tab:red",
                       label="rejected (at arrival)")
        ax.set_yscale("log")
        ax.set_xlabel("arrival time (s)")
        interactive = run.classes.get("interactive")
        ax.set_title(f"{run.name}: interactive TTFT p99 {fmt_seconds(interactive.ttft.get('p99'))}"
                     if interactive is not None else run.name)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("time to first token (s, log)")
    axes[1].legend(loc="upper left", markerscale=3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _run_doc(run: RunResult) -> dict[str, Any]:
    return {"overall": run.overall.as_dict(), "classes": {k: v.as_dict() for k, v in run.classes.items()}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", default=str(ROOT / "examples" / "demo-policy.yaml"))
    parser.add_argument("--workload", default=str(ROOT / "examples" / "workloads" / "chatbot.yaml"))
    parser.add_argument("--profile", default="llama-70b-2xh100")
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument("--load", type=float, default=1.5, help="arrival rate as a multiple of capacity")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per run")
    parser.add_argument("--drain", type=float, default=25.0,
                        help="seconds to wait for answers after the last arrival (later = timed out)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--capacity-schedule", default=None, metavar="T:F,...",
                        help="the simulated engine runs at fraction F of its capacity from T seconds on")
    parser.add_argument("--response-sample", type=positive_int, default=1, metavar="N",
                        help="extproc asks for the response headers of one admitted request in N "
                        "(extproc serve --response-sample; default 1: every one)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "demo"),
                        help="writes OUT.json and OUT.png")


def command(args: argparse.Namespace) -> int:
    spec = load_spec(args.workload)
    profile = get_profile(args.profile)
    capacity = capacity_rps(profile, args.time_scale, spec)
    rate = capacity * args.load
    spec = spec.model_copy(update={"arrivals": spec.arrivals.model_copy(update={"rate": rate})})
    requests = generate(spec, args.duration, args.seed)
    print(f"extproc demo: {profile.name} at time scale {args.time_scale}; capacity ≈ {capacity:.1f} req/s; "
          f"offering {rate:.1f} req/s ({args.load:g}x) for {args.duration:g}s = {len(requests)} requests, "
          f"twice.", file=sys.stderr)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="extproc-demo-") as tmp:
        workdir = Path(tmp)
        print("1/2 Envoy -> backend, no admission control", file=sys.stderr)
        baseline = run_once("no admission control", args, requests, spec, workdir, with_extproc=False)
        print("2/2 Envoy -> extproc -> backend", file=sys.stderr)
        extproc = run_once("with extproc", args, requests, spec, workdir, with_extproc=True)
    print()
    print(table(baseline, extproc))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Not with_suffix: an OUT such as outcomes-1.5x would lose its ".5x".
    json_path, png_path = out.parent / f"{out.name}.json", out.parent / f"{out.name}.png"
    doc = {
        "profile": profile.name, "time_scale": args.time_scale, "capacity_rps": capacity, "load": args.load,
        "rate_rps": rate, "duration_s": args.duration, "requests": len(requests), "seed": args.seed,
        "policy": str(args.policy), "workload": str(args.workload), "response_sample": args.response_sample,
        "runs": {r.name: _run_doc(r) for r in (baseline, extproc)},
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    json_path.write_text(json.dumps(doc, indent=1))
    title = (f"{len(requests)} requests at {args.load:g}x capacity "
             f"({profile.name}, time scale {args.time_scale})")
    drawn = plot(baseline, extproc, png_path, title)
    print(f"\nwrote {json_path}" + (f" and {png_path}" if drawn else ""))
    return 0

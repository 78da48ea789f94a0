"""Outcomes under overload: the demo's scenario swept over 0.7x-2x capacity, without and with extproc.

For each load factor the same seeded workload (examples/workloads/chatbot.yaml) is
sent through Envoy straight to the simulated 70B backend (the baseline: no
admission control) and through Envoy + extproc (examples/demo-policy.yaml), each
on a freshly started backend. Reports per lane p50/p99 TTFT, p99 E2E, goodput
(requests/s that met their lane's SLO, over the arrival window), rejection rate
and attempts per request; the ratios baseline/extproc; and whether the targets
hold: at 1.5x and 2x capacity, interactive p99 TTFT <= 1 s through extproc while
the baseline's is >= 10x higher, and goodput >= 2x the baseline's.

    .venv/bin/python bench/outcomes.py [--duration 60] [--loads 0.7,1,1.5,2] [--quick]
        [--response-sample 8]

``--response-sample N`` runs the extproc side with the response headers asked for on one admitted
request in N (``extproc serve --response-sample``): its service times are learnt from that sample
only. It writes bench/results/outcomes-sampleN.json (and .png) unless ``--out`` says otherwise, to
compare with the run that asks for every one.

Writes bench/results/outcomes.json and bench/results/outcomes.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from extproc.sim import demo
from extproc.sim.profiles import get_profile
from extproc.sim.report import Summary, fmt_seconds
from extproc.sim.simulate import capacity_rps
from extproc.sim.workload import generate, load_spec

RESULTS = Path(__file__).resolve().parent / "results"


def _lane(summary: Summary) -> dict[str, Any]:
    return {
        "ttft_p50": summary.ttft.get("p50"),
        "ttft_p99": summary.ttft.get("p99"),
        "e2e_p99": summary.e2e.get("p99"),
        "goodput_rps": summary.goodput_rps,
        "rejection_rate": summary.rejection_rate,
        "attempts_per_request": summary.retry_amplification,
        "requests": summary.requests,
        "ok": summary.ok,
        "timeouts": summary.timeouts,
        "errors": summary.errors,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    demo.add_arguments(parser)
    parser.add_argument("--loads", default="0.7,1.0,1.5,2.0")
    parser.add_argument("--quick", action="store_true", help="15 s per run, loads 1.5 and 2 only")
    parser.set_defaults(duration=60.0, drain=30.0, out=str(RESULTS / "outcomes"))
    args = parser.parse_args()
    if args.response_sample != 1 and args.out == str(RESULTS / "outcomes"):
        # Beside the recorded run (which the README quotes), not over it.
        args.out = str(RESULTS / f"outcomes-sample{args.response_sample}")
    if args.quick:
        args.duration, args.drain, args.loads = 15.0, 8.0, "1.5,2.0"
    loads = [float(x) for x in args.loads.split(",")]
    profile = get_profile(args.profile)
    base_spec = load_spec(args.workload)
    capacity = capacity_rps(profile, args.time_scale, base_spec)
    points: list[dict[str, Any]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="extproc-outcomes-") as tmp:
        for load in loads:
            spec = base_spec.model_copy(
                update={"arrivals": base_spec.arrivals.model_copy(update={"rate": capacity * load})}
            )
            requests = generate(spec, args.duration, args.seed)
            print(f"load {load:g}x: {len(requests)} requests in {args.duration:g}s", file=sys.stderr)
            runs = {}
            for name, with_extproc in (("baseline", False), ("extproc", True)):
                result = demo.run_once(f"{name}-{load:g}", args, requests, spec, Path(tmp), with_extproc)
                runs[name] = {
                    "overall": _lane(result.overall),
                    "lanes": {k: _lane(v) for k, v in result.classes.items()},
                }
            b, e = runs["baseline"], runs["extproc"]
            ratios = {
                "interactive_ttft_p99_baseline_over_extproc": _ratio(
                    b["lanes"]["interactive"]["ttft_p99"], e["lanes"]["interactive"]["ttft_p99"]
                ),
                "goodput_extproc_over_baseline": _ratio(
                    e["overall"]["goodput_rps"], b["overall"]["goodput_rps"]
                ),
                "interactive_goodput_extproc_over_baseline": _ratio(
                    e["lanes"]["interactive"]["goodput_rps"], b["lanes"]["interactive"]["goodput_rps"]
                ),
            }
            points.append(
                {
                    "load": load,
                    "rate_rps": capacity * load,
                    "requests": len(requests),
                    "runs": runs,
                    "ratios": ratios,
                }
            )
    targets = []
    for p in points:
        if p["load"] < 1.5:
            continue
        ttft = p["runs"]["extproc"]["lanes"]["interactive"]["ttft_p99"]
        ratio = p["ratios"]["interactive_ttft_p99_baseline_over_extproc"]
        goodput = p["ratios"]["goodput_extproc_over_baseline"]
        targets.append(
            {
                "load": p["load"],
                "interactive_ttft_p99_le_1s": ttft is not None and ttft <= 1.0,
                "baseline_ttft_p99_ge_10x": ratio is not None and ratio >= 10,
                "goodput_ge_2x": goodput is not None and goodput >= 2,
            }
        )
    doc = {
        "benchmark": "outcomes",
        "machine": {
            "nproc": os.cpu_count(),
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "parameters": {
            "profile": profile.name,
            "time_scale": args.time_scale,
            "capacity_rps": capacity,
            "duration_s": args.duration,
            "drain_s": args.drain,
            "seed": args.seed,
            "policy": Path(args.policy).name,
            "workload": Path(args.workload).name,
            "response_sample": args.response_sample,
        },
        "points": points,
        "targets": targets,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Not with_suffix: an OUT such as outcomes-1.5x would lose its ".5x".
    json_path, png_path = out.parent / f"{out.name}.json", out.parent / f"{out.name}.png"
    json_path.write_text(json.dumps(doc, indent=1))
    _plot(points, png_path, capacity)
    _print(points, targets)
    return 0


def _print(points: list[dict[str, Any]], targets: list[dict[str, Any]]) -> None:
    print(
        f"{'load':>5} {'run':<9} {'inter TTFT p50':>15} {'inter TTFT p99':>15} {'inter goodput':>14} "
        f"{'all goodput':>12} {'rejected':>9} {'attempts':>9}"
    )
    for p in points:
        for name in ("baseline", "extproc"):
            run = p["runs"][name]
            inter = run["lanes"]["interactive"]
            print(
                f"{p['load']:>4g}x {name:<9} {fmt_seconds(inter['ttft_p50']):>15} "
                f"{fmt_seconds(inter['ttft_p99']):>15} "
                f"{inter['goodput_rps']:>12.1f}/s {run['overall']['goodput_rps']:>10.1f}/s "
                f"{run['overall']['rejection_rate']:>9.0%} {run['overall']['attempts_per_request']:>9.2f}"
            )
    for t in targets:
        print(
            f"targets at {t['load']:g}x: "
            + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in t.items() if k != "load")
        )


def _plot(points: list[dict[str, Any]], path: Path, capacity: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    loads = [p["load"] for p in points]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, style in (("baseline", "o--"), ("extproc", "s-")):
        ax1.plot(
            loads,
            [p["runs"][name]["lanes"]["interactive"]["ttft_p99"] or 0 for p in points],
            style,
            label=f"{name}: interactive TTFT p99",
        )
        ax2.plot(
            loads,
            [p["runs"][name]["overall"]["goodput_rps"] for p in points],
            style,
            label=f"{name}: goodput (all lanes)",
        )
    ax1.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax1.set_yscale("log")
    ax1.set_ylabel("seconds")
    ax2.set_ylabel("requests/s meeting their SLO")
    for ax in (ax1, ax2):
        ax.set_xlabel(f"offered load (x capacity, {capacity:.1f} req/s)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

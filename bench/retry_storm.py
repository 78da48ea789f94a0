"""Retry storms at 2x overload: attempts per original request without and with the retry budget.

The same seeded workload (examples/workloads/chatbot.yaml, clients that retry like the
OpenAI SDKs: up to 2 retries on 408/409/429/5xx, honouring retry-after and
x-should-retry, marking retries with x-stainless-retry-count) is sent at twice the
simulated backend's capacity through Envoy three ways, each on a fresh backend:

* baseline   — no extproc: nothing is rejected, so clients retry only on errors;
* no budget  — extproc (examples/demo-policy.yaml) with ``retry_budget.enabled: false``;
* budget     — the same policy with the default retry budget (ratio 0.1, 1/s floor, 10 s window).

Reports attempts per original request (target: <= 1.1 with the budget), goodput, and
rejections by reason (from extproc's answers).

    .venv/bin/python bench/retry_storm.py [--duration 40] [--load 2]

Writes bench/results/retry_storm.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from extproc.sim import demo
from extproc.sim.profiles import get_profile
from extproc.sim.simulate import capacity_rps
from extproc.sim.workload import generate, load_spec

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(parser)
    parser.set_defaults(load=2.0, duration=40.0, drain=25.0, out=str(RESULTS / "retry_storm"))
    args = parser.parse_args()
    profile = get_profile(args.profile)
    spec = load_spec(args.workload)
    capacity = capacity_rps(profile, args.time_scale, spec)
    arrivals = spec.arrivals.model_copy(update={"rate": capacity * args.load})
    spec = spec.model_copy(update={"arrivals": arrivals})
    requests = generate(spec, args.duration, args.seed)
    base_policy = yaml.safe_load(Path(args.policy).read_text())
    print(f"{len(requests)} requests at {args.load:g}x capacity ({capacity * args.load:.1f}/s) "
          f"for {args.duration:g}s; client: {spec.client.kind}, max_retries {spec.client.max_retries}",
          file=sys.stderr)
    runs: dict[str, Any] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="extproc-retry-storm-") as tmp:
        for name, budget in (("baseline", None), ("no_budget", False), ("budget", True)):
            with_extproc = budget is not None
            if with_extproc:
                policy = {**base_policy, "retry_budget": {"enabled": bool(budget)}}
                path = Path(tmp) / f"{name}.yaml"
                path.write_text(yaml.safe_dump(policy))
                args.policy = str(path)
            result = demo.run_once(name, args, requests, spec, Path(tmp), with_extproc)
            attempts = sum(r.attempts for r in result.results)
            reasons = collections.Counter(r.reason for r in result.results if r.reason)
            overall = result.overall
            runs[name] = {
                "requests": len(result.results),
                "attempts": attempts,
                "attempts_per_request": attempts / len(result.results),
                "ok": overall.ok,
                "goodput_rps": overall.goodput_rps,
                "rejection_rate": overall.rejection_rate,
                "timeouts": overall.timeouts,
                "final_reasons": dict(reasons),
            }
    base, free, capped = runs["baseline"], runs["no_budget"], runs["budget"]
    doc = {
        "benchmark": "retry_storm",
        "machine": {"nproc": os.cpu_count(), "python": platform.python_version(),
                    "date": time.strftime("%Y-%m-%d %H:%M:%S")},
        "parameters": {"profile": profile.name, "time_scale": args.time_scale, "capacity_rps": capacity,
                       "load": args.load, "duration_s": args.duration, "drain_s": args.drain,
                       "seed": args.seed, "workload": Path(args.workload).name,
                       "policy": "demo-policy.yaml", "client": spec.client.model_dump()},
        "runs": runs,
        "ratios": {
            "attempts_budget_over_no_budget": capped["attempts_per_request"] / free["attempts_per_request"],
            "goodput_budget_over_baseline": (capped["goodput_rps"] / base["goodput_rps"]
                                             if base["goodput_rps"] else None),
        },
        "target": {"attempts_per_request_le_1_1": capped["attempts_per_request"] <= 1.1},
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / f"{out.name}.json").write_text(json.dumps(doc, indent=1))
    for name, run in runs.items():
        print(f"{name:>10}: {run['attempts_per_request']:.3f} attempts/request, "
              f"goodput {run['goodput_rps']:.1f}/s, rejected {run['rejection_rate']:.1%}, "
              f"final reasons {run['final_reasons']}")
    print(f"target attempts/request <= 1.1 with the budget: {doc['target']['attempts_per_request_le_1_1']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Retry-After that means something: the fleet's drain against a fixed value, live.

The demo's stack (the simulated llama-70b-2xh100 at x0.1, Envoy with the shipped config,
``extproc serve`` with examples/demo-policy.yaml) under the chatbot workload at 1.5x the engine's
capacity, with clients that honour Retry-After exactly (up to 4 retries; the OpenAI SDKs' rule,
without their backoff when a Retry-After is given). Two runs on the same requests:

* ``drain`` — the policy as shipped: Retry-After = the requests ahead in the lane (every replica's)
  over the lane's measured completion rate, booked on the lane's return schedule (one client per
  1/rate s), bounded by retry_after.min/max;
* ``fixed`` — the same policy answering a constant ``Retry-After: 1`` (retry_after min = max = 1 s,
  no jitter), what many gateways send.

``first_retry_admitted``: of the requests rejected at least once and retried, the share admitted on
their first retry. ``peak_to_mean_retry_rate``: retries sent per 1 s bin, the busiest bin over the
mean, between the first and the last retry (1.0: perfectly even; synchronised waves: high).

    .venv/bin/python bench/retry_after.py [--quick]

Writes bench/results/retry_after.json and bench/results/retry_after.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from extproc import localstack
from extproc.policy import load_policy
from extproc.sim.load import run as run_load
from extproc.sim.profiles import get_profile
from extproc.sim.report import Result
from extproc.sim.simulate import capacity_rps
from extproc.sim.workload import Client, Request, generate, load_spec

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
POLICY = ROOT / "examples" / "demo-policy.yaml"
WORKLOAD = ROOT / "examples" / "workloads" / "chatbot.yaml"
PROFILE, TIME_SCALE, LOAD, SEED = "llama-70b-2xh100", 0.1, 1.5, 3
#: Clients that do what Retry-After says (and give up after four retries).
CLIENT = Client(kind="openai", max_retries=4, max_retry_after=60, timeout=120)


def fixed_policy(path: Path) -> Path:
    doc = yaml.safe_load(POLICY.read_text())
    doc["retry_after"] = {"min": "1s", "max": "1s", "jitter": 0}
    path.write_text(yaml.safe_dump(doc))
    load_policy(path)  # must be a valid policy
    return path


def live(policy: Path, requests: list[Request], workdir: Path, drain: float) -> list[Result]:
    with localstack.stack(workdir) as s:
        gateway = s.gateway(policy, PROFILE, TIME_SCALE,
                            backend_args=["--log-level", "warning", "--seed", str(SEED)],
                            extproc_args=["--log-level", "warning", "--seed", str(SEED)])
        return asyncio.run(run_load(gateway.url, requests, CLIENT, seed=SEED, drain_timeout=drain))


def measure(results: list[Result]) -> dict[str, Any]:
    retried = [r for r in results if r.attempts >= 2]
    first = sum(1 for r in retried if r.attempts == 2 and r.ok)
    sends = sorted(r.at + offset for r in results for offset in r.retries)
    told = [s for r in results for s in r.retry_after if s is not None]
    out: dict[str, Any] = {
        "requests": len(results), "rejected_once_and_retried": len(retried),
        "first_retry_admitted": round(first / len(retried), 3) if retried else None,
        "retries": len(sends), "ok": sum(1 for r in results if r.ok),
        "retry_after_mean_s": round(sum(told) / len(told), 2) if told else None,
        "retry_after_max_s": max(told, default=None),
    }
    if len(sends) >= 2:
        start, end = sends[0], sends[-1]
        bins = [0] * (int(end - start) + 1)
        for t in sends:
            bins[int(t - start)] += 1
        mean = len(sends) / len(bins)
        out["peak_to_mean_retry_rate"] = round(max(bins) / mean, 3)
        out["retry_bins_per_s"] = bins
        out["retry_window_s"] = [round(start, 2), round(end, 2)]
    else:
        out["peak_to_mean_retry_rate"] = None
    return out


def plot(doc: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(9, 3.5))
    for name in ("drain", "fixed"):
        run = doc[name]
        bins = run.get("retry_bins_per_s") or []
        start = (run.get("retry_window_s") or [0])[0]
        ax.step([start + i for i in range(len(bins))], bins, where="post",
                label=f"{name}: first retry admitted {run['first_retry_admitted']}, "
                      f"peak/mean {run['peak_to_mean_retry_rate']}")
    ax.set_xlabel("seconds")
    ax.set_ylabel("retries sent per second")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title("Retry-After from the fleet's drain vs a fixed Retry-After: 1 (clients obey it exactly)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20 s of arrivals instead of 60")
    parser.add_argument("--out", default=str(RESULTS / "retry_after"))
    args = parser.parse_args()
    duration, drain = (20.0, 20.0) if args.quick else (60.0, 30.0)
    spec = load_spec(WORKLOAD)
    rate = capacity_rps(get_profile(PROFILE), TIME_SCALE, spec) * LOAD
    spec = spec.model_copy(update={"arrivals": spec.arrivals.model_copy(update={"rate": rate})})
    requests = generate(spec, duration, SEED)
    started = time.perf_counter()
    doc: dict[str, Any] = {
        "benchmark": "retry_after", "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "parameters": {"profile": PROFILE, "time_scale": TIME_SCALE, "load": LOAD, "rate": round(rate, 2),
                       "duration_s": duration, "requests": len(requests), "seed": SEED,
                       "client": CLIENT.model_dump(), "policy": "examples/demo-policy.yaml"},
    }
    with tempfile.TemporaryDirectory(prefix="retry-after-") as tmp:
        work = Path(tmp)
        print("drain", file=sys.stderr)
        doc["drain"] = measure(live(POLICY, requests, work / "drain", drain))
        print("fixed", file=sys.stderr)
        doc["fixed"] = measure(live(fixed_policy(work / "fixed.yaml"), requests, work / "fixed", drain))
    doc["elapsed_s"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, out.with_suffix(".png"))
    for name in ("drain", "fixed"):
        run = doc[name]
        print(f"{name:6} retried {run['rejected_once_and_retried']:5}  first retry admitted "
              f"{run['first_retry_admitted']}  peak/mean retry rate {run['peak_to_mean_retry_rate']}  "
              f"Retry-After mean {run['retry_after_mean_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

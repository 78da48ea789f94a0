"""Retry-After that means something: booked returns on the lane's schedule against a fixed value, live.

The demo's stack (the simulated llama-70b-2xh100 at x0.1, Envoy with the shipped config,
``extproc serve`` with examples/demo-policy.yaml) under the chatbot workload at 4x the engine's
capacity (enough rejections for a retry rate worth measuring), with clients that honour
Retry-After exactly (``retry-after-ms`` when sent, as the OpenAI SDKs do; ``x-should-retry:
false`` ends them; up to 4 retries). Two runs on the same requests, both with the demo policy's
retry budget raised to ``RATIO``:

* ``drain`` — Retry-After from the request's place in its lane's drain (the requests ahead of it
  over the lane's measured completion rate), booked on the lane's return schedule at ``SHARE`` of
  that rate (and of its slot time); a retry that comes back on time claims its booking and keeps
  its first attempt's place; when no return can be promised, ``x-should-retry: false``;
* ``fixed`` — a constant ``Retry-After: 1`` (retry_after min = max = 1 s, no jitter, no
  schedule), what many gateways send.

``first_retry_admitted``: of the requests rejected at least once and retried, the share admitted on
their first retry. ``peak_to_mean_retry_rate``: retries sent per 1 s bin, the busiest bin over the
mean, between the first and the last retry (1.0: perfectly even; synchronised waves: high);
``steady.peak_to_mean_retry_rate``: the same from WARMUP s to the last arrival (without the ramp
while queues first fill and rates are first measured, and the tail after arrivals stop).

    .venv/bin/python bench/retry_after.py [--quick] [--only drain|fixed]

Writes bench/results/retry_after.json and bench/results/retry_after.png (``--only`` runs one of the
two, about two minutes each, and merges it into the JSON).
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
PROFILE, TIME_SCALE, LOAD, SEED = "llama-70b-2xh100", 0.1, 4.0, 3
#: Seconds of arrivals before the steady-state window (queues fill, rates are measured).
WARMUP = 15.0
#: Clients that do what Retry-After says (and give up after four retries).
CLIENT = Client(kind="openai", max_retries=4, max_retry_after=60, timeout=120)


#: Both runs: the demo policy with room for retries: the return schedule keeps SHARE of each lane's
#: completion rate for them, and the retry budget allows RATIO of admitted originals (above SHARE /
#: (1 - SHARE) = 0.25, so that the budget does not leave holes in the schedule).
SHARE, RATIO = 0.2, 0.3


def variant(path: Path, retry_after: dict[str, Any]) -> Path:
    doc = yaml.safe_load(POLICY.read_text())
    doc["retry_after"] = retry_after
    doc["retry_budget"] = {"ratio": RATIO}
    path.write_text(yaml.safe_dump(doc))
    load_policy(path)  # must be a valid policy
    return path


def live(policy: Path, requests: list[Request], workdir: Path, drain: float) -> list[Result]:
    with localstack.stack(workdir) as s:
        gateway = s.gateway(policy, PROFILE, TIME_SCALE,
                            backend_args=["--log-level", "warning", "--seed", str(SEED)],
                            extproc_args=["--log-level", "warning", "--seed", str(SEED)])
        return asyncio.run(run_load(gateway.url, requests, CLIENT, seed=SEED, drain_timeout=drain))


def peak_to_mean(sends: list[float], start: float, end: float) -> tuple[float | None, list[int]]:
    """Sends per 1 s bin from ``start`` to ``end``: the busiest bin over the mean, and the bins."""
    inside = [t for t in sends if start <= t <= end]
    if len(inside) < 2 or end <= start:
        return None, []
    bins = [0] * (int(end - start) + 1)
    for t in inside:
        bins[int(t - start)] += 1
    return round(max(bins) / (len(inside) / len(bins)), 3), bins


def measure(results: list[Result], duration: float) -> dict[str, Any]:
    retried = [r for r in results if r.attempts >= 2]
    reasons: dict[str, int] = {}
    for r in results:
        if not r.ok:
            reasons[r.reason or str(r.status)] = reasons.get(r.reason or str(r.status), 0) + 1
    first = sum(1 for r in retried if r.attempts == 2 and r.ok)
    sends = sorted(r.at + offset for r in results for offset in r.retries)
    told = [s for r in results for s in r.retry_after if s is not None]
    out: dict[str, Any] = {
        "requests": len(results), "rejected_once_and_retried": len(retried),
        "first_retry_admitted": round(first / len(retried), 3) if retried else None,
        "retries": len(sends), "ok": sum(1 for r in results if r.ok),
        "rejected_not_retried": sum(1 for r in results if not r.ok and r.attempts == 1),
        "retried_admitted_eventually": sum(1 for r in retried if r.ok),
        "failed_by_reason": reasons,
        "ok_by_class": {c: sum(1 for r in results if r.ok and r.cls == c)
                        for c in sorted({r.cls for r in results})},
        "retry_after_mean_s": round(sum(told) / len(told), 2) if told else None,
        "retry_after_max_s": max(told, default=None),
    }
    # The measure: every retry, from the first to the last.
    if len(sends) >= 2:
        ratio, bins = peak_to_mean(sends, sends[0], sends[-1])
        out["peak_to_mean_retry_rate"] = ratio
        out["retry_bins_per_s"] = bins
        out["retry_window_s"] = [round(sends[0], 2), round(sends[-1], 2)]
    else:
        out["peak_to_mean_retry_rate"] = None
    # Beside it, the steady state: retries sent after the warm-up and before arrivals stop (the
    # ramp as queues first fill and the tail after the last arrival are not waves).
    steady, steady_bins = peak_to_mean(sends, WARMUP, duration)
    out["steady"] = {"window_s": [WARMUP, duration], "peak_to_mean_retry_rate": steady,
                     "retries_per_s": round(sum(steady_bins) / len(steady_bins), 2) if steady_bins else None}
    return out


def plot(doc: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for name in ("drain", "fixed"):
        run = doc[name]
        bins = run.get("retry_bins_per_s") or []
        start = (run.get("retry_window_s") or [0])[0]
        steady = (run.get("steady") or {}).get("peak_to_mean_retry_rate")
        ax.step([start + i for i in range(len(bins))], bins, where="post",
                label=f"{name}: first retry admitted {run['first_retry_admitted']}, "
                      f"peak/mean {run['peak_to_mean_retry_rate']} (steady {steady})")
    window = (doc["drain"].get("steady") or {}).get("window_s")
    if window:
        ax.axvspan(window[0], window[1], color="0.92", zorder=0, label="steady window")
    ax.set_xlabel("seconds from the first arrival")
    ax.set_ylabel("retries sent per second")
    ax.legend(loc="upper right", fontsize=7)
    ax.set_title("Booked returns (Retry-After from the drain) vs a fixed Retry-After: 1; clients obey",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20 s of arrivals instead of 90")
    parser.add_argument("--out", default=str(RESULTS / "retry_after"))
    parser.add_argument("--only", choices=("drain", "fixed"),
                        help="run one of the two (each run takes about two minutes) and merge it into --out")
    args = parser.parse_args()
    duration, drain = (20.0, 20.0) if args.quick else (90.0, 25.0)
    spec = load_spec(WORKLOAD)
    rate = capacity_rps(get_profile(PROFILE), TIME_SCALE, spec) * LOAD
    spec = spec.model_copy(update={"arrivals": spec.arrivals.model_copy(update={"rate": rate})})
    requests = generate(spec, duration, SEED)
    started = time.perf_counter()
    doc: dict[str, Any] = {
        "benchmark": "retry_after", "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "parameters": {"profile": PROFILE, "time_scale": TIME_SCALE, "load": LOAD, "rate": round(rate, 2),
                       "duration_s": duration, "requests": len(requests), "seed": SEED,
                       "client": CLIENT.model_dump(), "policy": "examples/demo-policy.yaml",
                       "retry_after_share": SHARE, "retry_budget_ratio": RATIO},
    }
    out = Path(args.out)
    if args.only is not None and out.with_suffix(".json").exists():
        before = json.loads(out.with_suffix(".json").read_text())
        if before.get("parameters") == doc["parameters"]:
            doc.update({k: v for k, v in before.items() if k in ("drain", "fixed")})
    shipped = yaml.safe_load(POLICY.read_text())["retry_after"]
    variants = {"drain": {**shipped, "share": SHARE},
                "fixed": {"min": "1s", "max": "1s", "jitter": 0, "share": 0}}
    with tempfile.TemporaryDirectory(prefix="retry-after-") as tmp:
        work = Path(tmp)
        for name, retry_after in variants.items():
            if args.only not in (None, name):
                continue
            print(name, file=sys.stderr)
            policy = variant(work / f"{name}.yaml", retry_after)
            doc[name] = measure(live(policy, requests, work / name, drain), duration)
            doc[name]["elapsed_s"] = round(time.perf_counter() - started, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    if "drain" in doc and "fixed" in doc:
        plot(doc, out.with_suffix(".png"))
    for name in ("drain", "fixed"):
        if name not in doc:
            continue
        run = doc[name]
        print(f"{name:6} retried {run['rejected_once_and_retried']:5}  first retry admitted "
              f"{run['first_retry_admitted']}  peak/mean retry rate {run['peak_to_mean_retry_rate']}  "
              f"(steady {run['steady']['peak_to_mean_retry_rate']})  "
              f"Retry-After mean {run['retry_after_mean_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

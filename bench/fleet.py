"""Fleet-wide fairness and budgets: 1, 2 and 3 extproc replicas sharing Redis behind one Envoy.

Every run starts a fresh stack: ``redis-server``, ``r`` replicas of ``extproc serve --store
redis://… --store-fleet-size r``, one Envoy (the shipped ``envoy/envoy.yaml``) whose ext_proc and
rate-limit clusters list the replicas with the same ``load_balancing_weight`` each (the split:
``100``; ``80/20`` and ``50/50``; ``60/30/10`` and ``34/33/33``), and an upstream that answers
after a fixed service time and tallies what reached it. Two tenants, ``acme`` (weight 3) and
``globex`` (weight 1), come in through the trusted tenant source of "Closed to abuse": their
demo API keys, which Envoy's ``api_key_auth`` turns into ``x-extproc-client``. Both saturate:
each keeps more requests outstanding than the fleet's in-flight limit could ever serve.

* fairness runs — a tenant's *admitted share* is its part of the predicted GPU-seconds that
  reached the upstream (``x-extproc-predicted-ms``, the fair-queuing unit) after a warm-up;
  ``share_error`` is ``|share(acme) - 3/4|``. Target ≤ 0.05 in every run.
* retry run (3 replicas, 34/33/33) — clients retry every 429 at once, up to 3 times, marking
  retries with ``x-stainless-retry-count`` (as the OpenAI SDKs do), against a policy whose queue
  overflows; ``retry_ratio_fleet`` = retries that reached the upstream / originals that did,
  fleet-wide, vs the policy's ``retry_budget.ratio`` (floor 0). Baseline in the same run: the same
  load with the retry budget disabled. Target: ≤ ratio + 0.02.
* budget run (3 replicas, 34/33/33) — ``acme`` has a request budget (``requests`` per second):
  admitted requests per second fleet-wide vs the budget (one bucket per tenant for the fleet;
  each replica alone would let through its own budget, i.e. r times as much).

    .venv/bin/python bench/fleet.py [--duration 20] [--only fairness|retry|budget]

Writes bench/results/fleet.json and bench/results/fleet.png. Only ever talks to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from extproc.localstack import Stack, envoy_config, free_port, wait_http  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KEYS = {"acme": "sk-demo-acme", "globex": "sk-demo-globex"}
WEIGHTS = {"acme": 3, "globex": 1}
SPLITS = [[100], [80, 20], [50, 50], [60, 30, 10], [34, 33, 33]]
#: The fleet's in-flight limit and the upstream's service time: ~LIMIT / SERVICE_S admissions a second.
LIMIT = 6
SERVICE_S = 0.2
#: Outstanding requests per tenant (closed loop): well above LIMIT, so both tenants always queue.
CLIENTS = 14
RETRY_RATIO = 0.1
#: Outstanding requests per tenant in the retry run: far more than the queue holds, so many are refused.
RETRY_CLIENTS = 20
BUDGET_RPS = 5

POLICY: dict[str, Any] = {
    "version": 1,
    "lanes": [{"name": "chat", "max_inflight": LIMIT, "max_queued": 200, "deadline": "30s"}],
    "capacity": {"max_inflight": LIMIT, "max_hold": "60s"},
    "trusted_headers": ["x-extproc-client"],
    "classification": {"default_lane": "chat"},
    "tenants": {"header": "x-extproc-client", "default": "anonymous", "weights": WEIGHTS},
    "queueing": {"sjf_weight": 0},
    # Predictions as the upstream serves (64 tokens at 3 ms, 8 ms overhead: 200 ms), so that the
    # first requests are not charged the prior's guess while the estimator learns.
    "estimation": {"default_max_tokens": 64, "default": {"prefill_ms_per_token": 0, "decode_ms_per_token": 3,
                                                         "overhead_ms": 8},
                   "occupancy_slowdown": 0, "learning_rate": 0.05},
    "ratelimit": {"mode": "off"},
    "retry_budget": {"enabled": False},
}


# -- the upstream: answers after SERVICE_S, tallies per tenant what reached it --------------------

def upstream(port: int, service_s: float) -> None:
    from aiohttp import web

    tally: dict[str, Any] = {}

    def reset() -> None:
        tally.clear()
        tally.update(tenants={}, originals=0, retries=0, since=time.monotonic())

    async def handle(request: web.Request) -> web.Response:
        if request.path == "/stats":
            out = {**tally, "elapsed": time.monotonic() - tally["since"]}
            if request.query.get("reset"):
                reset()
            return web.json_response(out)
        await request.read()
        tenant = request.headers.get("x-extproc-tenant", "?")
        per = tally["tenants"].setdefault(tenant, {"requests": 0, "predicted_ms": 0.0})
        per["requests"] += 1
        per["predicted_ms"] += float(request.headers.get("x-extproc-predicted-ms", "0") or 0)
        retry = request.headers.get("x-stainless-retry-count", "0")
        tally["retries" if retry.isdigit() and int(retry) > 0 else "originals"] += 1
        await asyncio.sleep(service_s)
        return web.json_response({"choices": [{"message": {"content": "ok"}}]})

    reset()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# -- the stack ------------------------------------------------------------------------------------

def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    ping = ["redis-cli", "-p", str(port), "ping"]
    while subprocess.run(ping, capture_output=True).stdout.strip() != b"PONG":
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("redis-server did not start")
        time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def weighted(ports: list[int], weights: list[int]) -> Any:
    def tweak(config: dict[str, Any]) -> None:
        for cluster in config["static_resources"]["clusters"]:
            if cluster["name"] in ("extproc", "extproc_ratelimit"):
                cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                                 "port_value": port}}},
                     "load_balancing_weight": weight} for port, weight in zip(ports, weights, strict=True)]}]
    return tweak


async def client(url: str, tenant: str, stop: float, *, retries: int) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        while time.monotonic() < stop:
            for attempt in range(retries + 1):
                headers = {"authorization": f"Bearer {KEYS[tenant]}",
                           "x-stainless-retry-count": str(attempt)}
                try:
                    response = await http.post(url + "/v1/chat/completions", headers=headers,
                                               json={"max_tokens": 64, "messages": [{"role": "user",
                                                                                     "content": "hi"}]})
                except httpx.HTTPError:
                    await asyncio.sleep(0.05)
                    break
                if response.status_code != 429 or time.monotonic() >= stop:
                    break
                await asyncio.sleep(0.02)  # a retry storm: at once, whatever Retry-After says
            else:
                await asyncio.sleep(0.02)


async def drive(url: str, upstream_url: str, duration: float, warmup: float, *, retries: int,
                clients: int) -> dict[str, Any]:
    stop = time.monotonic() + warmup + duration
    tasks = [asyncio.create_task(client(url, tenant, stop, retries=retries))
             for tenant in KEYS for _ in range(clients)]
    await asyncio.sleep(warmup)
    async with httpx.AsyncClient(timeout=10) as http:
        await http.get(upstream_url + "/stats?reset=1")
        await asyncio.sleep(duration)
        stats: dict[str, Any] = (await http.get(upstream_url + "/stats")).json()
    await asyncio.gather(*tasks, return_exceptions=True)
    return stats


def run(workdir: Path, split: list[int], policy: dict[str, Any], *, duration: float, warmup: float,
        retries: int = 0, clients: int = CLIENTS, share: str = "fleet") -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    replicas = len(split)
    stack = Stack(workdir)
    redis, url = start_redis(workdir)
    try:
        up = free_port()
        stack.start("upstream", [sys.executable, __file__, "--upstream", str(up)])
        wait_http(f"http://127.0.0.1:{up}/stats", proc=stack.processes[-1].popen)
        path = workdir / "policy.yaml"
        path.write_text(yaml.safe_dump(policy))
        ports = []
        for i in range(replicas):
            grpc, http_port = free_port(), free_port()
            stack.extproc(path, grpc, http_port, "--store", url, "--store-fleet-size", str(replicas),
                          "--store-share", share, name=f"extproc{i}", env={"PYTHONPATH": str(ROOT)})
            ports.append(grpc)
        listen, admin = free_port(), free_port()
        stack.envoy(envoy_config(listen, admin, up, ports[0], tweak=weighted(ports, split)))
        started = time.monotonic()
        stats = asyncio.run(drive(f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{up}", duration, warmup,
                                  retries=retries, clients=clients))
        stats["wall_s"] = round(time.monotonic() - started, 1)
        stats["envoy"] = envoy_stats(admin)
        return stats
    finally:
        stack.stop()
        redis.kill()
        redis.wait(10)


def envoy_stats(admin: int) -> dict[str, Any]:
    """The rate limit call as Envoy saw it: its latency (ms quantiles) and how calls ended."""
    text = httpx.get(f"http://127.0.0.1:{admin}/stats", timeout=5).text
    out: dict[str, Any] = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if name == "cluster.extproc_ratelimit.upstream_rq_time":
            quantiles = dict(part.strip(")").split("(") for part in value.split() if "(" in part)
            # "interval,cumulative": the whole run's is the second.
            whole = {q: v.split(",")[-1] for q, v in quantiles.items()}
            out["ratelimit_call_ms"] = {q: float(whole[q]) for q in ("P50", "P90", "P99", "P100")
                                        if whole.get(q, "nan") != "nan"}
        elif name.startswith("http.ingress.ratelimit.") or name.endswith(".ratelimit.error") \
                or "failure_mode_allowed" in name:
            out[name.rsplit(".", 1)[-1]] = value
    return out


def shares(stats: dict[str, Any]) -> tuple[list[float], dict[str, Any]]:
    tenants = stats["tenants"]
    total = sum(tenants.get(t, {}).get("predicted_ms", 0.0) for t in KEYS)
    share = [round(tenants.get(t, {}).get("predicted_ms", 0.0) / total, 4) if total else 0.0 for t in KEYS]
    return share, {t: tenants.get(t, {"requests": 0, "predicted_ms": 0.0}) for t in KEYS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=4.0)
    parser.add_argument("--only", choices=["fairness", "retry", "budget"], action="append")
    parser.add_argument("--split", action="append", help="fairness runs of these splits only (e.g. 80/20)")
    parser.add_argument("--out", default=str(RESULTS / "fleet"))
    parser.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.upstream:
        upstream(args.upstream, SERVICE_S)
        return 0
    parts = args.only or ["fairness", "retry", "budget"]
    out = Path(args.out)
    previous = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else {}
    result: dict[str, Any] = {
        "runs": previous.get("runs", []), "retry_ratio_fleet": previous.get("retry_ratio_fleet"),
        "baseline_per_replica": previous.get("baseline_per_replica", []),
        "setup": {"limit": LIMIT, "service_s": SERVICE_S, "clients_per_tenant": CLIENTS, "weights": WEIGHTS,
                  "duration_s": args.duration, "warmup_s": args.warmup, "cpus": os.cpu_count(),
                  "python": platform.python_version(), "tenant_source": "api_key_auth -> x-extproc-client"},
    }
    for key in ("retry", "budget"):
        if key in previous:
            result[key] = previous[key]
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fleet-") as tmp:
        work = Path(tmp)
        if "fairness" in parts:
            result["runs"] = []
            chosen = [s for s in SPLITS if not args.split or "/".join(map(str, s)) in args.split]
            result["baseline_per_replica"] = []
            for split in chosen:
                name = "/".join(map(str, split))
                # The baseline (fair queues per replica, as before they were shared) where it can differ:
                # the uneven splits.
                modes = ["fleet", "replica"] if len(set(split)) > 1 else ["fleet"]
                for mode in modes:
                    stats = run(work / f"fair-{name.replace('/', '-')}-{mode}", split, POLICY,
                                duration=args.duration, warmup=args.warmup, share=mode)
                    share, per = shares(stats)
                    entry = {"replicas": len(split), "split": name, "weights": [WEIGHTS[t] for t in KEYS],
                             "admitted_share": share, "share_error": round(abs(share[0] - 0.75), 4),
                             "admitted": per, "measured_s": round(stats["elapsed"], 1)}
                    entry["envoy"] = stats["envoy"]
                    result["runs" if mode == "fleet" else "baseline_per_replica"].append(entry)
                    print(mode, json.dumps(entry), file=sys.stderr)
        if "retry" in parts:
            retry: dict[str, Any] = {"replicas": 3, "split": "34/33/33", "ratio": RETRY_RATIO,
                                     "min_per_second": 0, "client_retries": 3}
            for label, enabled in (("baseline_no_budget", False), ("budget", True)):
                policy = {**POLICY, "lanes": [{**POLICY["lanes"][0], "max_queued": 3}],
                          "retry_budget": {"enabled": enabled, "ratio": RETRY_RATIO, "min_per_second": 0}}
                stats = run(work / f"retry-{label}", [34, 33, 33], policy, duration=args.duration,
                            warmup=args.warmup, retries=3, clients=RETRY_CLIENTS)
                ratio = stats["retries"] / stats["originals"] if stats["originals"] else None
                retry[label] = {"originals": stats["originals"], "retries": stats["retries"],
                                "ratio": round(ratio, 4) if ratio is not None else None}
                print(label, json.dumps(retry[label]), file=sys.stderr)
            result["retry"] = retry
            result["retry_ratio_fleet"] = retry["budget"]["ratio"]
        if "budget" in parts:
            budget: dict[str, Any] = {"replicas": 3, "split": "34/33/33", "tenant": "acme",
                                      "requests_per_second": BUDGET_RPS, "burst": 1.0}
            policy = {**POLICY, "ratelimit": {"mode": "enforce", "budgets": {"tenants": {
                "acme": {"requests": BUDGET_RPS, "per": "second", "burst": 1.0}}}}}
            for mode in ("fleet", "replica"):
                stats = run(work / f"budget-{mode}", [34, 33, 33], policy, duration=args.duration,
                            warmup=args.warmup, clients=4, share=mode)
                admitted = stats["tenants"].get("acme", {}).get("requests", 0)
                rate = round(admitted / stats["elapsed"], 3)
                if mode == "fleet":
                    budget["admitted_per_second"] = rate
                    budget["error"] = round(rate / BUDGET_RPS - 1, 4)
                    budget["envoy"] = stats["envoy"]
                else:  # the baseline: each replica its own bucket
                    budget["baseline_per_replica_admitted_per_second"] = rate
            result["budget"] = budget
            print(json.dumps(budget), file=sys.stderr)
    result["bench_wall_s"] = round(time.monotonic() - began, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')}", file=sys.stderr)
    return 0


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    if not runs:
        return
    baseline = result.get("baseline_per_replica", [])
    runs = runs + [{**r, "split": r["split"] + " per-replica"} for r in baseline]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels = [f"{r['replicas']}× {r['split']}" for r in runs]
    heavy = [r["admitted_share"][0] for r in runs]
    light = [r["admitted_share"][1] for r in runs]
    ax.bar(labels, heavy, label="acme (weight 3)")
    ax.bar(labels, light, bottom=heavy, label="globex (weight 1)")
    ax.axhline(0.75, color="k", linestyle="--", linewidth=1, label="3:1 → 0.75")
    for lo in (0.70, 0.80):
        ax.axhline(lo, color="grey", linestyle=":", linewidth=1)
    ax.set_ylabel("share of admitted predicted GPU-seconds")
    ratio = result.get("retry_ratio_fleet")
    ax.set_title(f"Tenant shares across replicas (Envoy endpoint weights); fleet retry ratio {ratio}")
    ax.legend(loc="lower right", fontsize=8)
    ax.tick_params(axis="x", labelsize=7, rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())

"""extproc overloaded itself: does it keep deciding at its best rate and refuse the excess at once?

One stack per configuration on loopback, each the shipped Envoy config (``extproc envoy-config``: fail
closed, one worker) in front of the instant upstream (bench/upstream.py), with a policy that admits
everything (limits that never bind, the body read):

* ``extproc``   ``extproc serve`` as shipped (under ``loads``), with its overload protection: it refuses
                 what reaches it too late, and the proxy's overload shed refuses in proportion to those
                 answers before requests reach it (``overloaded_by_extproc``: extproc's own share);
* ``noop``       bench/noop_extproc.py on uvloop's loop, as extproc, asking for the response headers
                 as extproc does (under ``noop``): any Python ext_proc server, for comparison.

For each: ``max_rate``, the most requests a second it admits closed loop (wrk, 16 connections, 10 s),
measured first; a light load (0.25 x max_rate) for the latency of an unloaded stack; then open-loop
load at 2 x and 4 x max_rate (bench/openloop.py: a fixed schedule, a new connection whenever none is
free, latency from each request's scheduled time). Per load: ``admitted_ratio`` (admitted per second /
max_rate; target >= 0.9), ``refusal_p99_ms`` (time to a refusal; target <= 100), ``admitted_added_p99_ms``
(the admitted requests' p99 minus the light load's p99, same stack; target <= 50), the statuses and
reasons, and each process's CPU (the server, Envoy, the load generator, the upstream: at 4 x they
share two cores). Writes bench/results/self_overload.json.

    .venv/bin/python bench/self_overload.py            # ~4 minutes
"""

from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from extproc import localstack  # noqa: E402  (after the path fix, so it runs from a checkout)
from extproc.localstack import free_port, wait_http  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openloop import BODY  # noqa: E402  (the same request as the open-loop runs send)
from overhead import cpu_seconds  # noqa: E402

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
PATH = "/v1/chat/completions"
POLICY = """\
version: 1
lanes:
  - {name: default, max_inflight: 100000, max_queued: 100000, deadline: 30s}
classification: {default_lane: default}
estimation: {read_body: always}
"""
WRK = f"""wrk.method = "POST"
wrk.body = '{BODY.decode()}'
wrk.headers["Content-Type"] = "application/json"
"""
CONFIGS = ("extproc", "noop")
TARGETS = {"admitted_ratio": 0.9, "refusal_p99_ms": 100.0, "admitted_added_p99_ms": 50.0}


def openloop(url: str, rate: float, duration: float, connections: int) -> tuple[dict[str, Any], float]:
    """bench/openloop.py's summary of one run, and its own CPU seconds."""
    proc = subprocess.Popen([sys.executable, str(BENCH / "openloop.py"), url, "--rate", f"{rate:.1f}",
                             "--duration", str(duration), "--connections", str(connections)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=duration + 120)
    if proc.returncode != 0:
        raise RuntimeError(f"openloop failed: {err.decode()[-2000:]}")
    summary: dict[str, Any] = json.loads(out)
    return summary, float(summary.get("cpu_s", 0.0))


def guard_refusals(port: int) -> int:
    """extproc's own 503 overloaded answers so far (its /metrics)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith('extproc_intake_rejections_total{reason="overloaded"}'):
            return int(float(line.split()[-1]))
    return 0


def run_config(key: str, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    policy = workdir / "policy.yaml"
    policy.write_text(POLICY)
    script = workdir / "post.lua"
    script.write_text(WRK)
    with localstack.stack(workdir) as s:
        upstream = free_port()
        up = s.start("upstream", [sys.executable, str(BENCH / "upstream.py"), str(upstream)])
        wait_http(f"http://127.0.0.1:{upstream}/health", proc=up.popen)
        grpc, metrics_port = free_port(), free_port()
        if key == "noop":
            server = s.start("noop", [sys.executable, str(BENCH / "noop_extproc.py"), str(grpc),
                                      "--event-loop", "uvloop", "--response-headers"])
            time.sleep(1.5)
        else:
            server = s.extproc(policy, grpc, metrics_port, "--log-level", "info")
        listen, admin = free_port(), free_port()
        envoy = s.envoy(localstack.envoy_config(listen, admin, upstream, grpc))
        url = f"http://127.0.0.1:{listen}{PATH}"
        pids = {"server": server.popen.pid, "envoy": envoy.popen.pid, "upstream": up.popen.pid}

        def wrk(seconds: int) -> float:
            out = subprocess.run(["wrk", "-t1", "-c16", f"-d{seconds}s", "-s", str(script), url],
                                 capture_output=True, text=True, check=True).stdout
            return float(out.split("Requests/sec:")[1].split()[0])

        wrk(3)  # warm-up
        max_rate = wrk(args.max_seconds)
        loads: dict[str, Any] = {}
        light_p99 = None
        for label, multiple in (("0.25", 0.25), *((m, float(m)) for m in args.loads)):
            time.sleep(2)  # (what the last load left behind drains)
            before = {k: cpu_seconds(p) for k, p in pids.items()}
            guard_before = guard_refusals(metrics_port) if key == "extproc" else 0
            summary, loadgen_cpu = openloop(url, max_rate * multiple, args.seconds, args.connections)
            after = {k: cpu_seconds(p) for k, p in pids.items()}
            guard = guard_refusals(metrics_port) - guard_before if key == "extproc" else None
            cpu = {k: round((after[k] - before[k]) / args.seconds, 3) for k in pids}
            cpu["loadgen"] = round(loadgen_cpu / args.seconds, 3)
            p99 = summary["admitted_ms"]["p99"]
            if label == "0.25":
                light_p99 = p99
            entry = {
                "offered_per_s": round(max_rate * multiple, 1),
                "admitted_ratio": round(summary["admitted_per_s"] / max_rate, 3),
                "refusal_p99_ms": summary["refused_ms"]["p99"],
                "admitted_added_p99_ms": (round(p99 - light_p99, 2)
                                          if p99 is not None and light_p99 is not None else None),
                "admitted_p50_ms": summary["admitted_ms"]["p50"], "admitted_p99_ms": p99,
                "refusal_p50_ms": summary["refused_ms"]["p50"],
                "statuses": summary["statuses"], "reasons": summary["reasons"],
                "cpu_cores": cpu, "connections_opened": summary["connections_opened"],
                # Of the overloaded answers: extproc's own (the request reached it too late), the
                # rest the proxy's overload shed (they never reached extproc).
                "overloaded_by_extproc": guard,
                "errors": summary["errors"],
            }
            loads[label] = entry
            shown = {k: entry[k] for k in ("admitted_ratio", "refusal_p99_ms", "admitted_added_p99_ms",
                                           "statuses")}
            print(f"  {key} {label}x: {json.dumps(shown)}", file=sys.stderr, flush=True)
        return {"max_rate": max_rate, "loads": loads}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--loads", nargs="+", default=["2", "4"])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--max-seconds", type=int, default=10)
    parser.add_argument("--connections", type=int, default=3000)
    parser.add_argument("--out", default=str(RESULTS / "self_overload.json"))
    args = parser.parse_args()
    result: dict[str, Any] = {"command": " ".join(["bench/self_overload.py", *sys.argv[1:]]),
                              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                          "load_avg_at_start": os.getloadavg()},
                              "targets": TARGETS, "commit": subprocess.run(
                                  ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                  check=False).stdout.strip() or None}
    with tempfile.TemporaryDirectory(prefix="extproc-overload-") as tmp:
        for key in args.configs.split(","):
            print(f"config {key}", file=sys.stderr, flush=True)
            got = run_config(key, Path(tmp) / key, args)
            if key == "extproc":
                result["max_rate"] = got["max_rate"]
                result["loads"] = got["loads"]
            else:
                result[key] = got
    extproc_loads = result.get("loads", {})
    result["met"] = {load: {name: (extproc_loads[load][name] is not None and
                                   (extproc_loads[load][name] >= bound if name == "admitted_ratio"
                                    else extproc_loads[load][name] <= bound))
                            for name, bound in TARGETS.items()}
                     for load in args.loads if load in extproc_loads}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["met"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What extproc adds to a request: latency at a moderate fixed rate, and maximum throughput.

Configurations, all behind Envoy (``--concurrency 1``, the shipped ``envoy/envoy.yaml`` with its
ports rewritten) and the same fast upstream (``bench/upstream.py``):

* ``A``     Envoy straight to the upstream (the ext_proc filter removed);
* ``B``     Envoy + ``bench/noop_extproc.py`` (CONTINUE to everything; reads the body like C);
* ``C``     Envoy + ``extproc serve`` with a one-lane policy whose limits never bind and
            ``read_body: always``, so each POST's JSON body is read via ``mode_override``;
* ``B-hdr``/``C-hdr``  the same two without body reading (headers only), fewer repetitions.

Every stack runs side by side for the whole run and the measurements are interleaved
(A, B, C, then the next repetition in a rotated order), so the ratios compare like with like
on a noisy shared machine; the medians over repetitions are reported. Latency comes from wrk
paced to a fixed total rate (a Lua ``delay()`` that hands each request the next slot of a
fixed schedule); throughput from closed-loop wrk. Requests are POSTs of a small chat JSON.

Run: ``.venv/bin/python bench/overhead.py [--duration S] [--rate N] [--quick]``.
Writes ``bench/results/overhead.json`` and (with matplotlib) ``bench/results/overhead.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from extproc import localstack  # noqa: E402  (after the path fix, so it runs from a checkout)

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
PATH = "/v1/chat/completions"
BODY = json.dumps({
    "model": "bench",
    "messages": [{"role": "user", "content": "Say hello in five words."}],
    "max_tokens": 32,
}, separators=(",", ":"))
#: Targets from the issue: what extproc may add over plain Envoy, and what it must keep of a no-op's rate.
TARGET_ADDED_P50_MS = 1.0
TARGET_ADDED_P99_MS = 3.0
TARGET_THROUGHPUT_RATIO = 0.75

POLICY = """\
# Limits that never bind: the benchmark measures the cost of deciding, not of queueing.
version: 1
lanes:
  - name: default
    max_inflight: 10000
    max_queued: 10000
    deadline: 30s
classification:
  default_lane: default
estimation:
  read_body: {read_body}
"""

# wrk's Lua hooks; done() prints one JSON line. The paced runs count non-2xx answers per status in
# response() (it runs in each thread's own Lua state, so done() collects them through setup()'s
# thread handles). Closed-loop runs skip response(): defining it makes wrk hand every response's
# headers and body to Lua, CPU that the 2-core machine would take from Envoy and ext_proc.
LUA_COMMON = r"""
wrk.method = "POST"
wrk.body = [==[@BODY@]==]
wrk.headers["Content-Type"] = "application/json"

local threads = {}
function setup(thread) table.insert(threads, thread) end

function init(args)
  non2xx = 0
  statuses = {}
  bench_init(args)
end

function done(summary, latency, requests)
  local n, codes = 0, {}
  for _, t in ipairs(threads) do
    n = n + t:get("non2xx")
    for k, v in pairs(t:get("statuses")) do codes[k] = (codes[k] or 0) + v end
  end
  if not counting then
    -- No response() hook: wrk's own count of answers >= 400 (the upstream sends no 1xx/3xx).
    n = summary.errors.status
  end
  local parts = {}
  for k, v in pairs(codes) do table.insert(parts, string.format('"%s":%d', k, v)) end
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"non2xx":%d,"statuses":{%s},' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
    '"latency_us":{"min":%d,"mean":%.1f,"max":%d,"p50":%d,"p90":%d,"p99":%d,"p999":%d}}\n',
    summary.requests, summary.duration, n, table.concat(parts, ","),
    e.connect, e.read, e.write, e.status, e.timeout,
    latency.min, latency.mean, latency.max, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency:percentile(99.9)))
end
"""

# Pacing: one schedule per wrk thread, one slot every 1/rate s; each request waits for the next
# free slot. Spare connections keep it open-loop while latency stays far below the slot spacing.
# wrk timers are whole milliseconds and Lua has no wall clock, hence clock_gettime via LuaJIT's ffi.
LUA_PACED = r"""
local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_nsec; } bench_timespec;
int clock_gettime(int clk, bench_timespec *tp);
]]
local ts = ffi.new("bench_timespec")
local function now_ms()
  ffi.C.clock_gettime(1, ts)  -- CLOCK_MONOTONIC
  return tonumber(ts.tv_sec) * 1000 + tonumber(ts.tv_nsec) / 1e6
end

local interval, next_at
function bench_init(args)
  interval = 1000 / (tonumber(args[1]) / tonumber(args[2]))
end

counting = true
function response(status, headers, body)
  if status < 200 or status > 299 then
    non2xx = non2xx + 1
    local k = tostring(status)
    statuses[k] = (statuses[k] or 0) + 1
  end
end

function delay()
  local t = now_ms()
  if next_at == nil then next_at = t end
  local slot = next_at
  next_at = next_at + interval
  if slot <= t then return 0 end
  return math.floor(slot - t + 0.5)
end
"""

LUA_CLOSED = "counting = false\nfunction bench_init(args) end\n"


@dataclass
class Config:
    key: str
    description: str
    listen: int
    #: Processes whose CPU time is charged to this configuration: role (envoy, ext_proc, upstream) → pid.
    pids: dict[str, int] = field(default_factory=dict)
    #: extproc's /metrics, to confirm afterwards that its traffic was admitted.
    metrics_url: str | None = None
    rate_runs: list[dict[str, Any]] = field(default_factory=list)
    throughput_runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen}{PATH}"


@dataclass
class Params:
    rate: int
    duration: int
    throughput_duration: int
    reps: int
    header_reps: int
    paced_connections: int
    throughput_connections: int
    throughput_threads: int
    warmup: int
    extproc_log_level: str

    def planned_seconds(self, n_main: int, n_hdr: int) -> float:
        per_run = self.duration + self.throughput_duration
        return (n_main * self.reps + n_hdr * self.header_reps) * per_run + (n_main + n_hdr) * self.warmup


# ---------------------------------------------------------------------------------------------
# Processes


def _wait_tcp(port: int, proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """A gRPC server with no HTTP side is ready when its port accepts connections."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} not open after {timeout}s")


def _failed(process: localstack.Process, exc: Exception) -> RuntimeError:
    return RuntimeError(f"{process.name} did not start: {exc}\n{process.output()[-3000:]}")


def _wait_tcp_started(process: localstack.Process, port: int) -> None:
    try:
        _wait_tcp(port, process.popen)
    except (RuntimeError, TimeoutError) as exc:
        raise _failed(process, exc) from None


def start_stacks(s: localstack.Stack, workdir: Path, params: Params, headers_only: bool) -> list[Config]:
    upstream_port = localstack.free_port()
    up = s.start("upstream", [sys.executable, str(BENCH / "upstream.py"), str(upstream_port)])
    try:
        localstack.wait_http(f"http://127.0.0.1:{upstream_port}/health", proc=up.popen)
    except (RuntimeError, TimeoutError) as exc:
        raise _failed(up, exc) from None

    variants = [("B", "C", "auto", "always", "body read via mode_override")]
    if headers_only:
        variants.append(("B-hdr", "C-hdr", "never", "never", "headers only"))

    configs = [Config("A", "Envoy -> upstream (no ext_proc)", localstack.free_port())]
    for b_key, c_key, noop_body, read_body, what in variants:
        noop_port = localstack.free_port()
        noop = s.start(f"noop-{b_key}", [sys.executable, str(BENCH / "noop_extproc.py"), str(noop_port),
                                          "--body", noop_body])
        _wait_tcp_started(noop, noop_port)
        configs.append(Config(b_key, f"Envoy + no-op ext_proc ({what})", localstack.free_port(),
                              {"ext_proc": noop.popen.pid}))

        policy = workdir / f"policy-{c_key}.yaml"
        policy.write_text(POLICY.format(read_body=read_body))
        grpc_port, http_port = localstack.free_port(), localstack.free_port()
        real = s.extproc(policy, grpc_port, http_port, "--log-level", params.extproc_log_level,
                         name=f"extproc-{c_key}")
        configs.append(Config(c_key, f"Envoy + extproc serve, limits never bind ({what})",
                              localstack.free_port(), {"ext_proc": real.popen.pid},
                              metrics_url=f"http://127.0.0.1:{http_port}/metrics"))

        for cfg, port in ((configs[-2], noop_port), (configs[-1], grpc_port)):
            envoy_cfg = localstack.envoy_config(cfg.listen, localstack.free_port(), upstream_port, port)
            cfg.pids["envoy"] = s.envoy(envoy_cfg, name=f"envoy-{cfg.key}").popen.pid

    envoy_cfg = localstack.envoy_config(configs[0].listen, localstack.free_port(), upstream_port, None)
    configs[0].pids["envoy"] = s.envoy(envoy_cfg, name="envoy-A").popen.pid
    for cfg in configs:
        cfg.pids["upstream"] = up.popen.pid
    return configs


def check_path(cfg: Config) -> None:
    """One request through each stack before measuring: a broken stack must fail loudly, not as 0 req/s."""
    request = urllib.request.Request(cfg.url, data=BODY.encode(), method="POST",
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        if response.status != 200:
            raise RuntimeError(f"{cfg.key}: sanity request answered {response.status}")
        json.loads(response.read())


def machine_cpu() -> tuple[int, int, int]:
    """(total, idle incl. iowait, steal) jiffies of the whole machine, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    steal = values[7] if len(values) > 7 else 0
    return sum(values[:8]), values[3] + values[4], steal


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (from /proc; 0 where unavailable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------
# Load generation


def wrk(cfg: Config, script: Path, *, duration: int, connections: int, threads: int,
        args: list[str]) -> dict[str, Any]:
    argv = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{duration:g}s", "--timeout", "2s",
            "-s", str(script), cfg.url, "--", *args]
    cpu_before, machine_before = {k: cpu_seconds(p) for k, p in cfg.pids.items()}, machine_cpu()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 30, check=False)
    cpu_after, machine_after = {k: cpu_seconds(p) for k, p in cfg.pids.items()}, machine_cpu()
    line = next((x for x in proc.stdout.splitlines() if x.startswith("WRKJSON ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({proc.returncode}) on {cfg.key}:\n{proc.stdout}\n{proc.stderr}")
    result: dict[str, Any] = json.loads(line.removeprefix("WRKJSON "))
    seconds = result["duration_us"] / 1e6
    result["req_per_s"] = round(result["requests"] / seconds, 1)
    result["latency_ms"] = {k: round(v / 1000, 3) for k, v in result.pop("latency_us").items()}
    requests = max(result["requests"], 1)
    # CPU per request of each process: shows where the time goes.
    result["cpu_us_per_request"] = {k: round((cpu_after[k] - cpu_before[k]) / requests * 1e6, 1)
                                    for k in cfg.pids}
    # Whole-machine busy and steal shares: a run where neighbours took the CPU shows here.
    total, idle, steal = (a - b for a, b in zip(machine_after, machine_before, strict=True))
    result["machine_busy"] = round(1 - idle / max(total, 1), 3)
    result["machine_steal"] = round(steal / max(total, 1), 3)
    return result


def rate_run(cfg: Config, script: Path, p: Params) -> dict[str, Any]:
    return wrk(cfg, script, duration=p.duration, connections=p.paced_connections, threads=1,
               args=[str(p.rate), "1"])


def throughput_run(cfg: Config, script: Path, p: Params) -> dict[str, Any]:
    return wrk(cfg, script, duration=p.throughput_duration, connections=p.throughput_connections,
               threads=p.throughput_threads, args=[])


# ---------------------------------------------------------------------------------------------
# Results


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def _median_cpu(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per process, the median over runs of CPU µs per request."""
    return {k: _median([r["cpu_us_per_request"][k] for r in runs]) for k in runs[0]["cpu_us_per_request"]}


def summarize(cfg: Config) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if cfg.rate_runs:
        out["latency_ms"] = {q: _median([r["latency_ms"][q] for r in cfg.rate_runs])
                             for q in ("p50", "p90", "p99", "max")}
        out["achieved_rate"] = _median([r["req_per_s"] for r in cfg.rate_runs])
        out["rate_non2xx"] = sum(r["non2xx"] for r in cfg.rate_runs)
        out["rate_socket_errors"] = sum(
            sum(v for k, v in r["errors"].items() if k != "status") for r in cfg.rate_runs)
        out["rate_cpu_us_per_request"] = _median_cpu(cfg.rate_runs)
        out["rate_machine_busy"] = _median([r["machine_busy"] for r in cfg.rate_runs])
    if cfg.throughput_runs:
        out["req_per_s"] = _median([r["req_per_s"] for r in cfg.throughput_runs])
        out["throughput_non2xx"] = sum(r["non2xx"] for r in cfg.throughput_runs)
        out["throughput_socket_errors"] = sum(
            sum(v for k, v in r["errors"].items() if k != "status") for r in cfg.throughput_runs)
        out["throughput_latency_ms"] = {q: _median([r["latency_ms"][q] for r in cfg.throughput_runs])
                                        for q in ("p50", "p99")}
        out["throughput_cpu_us_per_request"] = _median_cpu(cfg.throughput_runs)
    return out


def compare(summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    added: dict[str, dict[str, float]] = {}
    ratios: dict[str, float] = {}
    targets: dict[str, Any] = {}
    a = summary["A"]
    for b_key, c_key in (("B", "C"), ("B-hdr", "C-hdr")):
        if c_key not in summary:
            continue
        b, c = summary[b_key], summary[c_key]
        for name, x, y in ((f"{b_key}-A", b, a), (f"{c_key}-A", c, a), (f"{c_key}-{b_key}", c, b)):
            added[name] = {q: round(x["latency_ms"][q] - y["latency_ms"][q], 3)
                           for q in ("p50", "p90", "p99")}
        for name, x, y in ((f"{c_key}/{b_key}", c, b), (f"{c_key}/A", c, a), (f"{b_key}/A", b, a)):
            ratios[name] = round(x["req_per_s"] / y["req_per_s"], 3)
        targets[c_key] = {
            "added_p50_ms": added[f"{c_key}-A"]["p50"],
            "added_p50_met": added[f"{c_key}-A"]["p50"] <= TARGET_ADDED_P50_MS,
            "added_p99_ms": added[f"{c_key}-A"]["p99"],
            "added_p99_met": added[f"{c_key}-A"]["p99"] <= TARGET_ADDED_P99_MS,
            "throughput_ratio_vs_noop": ratios[f"{c_key}/{b_key}"],
            "throughput_ratio_met": ratios[f"{c_key}/{b_key}"] >= TARGET_THROUGHPUT_RATIO,
            "rate_non2xx_zero": c["rate_non2xx"] == 0,
        }
    return {"added_latency_ms": added, "throughput_ratios": ratios, "targets": targets}


def extproc_decisions(cfg: Config) -> dict[str, float]:
    """extproc's own count of decisions: proof that C's traffic really went through it, all admitted."""
    if cfg.metrics_url is None:
        return {}
    with urllib.request.urlopen(cfg.metrics_url, timeout=5) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for match in re.finditer(r'^inference_admission_decisions_total\{([^}]*)\} (\S+)$', text, re.M):
        outcome = re.search(r'outcome="([^"]*)"', match.group(1))
        if outcome:
            out[outcome.group(1)] = out.get(outcome.group(1), 0.0) + float(match.group(2))
    return out


def machine_info() -> dict[str, Any]:
    def version(argv: list[str]) -> str:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
            return (proc.stdout + proc.stderr).strip().splitlines()[0 if argv[0] == "wrk" else -1].strip()
        return "unknown"

    cpu = "unknown"
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "unknown")
    import grpc  # local: only for its version

    # What the machine was already doing before anything was started (others share it).
    before = machine_cpu()
    time.sleep(1)
    total, idle, steal = (a - b for a, b in zip(machine_cpu(), before, strict=True))
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "envoy": version([localstack.envoy_binary(), "--version"]),
        "wrk": version(["wrk", "-v"]),
        "loadavg_start": list(os.getloadavg()),
        "background_busy": round(1 - idle / max(total, 1), 3),
        "background_steal": round(steal / max(total, 1), 3),
    }


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    summary = result["summary"]
    keys = list(summary)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.27
    for i, q in enumerate(("p50", "p90", "p99")):
        values = [summary[k]["latency_ms"][q] for k in keys]
        bars = left.bar([x + (i - 1) * width for x in range(len(keys))], values, width, label=q)
        left.bar_label(bars, fmt="%.2f", fontsize=7)
    left.set_xticks(range(len(keys)), keys)
    left.set_ylabel("latency (ms)")
    params = result["parameters"]
    runs = f"median of {params['reps']} runs" + (
        f"; -hdr: {params['header_reps']}" if params["header_reps"] != params["reps"] else "")
    left.set_title(f"latency at {params['rate']} req/s ({runs})")
    left.legend()
    values = [summary[k]["req_per_s"] for k in keys]
    bars = right.bar(keys, values, color="tab:gray")
    right.bar_label(bars, fmt="%.0f", fontsize=8)
    right.set_ylabel("req/s")
    ratios = result["throughput_ratios"]
    note = ", ".join(f"{k} = {v:.2f}" for k, v in ratios.items() if "/A" not in k or k.startswith("C"))
    right.set_title(f"closed-loop throughput, {result['parameters']['throughput_connections']} connections\n"
                    f"{note}", fontsize=9)
    machine = result["machine"]
    fig.suptitle(f"extproc overhead — {machine['nproc']} cores, envoy --concurrency 1, {machine['date']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def print_table(result: dict[str, Any]) -> None:
    summary = result["summary"]
    print(f"\n{'config':7} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} {'rate':>6} {'non2xx':>6} "
          f"{'req/s':>8} {'non2xx':>6}   description")
    for key, s in summary.items():
        lat = s["latency_ms"]
        print(f"{key:7} {lat['p50']:7.2f} {lat['p90']:7.2f} {lat['p99']:7.2f} {s['achieved_rate']:6.0f} "
              f"{s['rate_non2xx']:6d} {s['req_per_s']:8.0f} {s['throughput_non2xx']:6d}   "
              f"{result['descriptions'][key]}")
    print("\nCPU µs per request, closed loop: " + "; ".join(
        f"{key} " + " ".join(f"{k} {v:.0f}" for k, v in s["throughput_cpu_us_per_request"].items())
        for key, s in summary.items()))
    print("\nadded latency (ms):")
    for name, d in result["added_latency_ms"].items():
        print(f"  {name:12} p50 {d['p50']:+.2f}  p90 {d['p90']:+.2f}  p99 {d['p99']:+.2f}")
    print("throughput ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in result["throughput_ratios"].items()))
    for key, t in result["targets"].items():
        def mark(ok: bool) -> str:
            return "met" if ok else "NOT met"
        print(f"targets {key}: added p50 {t['added_p50_ms']:.2f} ms ≤ {TARGET_ADDED_P50_MS} "
              f"{mark(t['added_p50_met'])}; added p99 {t['added_p99_ms']:.2f} ms ≤ {TARGET_ADDED_P99_MS} "
              f"{mark(t['added_p99_met'])}; throughput/no-op {t['throughput_ratio_vs_noop']:.2f} ≥ "
              f"{TARGET_THROUGHPUT_RATIO} {mark(t['throughput_ratio_met'])}")


# ---------------------------------------------------------------------------------------------


def _interleaved(keys: list[str], reps: int) -> Iterator[tuple[int, str]]:
    """A, B, C, then B, C, A, …: each configuration takes each position, so drift in the machine's
    load does not always favour the same one."""
    for rep in range(reps):
        shift = rep % len(keys)
        for key in keys[shift:] + keys[:shift]:
            yield rep, key


def run(params: Params, headers_only: bool, out_dir: Path, keep: bool) -> dict[str, Any]:
    for tool in ("wrk",):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found (apt-get install {tool})")
    started = time.monotonic()
    machine = machine_info()
    n_hdr = 2 if headers_only else 0
    print(f"planned measuring time ≈ {params.planned_seconds(3, n_hdr):.0f} s; background CPU busy "
          f"{machine['background_busy']:.0%} before start", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="extproc-bench-"))
    paced, closed = workdir / "paced.lua", workdir / "closed.lua"
    common = LUA_COMMON.replace("@BODY@", BODY)
    paced.write_text(LUA_PACED + common)
    closed.write_text(LUA_CLOSED + common)
    try:
        with localstack.stack(workdir) as s:
            configs = {c.key: c for c in start_stacks(s, workdir, params, headers_only)}
            for cfg in configs.values():
                check_path(cfg)
                # Warm-up: gRPC connections, Python's first-call paths, Envoy's connection pools.
                wrk(cfg, closed, duration=params.warmup, connections=8, threads=1, args=[])
            main_keys = ["A", "B", "C"]
            hdr_keys = ["B-hdr", "C-hdr"] if headers_only else []
            plan = list(_interleaved(main_keys, params.reps))
            plan += [(rep, k) for rep, k in _interleaved(hdr_keys, params.header_reps)] if hdr_keys else []
            order: dict[str, list[str]] = {"rate": [], "throughput": []}
            for phase, runner in (("rate", rate_run), ("throughput", throughput_run)):
                script = paced if phase == "rate" else closed
                for rep, key in plan:
                    cfg = configs[key]
                    r = runner(cfg, script, params)
                    r["rep"] = rep
                    (cfg.rate_runs if phase == "rate" else cfg.throughput_runs).append(r)
                    order[phase].append(key)
                    lat = r["latency_ms"]
                    print(f"  {phase:10} {key:6} rep {rep}: {r['req_per_s']:7.0f} req/s  p50 {lat['p50']:.2f}"
                          f"  p99 {lat['p99']:.2f} ms  non2xx {r['non2xx']}  machine busy "
                          f"{r['machine_busy']:.0%} steal {r['machine_steal']:.0%}", flush=True)
            decisions = {k: extproc_decisions(c) for k, c in configs.items() if k.startswith("C")}
            if keep:
                print(f"logs kept in {workdir}")
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)

    summary = {k: summarize(c) for k, c in configs.items()}
    result: dict[str, Any] = {
        "benchmark": "overhead",
        "machine": {**machine, "loadavg_end": list(os.getloadavg())},
        "parameters": {
            **params.__dict__,
            "method": "POST", "path": PATH, "body_bytes": len(BODY), "envoy_concurrency": 1,
            "latency_tool": "wrk, Lua delay() pacing to a fixed schedule (one thread)",
            "throughput_tool": "wrk closed loop",
            "order": order,
            "policy": POLICY,
        },
        "descriptions": {k: c.description for k, c in configs.items()},
        "summary": summary,
        **compare(summary),
        "extproc_decisions": decisions,
        "raw": {k: {"rate_runs": c.rate_runs, "throughput_runs": c.throughput_runs}
                for k, c in configs.items()},
        "notes": [
            "latency_ms are medians over repetitions of each run's wrk percentile",
            "cpu_us_per_request: CPU time per request of each process (10 ms clock-tick resolution)",
            "wrk's delay() pacing is not coordinated-omission corrected: a stall delays sends",
        ],
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    if not plot(result, out_dir / "overhead.png"):
        print("matplotlib not installed: no PNG (.venv/bin/pip install matplotlib)")
    return result


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description="extproc's added latency and throughput cost behind Envoy")
    # Defaults fit the whole run (8 fixed-rate + 8 closed-loop runs, start-up) in under 3 minutes.
    parser.add_argument("--duration", type=int, default=12.0, help="seconds per fixed-rate run (12)")
    parser.add_argument("--throughput-duration", type=int, default=7.0,
                        help="seconds per closed-loop run (7)")
    parser.add_argument("--rate", type=int, default=200, help="total req/s of the fixed-rate runs (200)")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of A, B, C (2)")
    parser.add_argument("--header-reps", type=int, default=1,
                        help="repetitions of the headers-only pair B-hdr, C-hdr (1; 0 skips them)")
    parser.add_argument("--connections", type=int, default=32, help="closed-loop connections (32)")
    parser.add_argument("--extproc-log-level", default="info",
                        help="extproc's log level (info: one decision line per request, as deployed)")
    parser.add_argument("--quick", action="store_true", help="short smoke run (≈ 30 s)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="output directory (bench/results)")
    parser.add_argument("--keep", action="store_true", help="keep the process logs (printed path)")
    args = parser.parse_args()
    params = Params(rate=args.rate, duration=args.duration, throughput_duration=args.throughput_duration,
                    reps=args.reps, header_reps=args.header_reps, paced_connections=16,
                    throughput_connections=args.connections, throughput_threads=1, warmup=1,
                    extproc_log_level=args.extproc_log_level)
    if args.quick:
        params.duration, params.throughput_duration, params.reps, params.header_reps = 3, 2, 1, 1
    # SIGTERM must unwind like Ctrl-C so the stack's finally stops every process.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = run(params, params.header_reps > 0, args.out, args.keep)
    except KeyboardInterrupt:
        raise SystemExit("interrupted; all processes stopped") from None
    print_table(result)
    print(f"\nwrote {args.out / 'overhead.json'} (elapsed {result['elapsed_s']} s)")


if __name__ == "__main__":
    main()

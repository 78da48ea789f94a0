"""What extproc adds to a request: latency at two fixed rates, maximum throughput, CPU per request.

Configurations, all behind one Envoy each (``--concurrency 1``, the shipped ``envoy/envoy.yaml``
with its ports rewritten) and the same fast upstream (``bench/upstream.py``):

* ``envoy``        Envoy straight to the upstream (everything that talks to extproc removed);
* ``noop``         Envoy + ``bench/noop_extproc.py`` (CONTINUE to everything, reads the body like
                   extproc, sets ``x-extproc-lane`` so the admission gate passes it), the
                   ratelimit filter removed: the cost of any Python ext_proc server; on the event
                   loop extproc serve runs on (uvloop's);
* ``noop_response`` the no-op asking for the response headers too (``--response-headers``): the
                   message per request extproc asks for beyond the no-op's (their status says which
                   service times to learn from; they carry the edge's x-ratelimit-* headers);
* ``extproc_only`` Envoy + ``extproc serve``, ext_proc only: no edge (the ratelimit filter removed,
                   the edge not judged in ext_proc either);
* ``extproc_edge_call``  the edge as a rate limit call of its own (``extproc envoy-config --edge
                   call``: the ratelimit filter asks extproc's rate limit service, then ext_proc),
                   the shipped config before the edge moved into the ext_proc headers phase;
* ``extproc_edge`` Envoy + ``extproc serve`` with the shipped config: the edge judged in the
                   ext_proc headers phase (``x-extproc-edge``), then ext_proc's decision;
* ``extproc_edge_sampled``  the same with the response headers asked for on one admitted request in 8
                   (``extproc serve --response-sample 8``; the edge's x-ratelimit-* of the others from
                   the route configuration): against the bare no-op, which asks for no response
                   headers either (``extproc_edge`` stays like for like with ``noop_response``);
* ``extproc_edge_redis``  the same with ``--store redis://127.0.0.1:PORT/0`` (a ``redis-server``
                   this script starts on a free port, no persistence);
* ``replicas_2``, ``replicas_3``  2 and 3 ``extproc serve`` replicas sharing that Redis behind one
                   Envoy whose ``extproc`` and ``extproc_ratelimit`` clusters list every replica
                   (round robin, equal weights).

extproc runs a one-lane policy whose limits never bind, with ``read_body: always`` (each POST's
small JSON body is read through ``mode_override``), logging at ``info`` (one decision line per
request, as deployed). Every stack runs side by side for the whole run and the measurements are
interleaved: each repetition runs every configuration paced at each rate (default 200 and 500
req/s), then closed loop, in an order rotated from one repetition to the next, so drift in the
shared machine's load does not always favour the same configuration. Medians over repetitions are
reported, and every "added" figure is against Envoy alone from the same run. Latency comes from
wrk paced to a fixed total rate (a Lua ``delay()`` that hands each request the next slot of a
fixed schedule); throughput from closed-loop wrk. A bare Redis PING p99 (redis-py's asyncio client
with hiredis, as the ledger talks to Redis, one PING every 2 ms from this script on loopback) is
measured in every repetition too.

CPU per request (``cpu_us_per_request``): user + system CPU (``/proc/PID/stat``) of Envoy, of
every ``extproc serve`` replica and of the no-op server where present, summed over the paced runs
of a repetition (both rates) and divided by the requests those runs completed; median over
repetitions. Not counted there: the upstream, wrk, this script, and redis-server (reported
apart, under ``cpu_detail``).

Run (full, about 10 minutes on 2 cores; stops by itself, ``--time-limit`` bounds it)::

    PYTHONPATH=. .venv/bin/python bench/overhead.py

``--quick`` is a smoke run (1 repetition, short runs, ≈ 1.5 min); ``--dry-run`` starts nothing and
checks the shape of the figures and ``targets`` computed from made-up runs; ``--configs a,b,...`` picks
configurations (Envoy alone is always run: every figure is relative to it); ``--rates 200,500``,
``--duration S``, ``--throughput-duration S``, ``--reps N``, ``--keep`` (keep process logs).
Writes ``bench/results/overhead.json`` and (with matplotlib) ``bench/results/overhead.png``.
Every process it starts (Envoys, extproc replicas, the no-op, the upstream, redis-server) is
stopped when it ends, fails, or gets SIGINT/SIGTERM/SIGHUP.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.util
import json
import math
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from extproc import bootstrap, localstack  # noqa: E402  (after the path fix, so it runs from a checkout)

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
PATH = "/v1/chat/completions"
BODY = json.dumps({
    "model": "bench",
    "messages": [{"role": "user", "content": "Say hello in five words."}],
    "max_tokens": 32,
}, separators=(",", ":"))

#: ``extproc_edge_sampled``: the response headers of one admitted request in this many.
RESPONSE_SAMPLE = 8
#: Configurations, in the order they are reported.
CONFIGS = ("envoy", "noop", "noop_response", "extproc_only", "extproc_edge_call", "extproc_edge",
           "extproc_edge_sampled", "extproc_edge_redis", "replicas_2", "replicas_3")
DESCRIPTIONS = {
    "envoy": "Envoy -> upstream (no ext_proc, no ratelimit filter)",
    "noop": "Envoy + no-op Python ext_proc (body read), ratelimit filter removed",
    "noop_response": "as noop, asking for the response headers too (one message more per request)",
    "extproc_only": "Envoy + extproc serve, ext_proc only (no edge)",
    "extproc_edge_call": "Envoy + extproc serve, the edge by a rate limit call (--edge call) + ext_proc, "
                         "memory store",
    "extproc_edge": "Envoy + extproc serve, shipped config (the edge in the ext_proc headers phase), "
                    "memory store",
    "extproc_edge_sampled": "as extproc_edge, the response headers asked for on one request in "
                            f"{RESPONSE_SAMPLE} (--response-sample {RESPONSE_SAMPLE})",
    "extproc_edge_redis": "as extproc_edge, with --store redis://",
    "replicas_2": "2 extproc replicas sharing Redis behind one Envoy (round robin)",
    "replicas_3": "3 extproc replicas sharing Redis behind one Envoy (round robin)",
}
REDIS_CONFIGS = ("extproc_edge_redis", "replicas_2", "replicas_3")
#: Processes whose CPU counts in cpu_us_per_request (by name prefix); the others are reported apart.
COUNTED = ("envoy", "extproc", "noop")

#: Targets (issue #31), each against a baseline from the same run, like for like: extproc as shipped
#: against the no-op that asks for the same messages (``noop_response``); with the response message
#: sampled (``extproc_edge_sampled``, when that configuration runs) against the bare no-op.
TARGET_CPU_VS_NOOP_RESPONSE = 1.10
TARGET_THROUGHPUT_VS_NOOP_RESPONSE = 0.70
TARGET_ADDED_P50_VS_NOOP_RESPONSE = 1.25
TARGET_ADDED_P99_VS_NOOP_RESPONSE = 1.5
TARGET_REPLICA_EFFICIENCY = 0.8
TARGET_SAMPLED_CPU_VS_NOOP = 1.2
TARGET_SAMPLED_THROUGHPUT_VS_NOOP = 0.6
TARGET_REDIS_SLACK_MS = 0.3
#: What each target compares (``targets`` in overhead.json: name → value, bound, met).
TARGETS = {
    "cpu": f"cpu_us_per_request extproc_edge / noop_response <= {TARGET_CPU_VS_NOOP_RESPONSE}",
    "throughput": "throughput_req_per_s extproc_edge / noop_response >= "
                  f"{TARGET_THROUGHPUT_VS_NOOP_RESPONSE}",
    "p50_500": f"added_ms_500 p50 extproc_edge / noop_response <= {TARGET_ADDED_P50_VS_NOOP_RESPONSE}",
    "p99_500": f"added_ms_500 p99 extproc_edge / noop_response <= {TARGET_ADDED_P99_VS_NOOP_RESPONSE}",
    "replicas_3": "replica_efficiency with 3 replicas (median of the repetitions) >= "
                  f"{TARGET_REPLICA_EFFICIENCY}",
    "sampled_cpu": f"cpu_us_per_request extproc_edge_sampled / noop <= {TARGET_SAMPLED_CPU_VS_NOOP}",
    "sampled_throughput": "throughput_req_per_s extproc_edge_sampled / noop >= "
                          f"{TARGET_SAMPLED_THROUGHPUT_VS_NOOP}",
    "redis_p99": f"redis_added_p99_ms <= redis_ping_p99_ms + {TARGET_REDIS_SLACK_MS}",
}

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
  read_body: always
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
    listen: int
    envoy_admin: int
    #: Processes whose CPU is measured during this configuration's runs: name → pid.
    pids: dict[str, int] = field(default_factory=dict)
    #: Each extproc replica's /metrics, to confirm afterwards that its traffic was admitted.
    metrics_urls: list[str] = field(default_factory=list)
    #: rate ("200", "500") → runs; "closed" → closed-loop runs.
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen}{PATH}"


@dataclass
class Params:
    rates: list[int]
    duration: int
    throughput_duration: int
    reps: int
    throughput_connections: int
    warmup: int
    pings: int
    #: Seconds of no traffic at the start, to measure what the idle stacks burn (they run side by side).
    idle: int
    extproc_log_level: str
    time_limit: float

    def paced_connections(self, rate: int) -> int:
        # Spare connections keep the pacing open loop while latency stays far below the schedule.
        return max(16, math.ceil(rate / 15))

    def planned_seconds(self, n_configs: int) -> float:
        per_rep = n_configs * (len(self.rates) * self.duration + self.throughput_duration)
        return self.reps * (per_rep + self.pings * 0.002) + n_configs * self.warmup + self.idle


# ---------------------------------------------------------------------------------------------
# Envoy bootstraps: the shipped file with its addresses rewritten, then these tweaks.


def without_ratelimit(config: dict[str, Any]) -> None:
    """No ratelimit filter (the edge): ext_proc alone talks to the server."""
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != bootstrap.RATELIMIT_FILTER]
    for vhost in hcm["route_config"]["virtual_hosts"]:
        for route in vhost["routes"]:
            route.get("typed_per_filter_config", {}).pop(bootstrap.RATELIMIT_FILTER, None)
    config["static_resources"]["clusters"] = [
        c for c in config["static_resources"]["clusters"] if c["name"] != "extproc_ratelimit"]


def replicas(ports: list[int]) -> Callable[[dict[str, Any]], None]:
    """Both extproc clusters list every replica: round robin, equal weights."""
    def tweak(config: dict[str, Any]) -> None:
        for cluster in config["static_resources"]["clusters"]:
            if cluster["name"] in bootstrap.EXTPROC_CLUSTERS:
                cluster["lb_policy"] = "ROUND_ROBIN"
                cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}},
                     "load_balancing_weight": 1} for p in ports]}]
    return tweak


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


#: Subprocesses run this checkout's code, whatever the caller's PYTHONPATH says.
ENV = {"PYTHONPATH": str(ROOT)}
#: The no-op servers' event loop: uvloop's, as ``extproc serve --event-loop auto`` (asyncio's where
#: uvloop is not installed, as there).
NOOP_LOOP = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def start_redis(s: localstack.Stack, workdir: Path) -> tuple[str, int]:
    import redis  # local: only the Redis configurations need it

    port = localstack.free_port()
    proc = s.start("redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)])
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis(port=port, socket_timeout=1).ping()
            return f"redis://127.0.0.1:{port}/0", proc.popen.pid
        except redis.ConnectionError as exc:
            if proc.popen.poll() is not None or time.monotonic() > deadline:
                raise _failed(proc, exc) from None
            time.sleep(0.05)


def serve_flags(key: str, log_level: str) -> list[str]:
    """``extproc serve``'s flags in configuration ``key`` (the store's apart). Spelled out, so that the
    environment (EXTPROC_EVENT_LOOP, EXTPROC_RESPONSE_SAMPLE) cannot move extproc off the loop the
    no-ops run on, nor change which response headers it asks for."""
    sample = RESPONSE_SAMPLE if key == "extproc_edge_sampled" else 1
    return ["--log-level", log_level, "--event-loop", "auto", "--response-sample", str(sample)]


def start_stacks(s: localstack.Stack, workdir: Path, params: Params,
                 keys: list[str]) -> tuple[dict[str, Config], str | None]:
    """Every configuration's processes, side by side; and the Redis URL (None without Redis)."""
    upstream_port = localstack.free_port()
    up = s.start("upstream", [sys.executable, str(BENCH / "upstream.py"), str(upstream_port)], env=ENV)
    try:
        localstack.wait_http(f"http://127.0.0.1:{upstream_port}/health", proc=up.popen)
    except (RuntimeError, TimeoutError) as exc:
        raise _failed(up, exc) from None
    policy = workdir / "policy.yaml"
    policy.write_text(POLICY)
    redis_url, redis_pid = start_redis(s, workdir) if any(k in REDIS_CONFIGS for k in keys) else ("", 0)

    configs: dict[str, Config] = {}
    for key in keys:
        cfg = Config(key, localstack.free_port(), localstack.free_port())
        cfg.pids["upstream"] = up.popen.pid
        tweak: Callable[[dict[str, Any]], None] | None = None
        target: int | None = None
        if key in ("noop", "noop_response"):
            target = localstack.free_port()
            flags = ["--body", "auto", *(["--response-headers"] if key == "noop_response" else []),
                     # The event loop extproc serve runs on by default: like for like.
                     "--event-loop", NOOP_LOOP]
            script = str(BENCH / "noop_extproc.py")
            noop = s.start(key, [sys.executable, script, str(target), *flags], env=ENV)
            _wait_tcp_started(noop, target)
            cfg.pids["noop"] = noop.popen.pid
            tweak = without_ratelimit
        elif key != "envoy":
            n = int(key.split("_")[1]) if key.startswith("replicas_") else 1
            extra = serve_flags(key, params.extproc_log_level)
            if key in REDIS_CONFIGS:
                extra += ["--store", redis_url, "--store-prefix", f"bench-{key}",
                          "--store-fleet-size", str(n)]
                cfg.pids["redis"] = redis_pid
            ports = []
            for i in range(n):
                grpc_port, http_port = localstack.free_port(), localstack.free_port()
                proc = s.extproc(policy, grpc_port, http_port, *extra, name=f"extproc-{key}-{i + 1}", env=ENV)
                cfg.pids[f"extproc-{i + 1}"] = proc.popen.pid
                cfg.metrics_urls.append(f"http://127.0.0.1:{http_port}/metrics")
                ports.append(grpc_port)
            target = ports[0]
            if key == "extproc_only":
                tweak = without_ratelimit
            elif n > 1:
                tweak = replicas(ports)
        # ext_proc only: the edge neither called nor judged in ext_proc (no x-extproc-edge either).
        edge = "call" if key in ("extproc_only", "extproc_edge_call", "noop", "noop_response") else "inline"
        envoy_cfg = localstack.envoy_config(cfg.listen, cfg.envoy_admin, upstream_port, target, tweak=tweak,
                                            edge=edge)
        cfg.pids["envoy"] = s.envoy(envoy_cfg, name=f"envoy-{key}").popen.pid
        configs[key] = cfg
    return configs, redis_url or None


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


def counted(name: str) -> bool:
    return name.startswith(COUNTED)


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
    cpu = {k: cpu_after[k] - cpu_before[k] for k in cfg.pids}
    result["cpu_s"] = {k: round(v, 3) for k, v in cpu.items()}
    # CPU per request of each process: shows where the time goes.
    result["cpu_us_per_request"] = {k: round(v / requests * 1e6, 1) for k, v in cpu.items()}
    result["counted_cpu_us_per_request"] = round(
        sum(v for k, v in cpu.items() if counted(k)) / requests * 1e6, 1)
    # Whole-machine busy and steal shares: a run where neighbours took the CPU shows here.
    total, idle, steal = (a - b for a, b in zip(machine_after, machine_before, strict=True))
    result["machine_busy"] = round(1 - idle / max(total, 1), 3)
    result["machine_steal"] = round(steal / max(total, 1), 3)
    return result


def redis_ping(url: str, n: int) -> dict[str, float]:
    """PING round trips from redis-py's asyncio client (hiredis parser when installed), the client the
    ledger uses, one every 2 ms (an idle connection woken, as between decisions; not a tight loop)."""
    import redis.asyncio

    async def go() -> list[float]:
        client = redis.asyncio.Redis.from_url(url)
        samples: list[float] = []
        try:
            for i in range(n + 50):
                t0 = time.perf_counter()
                await client.ping()
                if i >= 50:  # warm-up: the connection, the first calls
                    samples.append(time.perf_counter() - t0)
                await asyncio.sleep(0.002)
        finally:
            await client.aclose()
        return samples

    ordered = sorted(asyncio.run(go()))

    def at(q: float) -> float:
        return round(ordered[min(int(q * len(ordered)), len(ordered) - 1)] * 1000, 4)

    return {"p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": round(ordered[-1] * 1000, 4), "n": len(ordered)}


# ---------------------------------------------------------------------------------------------
# Results


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def _errors(runs: list[dict[str, Any]]) -> int:
    return sum(sum(v for k, v in r["errors"].items() if k != "status") for r in runs)


def _by_rep(runs: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for r in runs:
        out.setdefault(r["rep"], []).append(r)
    return out


def summarize(cfg: Config, rates: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rate in rates:
        runs = cfg.runs.get(str(rate), [])
        if not runs:
            continue
        out[f"rate_{rate}"] = {
            "latency_ms": {q: _median([r["latency_ms"][q] for r in runs])
                           for q in ("p50", "p90", "p99", "max")},
            "achieved_rate": _median([r["req_per_s"] for r in runs]),
            "sustained": all(r["req_per_s"] >= 0.97 * rate for r in runs),
            "non2xx": sum(r["non2xx"] for r in runs),
            "socket_errors": _errors(runs),
            "cpu_us_per_request": {k: _median([r["cpu_us_per_request"][k] for r in runs])
                                   for k in runs[0]["cpu_us_per_request"]},
            "counted_cpu_us_per_request": _median([r["counted_cpu_us_per_request"] for r in runs]),
            "machine_busy": _median([r["machine_busy"] for r in runs]),
        }
    closed = cfg.runs.get("closed", [])
    if closed:
        out["closed"] = {
            "req_per_s": _median([r["req_per_s"] for r in closed]),
            "non2xx": sum(r["non2xx"] for r in closed),
            "socket_errors": _errors(closed),
            "latency_ms": {q: _median([r["latency_ms"][q] for r in closed]) for q in ("p50", "p99")},
            "cpu_us_per_request": {k: _median([r["cpu_us_per_request"][k] for r in closed])
                                   for k in closed[0]["cpu_us_per_request"]},
            "counted_cpu_us_per_request": _median([r["counted_cpu_us_per_request"] for r in closed]),
        }
    # Over each repetition's paced runs (every rate): counted CPU per request, and requests per
    # extproc CPU-second (the replicas' efficiency); medians over repetitions.
    paced = [r for rate in rates for r in cfg.runs.get(str(rate), [])]
    per_rep_cpu, per_rep_proc = [], []
    per_rep_eff: dict[str, float] = {}
    for rep, runs in _by_rep(paced).items():
        requests = sum(r["requests"] for r in runs)
        cpu = {k: sum(r["cpu_s"][k] for r in runs) for k in runs[0]["cpu_s"]}
        per_rep_cpu.append(sum(v for k, v in cpu.items() if counted(k)) / requests * 1e6)
        per_rep_proc.append({k: v / requests * 1e6 for k, v in cpu.items()})
        extproc_cpu = sum(v for k, v in cpu.items() if k.startswith("extproc"))
        if extproc_cpu > 0:
            per_rep_eff[str(rep)] = requests / extproc_cpu
    if per_rep_cpu:
        out["paced_cpu_us_per_request"] = _median(per_rep_cpu)
        out["paced_cpu_us_per_request_by_process"] = {
            k: _median([p[k] for p in per_rep_proc]) for k in per_rep_proc[0]}
        out["requests_per_extproc_cpu_s"] = _median(list(per_rep_eff.values()))
        out["requests_per_extproc_cpu_s_by_rep"] = {r: round(v, 3) for r, v in per_rep_eff.items()}
    return out


def _added(summary: dict[str, Any], key: str, rate: int) -> dict[str, float] | None:
    a, x = summary.get("envoy", {}).get(f"rate_{rate}"), summary.get(key, {}).get(f"rate_{rate}")
    if a is None or x is None:
        return None
    return {q: round(x["latency_ms"][q] - a["latency_ms"][q], 3) for q in ("p50", "p90", "p99")}


def _ratio(x: float | None, y: float | None) -> float | None:
    return round(x / y, 3) if x is not None and y else None


def _target(value: float | None, bound: float | None, kind: str) -> dict[str, Any]:
    """``value`` against ``bound`` (``kind``: ``max`` or ``min``); met None when either is unknown."""
    met = None
    if value is not None and bound is not None:
        met = value <= bound if kind == "max" else value >= bound
    return {"value": value, "bound": None if bound is None else round(bound, 3), "met": met}


def replica_efficiency(summary: dict[str, Any], n: str) -> tuple[float | None, dict[str, float]]:
    """Requests per extproc CPU-second with ``n`` replicas over one replica on Redis, repetition by
    repetition (both measured side by side in each): the median over repetitions, and each."""
    many = summary.get(f"replicas_{n}", {}).get("requests_per_extproc_cpu_s_by_rep", {})
    one = summary.get("extproc_edge_redis", {}).get("requests_per_extproc_cpu_s_by_rep", {})
    by_rep = {rep: round(many[rep] / one[rep], 3) for rep in many if one.get(rep)}
    return _median(list(by_rep.values())), by_rep


def targets(out: dict[str, Any], pings_p99: float | None) -> dict[str, dict[str, Any]]:
    """Every target of ``TARGETS`` from ``compare``'s figures."""
    cpu, tput = out["cpu_us_per_request"], out["throughput_req_per_s"]
    added = out["added_ms_500"]
    edge, floor = added.get("extproc_edge"), added.get("noop_response")

    def added_ratio(q: str) -> float | None:
        return _ratio(edge[q], floor[q]) if edge and floor else None

    return {
        "cpu": _target(_ratio(cpu.get("extproc_edge"), cpu.get("noop_response")), TARGET_CPU_VS_NOOP_RESPONSE,
                       "max"),
        "throughput": _target(_ratio(tput.get("extproc_edge"), tput.get("noop_response")),
                              TARGET_THROUGHPUT_VS_NOOP_RESPONSE, "min"),
        "p50_500": _target(added_ratio("p50"), TARGET_ADDED_P50_VS_NOOP_RESPONSE, "max"),
        "p99_500": _target(added_ratio("p99"), TARGET_ADDED_P99_VS_NOOP_RESPONSE, "max"),
        "replicas_3": _target(out["replica_efficiency"]["3"], TARGET_REPLICA_EFFICIENCY, "min"),
        "sampled_cpu": _target(_ratio(cpu.get("extproc_edge_sampled"), cpu.get("noop")),
                               TARGET_SAMPLED_CPU_VS_NOOP, "max"),
        "sampled_throughput": _target(_ratio(tput.get("extproc_edge_sampled"), tput.get("noop")),
                                      TARGET_SAMPLED_THROUGHPUT_VS_NOOP, "min"),
        "redis_p99": _target(out["redis_added_p99_ms"],
                             pings_p99 + TARGET_REDIS_SLACK_MS if pings_p99 is not None else None, "max"),
    }


def compare(summary: dict[str, Any], rates: list[int], pings: list[dict[str, float]]) -> dict[str, Any]:
    keys = [k for k in summary if k != "envoy"]
    added = {str(rate): {k: _added(summary, k, rate) for k in keys} for rate in rates}
    tput = {k: summary[k].get("closed", {}).get("req_per_s") for k in summary}
    cpu = {k: summary[k].get("paced_cpu_us_per_request") for k in summary}
    eff = {k: summary[k].get("requests_per_extproc_cpu_s") for k in summary}
    ping_p99 = _median([p["p99_ms"] for p in pings])
    first = str(rates[0])
    second = str(rates[1]) if len(rates) > 1 else None

    def pick(rate: str | None, key: str) -> dict[str, float] | None:
        d = added.get(rate or "", {}).get(key)
        return {"p50": d["p50"], "p99": d["p99"]} if d else None

    def redis_added(rate: str | None) -> float | None:
        r, m = pick(rate, "extproc_edge_redis"), pick(rate, "extproc_edge")
        return round(r["p99"] - m["p99"], 3) if r and m else None

    efficiency = {n: replica_efficiency(summary, n) for n in ("2", "3")}
    baselines = ("extproc_edge", "noop", "noop_response")
    out: dict[str, Any] = {
        # The keys tools read (issues #19, #31): added_ms is at the first rate (200 req/s by default).
        "added_ms": {k: pick(first, k) for k in baselines},
        "added_ms_500": {k: pick(second, k) for k in baselines},
        "throughput_ratio_vs_noop": _ratio(tput.get("extproc_edge"), tput.get("noop")),
        "cpu_us_per_request": cpu,
        "replica_efficiency": {n: value for n, (value, _) in efficiency.items()},
        "redis_added_p99_ms": redis_added(first),
        "redis_ping_p99_ms": ping_p99,
        # Everything else.
        "added_ms_by_rate": added,
        "redis_added_p99_ms_by_rate": {r: redis_added(r) for r in added},
        "throughput_req_per_s": tput,
        "throughput_ratio_vs_noop_all": {k: _ratio(v, tput.get("noop")) for k, v in tput.items()},
        "throughput_ratio_vs_envoy": {k: _ratio(v, tput.get("envoy")) for k, v in tput.items()},
        "requests_per_extproc_cpu_s": {k: v for k, v in eff.items() if v is not None},
        "replica_efficiency_by_rep": {n: by_rep for n, (_, by_rep) in efficiency.items()},
        "redis_ping": pings,
    }
    out["targets"] = targets(out, ping_p99)
    out["targets_met"] = all(t["met"] for t in out["targets"].values() if t["met"] is not None)
    return out


def _made_up_run(key: str, phase: str, rep: int) -> dict[str, Any]:
    """A run as ``wrk`` reports it, of made-up figures (``dry_run``): every configuration a little slower
    and costlier than the one before it in ``CONFIGS``."""
    rank = CONFIGS.index(key) + 1
    requests = (20_000 if phase == "closed" else int(phase) * 10) // rank
    replicas = int(key[-1]) if key[-1].isdigit() else 1
    servers = {"noop": 0.4 * rank} if key.startswith("noop") else {
        f"extproc-{i + 1}": 0.5 * rank * (1 + 0.1 * rep * (replicas > 1)) for i in range(replicas)}
    processes = {"envoy": 0.3} if key == "envoy" else {"envoy": 0.6, **servers}
    cpu = {name: seconds_per_1000 * requests / 1000 for name, seconds_per_1000 in processes.items()}
    latency = {"p50": 0.3 * rank + 0.01 * rep, "p90": 0.6 * rank, "p99": 0.9 * rank + 0.02 * rep,
               "max": 5.0 * rank}
    return {"rep": rep, "requests": requests, "req_per_s": requests / 10, "latency_ms": latency, "non2xx": 0,
            "errors": {"connect": 0, "read": 0, "write": 0, "timeout": 0, "status": 0},
            "cpu_s": cpu, "cpu_us_per_request": {k: v / requests * 1e6 for k, v in cpu.items()},
            "counted_cpu_us_per_request": sum(v for k, v in cpu.items() if counted(k)) / requests * 1e6,
            "machine_busy": 0.5, "machine_steal": 0.0}


def dry_run(rates: list[int], reps: int) -> dict[str, Any]:
    """``compare``'s figures over made-up runs of every configuration, no process started: what
    overhead.json's keys and targets look like, checked (a ValueError names what is missing)."""
    summary = {}
    for key in CONFIGS:
        cfg = Config(key, 0, 0)
        for rep in range(reps):
            for phase in [*map(str, rates), "closed"]:
                cfg.runs.setdefault(phase, []).append(_made_up_run(key, phase, rep))
        summary[key] = summarize(cfg, rates)
    pings = [{"p50_ms": 0.2, "p99_ms": 0.4, "max_ms": 1.0, "n": 1000, "rep": rep} for rep in range(reps)]
    out = compare(summary, rates, pings)
    missing = [f"targets.{name}" for name in TARGETS if name not in out["targets"]]
    missing += [f"targets.{name}.{field}" for name, t in out["targets"].items()
                for field in ("value", "bound", "met") if field not in t]
    missing += [f"{figure}.{key}" for figure in ("added_ms", "added_ms_500")
                for key in ("extproc_edge", "noop", "noop_response") if out[figure].get(key) is None]
    if missing or set(out["targets"]) != set(TARGETS):
        raise ValueError(f"overhead.json's shape: missing or unexpected {missing or sorted(out['targets'])}")
    return out


def idle_usage(configs: dict[str, Config], seconds: int) -> dict[str, dict[str, float]]:
    """CPU % of every process with no traffic at all: the background each stack adds to the others' runs."""
    pids = {(k, name): pid for k, c in configs.items() for name, pid in c.pids.items()}
    before = {kp: cpu_seconds(pid) for kp, pid in pids.items()}
    time.sleep(seconds)
    out: dict[str, dict[str, float]] = {}
    for (k, name), pid in pids.items():
        out.setdefault(k, {})[name] = round((cpu_seconds(pid) - before[(k, name)]) / seconds * 100, 2)
    return out


def _count(path: Path, needle: str) -> int:
    with contextlib.suppress(OSError):
        return sum(1 for line in path.read_text(errors="replace").splitlines() if needle in line)
    return 0


def extproc_decisions(cfg: Config) -> list[dict[str, float]]:
    """Each replica's own count of decisions: proof that the traffic went through it, all admitted,
    and how evenly round robin spread it."""
    out = []
    for url in cfg.metrics_urls:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        counts: dict[str, float] = {}
        for match in re.finditer(r'^inference_admission_decisions_total\{([^}]*)\} (\S+)$', text, re.M):
            outcome = re.search(r'outcome="([^"]*)"', match.group(1))
            if outcome:
                counts[outcome.group(1)] = counts.get(outcome.group(1), 0.0) + float(match.group(2))
        out.append(counts)
    return out


def extproc_responses(cfg: Config) -> list[dict[str, float]]:
    """Each replica's count of response-headers messages asked for, skipped (--response-sample) and
    received: proof of the share each configuration asked for."""
    out = []
    for url in cfg.metrics_urls:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        out.append({match.group(1): float(match.group(2)) for match in re.finditer(
            r'^extproc_response_headers_total\{kind="([^"]*)"\} (\S+)$', text, re.M)})
    return out


def envoy_calls(cfg: Config) -> dict[str, float]:
    """Envoy's own counts: HTTP requests, and calls to each extproc cluster (gRPC calls per request)."""
    url = f"http://127.0.0.1:{cfg.envoy_admin}/stats?format=json"
    with urllib.request.urlopen(url, timeout=5) as response:
        stats = {s["name"]: s.get("value") for s in json.loads(response.read())["stats"] if "name" in s}
    out: dict[str, float] = {}
    downstream = stats.get("http.inference.downstream_rq_total") or 0
    out["http_requests"] = downstream
    for cluster in bootstrap.EXTPROC_CLUSTERS:
        calls = stats.get(f"cluster.{cluster}.upstream_rq_total")
        if calls is not None:
            out[f"{cluster}_calls"] = calls
            out[f"{cluster}_calls_per_request"] = round(calls / downstream, 3) if downstream else 0
    return out


def _git_dirty() -> bool | None:
    """Whether tracked files differ from the commit (None: git could not say)."""
    try:
        proc = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(proc.stdout.strip()) if proc.returncode == 0 else None


def machine_info() -> dict[str, Any]:
    def version(argv: list[str]) -> str:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
            lines = (proc.stdout + proc.stderr).strip().splitlines()
            return lines[0 if argv[0] == "wrk" else -1].strip() if lines else ""
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
        "hiredis": importlib.util.find_spec("hiredis") is not None,
        "envoy": version([localstack.envoy_binary(), "--version"]),
        "wrk": version(["wrk", "-v"]),
        "redis_server": version(["redis-server", "--version"]),
        "git_commit": version(["git", "-C", str(ROOT), "rev-parse", "HEAD"]),
        # Changes to tracked files not committed yet: then git_commit alone does not say what ran.
        "git_dirty": _git_dirty(),
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
    rates = result["parameters"]["rates"]
    keys = [k for k in summary if k != "envoy"]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    width = 0.38
    for ax, rate in zip(axes[0], rates[:2], strict=False):
        added = result["added_ms_by_rate"][str(rate)]
        for i, q in enumerate(("p50", "p99")):
            values = [added[k][q] if added[k] else 0 for k in keys]
            bars = ax.bar([x + (i - 0.5) * width for x in range(len(keys))], values, width, label=q)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        base = summary["envoy"][f"rate_{rate}"]["latency_ms"]
        ax.set_xticks(range(len(keys)), keys, rotation=20, fontsize=8)
        ax.set_ylabel("ms added over Envoy alone")
        ax.set_title(f"added latency at {rate} req/s (Envoy alone: p50 {base['p50']:.2f}, "
                     f"p99 {base['p99']:.2f} ms)", fontsize=9)
        ax.legend(fontsize=8)
    ax = axes[1][0]
    all_keys = list(summary)
    values = [summary[k].get("closed", {}).get("req_per_s") or 0 for k in all_keys]
    bars = ax.bar(all_keys, values, color="tab:gray")
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(all_keys)), all_keys, rotation=20, fontsize=8)
    ax.set_ylabel("req/s")
    ratio = result["throughput_ratio_vs_noop"]
    ax.set_title(f"closed-loop throughput, {result['parameters']['throughput_connections']} connections"
                 + (f" (extproc_edge / noop = {ratio:.2f})" if ratio is not None else ""), fontsize=9)
    ax = axes[1][1]
    bottom = [0.0] * len(all_keys)
    for role, color in (("envoy", "tab:blue"), ("extproc", "tab:orange"), ("noop", "tab:green"),
                        ("redis", "tab:red")):
        values = []
        for k in all_keys:
            by = summary[k].get("paced_cpu_us_per_request_by_process", {})
            values.append(sum(v for name, v in by.items() if name.startswith(role)))
        ax.bar(all_keys, values, bottom=bottom, color=color, hatch="//" if role == "redis" else None,
               label=role + (" (not counted)" if role == "redis" else ""))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(range(len(all_keys)), all_keys, rotation=20, fontsize=8)
    ax.set_ylabel("CPU µs per request")
    eff = result["replica_efficiency"]
    ax.set_title("CPU per request over the paced runs; replica efficiency "
                 + ", ".join(f"{n}: {v:.2f}" for n, v in eff.items() if v is not None), fontsize=9)
    ax.legend(fontsize=8)
    machine = result["machine"]
    met = sum(1 for t in result["targets"].values() if t["met"])
    fig.suptitle(f"extproc overhead — {machine['nproc']} cores, envoy --concurrency 1, "
                 f"median of {result['parameters']['reps']} reps, {machine['date']}; "
                 f"targets met {met}/{len(result['targets'])}; Redis PING p99 "
                 f"{result['redis_ping_p99_ms']} ms", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(result: dict[str, Any]) -> None:
    summary = result["summary"]
    rates = result["parameters"]["rates"]
    head = "".join(f"{f'+p50@{r}':>9}{f'+p99@{r}':>9}" for r in rates)
    print(f"\n{'config':20}{head}{'req/s':>8}{'cpu µs/req':>11}{'req/ext-cpu-s':>14}  non2xx")
    for key, s in summary.items():
        cols = ""
        for r in rates:
            a = result["added_ms_by_rate"][str(r)].get(key)
            lat = s.get(f"rate_{r}", {}).get("latency_ms", {})
            if key == "envoy":
                cols += f"{_fmt(lat.get('p50')):>9}{_fmt(lat.get('p99')):>9}"
            else:
                cols += f"{_fmt(a and a['p50']):>9}{_fmt(a and a['p99']):>9}"
        non2xx = (sum(s.get(f"rate_{r}", {}).get("non2xx", 0) for r in rates)
                  + s.get("closed", {}).get("non2xx", 0))
        print(f"{key:20}{cols}{_fmt(s.get('closed', {}).get('req_per_s'), '.0f'):>8}"
              f"{_fmt(s.get('paced_cpu_us_per_request'), '.0f'):>11}"
              f"{_fmt(s.get('requests_per_extproc_cpu_s'), '.0f'):>14}  {non2xx}")
    print("(envoy row: absolute latency in ms; other rows: ms added over it)")
    print(f"Redis PING p99 {result['redis_ping_p99_ms']} ms; "
          f"Redis added p99 {result['redis_added_p99_ms']} ms; "
          f"replica efficiency {result['replica_efficiency']}; throughput extproc_edge/noop "
          f"{result['throughput_ratio_vs_noop']}")
    for name, t in result["targets"].items():
        mark = {True: "met", False: "NOT met", None: "n/a"}[t["met"]]
        print(f"  {mark:8} {name:18} {TARGETS[name]}: {t['value']} (bound {t['bound']})")


# ---------------------------------------------------------------------------------------------


def _rotated(keys: list[str], rep: int) -> list[str]:
    """Each configuration takes each position in turn, so drift in the machine's load does not always
    favour the same one."""
    shift = rep % len(keys)
    return keys[shift:] + keys[:shift]


def run(params: Params, keys: list[str], out_dir: Path, keep: bool, quick: bool) -> dict[str, Any]:
    for tool in ("wrk",) + (("redis-server",) if any(k in REDIS_CONFIGS for k in keys) else ()):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found (apt-get install {tool})")
    started = time.monotonic()
    machine = machine_info()
    print(f"configurations: {', '.join(keys)}; "
          f"planned measuring time ≈ {params.planned_seconds(len(keys)):.0f} s; "
          f"background CPU busy {machine['background_busy']:.0%} before start", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="extproc-bench-"))
    paced, closed = workdir / "paced.lua", workdir / "closed.lua"
    common = LUA_COMMON.replace("@BODY@", BODY)
    paced.write_text(LUA_PACED + common)
    closed.write_text(LUA_CLOSED + common)
    pings: list[dict[str, float]] = []
    order: list[list[str]] = []
    reps_done = 0
    try:
        with localstack.stack(workdir) as s:
            configs, redis_url = start_stacks(s, workdir, params, keys)
            print(f"stacks up after {time.monotonic() - started:.0f} s", flush=True)
            for cfg in configs.values():
                check_path(cfg)
                # Warm-up: gRPC connections, Python's first-call paths, Envoy's connection pools.
                wrk(cfg, closed, duration=params.warmup, connections=8, threads=1, args=[])
            idle_cpu = idle_usage(configs, params.idle)
            for rep in range(params.reps):
                if rep > 0 and time.monotonic() - started > params.time_limit:
                    print(f"time limit ({params.time_limit:.0f} s) reached: stopping after {rep} repetitions",
                          flush=True)
                    break
                keys_now = _rotated(keys, rep)
                order.append(keys_now)
                if redis_url is not None:
                    pings.append({**redis_ping(redis_url, params.pings), "rep": rep})
                    print(f"  redis PING  rep {rep}: p50 {pings[-1]['p50_ms']:.3f}  "
                          f"p99 {pings[-1]['p99_ms']:.3f} ms", flush=True)
                for phase in [str(r) for r in params.rates] + ["closed"]:
                    for key in keys_now:
                        cfg = configs[key]
                        if phase == "closed":
                            r = wrk(cfg, closed, duration=params.throughput_duration,
                                    connections=params.throughput_connections, threads=1, args=[])
                        else:
                            rate = int(phase)
                            r = wrk(cfg, paced, duration=params.duration,
                                    connections=params.paced_connections(rate), threads=1, args=[phase, "1"])
                        r["rep"] = rep
                        cfg.runs.setdefault(phase, []).append(r)
                        lat = r["latency_ms"]
                        print(f"  {phase:>6} {key:19} rep {rep}: {r['req_per_s']:7.0f} req/s  "
                              f"p50 {lat['p50']:6.2f}"
                              f"  p99 {lat['p99']:6.2f} ms  cpu {r['counted_cpu_us_per_request']:6.0f} µs/req"
                              f"  non2xx {r['non2xx']}  busy {r['machine_busy']:.0%} steal "
                              f"{r['machine_steal']:.0%}", flush=True)
                reps_done = rep + 1
            decisions = {k: extproc_decisions(c) for k, c in configs.items() if c.metrics_urls}
            responses = {k: extproc_responses(c) for k, c in configs.items() if c.metrics_urls}
            calls = {k: envoy_calls(c) for k, c in configs.items()}
            outages = {k: [_count(p.log, '"event": "ledger_degraded"') for p in s.processes
                           if p.name.startswith(f"extproc-{k}-")] for k in configs if k in REDIS_CONFIGS}
            if keep:
                print(f"logs kept in {workdir}")
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)

    summary = {k: summarize(configs[k], params.rates) for k in keys}
    compared = compare(summary, params.rates, pings)
    result: dict[str, Any] = {
        "benchmark": "overhead",
        **{k: compared.pop(k) for k in ("added_ms", "added_ms_500", "throughput_ratio_vs_noop",
                                         "cpu_us_per_request", "replica_efficiency", "redis_added_p99_ms",
                                         "redis_ping_p99_ms")},
        **compared,
        "descriptions": {k: DESCRIPTIONS[k] for k in keys},
        "summary": summary,
        "cpu_detail": {
            k: {"paced_by_process_us_per_request": summary[k].get("paced_cpu_us_per_request_by_process"),
                "closed_loop_counted_us_per_request":
                    summary[k].get("closed", {}).get("counted_cpu_us_per_request"),
                "idle_cpu_percent_by_process": idle_cpu.get(k)}
            for k in keys},
        "store_outages": outages,
        "envoy_calls": calls,
        "extproc_decisions": decisions,
        "extproc_response_headers": responses,
        "machine": {**machine, "loadavg_end": list(os.getloadavg())},
        "parameters": {
            **params.__dict__,
            "quick": quick,
            "reps_done": reps_done,
            "configs": keys,
            "paced_connections": {str(r): params.paced_connections(r) for r in params.rates},
            "method": "POST", "path": PATH, "body_bytes": len(BODY), "envoy_concurrency": 1,
            "latency_tool": "wrk, Lua delay() pacing to a fixed schedule (one thread)",
            "throughput_tool": "wrk closed loop (one thread)",
            "order": order,
            "policy": POLICY,
            "noop_event_loop": NOOP_LOOP,
        },
        "definitions": {
            "added_ms": "p50/p99 latency minus Envoy alone's (medians over repetitions of each run's wrk "
                        "percentile), paced at the first rate (200 req/s); added_ms_500 at the second",
            "cpu_us_per_request": "user+system CPU (/proc/PID/stat) of Envoy + every extproc serve replica "
                                  "+ the no-op server where present, over each repetition's paced runs (all "
                                  "rates), divided by the requests they completed; median over repetitions. "
                                  "Not counted: upstream, wrk, this script, redis-server (see cpu_detail)",
            "throughput_ratio_vs_noop": "closed-loop max req/s of extproc_edge / of noop (medians)",
            "replica_efficiency": "requests per extproc CPU-second (all replicas' user+system CPU, over "
                                  "the paced runs) with N replicas sharing Redis / the same with one replica "
                                  "on Redis (extproc_edge_redis), in each repetition; the median over "
                                  "repetitions (each in replica_efficiency_by_rep)",
            "targets": TARGETS,
            "redis_added_p99_ms": "p99 at the first rate of extproc_edge_redis minus extproc_edge "
                                  "(memory store)",
            "redis_ping_p99_ms": "p99 of PING round trips from redis-py's asyncio client (hiredis parser "
                                 "when machine.hiredis), one PING every 2 ms on loopback, from the bench "
                                 "process, at the start of each repetition (no other traffic then); median "
                                 "over repetitions",
            "extproc_response_headers": "each extproc replica's extproc_response_headers_total at the end: "
                                        "admitted requests whose response headers it asked for, skipped "
                                        "(--response-sample) and received",
            "store_outages": "ledger_degraded events in each extproc replica's log (the Redis ledger timed "
                             "out and the replica decided alone for a moment)",
            "idle_cpu_percent_by_process": "CPU % of each process over the idle seconds at the start "
                                           "(every stack runs side by side: idle ones burn this during "
                                           "others' runs)",
        },
        "raw": {k: configs[k].runs for k in keys},
        "notes": [
            "cpu figures have 10 ms clock-tick resolution per process and run",
            "wrk's delay() pacing is not coordinated-omission corrected: a stall delays sends",
            "a rate a configuration cannot sustain shows as sustained: false and a lower achieved_rate; "
            "its latency then includes queueing",
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
    parser = argparse.ArgumentParser(
        description="extproc's added latency, throughput and CPU cost behind Envoy")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated configurations (default all: {','.join(CONFIGS)}); "
                             "envoy is always run")
    parser.add_argument("--rates", default="200,500", help="paced rates, req/s (200,500)")
    parser.add_argument("--duration", type=int, default=10, help="seconds per paced run (10)")
    parser.add_argument("--throughput-duration", type=int, default=6, help="seconds per closed-loop run (6)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (3)")
    parser.add_argument("--connections", type=int, default=32, help="closed-loop connections (32)")
    parser.add_argument("--pings", type=int, default=1000, help="Redis PINGs per repetition (1000)")
    parser.add_argument("--extproc-log-level", default="info",
                        help="extproc's log level (info: one decision line per request, as deployed)")
    parser.add_argument("--time-limit", type=float, default=780,
                        help="no new repetition starts after this many seconds (780)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1 repetition, 3 s paced, 2 s closed loop")
    parser.add_argument("--dry-run", action="store_true",
                        help="start nothing: compute the figures and targets from made-up runs and check "
                             "their shape (with --quick: one repetition)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="output directory (bench/results)")
    parser.add_argument("--keep", action="store_true", help="keep the process logs (printed path)")
    args = parser.parse_args()
    keys = [k.strip() for k in args.configs.split(",") if k.strip()]
    unknown = [k for k in keys if k not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    keys = [k for k in CONFIGS if k in keys or k == "envoy"]
    params = Params(rates=[int(r) for r in args.rates.split(",")], duration=args.duration,
                    throughput_duration=args.throughput_duration, reps=args.reps,
                    throughput_connections=args.connections, warmup=1, pings=args.pings, idle=4,
                    extproc_log_level=args.extproc_log_level, time_limit=args.time_limit)
    if args.quick:
        params.duration, params.throughput_duration, params.reps, params.pings, params.idle = 3, 2, 1, 300, 2
    if args.dry_run:
        compared = dry_run(params.rates, params.reps)
        print(json.dumps({k: compared[k] for k in ("added_ms", "added_ms_500", "replica_efficiency",
                                                    "targets", "targets_met")}, indent=1))
        print("shape ok (made-up figures: nothing was measured)")
        return
    # SIGTERM / SIGHUP must unwind like Ctrl-C so the stack's finally stops every process.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    try:
        result = run(params, keys, args.out, args.keep, args.quick)
    except KeyboardInterrupt:
        raise SystemExit("interrupted; all processes stopped") from None
    print_table(result)
    print(f"\nwrote {args.out / 'overhead.json'} (elapsed {result['elapsed_s']} s)")


if __name__ == "__main__":
    main()

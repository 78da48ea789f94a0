"""Chaos: extproc's faults cost new admissions at most, never a running generation.

A real stack on loopback — Envoy (the shipped envoy/envoy.yaml), the simulated 70B backend
(time scale 0.1), Redis (the shared store), Prometheus (scraping the backend; the policy reads
the engines' KV-cache usage from it) and `extproc serve` — under the demo's chatbot workload at
1.5x the engine's capacity, and one fault at a time:

* extproc_sigkill — SIGKILL extproc mid-run: every generation that was running goes on to its
  end; requests that arrive while it is down get the configured failure answer; after a restart
  nothing is leaked (extproc's in-flight gauges and the store's leases drop to 0 once idle).
* redis_outage — two replicas behind one Envoy sharing Redis; Redis is stopped for 15 s, then
  started again. Reports the busier replica's CPU (% of one core) before and during the outage,
  the highest in-flight total over both replicas' /metrics against the capacity limit (and per
  lane, beside the store's own count), and leaks. redis_outage_closed: the same with
  --store-fail closed.
* bad_policy — a 3 MB invalid file saved over the live policy for 9 s of a 15 s run at 20 req/s,
  against the same run without it: non-2xx answers and p99 latency.
* prometheus_outage — Prometheus stopped for 10 s under load: non-2xx answers from extproc's
  side (the signal goes stale and is ignored), leaks.
* cancels — 10,000 requests whose clients go away at random moments (while queued, while
  streaming, right after sending): extproc's in-flight and queued counts drop to 0.
* soak — 30 minutes at 2.0x (``--soak-minutes``): extproc's RSS and open files, sampled every 10 s
  with the requests Envoy received so far; after a warm-up, the RSS growth and the least-squares slope
  of RSS over requests (``bytes_per_request``; targets: growth ≤ 3 %, ≤ 10 bytes per request).
* soak_fast — 550 requests/s (``--fast-rate``) through Envoy to the instant upstream
  (bench/upstream.py) for 15 minutes (``--fast-minutes``), every request through the whole decision
  path and logged: the same measurements and targets, at ten times the soak's rate.

Writes bench/results/chaos.json (and chaos.png: in-flight over time in the Redis outage).

    .venv/bin/python bench/chaos.py                 # everything, ~60 minutes with both soaks
    .venv/bin/python bench/chaos.py --only soak soak_fast   # the memory soaks (~50 minutes)
    .venv/bin/python bench/chaos.py --only redis_outage bad_policy --soak-minutes 0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import redis
import yaml

from extproc import localstack
from extproc.localstack import Process, Stack, free_port, wait_http
from extproc.sim.profiles import get_profile
from extproc.sim.simulate import capacity_rps
from extproc.sim.workload import Request, generate, load_spec

ROOT = localstack.ROOT
RESULTS = ROOT / "bench" / "results"
PROFILE, TIME_SCALE = "llama-70b-2xh100", 0.1
WORKLOAD = ROOT / "examples" / "workloads" / "chatbot.yaml"
POLICY = ROOT / "examples" / "demo-policy.yaml"
SCENARIOS = ("extproc_sigkill", "redis_outage", "redis_outage_closed", "bad_policy", "prometheus_outage",
             "cancels", "soak", "soak_fast")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- processes ---------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def metric_sum(url: str, name: str, **labels: str) -> float:
    """Sum of one metric's samples on a /metrics page whose labels include ``labels``."""
    text = httpx.get(url, timeout=5).text
    total = 0.0
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total


@dataclass
class Replica:
    name: str
    process: Process
    grpc: int
    http: int
    admin: int
    policy: Path
    args: tuple[str, ...]

    @property
    def metrics(self) -> str:
        return f"http://127.0.0.1:{self.http}/metrics"


@dataclass
class Bench:
    """One scenario's stack: processes started together, stopped together."""

    workdir: Path
    stack: Stack = field(init=False)
    backend: int = 0
    redis_port: int = 0
    redis_proc: subprocess.Popen[bytes] | None = None
    prometheus: Process | None = None
    prometheus_port: int = 0
    replicas: list[Replica] = field(default_factory=list)
    envoy_port: int = 0
    envoy_admin: int = 0

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.stack = Stack(self.workdir)

    # backend, Redis, Prometheus ---------------------------------------------------------------------

    def start_backend(self, profile: str = PROFILE, time_scale: float = TIME_SCALE) -> None:
        self.backend = free_port()
        self.stack.start("backend", [sys.executable, "-m", "extproc", "sim", "backend", "--profile", profile,
                                     "--time-scale", str(time_scale), "--listen", f"127.0.0.1:{self.backend}",
                                     "--stream-interval", "0.1", "--log-level", "warning"])
        wait_http(f"http://127.0.0.1:{self.backend}/health", proc=self.stack.processes[-1].popen)

    def start_redis(self) -> None:
        self.redis_port = self.redis_port or free_port()
        self.redis_proc = subprocess.Popen(
            ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=self.redis_port, socket_timeout=1).ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop_redis(self) -> None:
        if self.redis_proc is not None:
            self.redis_proc.kill()
            self.redis_proc.wait(10)
            self.redis_proc = None

    @property
    def store(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def leases(self) -> int:
        client = redis.Redis(port=self.redis_port, socket_timeout=5)
        now_ms = int(time.time() * 1000)
        return sum(int(client.zcount(key, now_ms, "+inf")) for key in client.scan_iter("*:lease:*"))

    def start_prometheus(self) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise SystemExit("prometheus is not installed (make system-deps installs it)")
        self.prometheus_port = self.prometheus_port or free_port()
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "engines", "static_configs": [
                {"targets": [f"127.0.0.1:{self.backend}"]}]}],
        }))
        data = self.workdir / "prometheus-data"
        self.prometheus = self.stack.start("prometheus", [
            binary, f"--config.file={config}", f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{self.prometheus_port}", "--log.level=warn"])
        wait_http(f"http://127.0.0.1:{self.prometheus_port}/-/ready", timeout=30,
                  proc=self.prometheus.popen)

    def stop_prometheus(self) -> None:
        if self.prometheus is not None:
            self.prometheus.stop(signal.SIGKILL)
            self.stack.processes.remove(self.prometheus)
            self.prometheus = None

    # extproc and Envoy ------------------------------------------------------------------------------

    def policy(self, *, signals: bool = True) -> Path:
        """The demo policy, reading the engines' KV-cache usage from this Prometheus."""
        doc = yaml.safe_load(POLICY.read_text())
        if signals and self.prometheus_port:
            doc["signals"] = {
                "sources": {"prometheus": {"prometheus": {
                    "url": f"http://127.0.0.1:{self.prometheus_port}", "interval": "2s", "timeout": "1s"}}},
                "read": {"kv_cache": {"source": "prometheus", "query": "max(vllm:kv_cache_usage_perc)",
                                      "stale_after": "10s", "on_stale": "ignore"}},
                "saturation": [{"name": "kv-cache-full", "signal": "kv_cache", "above": 0.98, "below": 0.9,
                                "min_active": "5s", "shed": ["best-effort"]}],
            }
        path = self.workdir / "policy.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def start_extproc(self, name: str, policy: Path, *extra: str, ports: tuple[int, int, int] | None = None
                      ) -> Replica:
        grpc, http, admin = ports or (free_port(), free_port(), free_port())
        args = ("--log-format", "json", "--log-level", "warning", *extra)
        process = self.stack.extproc(policy, grpc, http, *args, name=name, admin=admin)
        replica = Replica(name, process, grpc, http, admin, policy, args)
        self.replicas = [r for r in self.replicas if r.name != name] + [replica]
        return replica

    def restart(self, replica: Replica) -> Replica:
        if replica.process in self.stack.processes:
            self.stack.processes.remove(replica.process)
        return self.start_extproc(replica.name, replica.policy, *replica.args[4:],
                                  ports=(replica.grpc, replica.http, replica.admin))

    def start_envoy(self) -> None:
        grpc_ports = [r.grpc for r in self.replicas]

        def every_replica(config: dict[str, Any]) -> None:
            for cluster in config["static_resources"]["clusters"]:
                if cluster["name"] in ("extproc", "extproc_ratelimit"):
                    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
                        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                                     "port_value": port}}}}
                        for port in grpc_ports]

        self.envoy_port, self.envoy_admin = free_port(), free_port()
        self.stack.envoy(localstack.envoy_config(self.envoy_port, self.envoy_admin, self.backend,
                                                 grpc_ports[0], tweak=every_replica))

    def envoy_counter(self, name: str) -> int:
        """One of Envoy's counters (e.g. ``http.inference.downstream_rq_total``), from its admin port."""
        text = httpx.get(f"http://127.0.0.1:{self.envoy_admin}/stats?filter=^{re.escape(name)}$",
                         timeout=5).text
        return int(text.split(":", 1)[1]) if ":" in text else 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"

    def stop(self) -> None:
        self.stack.stop()
        self.stop_redis()


@contextlib.contextmanager
def bench(workdir: Path) -> Iterator[Bench]:
    b = Bench(workdir)
    try:
        yield b
    finally:
        b.stop()


# -- load ---------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One request as its client saw it (times from the start of the run)."""

    index: int
    cls: str
    start: float
    status: int = 0
    first: float | None = None
    end: float | None = None
    complete: bool = False
    """A 200 whose stream ended with its final event."""
    retry_after: str | None = None
    reason: str | None = None


def workload(load: float, duration: float, seed: int) -> list[Request]:
    spec = load_spec(WORKLOAD)
    rate = capacity_rps(get_profile(PROFILE), TIME_SCALE, spec) * load
    spec = spec.model_copy(update={"arrivals": spec.arrivals.model_copy(update={"rate": rate})})
    return generate(spec, duration, seed)


async def _send(session: aiohttp.ClientSession, url: str, request: Request, origin: float,
                cancel_after: float | None = None) -> Outcome:
    loop = asyncio.get_running_loop()
    out = Outcome(request.index, request.cls, loop.time() - origin)
    headers = {"content-type": "application/json", **request.headers}
    if request.key:
        headers["authorization"] = f"Bearer {request.key}"
    body = json.dumps(request.body()).encode()

    async def go() -> None:
        async with session.post(url + request.path, data=body, headers=headers) as response:
            out.status = response.status
            out.retry_after = response.headers.get("retry-after")
            out.reason = response.headers.get("x-extproc-reason")
            tail = b""
            async for chunk in response.content.iter_any():
                if out.first is None:
                    out.first = loop.time() - origin
                tail = (tail + chunk)[-64:]
            out.complete = response.status == 200 and (not request.stream or b"[DONE]" in tail)

    try:
        if cancel_after is None:
            await go()
        else:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(cancel_after):
                    await go()
    except (TimeoutError, aiohttp.ClientError, ConnectionError):
        out.complete = False
    out.end = loop.time() - origin
    return out


async def drive(url: str, requests: list[Request], *, events: dict[float, Callable[[], Any]] | None = None,
                cancel: Callable[[Request], float | None] | None = None, drain: float = 90.0,
                connections: int = 0) -> list[Outcome]:
    """Send ``requests`` on their schedule (no retries); run each ``events[t]`` at ``t`` seconds."""
    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=drain + 600)
    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        origin = loop.time()
        tasks = []
        pending_events = sorted((events or {}).items())

        async def run_events() -> None:
            for at, action in pending_events:
                await asyncio.sleep(max(0.0, origin + at - loop.time()))
                result = action()
                if asyncio.iscoroutine(result):
                    await result

        event_task = loop.create_task(run_events())
        for request in requests:
            await asyncio.sleep(max(0.0, origin + request.at - loop.time()))
            after = cancel(request) if cancel is not None else None
            tasks.append(loop.create_task(_send(session, url, request, origin, after)))
        done, pending = await asyncio.wait(tasks, timeout=drain)
        for task in pending:
            task.cancel()
        await event_task
        return [t.result() for t in tasks if t in done and not t.cancelled()]


def run_async(coro: Any) -> Any:
    return asyncio.run(coro)


def wait_idle(replicas: list[Replica], timeout: float = 120.0) -> float:
    """Wait until no replica has anything queued or in flight; the in-flight total left (0 when idle)."""
    deadline = time.monotonic() + timeout
    left = 0.0
    while time.monotonic() < deadline:
        left = sum(metric_sum(r.metrics, "inference_inflight_requests") +
                   metric_sum(r.metrics, "inference_pending_requests") for r in replicas)
        if left == 0:
            return 0.0
        time.sleep(0.5)
    return left


class Sampler:
    """Samples every replica's /metrics (in-flight per lane) and CPU time in a thread, and the
    store's unexpired leases per lane while it answers (the truth the gauges report)."""

    def __init__(self, replicas: list[Replica], interval: float = 0.25, redis_port: int = 0) -> None:
        self.replicas = replicas
        self.redis_port = redis_port
        self.interval = interval
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.origin = time.monotonic()

    def _scrape(self, replica: Replica, row: dict[str, Any]) -> None:
        try:
            text = httpx.get(replica.metrics, timeout=2).text
            row["cpu"][replica.name] = cpu_seconds(replica.process.popen.pid)
        except (httpx.HTTPError, OSError):
            return
        for lane, value in re.findall(r'^inference_inflight_requests\{lane="([^"]+)"\} (\S+)$', text,
                                      re.MULTILINE):
            row["by"].setdefault(replica.name, {})[lane] = float(value)

    def _run(self) -> None:
        while not self._stop.is_set():
            row: dict[str, Any] = {"t": time.monotonic() - self.origin, "lanes": {}, "cpu": {}, "by": {}}
            # Every replica at once: scraped one after the other, a slot released on one and granted
            # on the other in between would be counted twice.
            threads = [threading.Thread(target=self._scrape, args=(r, row)) for r in self.replicas]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            for lanes in row["by"].values():
                for lane, value in lanes.items():
                    row["lanes"][lane] = row["lanes"].get(lane, 0.0) + value
            if self.redis_port:
                row["store"] = self._leases()
            self.samples.append(row)
            self._stop.wait(self.interval)

    def _leases(self) -> dict[str, int] | None:
        try:
            client = redis.Redis(port=self.redis_port, socket_timeout=0.2, socket_connect_timeout=0.2)
            now_ms = int(time.time() * 1000)
            return {key.decode().rsplit(":", 1)[1]: int(client.zcount(key, now_ms, "+inf"))
                    for key in client.scan_iter("*:lease:*")}
        except (redis.RedisError, OSError):
            return None

    def __enter__(self) -> Sampler:
        self.origin = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def cpu_pct(self, name: str, start: float, end: float) -> float:
        rows = [s for s in self.samples if start <= s["t"] <= end and name in s["cpu"]]
        if len(rows) < 2:
            return float("nan")
        first, last = rows[0], rows[-1]
        return 100.0 * (last["cpu"][name] - first["cpu"][name]) / (last["t"] - first["t"])


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


# -- scenarios ----------------------------------------------------------------------------------------


def extproc_sigkill(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    with bench(workdir) as b:
        b.start_backend()
        b.start_redis()
        b.start_prometheus()
        policy = b.policy()
        replica = b.start_extproc("extproc", policy, "--store", b.store, "--store-ttl", "5")
        b.start_envoy()
        kill_at, restart_at, duration = 12.0, 16.0, 30.0
        requests = workload(args.load, duration, args.seed)
        state: dict[str, Any] = {}

        def kill() -> None:
            os.kill(replica.process.popen.pid, signal.SIGKILL)
            state["killed"] = time.monotonic()
            log(f"extproc SIGKILLed ({len(requests)} requests in the run)")

        async def probe_while_down() -> None:
            async with aiohttp.ClientSession() as session, session.post(
                    b.url + "/v1/chat/completions", json={"max_tokens": 5, "messages": []}) as r:
                state["while_down"] = {"status": r.status, "retry_after": r.headers.get("retry-after"),
                                       "reason": r.headers.get("x-extproc-reason"),
                                       "body": json.loads(await r.read())}

        def restart() -> None:
            state["replica"] = b.restart(replica)
            log("extproc restarted")

        outcomes = run_async(drive(b.url, requests, events={kill_at: kill, kill_at + 1.0: probe_while_down,
                                                            restart_at: restart}))
        running = [o for o in outcomes if o.first is not None and o.first < kill_at
                   and (o.end is None or o.end > kill_at) and o.status == 200]
        completed = [o for o in running if o.complete]
        refused_down = [o for o in outcomes if kill_at <= o.start < restart_at]
        leaked_gauges = wait_idle([state["replica"]])
        time.sleep(6)  # the dead replica's leases run out (store TTL 5 s)
        leaked_leases = b.leases()
        return {
            "requests": len(outcomes),
            "running": len(running),
            "completed": len(completed),
            "leaked_slots": int(leaked_gauges + leaked_leases),
            "while_down": state.get("while_down"),
            "arrived_while_down": len(refused_down),
            "statuses_while_down": _count(o.status for o in refused_down),
            "completed_after_restart": sum(1 for o in outcomes if o.start >= restart_at + 1 and o.complete),
        }


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for value in values:
        out[str(value)] = out.get(str(value), 0) + 1
    return dict(sorted(out.items()))


def redis_outage(workdir: Path, args: argparse.Namespace, fail: str = "open") -> dict[str, Any]:
    with bench(workdir) as b:
        b.start_backend()
        b.start_redis()
        b.start_prometheus()
        policy = b.policy()
        a = b.start_extproc("a", policy, "--store", b.store, "--store-fail", fail)
        c = b.start_extproc("b", policy, "--store", b.store, "--store-fail", fail)
        b.start_envoy()
        down_at, up_at, duration = 15.0, 30.0, 45.0
        requests = workload(args.load, duration, args.seed)
        with Sampler([a, c], redis_port=b.redis_port) as sampler:
            offset = time.monotonic() - sampler.origin
            outcomes = run_async(drive(b.url, requests, events={
                down_at: lambda: (b.stop_redis(), log("Redis stopped")),
                up_at: lambda: (b.start_redis(), log("Redis started")),
            }))
            left = wait_idle([a, c])
            leases = b.leases()
        capacity = yaml.safe_load(policy.read_text())["capacity"]["max_inflight"]
        totals = [(s["t"] - offset, sum(s["lanes"].values())) for s in sampler.samples]
        before = max(sampler.cpu_pct(n, offset + 3, offset + down_at) for n in ("a", "b"))
        during = max(sampler.cpu_pct(n, offset + down_at + 1, offset + up_at) for n in ("a", "b"))
        lanes = yaml.safe_load(policy.read_text())["lanes"]
        def lane_max(name: str, start: float, end: float) -> float:
            return max((s["lanes"].get(name, 0.0) for s in sampler.samples
                        if start <= s["t"] - offset <= end), default=0.0)

        per_lane = {lane["name"]: {
            "limit": lane["max_inflight"] + (lane.get("max_borrow") or 0 if lane.get("borrow") else 0),
            "max_before": lane_max(lane["name"], 0, down_at),
            "max_during": lane_max(lane["name"], down_at, up_at),
            "max_after": lane_max(lane["name"], up_at, 1e9),
            # The store's own count, sampled at the same moments while it answers: the gauges of two
            # processes are read a few ms apart, and a slot released by one and granted to the other
            # in between is counted twice by their sum.
            "max_in_store": max((s["store"].get(lane["name"], 0) for s in sampler.samples
                                 if s.get("store") is not None), default=0)}
            for lane in lanes}
        return {
            "replicas": 2,
            "limit": capacity,
            "max_leases": max((t for _, t in totals), default=0.0),
            "max_leases_during_outage": max((t for at, t in totals if down_at <= at <= up_at + 5),
                                            default=0.0),
            "lanes": per_lane,
            "cpu_pct_before": round(before, 1),
            "cpu_pct_during": round(during, 1),
            "leaked_slots": int(left + leases),
            "requests": len(outcomes),
            "statuses": _count(o.status for o in outcomes),
            "statuses_arriving_during_outage": _count(o.status for o in outcomes
                                                      if down_at <= o.start < up_at),
            "running_at_outage_completed": _completed_across(outcomes, down_at),
            "timeline": [{"t": round(s["t"] - offset, 2), "inflight": sum(s["lanes"].values()), "by": s["by"],
                          "store": s.get("store")} for s in sampler.samples],
        }


#: 3.2 MB of policy-shaped YAML, every lane invalid: over the size cap, and slow to decode if read.
GARBAGE = b"lanes: [" + b"{name: x, max_inflight: nope}, " * 110_000 + b"]\n"


def _bad_policy_run(workdir: Path, bad: bool) -> dict[str, Any]:
    with bench(workdir) as b:
        b.start_backend()
        b.start_redis()
        policy = b.policy(signals=False)
        original = policy.read_bytes()
        replica = b.start_extproc("extproc", policy, "--store", b.store, "--watch-interval", "0.5")
        b.start_envoy()
        rate, duration = 20.0, 15.0
        requests = [Request(i, i / rate, "interactive", "acme", 20, 10, "/v1/chat/completions",
                            stream=False, model="llama-3.1-70b", key="sk-demo-acme",
                            gateway={"x-extproc-client": "acme"}) for i in range(int(rate * duration))]
        events: dict[float, Callable[[], Any]] = {}
        if bad:
            events = {3.0: lambda: policy.write_bytes(GARBAGE), 12.0: lambda: policy.write_bytes(original)}
        outcomes = run_async(drive(b.url, requests, events=events))
        latencies = [(o.end - o.start) * 1000 for o in outcomes if o.end is not None]
        return {"requests": len(outcomes), "non_2xx": sum(1 for o in outcomes if not 200 <= o.status < 300),
                "p99_ms": round(p99(latencies), 1),
                "reload_errors": metric_sum(replica.metrics, "extproc_policy_reloads_total", result="error")}


def _completed_across(outcomes: list[Outcome], at: float) -> str:
    running = [o for o in outcomes if o.status == 200 and o.first is not None and o.first < at
               and (o.end is None or o.end > at)]
    return f"{sum(1 for o in running if o.complete)}/{len(running)}"


def redis_outage_closed(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The same outage with --store-fail closed: nothing new is admitted while Redis is away."""
    result = redis_outage(workdir, args, fail="closed")
    return {k: v for k, v in result.items() if k != "timeline"}


def bad_policy(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    without = _bad_policy_run(workdir / "without", bad=False)
    with_bad = _bad_policy_run(workdir / "with", bad=True)
    return {"requests": with_bad["requests"], "non_2xx": with_bad["non_2xx"], "p99_ms": with_bad["p99_ms"],
            "p99_ms_without": without["p99_ms"], "non_2xx_without": without["non_2xx"],
            "reload_errors": with_bad["reload_errors"], "bad_file_bytes": len(GARBAGE)}


def prometheus_outage(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    with bench(workdir) as b:
        b.start_backend()
        b.start_redis()
        b.start_prometheus()
        replica = b.start_extproc("extproc", b.policy(), "--store", b.store)
        b.start_envoy()
        requests = workload(args.load, 30.0, args.seed)
        outcomes = run_async(drive(b.url, requests, events={
            10.0: lambda: (b.stop_prometheus(), log("Prometheus stopped")),
            20.0: lambda: (b.start_prometheus(), log("Prometheus started")),
        }))
        errors = metric_sum(replica.metrics, "extproc_signal_errors_total")
        left = wait_idle([replica])
        return {"requests": len(outcomes), "statuses": _count(o.status for o in outcomes),
                "errors_5xx": sum(1 for o in outcomes if o.status >= 500 or o.status <= 0),
                "signal_errors": errors, "leaked_slots": int(left)}


def cancels(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    with bench(workdir) as b:
        b.start_backend("test", 0.05)
        b.start_redis()
        policy = workdir / "policy.yaml"
        policy.write_text(yaml.safe_dump({
            "lanes": [{"name": "a", "max_inflight": 16, "max_queued": 400, "deadline": "20s"}],
            "classification": {"default_lane": "a"}, "ratelimit": {"mode": "off"},
            "estimation": {"read_body": "always"}}))
        replica = b.start_extproc("extproc", policy, "--store", b.store)
        b.start_envoy()
        rng = random.Random(args.seed)
        n, rate = args.cancels, 250.0
        requests = [Request(i, i / rate, "a", "default", rng.randint(10, 200), rng.randint(5, 200),
                            "/v1/chat/completions", stream=True, model="m") for i in range(n)]

        def cancel_after(_: Request) -> float | None:
            kind = rng.random()
            if kind < 0.2:
                return rng.uniform(0.0, 0.005)   # gone while sending or being classified
            if kind < 0.9:
                return rng.uniform(0.01, 1.0)    # gone while queued or streaming
            return None                          # stays to the end

        outcomes = run_async(drive(b.url, requests, cancel=cancel_after, connections=0))
        left = wait_idle([replica])
        time.sleep(1)
        return {"n": len(outcomes), "completed": sum(1 for o in outcomes if o.complete),
                "cancelled": sum(1 for o in outcomes if not o.complete),
                "leaked_slots": int(left + b.leases()),
                "stream_errors": metric_sum(replica.metrics, "extproc_stream_errors_total")}


#: Memory bounds of the soaks (issue "Runs for weeks"): after the warm-up, RSS grows by at most this
#: share, and the least-squares slope of RSS over requests stays under this many bytes per request.
SOAK_MAX_GROWTH = 0.03
SOAK_MAX_BYTES_PER_REQUEST = 10.0
#: How often the soaks sample RSS, open files and Envoy's request count.
SOAK_SAMPLE_S = 10.0


def slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ys over xs (0 with fewer than two distinct xs)."""
    if len(set(xs)) < 2:
        return 0.0
    return statistics.linear_regression(xs, ys).slope


def memory_verdict(series: list[dict[str, float]], warmup: float) -> dict[str, Any]:
    """From the samples after the warm-up: RSS at its start and end, the growth, and the slope of RSS over
    the requests Envoy received, in bytes per request (the samples keep both, so it can be recomputed)."""
    after = [s for s in series if s["t"] >= warmup]
    if len(after) < 2:
        return {"bytes_per_request": None, "growth": None}
    start, end = after[0], after[-1]
    per_request = slope([s["requests"] for s in after], [s["rss_mb"] * 1024 * 1024 for s in after])
    growth = (end["rss_mb"] - start["rss_mb"]) / start["rss_mb"]
    return {"rss_mb_start": start["rss_mb"], "rss_mb_end": end["rss_mb"],
            "requests_after_warmup": end["requests"] - start["requests"],
            "bytes_per_request": round(per_request, 2), "growth": round(growth, 4),
            "targets": {"growth_at_most": SOAK_MAX_GROWTH,
                        "bytes_per_request_at_most": SOAK_MAX_BYTES_PER_REQUEST,
                        "met": growth <= SOAK_MAX_GROWTH and per_request <= SOAK_MAX_BYTES_PER_REQUEST}}


async def sample_memory(b: Bench, pid: int, duration: float, series: list[dict[str, float]]) -> None:
    """Every SOAK_SAMPLE_S: extproc's RSS and open files, the requests Envoy received so far, and those it
    has open (``active``: held and running; what they hold is memory in use, not a leak)."""
    origin = time.monotonic()
    while True:
        requests = await asyncio.to_thread(b.envoy_counter, "http.inference.downstream_rq_total")
        active = await asyncio.to_thread(b.envoy_counter, "http.inference.downstream_rq_active")
        series.append({"t": round(time.monotonic() - origin, 1), "rss_mb": round(rss_mb(pid), 3),
                       "fds": open_files(pid), "requests": requests, "active": active})
        if time.monotonic() - origin >= duration:
            return
        await asyncio.sleep(min(SOAK_SAMPLE_S, max(0.0, duration - (time.monotonic() - origin))))


def soak(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The chatbot workload at 2x through Envoy for ``--soak-minutes``: does extproc's memory stay flat?"""
    minutes = args.soak_minutes
    with bench(workdir) as b:
        b.start_backend()
        b.start_redis()
        b.start_prometheus()
        replica = b.start_extproc("extproc", b.policy(), "--store", b.store)
        b.start_envoy()
        duration = minutes * 60.0
        warmup = min(120.0, duration * 0.2)
        requests = workload(2.0, duration, args.seed)
        pid = replica.process.popen.pid
        series: list[dict[str, float]] = []

        async def both() -> list[Outcome]:
            watcher = asyncio.create_task(sample_memory(b, pid, duration, series))
            try:
                out: list[Outcome] = await drive(b.url, requests, drain=120.0)
                return out
            finally:
                await watcher

        outcomes = run_async(both())
        left = wait_idle([replica])
        verdict = memory_verdict(series, warmup)
        log(f"soak: {json.dumps(verdict)}")
        return {"minutes": minutes, "load": 2.0, "warmup_s": warmup, **verdict,
                "fds_start": series[0]["fds"], "fds_end": series[-1]["fds"],
                "requests": len(outcomes), "statuses": _count(o.status for o in outcomes),
                "leaked_slots": int(left), "series": series}


#: The fast soak's policy: limits that never bind, the body read, one decision line per request (as
#: deployed): every request goes through the whole decision path.
FAST_POLICY = {
    "version": 1,
    "lanes": [{"name": "default", "max_inflight": 10000, "max_queued": 10000, "deadline": "30s"}],
    "classification": {"default_lane": "default"},
    "estimation": {"read_body": "always"},
}
FAST_BODY = '{"model":"soak","messages":[{"role":"user","content":"Say hello."}],"max_tokens":16}'
#: wrk at a fixed rate: each connection sends its next request at the next slot of its own schedule.
FAST_LUA = r"""
wrk.method = "POST"
wrk.body = [==[@BODY@]==]
wrk.headers["Content-Type"] = "application/json"
local interval, next_at
local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_nsec; } soak_timespec;
int clock_gettime(int clk, soak_timespec *tp);
]]
local ts = ffi.new("soak_timespec")
local function now_ms()
  ffi.C.clock_gettime(1, ts)
  return tonumber(ts.tv_sec) * 1000 + tonumber(ts.tv_nsec) / 1e6
end
function init(args) interval = 1000 / tonumber(args[1]) end
function delay()
  local t = now_ms()
  if next_at == nil then next_at = t end
  local slot = next_at
  next_at = next_at + interval
  if slot <= t then return 0 end
  return math.floor(slot - t + 0.5)
end
"""


def soak_fast(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``--fast-rate`` requests/s (default 550) through Envoy (the shipped config) to the instant upstream
    (bench/upstream.py) for ``--fast-minutes``: extproc's memory per request, at ten times the soak's rate."""
    minutes, rate = args.fast_minutes, args.fast_rate
    with bench(workdir) as b:
        upstream = free_port()
        b.stack.start("upstream", [sys.executable, str(ROOT / "bench" / "upstream.py"), str(upstream)])
        wait_http(f"http://127.0.0.1:{upstream}/health", proc=b.stack.processes[-1].popen)
        b.backend = upstream
        policy = workdir / "policy.yaml"
        policy.write_text(yaml.safe_dump(FAST_POLICY, sort_keys=False))
        # (At info: a decision line for every request, as deployed.)
        replica = b.start_extproc("extproc", policy, "--log-level", "info")
        b.start_envoy()
        script = workdir / "paced.lua"
        script.write_text(FAST_LUA.replace("@BODY@", FAST_BODY))
        duration = minutes * 60.0
        warmup = min(120.0, duration * 0.2)
        connections = 32
        pid = replica.process.popen.pid
        series: list[dict[str, float]] = []

        async def run() -> str:
            watcher = asyncio.create_task(sample_memory(b, pid, duration, series))
            try:
                # (One wrk thread: its one schedule paces every connection, rate requests a second.)
                proc = await asyncio.create_subprocess_exec(
                    "wrk", "-t1", f"-c{connections}", f"-d{duration:g}s", "--timeout", "5s",
                    "-s", str(script), f"{b.url}/v1/chat/completions", "--", str(rate),
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
                out, _ = await proc.communicate()
                return out.decode(errors="replace")
            finally:
                await watcher

        wrk_out = run_async(run())
        left = wait_idle([replica])
        verdict = memory_verdict(series, warmup)
        admitted = metric_sum(replica.metrics, "inference_admission_decisions_total", outcome="admitted")
        requests = series[-1]["requests"]
        log(f"soak_fast: {requests} requests, {json.dumps(verdict)}")
        return {"minutes": minutes, "rate": rate, "connections": connections, "warmup_s": warmup, **verdict,
                "requests": requests, "achieved_rate": round(requests / max(series[-1]["t"], 1.0), 1),
                "admitted": int(admitted), "fds_start": series[0]["fds"], "fds_end": series[-1]["fds"],
                "leaked_slots": int(left), "wrk": wrk_out.strip().splitlines()[-6:], "series": series}


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    outage = result.get("redis_outage")
    if not outage:
        return
    fig, ax = plt.subplots(figsize=(8, 3.5))
    t = [p["t"] for p in outage["timeline"]]
    ax.plot(t, [p["inflight"] for p in outage["timeline"]], label="in flight, both replicas")
    ax.axhline(outage["limit"], color="red", linestyle="--", label=f"capacity limit ({outage['limit']})")
    ax.axvspan(15, 30, color="grey", alpha=0.2, label="Redis down")
    ax.set_xlabel("seconds")
    ax.set_ylabel("requests in flight")
    ax.set_title("Redis outage under 1.5x load: two replicas, one set of limits")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def code_version() -> dict[str, Any]:
    """The commit this ran on, and the paths that differed from it (none: the commit's own code)."""
    def git(*argv: str) -> str:
        run = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, check=False)
        return run.stdout.rstrip() if run.returncode == 0 else ""
    # (Porcelain lines are "XY path": the status columns may be blank, so never strip their left.)
    changed = [line[3:] for line in git("status", "--porcelain").splitlines() if line.strip()]
    return {"commit": git("rev-parse", "HEAD").strip() or None, "changed_paths": changed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=SCENARIOS, help="run only these scenarios")
    parser.add_argument("--load", type=float, default=1.5, help="multiple of the engine's capacity")
    parser.add_argument("--soak-minutes", type=float, default=30.0, help="0 skips the soak")
    parser.add_argument("--fast-minutes", type=float, default=15.0, help="the fast soak's length; 0 skips it")
    parser.add_argument("--fast-rate", type=float, default=550.0, help="the fast soak's requests per second")
    parser.add_argument("--cancels", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--out", default=str(RESULTS / "chaos"))
    args = parser.parse_args()
    skipped = {"soak": args.soak_minutes <= 0, "soak_fast": args.fast_minutes <= 0}
    chosen = [s for s in (args.only or SCENARIOS) if not skipped.get(s, False)]
    out = Path(args.out)
    previous: dict[str, Any] = {}
    if out.with_suffix(".json").exists() and args.only:
        previous = json.loads(out.with_suffix(".json").read_text())
    result: dict[str, Any] = dict(previous)
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                         "load_avg_at_start": os.getloadavg()}
    result["code"] = code_version()
    with tempfile.TemporaryDirectory(prefix="extproc-chaos-") as tmp:
        for name in chosen:
            log(f"scenario {name}")
            started = time.monotonic()
            scenario = globals()[name](Path(tmp) / name, args)
            scenario["wall_s"] = round(time.monotonic() - started, 1)
            scenario["code"] = result["code"]  # (each scenario's own: --only runs merge into one file)
            result[name] = scenario
            summary = {k: v for k, v in scenario.items() if k not in ("timeline", "series")}
            log(f"{name}: {json.dumps(summary)}")
            out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

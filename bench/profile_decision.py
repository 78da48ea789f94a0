"""Where extproc's CPU goes per request, and A/B comparisons of code versions behind the same Envoy.

Starts ``bench/upstream.py``, the shipped Envoy config (``localstack.envoy_config``: ratelimit
filter + ext_proc) in front of one ``extproc serve`` per variant (each its own checkout, put first
on its PYTHONPATH; by default this checkout), optionally ``bench/noop_extproc.py`` (``--noop``, on
asyncio's loop; ``--noop-args NAME=ARGS`` for more, e.g. on uvloop's),
all with the policy ``bench/overhead.py`` uses (one lane whose limits never bind, ``read_body:
always``). Then

* ``--profile SECONDS``: py-spy records the first variant's extproc under closed-loop wrk, once
  as collapsed stacks (turned into a top-20 table by own and by cumulative time, markdown) and
  once as a flame graph SVG;
* ``--reps N``: interleaved closed-loop wrk runs over every configuration (rotated order),
  reporting req/s, latency and extproc CPU µs per request (from /proc) for each, and medians;
  ``--rate R`` adds paced runs (latency at a fixed rate).

Run: ``python bench/profile_decision.py --profile 15 --out bench/results`` or
``python bench/profile_decision.py --variant base=/tmp/base --variant new=. --reps 3``.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import overhead  # noqa: E402
from extproc import bootstrap, localstack  # noqa: E402
from extproc.settings import Address  # noqa: E402

BENCH = Path(__file__).resolve().parent


def start(s: localstack.Stack, workdir: Path, variants: list[tuple[str, Path]],
          noops: list[tuple[str, list[str]]], policy_text: str, redis: bool = False,
          extra: dict[str, list[str]] | None = None) -> list[overhead.Config]:
    upstream = localstack.free_port()
    up = s.start("upstream", [sys.executable, str(BENCH / "upstream.py"), str(upstream)])
    localstack.wait_http(f"http://127.0.0.1:{upstream}/health", proc=up.popen)
    policy = workdir / "policy.yaml"
    policy.write_text(policy_text)
    configs: list[overhead.Config] = []
    store: list[str] = []
    if redis:  # every variant on one redis-server of its own, each under its own prefix
        url, _ = overhead.start_redis(s, workdir)
        store = ["--store", url]
    for name, noop_args in noops:
        port = localstack.free_port()
        proc = s.start(name, [sys.executable, str(BENCH / "noop_extproc.py"), str(port), "--body", "auto",
                              *noop_args])
        overhead._wait_tcp_started(proc, port)
        cfg = overhead.Config(name, localstack.free_port(), localstack.free_port(),
                              {"ext_proc": proc.popen.pid})
        cfg.pids["grpc_port"] = port  # not a pid: popped below
        configs.append(cfg)
    for name, path in variants:
        grpc, http = localstack.free_port(), localstack.free_port()
        # NAME=CHECKOUT[:MORE]: more entries (a sitecustomize probe, say) may follow the checkout.
        # PYTHONSAFEPATH: ``python -m`` would otherwise put the working directory first on sys.path,
        # and run from a checkout every variant would import that checkout's extproc.
        env = {"PYTHONPATH": ":".join(str(Path(p).resolve()) for p in str(path).split(":")),
               "PYTHONSAFEPATH": "1"}
        on = [*store, "--store-prefix", f"profile-{name}"] if store else []
        proc = s.extproc(policy, grpc, http, "--log-level", "info", *on, *(extra or {}).get(name, []),
                         name=f"extproc-{name}", env=env)
        cfg = overhead.Config(name, localstack.free_port(), localstack.free_port(),
                              {"ext_proc": proc.popen.pid}, metrics_urls=[f"http://127.0.0.1:{http}/metrics"])
        cfg.pids["grpc_port"] = grpc  # not a pid: popped below
        configs.append(cfg)
    for cfg in configs:
        port = cfg.pids.pop("grpc_port")
        # The no-op sets no admission metadata: its Envoy runs without the admission gate.
        local = "127.0.0.1"
        envoy_cfg = bootstrap.render(Address(local, cfg.listen), Address(local, cfg.envoy_admin),
                                     Address(local, upstream), Address(local, port),
                                     fail_open=cfg.key in dict(noops))
        cfg.pids["envoy"] = s.envoy(envoy_cfg, name=f"envoy-{cfg.key}").popen.pid
    return configs


def named_args(parser: argparse.ArgumentParser, flag: str, given: list[str],
               names: list[str] | None = None) -> dict[str, list[str]]:
    """``FLAG NAME=ARGS`` items by NAME (repeats add up). ``names``: the only NAMEs allowed (else any plain
    name but upstream and redis, whose log files the stack keeps): a NAME that names nothing is an
    error, not a silent A/B of two identical configurations."""
    out: dict[str, list[str]] = {}
    for item in given:
        name, sep, text = item.partition("=")
        ok = name in names if names is not None else (
            re.fullmatch(r"[A-Za-z0-9_-]+", name) is not None and name not in ("upstream", "redis"))
        if not sep or not ok:
            known = f"one of {', '.join(names)}" if names is not None else \
                "letters, digits, _ and - (not upstream or redis)"
            parser.error(f"{flag} {item!r}: expected NAME=ARGS with NAME {known}")
        out.setdefault(name, []).extend(shlex.split(text))
    return out


def _commit(path: Path) -> str | None:
    """The checkout's commit, with ``-dirty`` when tracked files changed since."""
    try:
        return subprocess.run(["git", "-C", str(path).split(":")[0], "describe", "--always", "--dirty"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


Row = tuple[str, float, float]


def collapsed_top(path: Path, n: int = 20) -> tuple[list[Row], list[Row], int]:
    """(by own time, by cumulative time, total samples) from py-spy's collapsed stacks."""
    own: collections.Counter[str] = collections.Counter()
    cum: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        k = int(count)
        total += k
        frames = [f.split(" (", 1)[0] + " (" + f.split(" (", 1)[1].rsplit(":", 1)[0] + ")" if " (" in f else f
                  for f in stack.split(";")]
        own[frames[-1]] += k
        for f in set(frames):
            cum[f] += k

    def rows(counter: collections.Counter[str]) -> list[Row]:
        return [(f, 100 * c / total, 100 * cum[f] / total) for f, c in counter.most_common(n)]

    by_own = [(f, 100 * c / total, 100 * cum[f] / total) for f, c in own.most_common(n)]
    return by_own, rows(cum), total


def markdown(by_own: list[Row], by_cum: list[Row], total: int,
             command: str, extra: str) -> str:
    def short(f: str) -> str:
        f = f.replace(str(ROOT) + "/", "")
        return re.sub(r"/\S*/lib/python3\.\d+/(site-packages/)?", "", f)

    head = ["| # | function (file) | own % | cumulative % |", "|---|---|---:|---:|"]
    out = [f"Command: `{command}`", "", extra, "",
           f"{total} samples (py-spy, 100 Hz, idle excluded; without --native, time in gRPC's Cython/C "
           "core shows as the Python frame that called it, mostly `Handle._run` and the poller's "
           "`Thread.run`).", "", "### By own time", "", *head]
    out += [f"| {i} | `{short(f)}` | {o:.1f} | {c:.1f} |" for i, (f, o, c) in enumerate(by_own, 1)]
    out += ["", "### By cumulative time", "", *head]
    out += [f"| {i} | `{short(f)}` | {o:.1f} | {c:.1f} |" for i, (f, o, c) in enumerate(by_cum, 1)]
    return "\n".join(out) + "\n"


def py_spy(pid: int, seconds: int, fmt: str, out: Path, native: bool) -> None:
    spy = Path(sys.executable).parent / "py-spy"
    subprocess.run([str(spy), "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "100",
                    "--format", fmt, "--output", str(out), *(["--native"] if native else ["--nonblocking"])],
                   check=True, capture_output=True, timeout=seconds + 60)


def syscalls(cfg: overhead.Config, script: Path, seconds: int, connections: int) -> None:
    """System calls of the ext_proc process per request (strace -c -f), under closed-loop wrk."""
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{seconds + 2}s", "-s", str(script), cfg.url]
    wrk = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    time.sleep(1)
    before = _requests(cfg)
    trace = subprocess.run(["timeout", "-s", "INT", str(seconds), "strace", "-c", "-f", "-p",
                            str(cfg.pids["ext_proc"])], capture_output=True, text=True, check=False)
    n = _requests(cfg) - before
    wrk.communicate(timeout=60)
    print(f"{cfg.key}: {n:.0f} requests while traced; calls per request:")
    for line in trace.stderr.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] not in ("total",):
            calls = int(parts[3])
            if n and calls / n >= 0.05:
                print(f"  {parts[-1]:16} {calls / n:6.2f}")


def parallel(configs: list[overhead.Config], script: Path, seconds: int, connections: int,
             args: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Closed-loop wrk on every configuration at once: each sees the same machine (a neighbour's load
    hits all alike), so their CPU per request compares even on a busy machine."""
    before = {c.key: overhead.cpu_seconds(c.pids["ext_proc"]) for c in configs}
    procs = {c.key: subprocess.Popen(["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "2s",
                                      "-s", str(script), c.url, "--", *args],
                                     stdout=subprocess.PIPE, text=True)
             for c in configs}
    out: dict[str, dict[str, Any]] = {}
    for c in configs:
        stdout, _ = procs[c.key].communicate(timeout=seconds + 30)
        line = next(x for x in stdout.splitlines() if x.startswith("WRKJSON "))
        r: dict[str, Any] = json.loads(line.removeprefix("WRKJSON "))
        r["req_per_s"] = r["requests"] / (r["duration_us"] / 1e6)
        r["latency_ms"] = {k: v / 1000 for k, v in r.pop("latency_us").items()}
        cpu = overhead.cpu_seconds(c.pids["ext_proc"]) - before[c.key]
        r["cpu_us_per_request"] = {"ext_proc": cpu / max(r["requests"], 1) * 1e6}
        out[c.key] = r
    return out


def _requests(cfg: overhead.Config) -> float:
    """Requests the process answered so far: extproc's decisions, or the upstream's count for the no-op."""
    return sum(sum(d.values()) for d in overhead.extproc_decisions(cfg)) if cfg.metrics_urls else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=CHECKOUT[:PATH…] (default: this one)")
    parser.add_argument("--noop", action="store_true", help="also the no-op ext_proc server")
    parser.add_argument("--profile", type=int, default=0, help="seconds of py-spy per format (0: none)")
    parser.add_argument("--reps", type=int, default=0, help="interleaved closed-loop repetitions")
    parser.add_argument("--duration", type=int, default=5, help="seconds per closed-loop run")
    parser.add_argument("--rate", type=int, default=0, help="also paced runs at this rate (0: none)")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--read-body", default="always")
    parser.add_argument("--out", type=Path, default=None, help="where profile_top20.md/.svg go")
    parser.add_argument("--tag", default="", help="suffix of the profile files")
    parser.add_argument("--parallel", type=int, default=0,
                        help="repetitions of closed-loop wrk on every configuration at once")
    parser.add_argument("--paced", type=int, default=0,
                        help="with --parallel: wrk paced at this rate on each configuration, not closed-loop")
    parser.add_argument("--strace", type=int, default=0, help="seconds of strace -c per configuration")
    parser.add_argument("--native", action="store_true", help="py-spy --native: C frames too (gRPC's core)")
    parser.add_argument("--keep", action="store_true", help="keep the process logs (printed path)")
    parser.add_argument("--extproc-args", action="append", default=[], metavar="NAME=ARGS",
                        help="more extproc serve arguments for one variant (asyncio='--event-loop asyncio')")
    parser.add_argument("--noop-args", action="append", default=[], metavar="NAME=ARGS",
                        help="a no-op server more, named NAME, with noop_extproc.py's ARGS "
                        "(noop_uvloop='--event-loop uvloop')")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write every run and the medians there (with --reps/--parallel)")
    parser.add_argument("--redis", action="store_true",
                        help="extproc on a redis-server this script starts (--store redis://…)")
    args = parser.parse_args()
    variants = [(v.split("=", 1)[0], Path(v.split("=", 1)[1])) for v in args.variant] or [("this", ROOT)]
    serve_args = named_args(parser, "--extproc-args", args.extproc_args, [name for name, _ in variants])
    noop_args = named_args(parser, "--noop-args", args.noop_args)
    if args.noop:
        noop_args.setdefault("noop", [])
    if clash := set(noop_args) & {name for name, _ in variants}:
        parser.error(f"--noop-args: {', '.join(sorted(clash))} is a variant's name already")
    noops = sorted(noop_args.items(), key=lambda item: item[0] != "noop")  # --noop's first
    workdir = Path(tempfile.mkdtemp(prefix="extproc-profile-"))
    closed, paced = workdir / "closed.lua", workdir / "paced.lua"
    common = overhead.LUA_COMMON.replace("@BODY@", overhead.BODY)
    closed.write_text(overhead.LUA_CLOSED + common)
    paced.write_text(overhead.LUA_PACED + common)
    results: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    try:
        with localstack.stack(workdir) as s:
            configs = start(s, workdir, variants, noops, overhead.POLICY.format(read_body=args.read_body),
                            redis=args.redis, extra=serve_args)
            for cfg in configs:
                print(f"{cfg.key}: {cfg.url} {cfg.pids}", flush=True)
                overhead.check_path(cfg)
                overhead.wrk(cfg, closed, duration=2, connections=8, threads=1, args=[])
            if args.profile:
                cfg = next(c for c in configs if c.key not in dict(noops))
                out = args.out or workdir
                out.mkdir(parents=True, exist_ok=True)
                raw, svg = workdir / "stacks.txt", out / f"profile_flame{args.tag}.svg"
                for fmt, target in (("raw", raw), ("flamegraph", svg)):
                    wrk = subprocess.Popen(["wrk", "-t1", f"-c{args.connections}", f"-d{args.profile + 2}s",
                                            "-s", str(closed), cfg.url], stdout=subprocess.PIPE, text=True)
                    before = overhead.cpu_seconds(cfg.pids["ext_proc"])
                    time.sleep(0.5)
                    py_spy(cfg.pids["ext_proc"], args.profile, fmt, target, args.native)
                    after = overhead.cpu_seconds(cfg.pids["ext_proc"])
                    stdout, _ = wrk.communicate(timeout=60)
                    line = next(x for x in stdout.splitlines() if x.startswith("WRKJSON "))
                    summary = json.loads(line.removeprefix("WRKJSON "))
                    rps = summary["requests"] / (summary["duration_us"] / 1e6)
                    print(f"profiled ({fmt}): {rps:.0f} req/s; extproc CPU {after - before:.1f} s "
                          f"over ~{args.profile} s (includes py-spy's pauses)", flush=True)
                by_own, by_cum, total = collapsed_top(raw)
                command = shlex.join(["python", "bench/profile_decision.py", *sys.argv[1:]])
                extra = (f"extproc serve (policy of bench/overhead.py, read_body: {args.read_body}, "
                         f"ratelimit enforce) behind the shipped Envoy config, "
                         f"closed-loop wrk -c{args.connections}: "
                         f"{rps:.0f} req/s while sampled.")
                text = markdown(by_own, by_cum, total, command, extra)
                (out / f"profile_top20{args.tag}.md").write_text(text)
                print(text)
            if args.strace:
                for cfg in configs:
                    syscalls(cfg, closed, args.strace, args.connections)
            keys = [c.key for c in configs]
            by_key = {c.key: c for c in configs}
            for _ in range(args.parallel):
                if args.paced:  # the same fixed rate on each: equal work, so CPU per request compares
                    runs = parallel(configs, paced, args.duration, 16, (str(args.paced), "1"))
                else:
                    runs = parallel(configs, closed, args.duration, args.connections)
                for key, r in runs.items():
                    results[f"parallel:{key}"].append(r)
                    print(f"parallel {key:8} {r['req_per_s']:7.0f} req/s  extproc "
                          f"{r['cpu_us_per_request']['ext_proc']:.0f} µs/req  non2xx {r['non2xx']}",
                          flush=True)
            for phase in (["rate"] if args.rate else []) + (["closed"] if args.reps else []):
                for key in (k for rep in range(args.reps or 1) for k in overhead._rotated(keys, rep)):
                    cfg = by_key[key]
                    if phase == "rate":
                        r = overhead.wrk(cfg, paced, duration=args.duration, connections=16, threads=1,
                                         args=[str(args.rate), "1"])
                    else:
                        r = overhead.wrk(cfg, closed, duration=args.duration, connections=args.connections,
                                         threads=1, args=[])
                    results[f"{phase}:{key}"].append(r)
                    lat = r["latency_ms"]
                    print(f"{phase:6} {key:8} {r['req_per_s']:7.0f} req/s  p50 {lat['p50']:.2f} "
                          f"p99 {lat['p99']:.2f}"
                          f"  extproc {r['cpu_us_per_request']['ext_proc']:.0f} µs/req  non2xx {r['non2xx']}"
                          f"  busy {r['machine_busy']:.0%}", flush=True)
    finally:
        if args.keep:
            print(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    if results:
        print("\nmedians:")
        medians: dict[str, dict[str, float]] = {}
        for name, runs in results.items():
            def med(f: Any, runs: list[dict[str, Any]] = runs) -> float:
                return float(statistics.median(f(r) for r in runs))
            medians[name] = {"req_per_s": med(lambda r: r["req_per_s"]),
                             "p50_ms": med(lambda r: r["latency_ms"]["p50"]),
                             "p99_ms": med(lambda r: r["latency_ms"]["p99"]),
                             "extproc_cpu_us_per_request": med(lambda r: r["cpu_us_per_request"]["ext_proc"])}
            m = medians[name]
            print(f"  {name:16} {m['req_per_s']:7.0f} req/s  p50 {m['p50_ms']:.2f}  p99 {m['p99_ms']:.2f}"
                  f"  extproc {m['extproc_cpu_us_per_request']:.0f} µs/req")
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({
                "benchmark": "profile_decision",
                "command": shlex.join(["python", "bench/profile_decision.py", *sys.argv[1:]]),
                "machine": overhead.machine_info(),
                "variants": {name: {"checkout": str(path), "commit": _commit(path),
                                    "extproc_args": serve_args.get(name, [])} for name, path in variants},
                "noops": noop_args,
                "medians": medians,
                "runs": results,
            }, indent=1))
            print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

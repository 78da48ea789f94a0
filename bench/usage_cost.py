"""What reading token usage from the response costs: CPU per request and latency per chunk.

Token budgets need the tokens a response used, which vLLM reports only in the body (a stream's
only in its last event, and only when asked). Three configurations stream the same responses
through the shipped Envoy config and a real ``extproc serve``, side by side, interleaved:

* ``no_budget``   a policy without token budgets: nothing is read (today's cost, the baseline);
* ``proxy_lua``   token budgets on, the shipped design: ext_proc sets ``include_usage`` on the
                  request body it already reads, and Envoy's ``extproc.usage`` Lua filter reads
                  ``total_tokens`` as the chunks pass and strips the usage event the client did
                  not ask for (no response byte goes to extproc);
* ``ext_proc_streamed``  the same, plus the alternative: a second, fail-open ext_proc filter with
                  ``response_body_mode: STREAMED`` to ``bench/noop_extproc.py`` (which answers
                  each chunk CONTINUE and parses nothing: a lower bound of reading usage in a
                  Python ext_proc, each chunk waiting for its answer).

The upstream (``--serve``, a subprocess) streams SSE chunks in vLLM's shape, each carrying its
send time; the client (aiohttp, this process) notes each chunk's arrival, so a chunk's latency is
arrival − send on one clock. CPU is user+system of Envoy, extproc and the no-op server over each
configuration's runs, per request. Bounded: ``--requests`` per configuration and round.

Run: ``.venv/bin/python bench/usage_cost.py [--rounds 3] [--requests 40] [--chunks 100]``.
Writes ``bench/results/usage_cost.json`` and ``bench/results/usage_cost.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from extproc import localstack  # noqa: E402  (after the path fix, so it runs from a checkout)

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = ("no_budget", "proxy_lua", "ext_proc_streamed")
POLICY = """\
version: 1
lanes:
  - {{name: default, max_inflight: 10000, max_queued: 10000, deadline: 30s}}
capacity: {{max_hold: 300s}}
trusted_headers: [x-extproc-client]
classification: {{default_lane: default}}
tenants: {{header: x-extproc-client, default: anonymous}}
estimation: {{read_body: always}}
{budgets}"""
BUDGETS = "ratelimit: {budgets: {default: {tokens: 4000000000, per: day}}}\n"


# -- the upstream (a subprocess) ---------------------------------------------------------------


async def _serve(port: int, gap_s: float) -> None:
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        doc = json.loads(await request.read())
        chunks = int(doc.get("max_tokens", 10))
        asked = bool((doc.get("stream_options") or {}).get("include_usage"))
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for _i in range(chunks):
            event = {"id": "b", "object": "chat.completion.chunk", "model": "bench", "t": time.time(),
                     "choices": [{"index": 0, "delta": {"content": "tok"}, "finish_reason": None}]}
            await response.write(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")
            await asyncio.sleep(gap_s)
        if asked:
            usage = {"id": "b", "object": "chat.completion.chunk", "model": "bench", "choices": [],
                     "usage": {"prompt_tokens": 20, "completion_tokens": chunks, "total_tokens": 20 + chunks}}
            await response.write(b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


# -- the client ---------------------------------------------------------------------------------


async def _one(session: Any, url: str, chunks: int) -> tuple[list[float], bool, bool]:
    """(chunk latencies in ms, saw a usage event, ok)."""
    body = {"model": "bench", "messages": [{"role": "user", "content": "hello " * 12}], "max_tokens": chunks,
            "stream": True}
    latencies: list[float] = []
    usage = False
    async with session.post(url, json=body, headers={"authorization": "Bearer sk-demo-acme"}) as response:
        if response.status != 200:
            await response.read()
            return latencies, usage, False
        async for line in response.content:
            now = time.time()
            if not line.startswith(b"data: {"):
                continue
            doc = json.loads(line[6:])
            if "usage" in doc:
                usage = True
            elif "t" in doc:
                latencies.append((now - doc["t"]) * 1000)
    return latencies, usage, len(latencies) == chunks


async def _load(url: str, requests: int, concurrency: int, chunks: int) -> dict[str, Any]:
    import aiohttp

    latencies: list[float] = []
    usage_seen = ok = 0
    queue = list(range(requests))

    async def worker(session: Any) -> None:
        nonlocal usage_seen, ok
        while queue:
            queue.pop()
            lat, saw, good = await _one(session, url, chunks)
            latencies.extend(lat)
            usage_seen += saw
            ok += good

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
    return {"latencies": latencies, "usage_seen": usage_seen, "ok": ok}


# -- stacks ---------------------------------------------------------------------------------------


def _second_ext_proc(port: int) -> Any:
    """A tweak adding the alternative design: a fail-open ext_proc that streams response bodies."""
    def tweak(config: dict[str, Any]) -> None:
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        filters = hcm["http_filters"]
        streamed = {
            "name": "bench.response_body",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {"envoy_grpc": {"cluster_name": "bench_streamed"}, "timeout": "2s"},
                "failure_mode_allow": True,
                "processing_mode": {"request_header_mode": "SKIP", "response_header_mode": "SKIP",
                                    "request_body_mode": "NONE", "response_body_mode": "STREAMED",
                                    "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"},
                "message_timeout": "1s",
            },
        }
        filters.insert(len(filters) - 1, streamed)
        cluster = json.loads(json.dumps(next(c for c in config["static_resources"]["clusters"]
                                             if c["name"] == "extproc")))
        cluster["name"] = cluster["load_assignment"]["cluster_name"] = "bench_streamed"
        endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        endpoint["address"]["socket_address"]["port_value"] = port
        config["static_resources"]["clusters"].append(cluster)
    return tweak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=40, help="per configuration and round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=100, help="SSE chunks per response")
    parser.add_argument("--gap-ms", type=float, default=10.0, help="between chunks, as a decode step")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(args.serve, args.gap_ms / 1000))
        return 0
    from bench.overhead import cpu_seconds

    workdir = Path(tempfile.mkdtemp(prefix="usage-cost-"))
    stack = localstack.Stack(workdir)
    try:
        upstream = localstack.free_port()
        stack.start("upstream", [sys.executable, __file__, "--serve", str(upstream),
                                 "--gap-ms", str(args.gap_ms)])
        localstack.wait_http(f"http://127.0.0.1:{upstream}/health", proc=stack.processes[-1].popen)
        noop = localstack.free_port()
        noop_proc = stack.start("noop", [sys.executable, str(ROOT / "bench" / "noop_extproc.py"), str(noop)])
        stacks: dict[str, tuple[str, list[int], str]] = {}
        for name in CONFIGS:
            policy = workdir / f"{name}.yaml"
            policy.write_text(POLICY.format(budgets="" if name == "no_budget" else BUDGETS))
            grpc, http = localstack.free_port(), localstack.free_port()
            extproc = stack.extproc(policy, grpc, http, "--log-level", "warning", name=f"extproc-{name}")
            listen, admin = localstack.free_port(), localstack.free_port()
            tweak = _second_ext_proc(noop) if name == "ext_proc_streamed" else None
            envoy = stack.envoy(localstack.envoy_config(listen, admin, upstream, grpc, tweak=tweak),
                                name=f"envoy-{name}")
            pids = [extproc.popen.pid, envoy.popen.pid] + ([noop_proc.popen.pid] if tweak else [])
            stacks[name] = (f"http://127.0.0.1:{listen}/v1/chat/completions", pids,
                            f"http://127.0.0.1:{http}/metrics")
        runs: dict[str, dict[str, Any]] = {n: {"latencies": [], "cpu_s": 0.0, "requests": 0, "ok": 0,
                                               "usage_seen": 0} for n in CONFIGS}
        asyncio.run(_load(stacks["no_budget"][0], 8, 4, 10))  # warm-up
        for r in range(args.rounds):
            for name in CONFIGS[r % 3:] + CONFIGS[:r % 3]:
                url, pids, _ = stacks[name]
                before = sum(cpu_seconds(p) for p in pids)
                out = asyncio.run(_load(url, args.requests, args.concurrency, args.chunks))
                run = runs[name]
                run["cpu_s"] += sum(cpu_seconds(p) for p in pids) - before
                run["latencies"].extend(out["latencies"])
                run["requests"] += args.requests
                run["ok"] += out["ok"]
                run["usage_seen"] += out["usage_seen"]
                print(f"round {r + 1} {name}: ok {out['ok']}/{args.requests}", file=sys.stderr)
        from tests.integration.conftest import metric

        summary: dict[str, Any] = {}
        for name, run in runs.items():
            lat = sorted(run["latencies"])
            q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [0.0] * 99
            summary[name] = {
                "requests": run["requests"], "ok": run["ok"], "chunks": len(lat),
                "chunk_latency_ms": {"p50": round(q[49], 3), "p99": round(q[98], 3)},
                "cpu_us_per_request": round(run["cpu_s"] / max(run["requests"], 1) * 1e6),
                "cpu_us_per_chunk": round(run["cpu_s"] / max(len(lat), 1) * 1e6, 1),
                "usage_events_seen_by_client": run["usage_seen"],
                "usage_reports": metric(stacks[name][2], "extproc_ratelimit_usage_reports_total"),
            }
        base = summary["no_budget"]
        for name in ("proxy_lua", "ext_proc_streamed"):
            s = summary[name]
            s["added_chunk_latency_ms"] = {k: round(s["chunk_latency_ms"][k] - base["chunk_latency_ms"][k], 3)
                                           for k in ("p50", "p99")}
            s["added_cpu_us_per_request"] = s["cpu_us_per_request"] - base["cpu_us_per_request"]
            ratio = s["cpu_us_per_request"] / max(base["cpu_us_per_request"], 1)
            s["cpu_ratio_vs_no_budget"] = round(ratio, 3)
        doc = {
            "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
            "command": " ".join(["bench/usage_cost.py", *sys.argv[1:]]),
            "rounds": args.rounds, "requests_per_round": args.requests, "concurrency": args.concurrency,
            "chunks_per_response": args.chunks, "gap_ms": args.gap_ms,
            "configs": summary,
            "chosen": "proxy_lua",
        }
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "usage_cost.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(summary, indent=1))
        with contextlib.suppress(ImportError):
            _plot(summary)
    finally:
        stack.stop()
    return 0


def _plot(summary: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(names))
    a.bar([i - 0.2 for i in x], [summary[n]["chunk_latency_ms"]["p50"] for n in names], 0.4, label="p50")
    a.bar([i + 0.2 for i in x], [summary[n]["chunk_latency_ms"]["p99"] for n in names], 0.4, label="p99")
    a.set_xticks(list(x), names, rotation=10)
    a.set_ylabel("chunk latency, upstream write → client (ms)")
    a.legend()
    b.bar(list(x), [summary[n]["cpu_us_per_request"] / 1000 for n in names], 0.5)
    b.set_xticks(list(x), names, rotation=10)
    b.set_ylabel("CPU ms per streamed request")
    b.set_title("Envoy + extproc (+ the no-op server)", fontsize=9)
    fig.suptitle("Reading token usage: in the proxy vs through a Python ext_proc")
    fig.tight_layout()
    fig.savefig(RESULTS / "usage_cost.png", dpi=100)


if __name__ == "__main__":
    sys.exit(main())

"""Open-loop HTTP load runner: sends a workload to a URL on schedule and records what happened.

Open-loop means arrivals follow the workload's clock, never the server's pace:
each request is started at its scheduled time whether or not earlier ones have
been answered, so a slow server builds a queue exactly as real users would.
Clients retry as the workload says (the OpenAI SDKs' policy by default).
Streaming responses are timed at their first SSE data event (TTFT) and at their
end (E2E); both are measured from the request's first attempt, so time spent
in retries counts, as it does for a user.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import aiohttp

from extproc.sim import traces
from extproc.sim.report import Result, Slo, Summary, grouped, length_class
from extproc.sim.workload import (
    Arrivals,
    Client,
    Request,
    WorkloadSpec,
    generate,
    load_spec,
    retry_delay,
    write_trace,
)

#: Progress callback: (seconds elapsed, requests started, requests finished).
Progress = Callable[[float, int, int], None]


def progress_printer(label: str, total: int | None) -> Progress:
    """Progress on stderr: one line rewritten in place on a terminal, a line every 10 s otherwise."""
    tty = sys.stderr.isatty()
    last = [-10.0]

    def show(elapsed: float, started: int, finished: int) -> None:
        line = f"  [{label}] {elapsed:5.0f}s  sent {started:5d}/{total or '?'}  finished {finished:5d}"
        if tty:
            print(f"\r{line}", end="", file=sys.stderr, flush=True)
        elif elapsed - last[0] >= 10.0:
            last[0] = elapsed
            print(line, file=sys.stderr, flush=True)

    return show


async def _attempt(session: aiohttp.ClientSession, url: str, request: Request, started: float,
                   retry: int = 0) -> tuple[int, float | None, float | None, dict[str, str]]:
    """One HTTP attempt: (status, ttft, e2e, response headers), times from ``started``.

    ``retry`` is the attempt's retry number, sent as the OpenAI SDKs send it (0 on the first).
    """
    body = json.dumps(request.body()).encode()
    headers = {"content-type": "application/json", "x-stainless-retry-count": str(retry), **request.headers}
    if request.key is not None:
        headers["authorization"] = f"Bearer {request.key}"
    async with session.post(url + request.path, data=body, headers=headers) as response:
        hdrs = {k.lower(): v for k, v in response.headers.items()}
        if response.status != 200:
            await response.read()
            return response.status, None, None, hdrs
        ttft: float | None = None
        if request.stream:
            # Only the first data event is timed; the rest is drained in large reads, which
            # keeps the runner's CPU cost low at thousands of tokens per second.
            buffer = b""
            async for chunk in response.content.iter_any():
                if ttft is None:
                    buffer += chunk
                    if b"data:" in buffer:
                        ttft = time.monotonic() - started
                        buffer = b""
        else:
            await response.read()
        e2e = time.monotonic() - started
        return response.status, ttft if ttft is not None else e2e, e2e, hdrs


async def _one(session: aiohttp.ClientSession, url: str, request: Request, client: Client,
               rng: random.Random) -> Result:
    started = time.monotonic()
    attempts = 0
    status: int = 0
    ttft: float | None = None
    e2e: float | None = None
    headers: dict[str, str] = {}
    retries: list[float] = []
    told: list[int | None] = []
    while True:
        attempts += 1
        if attempts > 1:
            retries.append(time.monotonic() - started)
        try:
            status, ttft, e2e, headers = await _attempt(session, url, request, started, attempts - 1)
        except TimeoutError:
            return Result(request.index, request.cls, request.tenant, request.at, -1, None, None, attempts,
                          request.output_tokens, retries=tuple(retries), retry_after=tuple(told))
        except aiohttp.ClientError:
            status, ttft, e2e, headers = 0, None, None, {}
        if 200 <= status < 300:
            break
        told.append(_seconds(headers.get("retry-after")))
        # Status 0 is a connection error: retried like the SDKs do.
        delay = retry_delay(client, attempts, status or None, headers, rng)
        if delay is None:
            break
        await asyncio.sleep(delay)
    return Result(request.index, request.cls, request.tenant, request.at, status, ttft, e2e, attempts,
                  request.output_tokens, headers.get("x-extproc-reason", ""), retries=tuple(retries),
                  retry_after=tuple(told))


def _seconds(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


async def run(url: str, requests: Iterable[Request], client: Client, *, seed: int = 0,
              drain_timeout: float = 120.0, progress: Progress | None = None,
              connections: int = 0) -> list[Result]:
    """Send ``requests`` to ``url`` on their schedule; return one Result per request.

    After the last arrival, requests still running get ``drain_timeout`` seconds
    to finish; those that do not are recorded as client timeouts (status -1).
    ``requests`` is read as their arrival times come (a trace streams).
    """
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=client.timeout)
    connector = aiohttp.TCPConnector(limit=connections, force_close=False)
    results: dict[int, Result] = {}
    sent: list[Request] = []
    done = 0

    async def track(i: int, coro: Any) -> None:
        nonlocal done
        results[i] = await coro
        done += 1

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        loop = asyncio.get_running_loop()
        origin = loop.time()
        tasks: list[asyncio.Task[None]] = []
        next_report = 1.0
        for i, request in enumerate(requests):
            sent.append(request)
            delay = origin + request.at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(loop.create_task(track(i, _one(session, url, request, client, rng))))
            if progress is not None and loop.time() - origin >= next_report:
                progress(loop.time() - origin, len(tasks), done)
                next_report += 1.0
        pending = [t for t in tasks if not t.done()]
        deadline = loop.time() + drain_timeout
        while pending and loop.time() < deadline:
            _, still = await asyncio.wait(pending, timeout=min(1.0, deadline - loop.time()))
            pending = list(still)
            if progress is not None:
                progress(loop.time() - origin, len(tasks), done)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return [
        results.get(i) or Result(req.index, req.cls, req.tenant, req.at, -1, None, None, 1, req.output_tokens)
        for i, req in enumerate(sent)
    ]


def results_table(summaries: dict[str, Summary]) -> str:
    """A fixed-width table of per-group summaries (what `extproc sim load` prints)."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    lines = [f"{'group':<14}{'reqs':>7}{'ok':>7}{'rej%':>7}{'ttft p50':>10}{'ttft p99':>10}"
             f"{'e2e p50':>10}{'e2e p99':>10}{'goodput/s':>11}{'attempts':>10}"]
    for name, s in summaries.items():
        lines.append(
            f"{name:<14}{s.requests:>7}{s.ok:>7}{s.rejection_rate * 100:>6.1f}%{ms(s.ttft['p50']):>10}"
            f"{ms(s.ttft['p99']):>10}{ms(s.e2e['p50']):>10}{ms(s.e2e['p99']):>10}{s.goodput_rps:>11.2f}"
            f"{s.retry_amplification:>10.2f}"
        )
    lines.append("(times in ms; goodput = requests/s that met their class's TTFT and E2E SLO)")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="base URL, e.g. http://127.0.0.1:10000")
    parser.add_argument("--workload", help="workload spec (YAML), e.g. examples/workloads/chatbot.yaml; "
                        "with --trace, its SLOs and client, and the classes a public trace's requests become")
    parser.add_argument("--trace", help="replay a trace instead: Azure 2023, Mooncake or BurstGPT, extproc's "
                        "JSONL or decision log (see --trace-format)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (workload only)")
    parser.add_argument("--rate", type=float, default=None,
                        help="mean requests per second: the workload's rate, or a trace sped up to it")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-retries", action="store_true", help="clients never retry")
    parser.add_argument("--no-usage", action="store_true",
                        help="streamed requests do not ask for their usage (stream_options.include_usage), "
                             "as the OpenAI SDKs by default")
    parser.add_argument("--drain-timeout", type=float, default=120.0,
                        help="seconds to wait for requests still running after the last arrival")
    parser.add_argument("--json", dest="json_out", help="write per-request results and summaries here")
    parser.add_argument("--write-trace", help="also write the requests sent as a JSONL trace")
    traces.add_arguments(parser)


def command(args: argparse.Namespace) -> int:
    if not args.workload and not args.trace:
        raise SystemExit("extproc sim load: give --workload SPEC or --trace FILE")
    spec = load_spec(args.workload) if args.workload else WorkloadSpec(arrivals=Arrivals(rate=1.0))
    requests: Iterable[Request]
    trace = None
    if args.trace:
        try:
            trace = traces.from_args(args, spec)
            if args.rate is not None:
                n, span, _, _ = trace.mix()
                if span <= 0:
                    raise traces.TraceError(f"{args.trace}: every request arrives at once: no rate to scale")
                trace = traces.with_speedup(trace, args.rate / (n * trace.replay.rate_scale / span))
        except (OSError, ValueError) as exc:
            print(f"extproc sim load: {exc}", file=sys.stderr)
            return 2
        requests = trace
    else:
        if args.rate is not None:
            spec = spec.model_copy(update={"arrivals": spec.arrivals.model_copy(update={"rate": args.rate})})
        requests = generate(spec, args.duration, args.seed)
    client = spec.client.model_copy(update={"kind": "none"}) if args.no_retries else spec.client
    sent: list[Request] = []

    def recorded(source: Iterable[Request]) -> Iterator[Request]:
        for request in source:
            if args.no_usage:
                request = dataclasses.replace(request, include_usage=False)
            sent.append(request)
            yield request

    total = len(requests) if isinstance(requests, list) else None
    try:
        results = asyncio.run(run(args.target, recorded(requests), client, seed=args.seed,
                                  drain_timeout=args.drain_timeout, progress=progress_printer("load", total)))
    except ValueError as exc:  # a malformed trace line, met while replaying
        print(f"\nextproc sim load: {exc}", file=sys.stderr)
        return 2
    if sys.stderr.isatty():
        print(file=sys.stderr)
    if args.write_trace:
        write_trace(sent, args.write_trace)
    duration = args.duration if trace is None else max((r.at for r in sent), default=0.0)
    slos = {c.name: Slo(c.slo.ttft, c.slo.e2e) for c in spec.classes}
    per_class = grouped(results, slos, duration)
    per_length = grouped(results, slos, duration, key=length_class)
    print(results_table({**per_class, **{f"[{k}]": v for k, v in per_length.items()}}))
    if trace is not None and trace.bad:
        print(f"{trace.path}: skipped {trace.bad} malformed lines", file=sys.stderr)
    if args.json_out:
        doc: dict[str, Any] = {
            "target": args.target, "duration_s": duration, "seed": args.seed, "requests": len(sent),
            "classes": {k: v.as_dict() for k, v in per_class.items()},
            "lengths": {k: v.as_dict() for k, v in per_length.items()},
            "results": [dataclasses.asdict(r) for r in results],
        }
        if trace is not None:
            doc["trace"] = {"path": str(trace.path), "format": trace.format, "speedup": trace.replay.speedup,
                            "skipped_bad_lines": trace.bad}
        Path(args.json_out).write_text(json.dumps(doc, indent=1))
    return 0

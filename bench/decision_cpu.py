"""The Python work of one request, without gRPC: CPU µs of each part, for A/B comparisons of checkouts.

One request as Envoy sends it to ``extproc serve`` with the policy of ``bench/overhead.py``
(``read_body: always``, limits that never bind), both ways the edge can be judged: with
``--edge call``, the rate limit call on arrival then the ext_proc stream (request headers, the body,
response headers; each message arrives on a later pass of the event loop, as from gRPC); shipped,
the ext_proc stream whose request headers carry ``x-extproc-edge`` (the edge judged in it). Then
the rate limit call with the usage descriptor when a response ends (sent only for token budgets).
The servicers are called directly, so what is measured is extproc's own code (and asyncio's), not
gRPC's.

Each checkout runs in its own process, alternately, ``--rounds`` times; the minimum over rounds of
each part's process CPU time per request is reported (the least disturbed round: on a shared
machine the minimum is the steadiest estimate of the work itself).

Run: ``python bench/decision_cpu.py [--rounds 8] [--n 2000] CHECKOUT [CHECKOUT…]``.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
NOWHERE = open(os.devnull, "w")  # noqa: SIM115  (open for the process's life)


async def measure(n: int) -> dict[str, float]:
    import structlog
    from envoy.extensions.common.ratelimit.v3.ratelimit_pb2 import RateLimitDescriptor
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ratelimit.v3 import rls_pb2 as rls
    from prometheus_client import CollectorRegistry

    from extproc import log
    from extproc.controller import Controller
    from extproc.metrics import Metrics, RateLimitMetrics
    from extproc.policy.loader import parse_policy
    from extproc.servers.extproc import ExternalProcessor
    from extproc.servers.ratelimit import RateLimitService

    sys.path.insert(0, str(BENCH.parent))
    from bench.overhead import BODY, POLICY

    # The decision lines are written (as deployed), to nowhere.
    try:
        log.configure("json", "info", file=NOWHERE)
    except TypeError:  # a checkout from before configure took a stream
        log.configure("json", "info")
        structlog.configure(logger_factory=structlog.WriteLoggerFactory(file=NOWHERE))

    def descriptor_request(entries: list[tuple[str, str]]) -> rls.RateLimitRequest:
        d = RateLimitDescriptor()
        for k, v in entries:
            e = d.entries.add()
            e.key, e.value = k, v
        return rls.RateLimitRequest(domain="extproc", descriptors=[d])

    arrival = descriptor_request([("generic_key", "gpu_inference"), ("method", "POST"),
                                  ("path", "/v1/chat/completions")])
    usage = descriptor_request([("generic_key", "gpu_inference_tokens")] + [
        (k, "none") for k in ("usage", "prompt_tokens", "output_tokens", "max_tokens", "service_ms",
                              "admitted_ms")])
    headers = pb.ProcessingRequest()
    for k, v in ((":method", "POST"), (":path", "/v1/chat/completions"), ("content-length", str(len(BODY))),
                 ("x-request-id", "2b5c1c62-3c1e-4a39-a7a4-0ad3b9f3c0aa"), ("x-extproc-usage-filter", "1")):
        headers.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    headers.attributes["envoy.filters.http.ext_proc"].fields["source.address"].string_value = "127.0.0.1:5555"
    body = pb.ProcessingRequest()
    body.request_body.body = BODY.encode()
    body.request_body.end_of_stream = True
    response = pb.ProcessingRequest()
    response.response_headers.headers.headers.add(key=":status", raw_value=b"200")
    messages = [headers, body, response]
    inline_headers = pb.ProcessingRequest()
    inline_headers.CopyFrom(headers)
    inline_headers.request_headers.headers.headers.add(key="x-extproc-edge", raw_value=b"1")
    inline = [inline_headers, body, response]

    policy = parse_policy(POLICY.format(read_body="always"))
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    controller = Controller(policy, metrics)
    controller.start()
    processor = ExternalProcessor(controller)
    edge_metrics = RateLimitMetrics(registry, metrics.saturation_rejections)
    machine = getattr(controller, "machine", None)
    if machine is None:  # a checkout from before the decision machine: the edge read the scheduler
        from extproc.servers.ratelimit import ControllerPressure  # type: ignore[attr-defined]

        machine = ControllerPressure(controller)
    edge = RateLimitService(machine, edge_metrics, lambda: controller.policy.ratelimit)
    loop = asyncio.get_running_loop()

    async def stream(sent: list[Any]) -> AsyncIterator[Any]:
        for message in sent:
            arrived = loop.create_future()
            loop.call_soon(arrived.set_result, None)
            await arrived
            yield message

    async def process() -> None:
        async for _ in processor.Process(stream(messages), None):
            pass

    async def process_inline() -> None:
        async for _ in processor.Process(stream(inline), None):
            pass

    processor.edge = edge

    for _ in range(300):  # warm-up
        await edge.ShouldRateLimit(arrival, None)
        await process()
        await process_inline()
        await edge.ShouldRateLimit(usage, None)
    parts: dict[str, float] = {}
    for name, call in (("rls arrival", lambda: edge.ShouldRateLimit(arrival, None)),
                       ("ext_proc stream", process),
                       ("stream, edge inline", process_inline),
                       ("rls usage", lambda: edge.ShouldRateLimit(usage, None))):
        start = time.process_time()
        for _ in range(n):
            await call()
        parts[name] = (time.process_time() - start) / n * 1e6
    await controller.stop()
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkouts", nargs="*", type=Path)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--n", type=int, default=2000, help="requests per part and round")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(asyncio.run(measure(args.n)))
        return
    checkouts = args.checkouts or [BENCH.parent]
    runs: dict[Path, list[dict[str, float]]] = {c: [] for c in checkouts}
    for _ in range(args.rounds):
        for checkout in checkouts:
            out = subprocess.run([sys.executable, __file__, "--child", "--n", str(args.n)],
                                 capture_output=True, text=True, check=True, cwd="/",
                                 env={**os.environ, "PYTHONPATH": str(checkout.resolve())}).stdout
            runs[checkout].append(ast.literal_eval(out.strip().splitlines()[-1]))
    print(f"CPU µs per request, minimum over {args.rounds} rounds of {args.n}:")
    for checkout, results in runs.items():
        best = {k: min(r[k] for r in results) for k in results[0]}
        cells = "  ".join(f"{k} {v:6.1f}" for k, v in best.items())
        call = sum(v for k, v in best.items() if k != "stream, edge inline")
        inline = best.get("stream, edge inline")
        print(f"  {checkout!s:32} {cells}  total --edge call {call:6.1f}"
              + (f", inline {inline + best.get('rls usage', 0):6.1f}" if inline is not None else ""))


if __name__ == "__main__":
    main()

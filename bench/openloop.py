"""An open-loop HTTP/1.1 load generator that records every request's status and latency.

wrk paces well but reports one latency distribution for every answer; an overload benchmark needs
the time to a refusal apart from the latency of an admitted request. This sends POSTs on a fixed
schedule (``rate`` per second for ``duration`` seconds) over keep-alive connections, opening another
connection whenever none is free (up to ``max_connections``), so a slow answer never delays the next
send: latency is measured from each request's scheduled time (no coordinated omission). It is a
raw asyncio protocol on uvloop's loop, like bench/upstream.py, to cost little CPU beside what it
measures. It reads just enough of each answer: the status line, the headers, a content-length body.

    python bench/openloop.py URL --rate 2000 --duration 20 --connections 1500 > results.json

As a module: ``asyncio.run(run(url, rate=..., duration=...))`` returns a :class:`Result`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

BODY = b'{"model":"bench","messages":[{"role":"user","content":"Say hello in five words."}],"max_tokens":32}'


@dataclass
class Result:
    """Per request: scheduled offset (s from the start), status (0: no answer), latency (s, from the
    scheduled time), and the ``x-extproc-reason`` of refusals."""

    rate: float
    duration: float
    scheduled: list[float] = field(default_factory=list)
    status: list[int] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    connections_opened: int = 0
    errors: int = 0
    elapsed: float = 0.0


class _Connection(asyncio.Protocol):
    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False
        self.closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._parse()

    def _parse(self) -> None:
        if self.waiter is None or self.waiter.done():
            return
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buffer[:end]).decode("latin-1")
        lines = head.split("\r\n")
        length = 0
        reason = b""
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value.strip())
            elif name == "x-extproc-reason":
                reason = value.strip().encode()
            elif name == "connection" and value.strip().lower() == "close":
                # (The server closes after this answer: never send another request on it.)
                self.closing = True
        if len(self.buffer) < end + 4 + length:
            return
        del self.buffer[:end + 4 + length]
        status = int(lines[0].split(" ", 2)[1])
        self.waiter.set_result((status, reason))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((0, b""))
        self.pool.lost(self)

    async def send(self, request: bytes) -> tuple[int, bytes]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await self.waiter


class _Pool:
    def __init__(self, host: str, port: int, limit: int) -> None:
        self.host, self.port, self.limit = host, port, limit
        self.idle: list[_Connection] = []
        self.open = 0
        self.opened = 0
        self.waiting: asyncio.Queue[None] = asyncio.Queue()

    async def take(self) -> _Connection:
        while True:
            while self.idle:
                conn = self.idle.pop()
                if not conn.closed:
                    return conn
            if self.open < self.limit:
                self.open += 1
                self.opened += 1
                loop = asyncio.get_running_loop()
                try:
                    transport, proto = await loop.create_connection(lambda: _Connection(self), self.host,
                                                                    self.port)
                except OSError:
                    self.open -= 1
                    raise
                # (uvloop may call connection_made after create_connection returns.)
                proto.transport = transport
                return proto
            await self.waiting.get()

    def give(self, conn: _Connection) -> None:
        if conn.closing and conn.transport is not None:
            conn.transport.close()
        elif not conn.closed:
            self.idle.append(conn)
            self.waiting.put_nowait(None)

    def lost(self, conn: _Connection) -> None:
        self.open -= 1
        self.waiting.put_nowait(None)


async def run(url: str, *, rate: float, duration: float, max_connections: int = 2000,
              give_up_s: float = 10.0, body: bytes = BODY) -> Result:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    path = parts.path or "/"
    request = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\ncontent-type: application/json\r\n"
               f"content-length: {len(body)}\r\n\r\n").encode() + body
    pool = _Pool(host, port, max_connections)
    result = Result(rate, duration)
    loop = asyncio.get_running_loop()
    n = int(rate * duration)
    result.scheduled = [i / rate for i in range(n)]
    result.status = [0] * n
    result.latency = [float("nan")] * n
    reasons: dict[bytes, int] = {}
    origin = loop.time()
    tasks: set[asyncio.Task[None]] = set()

    async def one(i: int, due: float) -> None:
        conn = None
        try:
            async with asyncio.timeout(give_up_s):
                conn = await pool.take()
                status, reason = await conn.send(request)
        except (TimeoutError, OSError):
            result.errors += 1
            if conn is not None and conn.transport is not None:
                conn.transport.close()
            return
        result.status[i] = status
        result.latency[i] = loop.time() - due
        if reason:
            reasons[reason] = reasons.get(reason, 0) + 1
        if status:
            pool.give(conn)

    for i in range(n):
        due = origin + result.scheduled[i]
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        task = loop.create_task(one(i, due))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks)
    result.elapsed = loop.time() - origin
    result.connections_opened = pool.opened
    result.reasons = {k.decode(): v for k, v in reasons.items()}
    for conn in pool.idle:
        if conn.transport is not None:
            conn.transport.close()
    return result


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0-1) of ``values``; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))]


def summary(result: Result) -> dict[str, Any]:
    by_status: dict[str, int] = {}
    for s in result.status:
        by_status[str(s)] = by_status.get(str(s), 0) + 1
    ok = [lat for s, lat in zip(result.status, result.latency, strict=True) if 200 <= s < 300]
    refused = [lat for s, lat in zip(result.status, result.latency, strict=True) if s >= 400]

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 2)

    return {"rate": result.rate, "duration_s": result.duration, "sent": len(result.status),
            "statuses": dict(sorted(by_status.items())), "reasons": result.reasons,
            # (Over the time until the last answer: a backlog is still being served after the last send.)
            "admitted_per_s": round(len(ok) / max(result.elapsed, result.duration), 1),
            "admitted_ms": {"p50": ms(percentile(ok, 0.5)), "p99": ms(percentile(ok, 0.99))},
            "refused_ms": {"p50": ms(percentile(refused, 0.5)), "p99": ms(percentile(refused, 0.99))},
            "connections_opened": result.connections_opened, "errors": result.errors,
            "elapsed_s": round(result.elapsed, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=2000)
    args = parser.parse_args()
    try:
        import uvloop
        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    started = time.monotonic()
    result = runner(run(args.url, rate=args.rate, duration=args.duration, max_connections=args.connections))
    out = summary(result)
    out["wall_s"] = round(time.monotonic() - started, 2)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 3)  # (the generator's own CPU: it shares the cores)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

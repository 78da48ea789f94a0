"""A small real upstream for integration tests: echoes what it received, slowly if asked.

Run as ``python tests/integration/upstream.py PORT``. Behaviour per request:
``x-test-delay-ms`` delays the answer; ``x-test-status`` sets its status; ``x-test-stream:
N:MS`` streams N chunks MS apart (a generation); ``x-test-usage-body: KIND`` answers with a body
whose usage is hard to read (see ``USAGE_BODIES``); path ``/reset`` closes the connection without
answering (an upstream reset); ``/stats`` reports the highest concurrency seen and resets it.
"""

from __future__ import annotations

import asyncio
import sys

from aiohttp import web

state = {"active": 0, "peak": 0, "total": 0}
_USAGE = (b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,'
          b'"total_tokens":7}}\n\n')
_TOKEN = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
#: Bodies whose token usage the proxy must read (or give up on) without harm, written in these pieces.
USAGE_BODIES: dict[str, tuple[str, list[bytes]]] = {
    # A 3 MB JSON answer, its usage at the very end (a proxy that buffered it would refuse it).
    "big": ("application/json", [b'{"pad":"' + b"x" * 3_000_000 + b'","usage":{"total_tokens":99}}']),
    # The usage event cut in the middle of "total_tokens" by two writes: counted, not removed.
    "split": ("text/event-stream", [_TOKEN, _USAGE[:60], _USAGE[60:], b"data: [DONE]\n\n"]),
    # Garbage: a count that is not a number, binary junk, a 200 kB event without a delimiter.
    "garbage": ("text/event-stream", [b'data: {"usage":{"total_tokens":"lots"}}\n\n', bytes(range(256)),
                                      b"data: " + b"total_tokens" * 20_000, b"\n\ndata: [DONE]\n\n"]),
}


async def echo(request: web.Request) -> web.StreamResponse:
    if request.path == "/stats":
        body = dict(state)
        state["peak"] = state["active"]
        return web.json_response(body)
    state["active"] += 1
    state["total"] += 1
    state["peak"] = max(state["peak"], state["active"])
    try:
        size = len(await request.read())
        delay = float(request.headers.get("x-test-delay-ms", "0")) / 1000
        if delay:
            await asyncio.sleep(delay)
        if request.path.endswith("/reset"):
            assert request.transport is not None
            request.transport.abort()
            return web.Response(status=500)
        kind = request.headers.get("x-test-usage-body")
        if kind in USAGE_BODIES:
            content_type, pieces = USAGE_BODIES[kind]
            response = web.StreamResponse(headers={"content-type": content_type})
            await response.prepare(request)
            for piece in pieces:
                await response.write(piece)
                await asyncio.sleep(0.02)  # each piece its own read at the proxy
            await response.write_eof()
            return response
        stream = request.headers.get("x-test-stream")
        if stream:
            chunks, _, gap = stream.partition(":")
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            for i in range(int(chunks)):
                if i:
                    await asyncio.sleep(float(gap or 0) / 1000)
                await response.write(f"data: {i}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        return web.json_response(status=int(request.headers.get("x-test-status", "200")), data={
            "path": request.path_qs,
            "raw_path": request.raw_path,
            "method": request.method,
            "headers": {k.lower(): v for k, v in request.headers.items()},
            "body_bytes": size,
        })
    finally:
        state["active"] -= 1


def main() -> None:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", echo)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)


if __name__ == "__main__":
    main()

"""A fast stand-in inference backend for benchmarks: answers every request with a small JSON at once.

Run as ``python bench/upstream.py PORT``. A raw asyncio protocol rather than aiohttp (as in
``tests/integration/upstream.py``): the benchmark measures what Envoy and ext_proc add, so the
backend must cost as little CPU per request as possible on a 2-core machine shared with them.
It speaks just enough HTTP/1.1 for Envoy's upstream connections: keep-alive, bodies framed by
``content-length`` or ``transfer-encoding: chunked`` (read and discarded). ``GET /health``
answers like any other path, so it doubles as the readiness probe.
"""

from __future__ import annotations

import asyncio
import signal
import sys

BODY = (b'{"id":"bench","object":"chat.completion","model":"bench","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}]}')
RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)
BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
#: Bigger heads than this are not something Envoy sends here; treat them as garbage.
MAX_HEAD = 64 * 1024


class _Malformed(Exception):
    pass


def _chunked_end(buf: bytes | bytearray, start: int) -> int:
    """Offset just past a complete chunked body starting at ``start``; -1 if more bytes are needed."""
    pos = start
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return -1
        try:
            size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
        except ValueError:
            raise _Malformed from None
        pos = eol + 2
        if size == 0:
            # Trailers (if any) end with an empty line.
            end = buf.find(b"\r\n\r\n", pos - 2)
            return -1 if end < 0 else end + 4
        pos += size + 2
        if pos > len(buf):
            return -1


class _Http(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.buf += data
        out: list[bytes] = []
        # Several pipelined requests may arrive in one read; answer each complete one.
        while True:
            try:
                used = self._one_request()
            except _Malformed:
                self.transport.write(b"".join(out) + BAD_REQUEST)
                self.transport.close()
                return
            if used < 0:
                break
            del self.buf[:used]
            out.append(RESPONSE)
        if out:
            self.transport.write(b"".join(out))

    def _one_request(self) -> int:
        head_end = self.buf.find(b"\r\n\r\n")
        if head_end < 0:
            if len(self.buf) > MAX_HEAD:
                raise _Malformed
            return -1
        body_start = head_end + 4
        length = 0
        chunked = False
        for line in bytes(self.buf[:head_end]).split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    raise _Malformed from None
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        if chunked:
            return _chunked_end(self.buf, body_start)
        end = body_start + length
        return end if len(self.buf) >= end else -1


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Http, "127.0.0.1", port, backlog=1024)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1])))

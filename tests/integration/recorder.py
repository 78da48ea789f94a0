"""A stand-in ext_proc server that records what Envoy sends it and admits everything.

The probe suite points a shipped Envoy config at it to see exactly which headers reach
"extproc" (forward_rules), independent of what the real extproc then does with them. It
admits by setting ``x-extproc-lane: recorded``, which is what the admission gate looks for; a path
under ``LIMITED`` is admitted with the edge's x-ratelimit-* in the ``extproc`` metadata, as extproc
admits a request whose response headers it does not ask for.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.config.core.v3.base_pb2 import HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

#: A path under this prefix is admitted with the edge's x-ratelimit-* in the "extproc" dynamic metadata,
#: as extproc admits a request whose response headers it does not ask for (--response-sample).
LIMITED = "/recorded-limits"
RECORDED_LIMITS = {"x-ratelimit-limit": '7, 7;w=60;name="tenant_requests"', "x-ratelimit-remaining": "6",
                   "x-ratelimit-reset": "5"}


class _Recording(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, seen: list[dict[str, str]]) -> None:
        self.seen = seen

    async def Process(self, requests: AsyncIterator[pb.ProcessingRequest],
                      context: Any) -> AsyncIterator[pb.ProcessingResponse]:
        async for message in requests:
            kind = message.WhichOneof("request")
            response = pb.ProcessingResponse()
            if kind == "request_headers":
                headers = {h.key: (h.raw_value or h.value.encode()).decode()
                           for h in message.request_headers.headers.headers}
                self.seen.append(headers)
                common = response.request_headers.response
                option = common.header_mutation.set_headers.add(
                    append_action=HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD)
                option.header.key = "x-extproc-lane"
                option.header.raw_value = b"recorded"
                if headers.get(":path", "").startswith(LIMITED):
                    response.dynamic_metadata.update({"extproc": {
                        "ratelimit_" + name.removeprefix("x-ratelimit-"): value
                        for name, value in RECORDED_LIMITS.items()}})
            elif kind in ("request_body", "response_headers", "response_body"):
                getattr(response, kind).response.SetInParent()
            else:
                getattr(response, kind).SetInParent()
            yield response


class Recorder:
    """Runs the recording server on its own event loop in a thread: ``with Recorder(port) as seen``."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.seen: list[dict[str, str]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: grpc.aio.Server | None = None

    async def _start(self) -> None:
        self._server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(_Recording(self.seen), self._server)
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self._server.start()

    def __enter__(self) -> Recorder:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *_: object) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

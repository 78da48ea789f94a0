"""A do-nothing ext_proc server: the baseline cost of any Python grpc.aio ext_proc service.

Run as ``python bench/noop_extproc.py PORT [--body auto|never]``. It follows the same message
contract as ``extproc serve`` against the shipped ``envoy/envoy.yaml`` (request headers sent,
``response_trailer_mode: SEND`` so the stream lasts as long as the HTTP request) but makes no
decision: request headers get CONTINUE with ``x-extproc-lane: default`` set (the shipped
admission gate lets only requests carrying that header through, and extproc sets it on every
admission), a request body gets CONTINUE, trailers get an empty trailers answer. With
``--body auto`` (the default) a request that has a body is asked for it with the same
``mode_override`` extproc uses, so the no-op pays the same extra gRPC round as a body-reading
policy; ``--body never`` compares with a headers-only policy. ``--response-headers`` asks for the
response headers too (as extproc does, for their status and the edge's x-ratelimit-* headers) and
answers them with CONTINUE: the cost of that one message more. ``--event-loop uvloop`` runs it on
uvloop's loop (as ``extproc serve`` runs by default); asyncio's is the default here.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

#: The mode extproc's BODY_MODE asks for (first body chunk buffered, stream kept to the end), so
#: B and C differ only in what the server does per message. Spelled out here rather than imported
#: so the baseline does not load extproc's own modules.
BODY_MODE = ProcessingMode(
    request_header_mode=ProcessingMode.SEND,
    response_header_mode=ProcessingMode.SKIP,
    request_body_mode=ProcessingMode.BUFFERED_PARTIAL,
    response_body_mode=ProcessingMode.NONE,
    request_trailer_mode=ProcessingMode.SKIP,
    response_trailer_mode=ProcessingMode.SEND,
)
#: What extproc sends with a decision made on the headers: skip the body, whatever the filter's
#: static mode (envoy.yaml reads bodies by default), so the headers-only pair is like for like.
NO_BODY_MODE = ProcessingMode()
NO_BODY_MODE.CopyFrom(BODY_MODE)
NO_BODY_MODE.request_body_mode = ProcessingMode.NONE
_CONTINUE = pb.CommonResponse(status=pb.CommonResponse.CONTINUE)
#: CONTINUE that passes the admission gate (header values must go in raw_value).
_ADMIT = pb.CommonResponse(
    status=pb.CommonResponse.CONTINUE,
    header_mutation=pb.HeaderMutation(set_headers=[
        HeaderValueOption(header=HeaderValue(key="x-extproc-lane", raw_value=b"default"))]),
)


#: The same two modes, with the response headers asked for.
BODY_MODE_RESPONSE = ProcessingMode()
BODY_MODE_RESPONSE.CopyFrom(BODY_MODE)
BODY_MODE_RESPONSE.response_header_mode = ProcessingMode.SEND
NO_BODY_MODE_RESPONSE = ProcessingMode()
NO_BODY_MODE_RESPONSE.CopyFrom(NO_BODY_MODE)
NO_BODY_MODE_RESPONSE.response_header_mode = ProcessingMode.SEND


class NoopProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, read_body: bool, response_headers: bool = False) -> None:
        self.read_body = read_body
        self.body_mode = BODY_MODE_RESPONSE if response_headers else BODY_MODE
        self.no_body_mode = NO_BODY_MODE_RESPONSE if response_headers else NO_BODY_MODE

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        async for message in request_iterator:
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                headers = pb.HeadersResponse(response=_ADMIT)
                if self.read_body and not message.request_headers.end_of_stream:
                    yield pb.ProcessingResponse(request_headers=headers, mode_override=self.body_mode)
                else:
                    yield pb.ProcessingResponse(request_headers=headers, mode_override=self.no_body_mode)
            elif kind == "request_body":
                yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=_CONTINUE))
            elif kind == "response_headers":
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=_CONTINUE))
            elif kind in ("request_trailers", "response_trailers"):
                response = pb.ProcessingResponse()
                # An empty ProcessingResponse is "spurious" to Envoy (503): mark the field set.
                getattr(response, kind).SetInParent()
                yield response
            else:
                # Not configured in envoy.yaml; answered anyway so a config change cannot hang requests.
                response = pb.ProcessingResponse()
                getattr(response, str(kind)).response.SetInParent()
                yield response


async def serve(port: int, read_body: bool, response_headers: bool = False) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(NoopProcessor(read_body, response_headers), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--body", choices=["auto", "never"], default="auto",
                        help="auto: read request bodies via mode_override like a body-reading policy")
    parser.add_argument("--response-headers", action="store_true",
                        help="ask for the response headers too (one message more per request, as extproc)")
    parser.add_argument("--event-loop", choices=["asyncio", "uvloop"], default="asyncio",
                        help="the event loop (extproc serve runs on uvloop's by default)")
    args = parser.parse_args()
    factory = None
    if args.event_loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve(args.port, args.body == "auto", args.response_headers))


if __name__ == "__main__":
    main()

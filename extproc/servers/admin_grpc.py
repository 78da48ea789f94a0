"""The admin API over gRPC (``extproc.api.admin.v1.Admin``), on its own loopback port.

It is a server of its own, never the ext_proc / rate limit port Envoy talks to, listening on
``--admin-grpc`` (127.0.0.1:9092 by default). extproc refuses to start with it off loopback and
no admin token. The rules of the HTTP admin port hold here too:

* with a token, every call needs the metadata ``authorization: Bearer <token>``
  (``UNAUTHENTICATED`` otherwise);
* a browser cannot reach it: a native gRPC port only speaks HTTP/2 with prior knowledge, which
  no web page can send (a page's request is not answered, whatever ``Host`` it names), and a
  call that carries browser metadata (``origin``, or ``sec-fetch-site: cross-site``, as a
  grpc-web proxy would pass on) is refused with ``PERMISSION_DENIED``.

Python's gRPC server does not show a call's ``:authority`` to the application, so unlike the
HTTP port this one cannot check ``Host``; nothing a browser sends can reach it in the first place.

The port also serves gRPC server reflection (``grpc.reflection.v1alpha.ServerReflection``), so
generic gRPC tools can list the admin API and read its descriptors without the ``.proto``. It sits
behind the same guard: with a token, reflection needs it too. The guard answers a refused call
with a handler of the method's own shape (a stream for reflection's bidirectional stream): a
unary one would wait for a first message, and a streaming client that waits for the server before
it writes would hang until its deadline instead of reading the refusal.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import structlog
from grpc_reflection.v1alpha import reflection

from extproc.api.admin.v1 import admin_pb2 as pb
from extproc.api.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc.operations import Operations, reload_response

log = structlog.get_logger("extproc.admin")
SERVICE = "extproc.api.admin.v1.Admin"


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, admin: Operations) -> None:
        self.admin = admin

    async def GetState(self, request: pb.GetStateRequest, context: grpc.aio.ServicerContext[Any, Any]
                       ) -> pb.State:
        return self.admin.state()

    async def Reload(self, request: pb.ReloadRequest, context: grpc.aio.ServicerContext[Any, Any]
                     ) -> pb.ReloadResponse:
        return reload_response(await self.admin.reload())

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext[Any, Any]
                    ) -> pb.DrainResponse:
        log.warning("drain requested by an operator", via="grpc")
        self.admin.drain()
        return pb.DrainResponse(draining=True)

    async def Undrain(self, request: pb.UndrainRequest, context: grpc.aio.ServicerContext[Any, Any]
                      ) -> pb.DrainResponse:
        log.warning("undrain requested by an operator", via="grpc")
        self.admin.undrain()
        return pb.DrainResponse(draining=False)

    async def Pause(self, request: pb.PauseRequest, context: grpc.aio.ServicerContext[Any, Any]
                    ) -> pb.PauseResponse:
        await self._lane(self.admin.pause, request.lane, context)
        log.warning("lane paused by an operator", lane=request.lane, via="grpc")
        return pb.PauseResponse(lane=request.lane, paused=True)

    async def Resume(self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext[Any, Any]
                     ) -> pb.PauseResponse:
        await self._lane(self.admin.resume, request.lane, context)
        log.warning("lane resumed by an operator", lane=request.lane, via="grpc")
        return pb.PauseResponse(lane=request.lane, paused=False)

    async def _lane(self, action: Callable[[str], None], lane: str,
                    context: grpc.aio.ServicerContext[Any, Any]) -> None:
        try:
            action(lane)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"unknown lane {lane!r}, expected one of {self.admin.lanes()}")


_HANDLERS = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}


def _refusal(code: grpc.StatusCode, details: str,
             like: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler that ends the call with ``code``, shaped like the method's own (``like``; unary when
    the method does not exist, so an unknown method is refused as any other)."""
    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(code, details)

    shape = (bool(like and like.request_streaming), bool(like and like.response_streaming))
    return _HANDLERS[shape](refuse)


class Guard(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """The token and browser rules, before any method runs."""

    def __init__(self, token: str | None) -> None:
        self._expected = f"Bearer {token}".encode() if token else None

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)  # only looked up: nothing of the method runs before the checks
        refused = self._refused(details)
        return handler if refused is None else _refusal(*refused, like=handler)

    def _refused(self, details: grpc.HandlerCallDetails) -> tuple[grpc.StatusCode, str] | None:
        metadata = {key: value for key, value in (details.invocation_metadata or ())}
        site = metadata.get("sec-fetch-site", "")
        if "origin" in metadata or site == "cross-site":
            log.warning("admin call from a browser refused", method=details.method,
                        origin=str(metadata.get("origin", ""))[:100])
            return grpc.StatusCode.PERMISSION_DENIED, "calls from a browser are refused"
        if self._expected is not None:
            given = metadata.get("authorization", "")
            given_bytes = given.encode() if isinstance(given, str) else bytes(given)
            if not hmac.compare_digest(given_bytes, self._expected):
                return (grpc.StatusCode.UNAUTHENTICATED,
                        "a valid 'authorization: Bearer <token>' metadata is required")
        return None


def build_server(admin: Operations, token: str | None) -> grpc.aio.Server:
    server = grpc.aio.server(interceptors=[Guard(token)],
                             options=[("grpc.max_receive_message_length", 64 * 1024)])
    pb_grpc.add_AdminServicer_to_server(AdminService(admin), server)  # type: ignore[no-untyped-call]
    # Reflection lists the admin API only (and itself): the Admin descriptors are in the default pool.
    reflection.enable_server_reflection((SERVICE, reflection.SERVICE_NAME), server)
    return server

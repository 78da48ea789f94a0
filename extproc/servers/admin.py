"""The admin HTTP port: the state document and operator actions, never reachable through Envoy.

It listens on loopback by default, on its own port that no Envoy route points at. When a
token is configured every endpoint needs ``Authorization: Bearer <token>``; extproc refuses
to start with the admin port on a non-loopback address and no token.

A browser is never a way in: every request must name an allowed ``Host`` (a page whose DNS
name is rebound to 127.0.0.1 sends its own name, and reads nothing), a POST that carries a
foreign ``Origin`` or says it is cross-site (``Sec-Fetch-Site``) is refused, and no CORS
header is ever sent. Without a token, on loopback, any process on the host may read and act.

    GET  /admin/state                    the live state (what ``extproc top`` shows): the admin API's
                                         State message as JSON (extproc/api/document.py)
    POST /admin/reload                   read the policy file again (as SIGHUP does)
    POST /admin/drain                    stop admitting; queued requests get 503; in-flight ones finish
    POST /admin/undrain                  admit again
    POST /admin/lanes/{lane}/pause       admit nothing more from the lane; its requests queue
    POST /admin/lanes/{lane}/resume
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from extproc.api.admin.v1 import admin_pb2 as pb
from extproc.api.document import to_document
from extproc.operations import Operations, reload_response

log = structlog.get_logger("extproc.admin")
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def guard(hosts: frozenset[str] | None) -> Middleware:
    """Refuse a foreign ``Host`` (every method) and a foreign ``Origin`` or cross-site fetch (POSTs)."""

    @web.middleware
    async def middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
        host = request.headers.get("Host", "").lower()
        if hosts is not None and host not in hosts:
            log.warning("admin request with a foreign Host refused", host=host[:100], path=request.path)
            return web.json_response({"error": "this port does not answer to that Host name"}, status=421)
        if request.method not in ("GET", "HEAD"):
            origin = request.headers.get("Origin")
            site = request.headers.get("Sec-Fetch-Site", "")
            named = origin.lower().partition("://")[2] if origin is not None else None
            foreign = named is not None and (hosts is None or named not in hosts)
            if foreign or site == "cross-site":
                log.warning("cross-origin admin request refused", origin=(origin or "")[:100],
                            path=request.path)
                return web.json_response({"error": "cross-origin requests are refused"}, status=403)
        return await handler(request)

    return middleware


def _auth(token: str | None, paths: frozenset[str] | None = None) -> Middleware:
    """Require ``Authorization: Bearer <token>`` (on ``paths`` only, when given)."""
    expected = f"Bearer {token}".encode() if token else None

    @web.middleware
    async def middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
        if expected is not None and (paths is None or request.path in paths):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return web.json_response({"error": "a valid 'Authorization: Bearer <token>' is required"},
                                         status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return middleware


def build_app(admin: Operations, token: str | None, hosts: frozenset[str] | None = None) -> web.Application:
    async def state(_: web.Request) -> web.Response:
        return web.json_response(to_document(admin.state()))

    async def reload(_: web.Request) -> web.Response:
        result = await admin.reload()
        return web.json_response(to_document(reload_response(result)), status=200 if result.ok else 422)

    async def drain(_: web.Request) -> web.Response:
        log.warning("drain requested by an operator")
        admin.drain()
        return web.json_response(to_document(pb.DrainResponse(draining=True)))

    async def undrain(_: web.Request) -> web.Response:
        log.warning("undrain requested by an operator")
        admin.undrain()
        return web.json_response(to_document(pb.DrainResponse(draining=False)))

    def lane_action(action: Callable[[str], None], paused: bool) -> _Handler:
        async def handler(request: web.Request) -> web.Response:
            lane = request.match_info["lane"]
            try:
                action(lane)
            except KeyError:
                return web.json_response({"error": f"unknown lane {lane!r}, expected one of {admin.lanes()}"},
                                         status=404)
            log.warning("lane paused by an operator" if paused else "lane resumed by an operator", lane=lane)
            return web.json_response(to_document(pb.PauseResponse(lane=lane, paused=paused)))

        return handler

    app = web.Application(middlewares=[guard(hosts), _auth(token)])
    app.router.add_get("/admin/state", state)
    app.router.add_post("/admin/reload", reload)
    app.router.add_post("/admin/drain", drain)
    app.router.add_post("/admin/undrain", undrain)
    app.router.add_post("/admin/lanes/{lane}/pause", lane_action(admin.pause, True))
    app.router.add_post("/admin/lanes/{lane}/resume", lane_action(admin.resume, False))
    return app

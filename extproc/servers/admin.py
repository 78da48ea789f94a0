"""The admin HTTP port: the state document and operator actions, never reachable through Envoy.

It listens on loopback by default, on its own port that no Envoy route points at. When a
token is configured every endpoint needs ``Authorization: Bearer <token>``; extproc refuses
to start with the admin port on a non-loopback address and no token.

    GET  /admin/state                    the live state (what ``extproc top`` shows)
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

from extproc.admin import Admin

log = structlog.get_logger("extproc.admin")
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _auth(token: str | None) -> Middleware:
    expected = f"Bearer {token}".encode() if token else None

    @web.middleware
    async def middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
        if expected is not None:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return web.json_response({"error": "a valid 'Authorization: Bearer <token>' is required"},
                                         status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return middleware


def build_app(admin: Admin, token: str | None) -> web.Application:
    async def state(_: web.Request) -> web.Response:
        return web.json_response(admin.state())

    async def reload(_: web.Request) -> web.Response:
        result = await admin.reload()
        body = {"ok": result.ok, "changed": result.changed, "sha256": result.sha256,
                "problems": list(result.problems)}
        return web.json_response(body, status=200 if result.ok else 422)

    async def drain(_: web.Request) -> web.Response:
        log.warning("drain requested by an operator")
        admin.drain()
        return web.json_response({"draining": True})

    async def undrain(_: web.Request) -> web.Response:
        log.warning("undrain requested by an operator")
        admin.undrain()
        return web.json_response({"draining": False})

    def lane_action(action: Callable[[str], None], paused: bool) -> _Handler:
        async def handler(request: web.Request) -> web.Response:
            lane = request.match_info["lane"]
            try:
                action(lane)
            except KeyError:
                lanes = sorted(admin.controller.scheduler.snapshot(admin.controller.now()))
                return web.json_response({"error": f"unknown lane {lane!r}, expected one of {lanes}"},
                                         status=404)
            log.warning("lane paused by an operator" if paused else "lane resumed by an operator", lane=lane)
            return web.json_response({"lane": lane, "paused": paused})

        return handler

    app = web.Application(middlewares=[_auth(token)])
    app.router.add_get("/admin/state", state)
    app.router.add_post("/admin/reload", reload)
    app.router.add_post("/admin/drain", drain)
    app.router.add_post("/admin/undrain", undrain)
    app.router.add_post("/admin/lanes/{lane}/pause", lane_action(admin.pause, True))
    app.router.add_post("/admin/lanes/{lane}/resume", lane_action(admin.resume, False))
    return app

"""The HTTP port: /metrics for Prometheus, /healthz (alive) and /readyz (ready for traffic).

With a metrics token, /metrics needs ``Authorization: Bearer <token>`` (Prometheus:
``authorization: {credentials_file: …}``); the health endpoints stay open for probes. On
loopback, a foreign ``Host`` is refused (a rebound DNS name cannot read it from a browser).
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from extproc.servers.admin import _auth, guard


def build_app(registry: CollectorRegistry, ready: Callable[[], tuple[bool, str]], *,
              token: str | None = None, hosts: frozenset[str] | None = None) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        ok, why = ready()
        return web.json_response({"status": "ready" if ok else "not ready", "detail": why},
                                 status=200 if ok else 503)

    app = web.Application(middlewares=[guard(hosts), _auth(token, frozenset({"/metrics"}))])
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app

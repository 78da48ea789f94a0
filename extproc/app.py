"""Wiring only: build the parts from settings, start them in order, stop them gracefully.

Shutdown (SIGTERM or SIGINT): readiness and gRPC health turn to not-serving,
queued requests are answered 503 at once, new ones are refused with 503, and
in-flight requests get up to the grace period to finish before the servers stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal

import grpc
import structlog
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from extproc.controller import Controller
from extproc.metrics import Metrics
from extproc.policy.schema import Policy
from extproc.servers import http
from extproc.servers.extproc import ExternalProcessor
from extproc.settings import Settings

log = structlog.get_logger("extproc")
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


class StartupError(Exception):
    """A port could not be bound or a part could not start."""


async def serve(settings: Settings, policy: Policy, stop: asyncio.Event | None = None) -> None:
    """Run until ``stop`` is set or the process gets SIGTERM/SIGINT."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)

    registry = CollectorRegistry()
    metrics = Metrics(registry)
    rng = random.Random(settings.seed) if settings.seed is not None else None
    controller = Controller(policy, metrics, rng=rng)
    processor = ExternalProcessor(controller)

    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        bound = server.add_insecure_port(str(settings.grpc))
    except RuntimeError as exc:
        raise StartupError(f"cannot listen for gRPC on {settings.grpc}: {exc}") from None
    if bound == 0:
        raise StartupError(f"cannot listen for gRPC on {settings.grpc}")

    def ready() -> tuple[bool, str]:
        if controller.scheduler.draining:
            return False, "draining"
        return True, "serving"

    runner = web.AppRunner(http.build_app(registry, ready), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, settings.http.host, settings.http.port).start()
    except OSError as exc:
        await runner.cleanup()
        raise StartupError(f"cannot listen for HTTP on {settings.http}: {exc.strerror}") from None

    await server.start()
    controller.start()
    for name in ("", EXT_PROC_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving", grpc=str(settings.grpc), http=str(settings.http), policy=settings.policy,
             lanes=[lane.name for lane in policy.lanes], capacity=policy.total_capacity)
    try:
        await stop.wait()
    finally:
        log.info("draining", inflight=controller.scheduler.total_inflight,
                 queued=controller.scheduler.total_queued, grace_s=settings.shutdown_grace_s)
        for name in ("", EXT_PROC_SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        controller.drain()
        finished = await controller.wait_idle(settings.shutdown_grace_s)
        if not finished:
            log.warning("grace period over", inflight=controller.scheduler.total_inflight)
        await server.stop(grace=1.0)
        await controller.stop()
        await runner.cleanup()
        log.info("stopped")

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
import time
from collections.abc import Coroutine
from typing import Any

import grpc
import structlog
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from extproc.admin import Admin
from extproc.controller import Controller
from extproc.metrics import Metrics, RateLimitMetrics, SaturationCollector
from extproc.policy.schema import Policy
from extproc.policy.watcher import PolicyFile, ReloadResult
from extproc.servers import admin as admin_http
from extproc.servers import admin_grpc, http
from extproc.servers.extproc import ExternalProcessor
from extproc.servers.ratelimit import SERVICE as RATELIMIT_SERVICE
from extproc.servers.ratelimit import RateLimitService
from extproc.servers.ratelimit import add_to_server as add_ratelimit_service
from extproc.settings import Settings, allowed_hosts, is_loopback
from extproc.signals.hub import SignalHub
from extproc.state.fallback import FallbackLedger
from extproc.state.store import budget_store, open_ledger

log = structlog.get_logger("extproc")
_tasks: set[asyncio.Task[object]] = set()
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def _background(coro: Coroutine[Any, Any, object]) -> None:
    """Run ``coro`` on the loop, keeping a reference until it ends (a signal handler cannot await)."""
    task = asyncio.get_running_loop().create_task(coro)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


class StartupError(Exception):
    """A port could not be bound or a part could not start."""


async def serve(settings: Settings, policy: Policy, stop: asyncio.Event | None = None) -> None:
    """Run until ``stop`` is set or the process gets SIGTERM/SIGINT."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)

    if settings.admin_exposed and not settings.admin_token:
        ports = ", ".join(str(a) for a in (settings.admin, settings.admin_grpc)
                          if a is not None and not is_loopback(a.host))
        raise StartupError(f"the admin port {ports} is not on loopback: set a token "
                           f"(EXTPROC_ADMIN_TOKEN or --admin-token-file) or listen on 127.0.0.1")
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    rng = random.Random(settings.seed) if settings.seed is not None else None
    ledger = None
    if settings.store and not settings.store.startswith("memory:"):
        try:
            ledger = open_ledger(settings.store, prefix=settings.store_prefix,
                                 timeout=settings.store_timeout_s,
                                 fail_open=settings.store_fail_open, ttl=settings.store_ttl_s,
                                 fleet_size=settings.store_fleet_size)
        except ValueError as exc:
            raise StartupError(f"cannot use the store {settings.store!r}: {exc}") from None
        if isinstance(ledger, FallbackLedger):
            ledger.on_script_error(lambda script: metrics.store_script_errors.labels(script).inc())
        await ledger.start()
    # Tenant budgets, the retry budget and fair shares: the fleet's, through the store (or each replica's).
    budgets = budget_store(ledger) if settings.store_share_fleet else None
    controller = Controller(policy, metrics, rng=rng, ledger=ledger, budgets=budgets, edge_rng=rng)
    processor = ExternalProcessor(controller, log_key=settings.log_key,
                                  overload_after=settings.overload_after_s)
    controller.on_reconfigure.append(lambda _: processor.reconfigure())
    registry.register(SaturationCollector(controller.machine.saturation, controller.now))
    hub = SignalHub(policy.signals, registry, controller.now, controller.on_signals)
    controller.on_reconfigure.append(lambda new: hub.reconfigure(new.signals))

    def reloaded(result: ReloadResult) -> None:
        metrics.policy_reload_failing.set(0 if result.ok else 1)
        metrics.policy_stale_since.set(policy_file.stale_since or 0)
        if not result.ok:
            metrics.policy_reloads.labels("error").inc()
        elif result.changed:
            # (A bad edit reverted to the policy in force is ok but changes nothing.)
            metrics.policy_reloads.labels("ok").inc()
            metrics.policy_loaded.set_to_current_time()

    policy_file = PolicyFile(settings.policy, policy, controller.reconfigure, on_result=reloaded)
    metrics.policy_loaded.set(policy_file.loaded_at)
    with contextlib.suppress(NotImplementedError, RuntimeError, AttributeError):
        loop.add_signal_handler(signal.SIGHUP, lambda: _background(policy_file.reload("sighup")))

    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    edge_metrics = RateLimitMetrics(registry, metrics.saturation_rejections)
    ratelimit = RateLimitService(controller.machine, edge_metrics,
                                 lambda: controller.policy.ratelimit, log_key=settings.log_key,
                                 store=budgets, store_timeout=settings.store_budget_timeout_s)
    add_ratelimit_service(ratelimit, server)
    # A proxy that leaves the edge to ext_proc (x-extproc-edge) gets the same answers, in process.
    processor.edge = ratelimit
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        bound = server.add_insecure_port(str(settings.grpc))
    except RuntimeError as exc:
        raise StartupError(f"cannot listen for gRPC on {settings.grpc}: {exc}") from None
    if bound == 0:
        raise StartupError(f"cannot listen for gRPC on {settings.grpc}")

    def ready() -> tuple[bool, str]:
        if controller.machine.draining:
            return False, "draining"
        notes = []
        view = controller.view
        if view is not None and view.degraded:
            # Still ready: the fallback keeps deciding (within this replica's share, or refusing).
            notes.append(f"shared store unreachable ({view.reason}), local fallback")
        if policy_file.stale_since is not None:
            # Still ready: the previous policy serves.
            since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(policy_file.stale_since))
            first = policy_file.last_error[0] if policy_file.last_error else "unknown problem"
            notes.append(f"policy file invalid since {since}, previous policy in force ({first})")
        return True, "; ".join(["serving", *notes])

    runner = web.AppRunner(http.build_app(registry, ready, token=settings.metrics_token,
                                          hosts=allowed_hosts(settings.http)), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, settings.http.host, settings.http.port).start()
    except OSError as exc:
        await runner.cleanup()
        raise StartupError(f"cannot listen for HTTP on {settings.http}: {exc.strerror}") from None
    admin = Admin(controller, policy_file, signals=hub)
    admin_runner: web.AppRunner | None = None
    if settings.admin is not None:
        hosts = allowed_hosts(settings.admin, settings.admin_hosts)
        admin_app = admin_http.build_app(admin, settings.admin_token, hosts)
        admin_runner = web.AppRunner(admin_app, access_log=None)
        await admin_runner.setup()
        try:
            await web.TCPSite(admin_runner, settings.admin.host, settings.admin.port).start()
        except OSError as exc:
            await admin_runner.cleanup()
            await runner.cleanup()
            raise StartupError(f"cannot listen for admin HTTP on {settings.admin}: {exc.strerror}") from None
    admin_server: grpc.aio.Server | None = None
    if settings.admin_grpc is not None:
        admin_server = admin_grpc.build_server(admin, settings.admin_token)
        try:
            admin_bound = admin_server.add_insecure_port(str(settings.admin_grpc))
        except RuntimeError:
            admin_bound = 0
        if admin_bound == 0:
            if admin_runner is not None:
                await admin_runner.cleanup()
            await runner.cleanup()
            raise StartupError(f"cannot listen for admin gRPC on {settings.admin_grpc}")
        await admin_server.start()
    watcher = (loop.create_task(policy_file.watch(settings.watch_interval_s), name="extproc-policy-watch")
               if settings.watch_interval_s > 0 else None)

    await server.start()
    controller.start()
    hub.start()
    for name in ("", EXT_PROC_SERVICE, RATELIMIT_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving", grpc=str(settings.grpc), http=str(settings.http),
             event_loop=type(asyncio.get_running_loop()).__module__.split(".")[0],
             admin=str(settings.admin) if settings.admin else None,
             admin_grpc=str(settings.admin_grpc) if settings.admin_grpc else None, policy=settings.policy,
             lanes=[lane.name for lane in policy.lanes], capacity=policy.total_capacity,
             shadow=policy.shadow or [lane.name for lane in policy.lanes if lane.shadow])
    try:
        await stop.wait()
    finally:
        log.info("draining", inflight=controller.machine.total_inflight,
                 queued=controller.machine.total_queued, grace_s=settings.shutdown_grace_s)
        for name in ("", EXT_PROC_SERVICE, RATELIMIT_SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        controller.drain()
        finished = await controller.wait_idle(settings.shutdown_grace_s)
        if not finished:
            log.warning("grace period over", inflight=controller.machine.total_inflight)
        await server.stop(grace=1.0)
        await ratelimit.close()
        if admin_server is not None:
            await admin_server.stop(grace=0.5)
        await hub.stop()
        await controller.stop()
        if ledger is not None:
            await ledger.close()
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        if admin_runner is not None:
            await admin_runner.cleanup()
        await runner.cleanup()
        log.info("stopped")

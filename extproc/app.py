"""Wiring only: build the parts from settings, start them in order, stop them gracefully.

How this works: :class:`App` makes every part from the settings and the policy, with no I/O and
nothing listening yet. ``start`` connects the store, binds the four listeners (HTTP, admin HTTP,
admin gRPC, then gRPC as it starts) and starts the rest, pushing each one's undo onto an
``AsyncExitStack`` as it succeeds: a start that fails half-way (a port taken) gives back what it
had bound, in reverse, before its ``StartupError`` goes up. ``stop`` drains, then stops
everything in the shutdown order. :func:`serve` is the three of them around a wait for the signal.

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

from extproc.controller import Controller
from extproc.metrics import Metrics, RateLimitMetrics, SaturationCollector
from extproc.operations import Operations
from extproc.policy.schema import Policy
from extproc.policy.watcher import PolicyFile, ReloadResult
from extproc.servers import admin as admin_http
from extproc.servers import admin_grpc, http
from extproc.servers.extproc import ExternalProcessor
from extproc.servers.ratelimit import SERVICE as RATELIMIT_SERVICE
from extproc.servers.ratelimit import RateLimitService
from extproc.servers.ratelimit import add_to_server as add_ratelimit_service
from extproc.settings import Address, Settings, allowed_hosts, is_loopback
from extproc.signals.hub import SignalHub
from extproc.state import Ledger
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


class App:
    """One ``extproc serve``: its parts, built from the settings; ``start``, then ``stop``."""

    def __init__(self, settings: Settings, policy: Policy) -> None:
        """Build every part (nothing connects or listens yet); StartupError for settings that cannot serve."""
        _refuse_an_open_admin_port(settings)
        self.settings = settings
        self.policy = policy
        self.registry = registry = CollectorRegistry()
        self.metrics = metrics = Metrics(registry)
        rng = random.Random(settings.seed) if settings.seed is not None else None
        self.ledger = _open_ledger(settings, metrics)
        # Tenant budgets, the retry budget and fair shares: the fleet's, through the store
        # (or each replica's).
        budgets = budget_store(self.ledger) if settings.store_share_fleet else None
        self.controller = controller = Controller(policy, metrics, rng=rng, ledger=self.ledger,
                                                  budgets=budgets, edge_rng=rng)
        registry.register(SaturationCollector(controller.machine.saturation, controller.now))
        self.hub = SignalHub(policy.signals, registry, controller.now, controller.on_signals)
        controller.want_reading = self.hub.hurry
        self.policy_file = PolicyFile(settings.policy, policy, controller.reconfigure,
                                      on_result=self._reloaded)
        metrics.policy_loaded.set(self.policy_file.loaded_at)
        edge_metrics = RateLimitMetrics(registry, metrics.saturation_rejections)
        policy_hash = self._policy_hash
        self.ratelimit = RateLimitService(controller.machine, edge_metrics,
                                          lambda: controller.policy.ratelimit, log_key=settings.log_key,
                                          store=budgets,
                                          store_timeout=settings.store_budget_timeout_s,
                                          refused=controller.refused, policy_hash=policy_hash)
        # A proxy that leaves the edge to ext_proc (x-extproc-edge) gets the same answers, in process.
        self.processor = ExternalProcessor(controller, log_key=settings.log_key,
                                           overload_after=settings.overload_after_s, edge=self.ratelimit,
                                           policy_hash=policy_hash, response_sample=settings.response_sample)
        controller.on_reconfigure.append(lambda _: self.processor.reconfigure())
        controller.on_reconfigure.append(lambda new: self.hub.reconfigure(new.signals))
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server()
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(self.processor, self.server)
        add_ratelimit_service(self.ratelimit, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.runner = web.AppRunner(http.build_app(registry, self.ready, token=settings.metrics_token,
                                                   hosts=allowed_hosts(settings.http)), access_log=None)
        self.operations = admin = Operations(controller, self.policy_file, signals=self.hub)
        self.admin_runner = None if settings.admin is None else web.AppRunner(
            admin_http.build_app(admin, settings.admin_token,
                                 allowed_hosts(settings.admin, settings.admin_hosts)), access_log=None)
        self.admin_server = (admin_grpc.build_server(admin, settings.admin_token)
                             if settings.admin_grpc is not None else None)
        self.watcher: asyncio.Task[None] | None = None

    def _policy_hash(self) -> str:
        """The sha256 of the policy file in force (swapped with the policy, on the one event loop)."""
        return self.policy_file.sha256

    def _reloaded(self, result: ReloadResult) -> None:
        self.operations.reloaded(result)
        metrics = self.metrics
        metrics.policy_reload_failing.set(0 if result.ok else 1)
        metrics.policy_stale_since.set(self.policy_file.stale_since or 0)
        if not result.ok:
            metrics.policy_reloads.labels("error").inc()
        elif result.changed:
            # (A bad edit reverted to the policy in force is ok but changes nothing.)
            metrics.policy_reloads.labels("ok").inc()
            metrics.policy_loaded.set_to_current_time()

    def ready(self) -> tuple[bool, str]:
        """Readiness, and why: not while draining; a degraded store or a stale policy is a note."""
        if self.controller.machine.draining:
            return False, "draining"
        notes = []
        view = self.controller.view
        if view is not None and view.degraded:
            # Still ready: the fallback keeps deciding (within this replica's share, or refusing).
            notes.append(f"shared store unreachable ({view.reason}), local fallback")
        policy_file = self.policy_file
        if policy_file.stale_since is not None:
            # Still ready: the previous policy serves.
            since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(policy_file.stale_since))
            first = policy_file.last_error[0] if policy_file.last_error else "unknown problem"
            notes.append(f"policy file invalid since {since}, previous policy in force ({first})")
        notes += _capacity_notes(self.controller)
        return True, "; ".join(["serving", *notes])

    async def start(self) -> None:
        """Connect the store, bind the listeners, start serving; StartupError (what had started
        stopped again, in reverse) if a port cannot be bound."""
        settings = self.settings
        loop = asyncio.get_running_loop()
        async with contextlib.AsyncExitStack() as started:
            if self.ledger is not None:
                await self.ledger.start()
                started.push_async_callback(self.ledger.close)
            with contextlib.suppress(NotImplementedError, RuntimeError, AttributeError):
                loop.add_signal_handler(signal.SIGHUP, lambda: _background(self.policy_file.reload("sighup")))
            await _listen(self.runner, settings.http, "HTTP")
            started.push_async_callback(self.runner.cleanup)
            if self.admin_runner is not None and settings.admin is not None:
                await _listen(self.admin_runner, settings.admin, "admin HTTP")
                started.push_async_callback(self.admin_runner.cleanup)
            if self.admin_server is not None and settings.admin_grpc is not None:
                _bind(self.admin_server, settings.admin_grpc, "admin gRPC", say_why=False)
                await self.admin_server.start()
                started.push_async_callback(self.admin_server.stop, None)
            if settings.watch_interval_s > 0:
                self.watcher = loop.create_task(self.policy_file.watch(settings.watch_interval_s),
                                                name="extproc-policy-watch")
                started.push_async_callback(_cancel, self.watcher)
            # Bound only now, as it starts: a gRPC server bound and never started keeps its port
            # until the process ends, even once stopped.
            _bind(self.server, settings.grpc, "gRPC")
            started.push_async_callback(self._stop_grpc, None)
            await self.server.start()
            self.controller.start()
            started.push_async_callback(self.controller.stop)
            self.hub.start()
            started.push_async_callback(self.hub.stop)
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
            started.pop_all()  # all started: stop() takes it from here, in the shutdown order
        self._log_serving()

    def _log_serving(self) -> None:
        settings, policy = self.settings, self.policy
        log.info("serving", grpc=str(settings.grpc), http=str(settings.http),
                 event_loop=type(asyncio.get_running_loop()).__module__.split(".")[0],
                 admin=str(settings.admin) if settings.admin else None,
                 admin_grpc=str(settings.admin_grpc) if settings.admin_grpc else None, policy=settings.policy,
                 response_sample=settings.response_sample,
                 lanes=[lane.name for lane in policy.lanes], capacity=policy.total_capacity,
                 shadow=policy.shadow or [lane.name for lane in policy.lanes if lane.shadow])

    async def stop(self) -> None:
        """Drain (health not serving, the queue answered at once, the in-flight given the grace
        period), then stop the parts: the gRPC ports first, the HTTP ones (probes, metrics) last."""
        controller, grace_s = self.controller, self.settings.shutdown_grace_s
        log.info("draining", inflight=controller.machine.total_inflight,
                 queued=controller.machine.total_queued, grace_s=grace_s)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.operations.drain("shutdown")
        finished = await controller.wait_idle(grace_s)
        if not finished:
            log.warning("grace period over", inflight=controller.machine.total_inflight)
        await self._stop_grpc(1.0)
        if self.admin_server is not None:
            await self.admin_server.stop(grace=0.5)
        await self.hub.stop()
        await controller.stop()
        if self.ledger is not None:
            await self.ledger.close()
        if self.watcher is not None:
            await _cancel(self.watcher)
        if self.admin_runner is not None:
            await self.admin_runner.cleanup()
        await self.runner.cleanup()
        log.info("stopped")

    async def _stop_grpc(self, grace: float | None) -> None:
        """Stop the gRPC server (ext_proc, the edge, health), then let the edge's store calls finish."""
        await self.server.stop(grace=grace)
        await self.ratelimit.close()

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        for name in ("", EXT_PROC_SERVICE, RATELIMIT_SERVICE):
            await self.health.set(name, status)


def _refuse_an_open_admin_port(settings: Settings) -> None:
    """StartupError if an admin port listens beyond loopback with no token to guard it."""
    if settings.admin_exposed and not settings.admin_token:
        ports = ", ".join(str(a) for a in (settings.admin, settings.admin_grpc)
                          if a is not None and not is_loopback(a.host))
        raise StartupError(f"the admin port {ports} is not on loopback: set a token "
                           f"(EXTPROC_ADMIN_TOKEN or --admin-token-file) or listen on 127.0.0.1")


def _open_ledger(settings: Settings, metrics: Metrics) -> Ledger | None:
    """The shared store's ledger, not connected yet (None: this replica alone)."""
    if not settings.store or settings.store.startswith("memory:"):
        return None
    try:
        ledger = open_ledger(settings.store, prefix=settings.store_prefix, timeout=settings.store_timeout_s,
                             fail_open=settings.store_fail_open, ttl=settings.store_ttl_s,
                             fleet_size=settings.store_fleet_size)
    except ValueError as exc:
        raise StartupError(f"cannot use the store {settings.store!r}: {exc}") from None
    if isinstance(ledger, FallbackLedger):
        ledger.on_script_error(lambda script: metrics.store_script_errors.labels(script).inc())
    return ledger


def _bind(server: grpc.aio.Server, address: Address, what: str, *, say_why: bool = True) -> None:
    """Bind ``server`` to ``address`` (it serves once started); StartupError if it cannot (``say_why``:
    with gRPC's reason; the admin port's message has always been without it)."""
    try:
        bound = server.add_insecure_port(str(address))
    except RuntimeError as exc:
        if say_why:
            raise StartupError(f"cannot listen for {what} on {address}: {exc}") from None
        bound = 0
    if bound == 0:
        raise StartupError(f"cannot listen for {what} on {address}")


async def _listen(runner: web.AppRunner, address: Address, what: str) -> None:
    """Serve ``runner``'s app on ``address``; StartupError (the runner cleaned up) if it cannot."""
    await runner.setup()
    try:
        await web.TCPSite(runner, address.host, address.port).start()
    except OSError as exc:
        await runner.cleanup()
        raise StartupError(f"cannot listen for {what} on {address}: {exc.strerror}") from None


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def serve(settings: Settings, policy: Policy, stop: asyncio.Event | None = None) -> None:
    """Run until ``stop`` is set or the process gets SIGTERM/SIGINT."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    app = App(settings, policy)
    await app.start()
    try:
        await stop.wait()
    finally:
        await app.stop()


def _capacity_notes(controller: Controller) -> list[str]:
    """What readiness says of a self-sized limit that cannot follow the engines (still ready: the last
    limit, or its min, keeps deciding)."""
    auto = controller.machine.auto
    if auto is None:
        return []
    state = auto.state()
    notes = []
    if state.stale:
        notes.append(f"capacity signals stale: limit {state.limit} held, then decaying to min {state.min}")
    if state.unreachable:
        notes.append(f"capacity latency target unreachable ({state.unreachable}): limit at min {state.min}")
    return notes

"""Real processes on loopback: an upstream, extproc (`extproc serve`) and Envoy."""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from extproc.localstack import Process, Stack, envoy_config, free_port, stack, wait_http
from tests.integration.kueue_exporter import Exporter

UPSTREAM = Path(__file__).with_name("upstream.py")
#: The demo API keys in envoy/envoy.yaml's api_key_auth filter: key -> client name (the tenant the
#: gateway vouches for, forwarded as x-extproc-client).
DEMO_KEYS = {"acme": "sk-demo-acme", "globex": "sk-demo-globex", "free": "sk-demo-free"}


def as_tenant(tenant: str) -> dict[str, str]:
    """Request headers that make the gateway vouch for ``tenant`` (its demo API key)."""
    return {"authorization": f"Bearer {DEMO_KEYS[tenant]}"}


def metric(url: str, name: str, **labels: str) -> float:
    """Current value of one sample from a /metrics page (0 if absent)."""
    text = httpx.get(url, timeout=5).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        got = ",".join(sorted((match.group(2) or "").split(","))) if match.group(2) else ""
        if got == want:
            return float(match.group(3))
    return 0.0


@dataclass
class Env:
    stack: Stack
    url: str
    metrics_url: str
    upstream_url: str
    extproc_grpc: int
    admin_url: str
    policy: Path
    admin_grpc: str = ""
    """The gRPC admin API's address (HOST:PORT)."""

    def metric(self, name: str, **labels: str) -> float:
        """Current value of one sample from extproc's /metrics (0 if absent)."""
        return metric(self.metrics_url, name, **labels)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until no lane has anything queued or in flight."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = httpx.get(self.metrics_url, timeout=5).text
            busy = [line for line in text.splitlines()
                    if line.startswith(("inference_pending_requests{", "inference_inflight_requests{"))
                    and not line.endswith(" 0.0")]
            if not busy:
                return
            time.sleep(0.05)
        raise AssertionError(f"extproc still busy after {timeout}s: {busy}")


def ready(process: Process, url: str) -> None:
    """Wait until ``process`` answers 200 on ``url``; if it never does, fail with its output."""
    try:
        wait_http(url, proc=process.popen)
    except (RuntimeError, TimeoutError) as exc:
        raise RuntimeError(f"{process.name} did not start: {exc}\n{process.output()[-3000:]}") from None


def start_env(workdir: Path, policy: Path, *, extproc_args: tuple[str, ...] = (),
              tweak: Callable[[dict[str, Any]], None] | None = None) -> tuple[Stack, Env]:
    s = Stack(workdir)
    try:
        # The three start side by side (each knows the others' ports up front; Envoy connects to
        # its upstream and to extproc only when a request comes), then each is waited for.
        upstream = free_port()
        echo = s.start("upstream", [sys.executable, str(UPSTREAM), str(upstream)])
        grpc, http, admin_port, admin_grpc = free_port(), free_port(), free_port(), free_port()
        extproc = s.extproc(policy, grpc, http, "--seed", "7", "--log-format", "json", *extproc_args,
                            admin=admin_port, admin_grpc=admin_grpc, wait=False)
        listen, admin = free_port(), free_port()
        s.envoy(envoy_config(listen, admin, upstream, grpc, tweak=tweak))
        ready(echo, f"http://127.0.0.1:{upstream}/stats")
        ready(extproc, f"http://127.0.0.1:{http}/readyz")
    except BaseException:
        s.stop()
        raise
    return s, Env(s, f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{http}/metrics",
                  f"http://127.0.0.1:{upstream}", grpc, f"http://127.0.0.1:{admin_port}", policy,
                  f"127.0.0.1:{admin_grpc}")


@contextlib.contextmanager
def shared_env(factory: pytest.TempPathFactory, name: str, policy_text: str) -> Iterator[Env]:
    """One stack with ``policy_text`` for a module's tests that change nothing in it (a module-scoped
    fixture's body; tests that change the stack make their own)."""
    workdir = factory.mktemp(name)
    policy = workdir / "policy.yaml"
    policy.write_text(policy_text)
    stack, environment = start_env(workdir, policy)
    try:
        yield environment
    finally:
        stack.stop()


@pytest.fixture
def make_env(tmp_path: Path) -> Iterator[Callable[..., Env]]:
    """Start a whole stack for one test with the given policy text."""
    stacks: list[Stack] = []
    with stack(tmp_path) as holder:
        def make(policy_text: str, **kwargs: Any) -> Env:
            policy = tmp_path / f"policy{len(holder.processes)}.yaml"
            policy.write_text(policy_text)
            s, env = start_env(tmp_path, policy, **kwargs)
            holder.processes.extend(s.processes)
            stacks.append(s)
            return env
        try:
            yield make
        finally:
            # Processes a test started later on an env's own stack (a restarted extproc) stop too.
            for s in reversed(stacks):
                s.stop()


@pytest.fixture(scope="module")
def exporter() -> Iterator[Exporter]:
    """A Kueue exporter in this process (see kueue_exporter.py), one per test module."""
    e = Exporter()
    e.start()
    try:
        yield e
    finally:
        e.stop()


async def serve_http(exits: AsyncExitStack, handle: Callable[[web.Request], Awaitable[web.StreamResponse]]
                     ) -> int:
    """An HTTP server on a free loopback port answering every method and path with ``handle``, stopped
    when ``exits`` closes; its port."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    exits.push_async_callback(runner.cleanup)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port: int = runner.addresses[0][1]
    return port


async def until(predicate: Callable[[], bool], what: str, within_s: float = 10.0) -> None:
    """Wait for a state the test needs before its next step (not a speed assertion)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


class LogRecords:
    """A bound logger's stand-in that keeps each record (the servicers' own loggers are cached)."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records

    def info(self, event: str, **fields: Any) -> None:
        self.records.append({"event": event, **fields})

    warning = error = exception = info

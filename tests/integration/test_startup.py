"""A start that fails half-way, on real ports: the listeners already bound are given back.

``extproc serve`` binds HTTP, admin HTTP, admin gRPC and gRPC in that order. Here one of the
ports is already taken by another socket: the start fails with its StartupError, and every
other port is free at once (not only when the process exits or the objects are collected: the
raised error keeps them alive).
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from extproc import app
from extproc.localstack import free_port
from extproc.policy import load_policy
from extproc.settings import Address, Settings

POLICY = """
lanes: [{name: a, max_inflight: 2, max_queued: 10, deadline: 5s}]
classification: {default_lane: a}
"""

#: The listeners in the order they are bound, and how the error names each.
LISTENERS = {"http": "HTTP", "admin": "admin HTTP", "admin_grpc": "admin gRPC", "grpc": "gRPC"}


def _free(port: int) -> bool:
    """Whether nothing holds ``port`` (a plain socket can bind it, as any other program's would)."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("taken", list(LISTENERS))
async def test_a_port_taken_half_way_gives_back_the_ones_already_bound(taken: str, tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        ports = {name: free_port() for name in LISTENERS}
        ports[taken] = other.getsockname()[1]
        settings = Settings(policy=str(path), watch_interval_s=0,
                            **{name: Address("127.0.0.1", port) for name, port in ports.items()})
        with pytest.raises(app.StartupError) as failed:
            await app.serve(settings, load_policy(str(path)), asyncio.Event())
        said = f"cannot listen for {LISTENERS[taken]} on 127.0.0.1:{ports[taken]}"
        assert str(failed.value).startswith(said)
        others = [name for name in LISTENERS if name != taken]
        assert {name: _free(ports[name]) for name in others} == dict.fromkeys(others, True)


async def test_a_start_that_succeeds_holds_every_port_until_stopped(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    ports = {name: free_port() for name in LISTENERS}
    settings = Settings(policy=str(path), watch_interval_s=0, shutdown_grace_s=1.0,
                        **{name: Address("127.0.0.1", port) for name, port in ports.items()})
    stop = asyncio.Event()
    serving = asyncio.create_task(app.serve(settings, load_policy(str(path)), stop))
    try:
        for _ in range(100):
            if not any(_free(port) for port in ports.values()):
                break
            await asyncio.sleep(0.05)
        assert {name: _free(port) for name, port in ports.items()} == dict.fromkeys(LISTENERS, False)
    finally:
        stop.set()
        await asyncio.wait_for(serving, 10)
    assert {name: _free(port) for name, port in ports.items()} == dict.fromkeys(LISTENERS, True)

"""free_port: a stack asks for several ports before anything binds them; none may come twice."""

from __future__ import annotations

import socket

import pytest

from extproc import localstack


def test_free_port_never_hands_out_a_port_twice_in_a_row_of_asks() -> None:
    ports = [localstack.free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
    for port in ports[:5]:  # and each is free to bind
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_the_memory_of_handed_out_ports_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(localstack, "_HANDED_OUT_KEPT", 10)
    for _ in range(50):
        localstack.free_port()
    assert len(localstack._HANDED_OUT) == 10

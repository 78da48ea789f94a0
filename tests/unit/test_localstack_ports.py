"""free_port: a stack asks for several ports before anything binds them; none may come twice."""

from __future__ import annotations

import collections
import socket
from typing import Any

import pytest

from extproc import localstack


class Offered:
    """A socket whose bind(0) gets the ports of ``offers`` in turn (what the kernel would pick)."""

    def __init__(self, offers: list[int]) -> None:
        self.offers = offers

    def __call__(self, *args: Any) -> Offered:
        return self

    def __enter__(self) -> Offered:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def bind(self, address: tuple[str, int]) -> None:
        pass

    def getsockname(self) -> tuple[str, int]:
        return "127.0.0.1", self.offers.pop(0)


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(localstack, "_HANDED_OUT", collections.OrderedDict())


@pytest.mark.usefixtures("fresh")
def test_a_port_the_kernel_offers_again_is_not_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(localstack.socket, "socket", Offered([40001, 40001, 40002]))
    assert localstack.free_port() == 40001
    assert localstack.free_port() == 40002  # the second offer of 40001 passed over


@pytest.mark.usefixtures("fresh")
def test_when_only_handed_out_ports_are_offered_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(localstack.socket, "socket", Offered([40001] * 101))
    assert localstack.free_port() == 40001
    with pytest.raises(RuntimeError, match="no free loopback port"):
        localstack.free_port()


@pytest.mark.usefixtures("fresh")
def test_real_ports_are_distinct_and_free() -> None:
    ports = [localstack.free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


@pytest.mark.usefixtures("fresh")
def test_the_memory_of_handed_out_ports_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(localstack, "_HANDED_OUT_KEPT", 10)
    for _ in range(50):
        localstack.free_port()
    assert len(localstack._HANDED_OUT) == 10

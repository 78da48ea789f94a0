"""Process settings (ports, paths, logging), from command-line flags with environment fallbacks."""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Address:
        host, sep, port = text.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"expected HOST:PORT, got {text!r}")
        return cls(host.strip("[]"), int(port))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Settings:
    policy: str
    grpc: Address = Address("127.0.0.1", 50051)
    http: Address = Address("127.0.0.1", 9090)
    log_format: str = "json"
    log_level: str = "info"
    shutdown_grace_s: float = 30.0
    overload_after_s: float = 0.05
    """A request whose headers reach extproc more than this after the proxy stamped its arrival is
    refused at once (503 overloaded) rather than decided, once such late ones have come for twice this
    on end: extproc is beyond its decision rate (core/overload.py). 0: off."""
    response_sample: int = 1
    """Ask Envoy for the response headers of one admitted request in this many (1: every one). The
    others cost neither extproc nor Envoy that message: their service times teach the estimator
    nothing and their decision lines have no ``status``; the edge's x-ratelimit-* reach their
    responses through dynamic metadata, which the proxy's route configuration adds
    (``envoy/envoy.yaml``'s ``response_headers_to_add``)."""
    seed: int | None = None
    admin: Address | None = Address("127.0.0.1", 9091)
    """The admin port (state, reload, drain, pause); None: no admin port."""
    admin_token: str | None = None
    """The token both admin ports require (None: none, allowed on loopback only)."""
    admin_grpc: Address | None = Address("127.0.0.1", 9092)
    """The admin API over gRPC (extproc.api.admin.v1.Admin); None: not served."""
    watch_interval_s: float = 1.0
    """How often the policy file is checked for changes; 0: only on SIGHUP or the admin endpoint."""
    store: str | None = None
    """Shared store URL (redis://, rediss://, redis+sentinel://): replicas enforce one set of limits.
    None or memory://: this replica alone."""
    store_fail_open: bool = True
    """While the store is unreachable: admit within this replica's share of the limits (open) or refuse."""
    store_ttl_s: float = 15.0
    """Lease lifetime: how long a dead replica's slots stay taken."""
    store_fleet_size: int = 1
    """How many replicas share the store: while the store is unreachable and this replica has seen
    fewer alive (it started during the outage), it takes only the smallest of this many parts."""
    store_budget_timeout_s: float = 0.02
    """The longest the rate limit service waits for the store's tenant budgets before it decides alone
    (its part of each budget): well within Envoy's ratelimit filter timeout (50 ms shipped), so a slow
    store never makes Envoy pass a request unjudged."""
    store_timeout_s: float = 0.05
    """The longest a decision waits for one store reply (then the store counts as away)."""
    store_prefix: str = "extproc"
    store_share_fleet: bool = True
    """With a store: tenant budgets, the retry budget and tenants' fair shares are one for the whole
    fleet (False: each replica keeps its own, as before they were shared; for comparison)."""
    admin_hosts: tuple[str, ...] = ()
    """Host names the admin port answers to besides its own address and loopback's (DNS rebinding)."""
    metrics_token: str | None = None
    """When set, /metrics needs ``Authorization: Bearer <token>`` (the health endpoints never do)."""
    log_key: bytes | None = None
    """Key of the hashes that stand in for credential-like values in logs (None: random per start)."""

    @property
    def admin_exposed(self) -> bool:
        """Whether an admin port (HTTP or gRPC) listens beyond loopback."""
        return any(address is not None and not is_loopback(address.host)
                   for address in (self.admin, self.admin_grpc))


_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_WILDCARDS = ("0.0.0.0", "::", "")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(listen: Address, extra: tuple[str, ...] = ()) -> frozenset[str] | None:
    """``Host`` header values a port listening on ``listen`` accepts (None: any).

    Loopback names with the port, the listen address itself, and ``extra`` names (with or
    without the port). A port on a wildcard address with no ``extra`` accepts any name: it is
    reached by whatever address routes to it (and an admin port there needs a token anyway).
    """
    if listen.host in _WILDCARDS and not extra:
        return None
    port = listen.port
    names = {*_LOOPBACK_NAMES, *extra}
    if listen.host not in _WILDCARDS:
        names.add(listen.host)
    out: set[str] = set()
    for name in names:
        bare = name.strip("[]").lower()
        shown = f"[{bare}]" if ":" in bare else bare
        out.update({shown, f"{shown}:{port}"})
    return frozenset(out)


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (the error names what was given)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number above 0, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number above 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number, 0 or above (the error names what was given)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, 0 or above, got {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a number, 0 or above, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0 (the error names what was given)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
    return value


def env(name: str, default: str) -> str:
    return os.environ.get(f"EXTPROC_{name}", default)


def read_token(path: str) -> str:
    """A token from a file (a mounted Secret, usually newline-terminated); ValueError if empty."""
    with open(path, encoding="utf-8") as file:
        token = file.read().strip()
    if not token:
        raise ValueError(f"the token file {path} is empty")
    return token

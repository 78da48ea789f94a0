"""Envoy bootstraps derived from the shipped ``envoy/envoy.yaml``.

One file is the source of truth; other topologies (local ports chosen at run
time, the compose network's host names, Envoy without extproc as a baseline)
are that file with its addresses rewritten, so what is tested is what ships.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from extproc.settings import Address

ROOT = Path(__file__).resolve().parent.parent
ENVOY_CONFIG = ROOT / "envoy" / "envoy.yaml"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
RATELIMIT_FILTER = "envoy.filters.http.ratelimit"
#: Clusters that point at extproc: its ext_proc stream and its rate limit service (one port).
EXTPROC_CLUSTERS = ("extproc", "extproc_ratelimit")


def _socket(address: Address) -> dict[str, Any]:
    return {"address": address.host, "port_value": address.port}


def _is_ip(host: str) -> bool:
    return host.replace(".", "").isdigit() or ":" in host


def _set_endpoint(cluster: dict[str, Any], address: Address) -> None:
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    endpoint["address"]["socket_address"] = _socket(address)
    # A host name (compose, Kubernetes) needs DNS; an IP address does not.
    cluster["type"] = "STATIC" if _is_ip(address.host) else "STRICT_DNS"


def _hcm(config: dict[str, Any]) -> dict[str, Any]:
    typed: dict[str, Any] = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]
    return typed


def render(
    listen: Address,
    admin: Address,
    backend: Address,
    extproc: Address | None,
    *,
    base: Path = ENVOY_CONFIG,
    tweak: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The shipped bootstrap with its addresses rewritten.

    ``extproc=None`` removes everything that talks to extproc (the ratelimit and ext_proc
    filters, their per-route settings and clusters): plain Envoy, a baseline.
    """
    config: dict[str, Any] = copy.deepcopy(yaml.safe_load(base.read_text()))
    config["admin"]["address"]["socket_address"] = _socket(admin)
    config["static_resources"]["listeners"][0]["address"]["socket_address"] = _socket(listen)
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    _set_endpoint(clusters["inference_backend"], backend)
    if extproc is None:
        hcm = _hcm(config)
        ours = (EXT_PROC_FILTER, RATELIMIT_FILTER)
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] not in ours]
        for vhost in hcm["route_config"]["virtual_hosts"]:
            for route in vhost["routes"]:
                per_filter = route.get("typed_per_filter_config", {})
                for name in ours:
                    per_filter.pop(name, None)
                if not per_filter:
                    route.pop("typed_per_filter_config", None)
        config["static_resources"]["clusters"] = [
            c for c in config["static_resources"]["clusters"] if c["name"] not in EXTPROC_CLUSTERS
        ]
    else:
        for name in EXTPROC_CLUSTERS:
            _set_endpoint(clusters[name], extproc)
    if tweak is not None:
        tweak(config)
    return config


def dump(config: dict[str, Any], header: str = "") -> str:
    return header + yaml.safe_dump(config, sort_keys=False, width=120)

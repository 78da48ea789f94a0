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
#: Removes every client-sent x-extproc-* header, first in the chain.
STRIP_FILTER = "extproc.strip_client_headers"
#: Maps a client's API key to the client name it forwards as x-extproc-client.
API_KEY_FILTER = "envoy.filters.http.api_key_auth"
#: After ext_proc: denies what extproc did not admit (fail-closed for new requests only).
GATE_FILTER = "extproc.admission_gate"
#: Reads a response's token usage for the tenant budgets (and strips the usage event extproc asked for).
USAGE_FILTER = "extproc.usage"
#: Before ext_proc: sheds new requests in proportion to extproc's "overloaded" answers (status 529).
OVERLOAD_FILTER = "envoy.filters.http.admission_control"
#: Before the shed: turns extproc's "overloaded" status (529, the shed's signal) into the 503 clients get.
OVERLOAD_STATUS_FILTER = "extproc.overload_status"
#: The shed's refusal, as it shows in %RESPONSE_CODE_DETAILS%.
OVERLOAD_DENIAL = "denied_by_admission_control"
#: The RBAC policy the gate denies by, as it shows in %RESPONSE_CODE_DETAILS%.
GATE_DENIAL = "rbac_access_denied_matched_policy[extproc-not-admitted]"
#: Clusters that point at extproc: its ext_proc stream and its rate limit service (one port).
EXTPROC_CLUSTERS = ("extproc", "extproc_ratelimit")
#: The proxy's word that extproc judges the edge in the ext_proc headers phase (core/intake.py).
EDGE_HEADER = "x-extproc-edge"
#: Where the edge is judged: in the ext_proc headers phase (shipped), or in a rate limit call of its own.
EDGE_MODES = ("inline", "call")
#: The arrival descriptor the ratelimit filter sends with ``edge="call"``: what extproc needs to classify
#: the request as ext_proc will (method, path, and each header the shipped policies trust, under its
#: own name; skip_if_absent keeps the descriptor when one is missing). Add an entry for every header
#: in your policy's trusted_headers.
ARRIVAL_DESCRIPTOR: dict[str, Any] = {"actions": [
    {"generic_key": {"descriptor_value": "gpu_inference"}},
    {"request_headers": {"header_name": ":method", "descriptor_key": "method"}},
    {"request_headers": {"header_name": ":path", "descriptor_key": "path"}},
    {"request_headers": {"header_name": "x-extproc-client", "descriptor_key": "x-extproc-client",
                         "skip_if_absent": True}},
    # A retry (retry_budget.header) may hold a booked return: the edge lets it through.
    {"request_headers": {"header_name": "x-stainless-retry-count",
                         "descriptor_key": "x-stainless-retry-count", "skip_if_absent": True}},
    # The request id Envoy logs (set by the connection manager before any filter): a shed's record
    # carries it, so a 429 in the access log is found in extproc's log. Never classified.
    {"request_headers": {"header_name": "x-request-id", "descriptor_key": "request_id",
                         "skip_if_absent": True}},
]}


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


def _remove_filters(hcm: dict[str, Any], names: tuple[str, ...]) -> None:
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] not in names]
    for vhost in hcm["route_config"]["virtual_hosts"]:
        for route in vhost["routes"]:
            per_filter = route.get("typed_per_filter_config", {})
            for name in names:
                per_filter.pop(name, None)
            if not per_filter:
                route.pop("typed_per_filter_config", None)


def _remove_with_mapper(hcm: dict[str, Any], name: str, denial: str) -> None:
    """No filter ``name``, and no mapping of its refusal (``denial``: its response code details)."""
    _remove_filters(hcm, (name,))
    replies = hcm.get("local_reply_config")
    if replies is not None:
        mappers = replies.get("mappers", [])
        replies["mappers"] = [m for m in mappers if denial not in str(m.get("filter"))]
        if not replies["mappers"]:
            del hcm["local_reply_config"]


def _edge_by_call(hcm: dict[str, Any]) -> None:
    """The edge as a rate limit call of its own: the arrival descriptor on every route that has the
    ratelimit filter's settings, and no x-extproc-edge (extproc then judges no arrival itself; the
    routes still drop the proxy's headers, and the x-extproc-edge-judged the call adds)."""
    seen: set[int] = set()
    for vhost in hcm["route_config"]["virtual_hosts"]:
        for route in vhost["routes"]:
            settings = route.get("typed_per_filter_config", {}).get(RATELIMIT_FILTER)
            if settings is None or "rate_limits" not in settings or id(settings) in seen:
                continue  # (routes may share one settings object: the file's YAML anchors)
            seen.add(id(settings))
            settings["rate_limits"].insert(0, copy.deepcopy(ARRIVAL_DESCRIPTOR))
    for http_filter in hcm["http_filters"]:
        if http_filter["name"] == STRIP_FILTER:
            mutations = http_filter["typed_config"]["mutations"]["request_mutations"]
            mutations[:] = [m for m in mutations
                            if m.get("append", {}).get("header", {}).get("key") != EDGE_HEADER]
    for log in hcm.get("access_log", []):
        fields = log.get("typed_config", {}).get("log_format", {}).get("json_format", {})
        if "edge_shadow" in fields:
            fields["edge_shadow"] = "%DYNAMIC_METADATA(envoy.filters.http.ratelimit:shadow)%"


def render(
    listen: Address,
    admin: Address,
    backend: Address,
    extproc: Address | None,
    *,
    base: Path = ENVOY_CONFIG,
    fail_open: bool = False,
    edge: str = "inline",
    tweak: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The shipped bootstrap with its addresses rewritten.

    ``extproc=None`` removes everything that talks to extproc or serves it (the ratelimit and
    ext_proc filters, the overload shed, the admission gate, their per-route settings and clusters,
    the x-ratelimit-* headers the route configuration adds from extproc's metadata)
    and keeps the gateway's own work (the strip of client x-extproc-* headers, API keys): plain
    Envoy, a baseline.
    ``fail_open`` removes the admission gate: while extproc is down, requests pass unadmitted (the
    overload shed stays: its refusals are the same in either mode).
    ``edge="call"`` has the ratelimit filter ask for the edge's judgement of each arrival (a unary
    call of its own) instead of extproc judging it in the ext_proc headers phase.
    """
    if edge not in EDGE_MODES:
        raise ValueError(f"edge must be one of {EDGE_MODES}, not {edge!r}")
    config: dict[str, Any] = copy.deepcopy(yaml.safe_load(base.read_text()))
    config["admin"]["address"]["socket_address"] = _socket(admin)
    config["static_resources"]["listeners"][0]["address"]["socket_address"] = _socket(listen)
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    _set_endpoint(clusters["inference_backend"], backend)
    hcm = _hcm(config)
    if fail_open or extproc is None:
        # Fail open: no admission gate (the overload shed stays: it answers alike in either mode).
        _remove_with_mapper(hcm, GATE_FILTER, GATE_DENIAL)
    if edge == "call" and extproc is not None:
        _edge_by_call(hcm)
    if extproc is None:
        _remove_with_mapper(hcm, OVERLOAD_FILTER, OVERLOAD_DENIAL)
        _remove_filters(hcm, (EXT_PROC_FILTER, RATELIMIT_FILTER, USAGE_FILTER, OVERLOAD_STATUS_FILTER))
        # (Headers from extproc's metadata: nothing would set it.)
        hcm["route_config"].pop("response_headers_to_add", None)
        config["static_resources"]["clusters"] = [
            c for c in config["static_resources"]["clusters"] if c["name"] not in EXTPROC_CLUSTERS
        ]
    else:
        for name in EXTPROC_CLUSTERS:
            _set_endpoint(clusters[name], extproc)
    if tweak is not None:
        tweak(config)
    return config


class _NoAliases(yaml.SafeDumper):
    """Writes shared parts (the shipped file's YAML anchors) out in full, as Envoy's users read them."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump(config: dict[str, Any], header: str = "") -> str:
    return header + yaml.dump(config, Dumper=_NoAliases, sort_keys=False, width=120)

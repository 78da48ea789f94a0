"""A hostile client against every shipped Envoy config: nobody picks their own lane or tenant.

Each shipped config runs as a real Envoy on loopback in front of the real ``extproc serve`` and
an echo upstream: ``envoy/envoy.yaml``; ``envoy/compose.yaml`` with its addresses rewritten to
loopback; and each Istio EnvoyFilter (gateway, sidecar) applied to a stand-in Envoy bootstrap
the way Istio applies patches. Every probe asserts what the upstream received and what extproc
decided (its decision record), not only the status. A second set points the same configs at a
recording ext_proc server to see exactly which headers reach extproc.

What the Istio stand-ins leave untested: Istio's own filters and settings (metadata exchange,
jwt_authn from RequestAuthentication, AuthorizationPolicy's RBAC, stats), the MeshConfig
defaults Istio writes into the connection manager (use_remote_address, forwarded-for handling;
its pathNormalization the patch overrides anyway), and mTLS between proxies.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import yaml

from extproc import bootstrap
from extproc.localstack import ROOT, Stack, free_port, wait_http
from extproc.settings import Address
from tests.integration.conftest import UPSTREAM, as_tenant
from tests.integration.recorder import LIMITED, RECORDED_LIMITS, Recorder
from tests.integration.test_k8s_manifests import HCM, _merge

pytestmark = pytest.mark.envoy

POLICY = """
lanes:
  - {name: interactive, priority: 100, max_inflight: 8, max_queued: 16, deadline: 5s}
  - {name: batch, priority: 50, max_inflight: 8, max_queued: 16, deadline: 5s}
  - {name: best-effort, max_inflight: 8, max_queued: 16, deadline: 5s}
capacity: {max_hold: 300s}
trusted_headers: [x-extproc-client]
classification:
  default_lane: best-effort
  rules:
    - {name: chat, match: {path: /v1/chat/completions}, lane: interactive}
    - {name: completions, match: {path: /v1/completions}, lane: batch}
tenants: {header: x-extproc-client, default: anonymous}
estimation:
  default: {prefill_ms_per_token: 0, decode_ms_per_token: 1, overhead_ms: 1}
  learning_rate: 0
ratelimit: {mode: "off"}
"""

CONFIGS = ["envoy.yaml", "compose.yaml", "istio-gateway", "istio-sidecar"]
#: The configs with the local demo's API-key map (the mesh takes tenants from JWT claims instead).
KEYED = {"envoy.yaml", "compose.yaml"}
CREDENTIALS = {"authorization": "Bearer sk-demo-acme", "proxy-authorization": "Basic eDp5",
               "cookie": "session=s3cr3t", "x-api-key": "k1", "api-key": "k2", "x-goog-api-key": "k3",
               "openai-api-key": "k4"}


def _istio_standin(overlay: str, listen: int, admin: int, backend: int, extproc: int) -> dict[str, Any]:
    """A bootstrap with one EnvoyFilter's patches applied the way Istio applies them, routed like
    the overlay's VirtualService (gateway) or Istio's inbound catch-all (sidecar)."""
    envoyfilter = yaml.safe_load((ROOT / "istio" / "overlays" / overlay / "envoyfilter.yaml").read_text())
    if overlay == "gateway":
        routes = [{"name": "health", "match": {"path": "/health"}, "route": {"cluster": "backend"}},
                  {"name": "inference", "match": {"prefix": "/"},
                   "route": {"cluster": "backend", "timeout": "0s"}}]
    else:
        routes = [{"name": "default", "match": {"prefix": "/"}, "route": {"cluster": "inbound|8000||"}}]
    hcm: dict[str, Any] = {"@type": HCM, "stat_prefix": "standin",
                           "route_config": {"name": "standin", "virtual_hosts": [
                               {"name": "inbound|http|8000", "domains": ["*"], "routes": routes}]}}
    filters: list[dict[str, Any]] = [{"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]
    clusters: dict[str, dict[str, Any]] = {}
    for patch in envoyfilter["spec"]["configPatches"]:
        value = copy.deepcopy(patch["patch"]["value"])
        kind, operation = patch["applyTo"], patch["patch"]["operation"]
        if kind == "HTTP_FILTER" and operation == "INSERT_FIRST":
            filters.insert(0, value)
        elif kind == "HTTP_FILTER":
            filters.insert(len(filters) - 1, value)
        elif kind == "NETWORK_FILTER":
            _merge(hcm, value["typed_config"])
        elif kind == "ROUTE_CONFIGURATION" and operation == "MERGE":
            _merge(hcm["route_config"], value)
        elif kind == "HTTP_ROUTE" and operation == "MERGE":
            target = patch["match"]["routeConfiguration"]["vhost"]["route"]["name"]
            _merge(next(r for r in routes if r["name"] == target), value)
        elif kind == "HTTP_ROUTE":
            target = patch["match"]["routeConfiguration"]["vhost"]["route"]["name"]
            routes.insert(next(i for i, r in enumerate(routes) if r["name"] == target), value)
    hcm["http_filters"] = filters
    text = json.dumps(envoyfilter)
    extproc_cluster = next(word for word in text.replace('"', " ").split() if word.startswith("outbound|"))

    def cluster(name: str, port: int, http2: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"name": name, "type": "STATIC", "connect_timeout": "1s",
                               "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                                   {"endpoint": {"address": {"socket_address": {
                                       "address": "127.0.0.1", "port_value": port}}}}]}]}}
        if http2:
            options = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
            out["typed_extension_protocol_options"] = {options: {
                "@type": f"type.googleapis.com/{options}",
                "explicit_http_config": {"http2_protocol_options": {}}}}
        return out

    for name in ("backend", "inbound|8000||"):
        clusters[name] = cluster(name, backend)
    clusters[extproc_cluster] = cluster(extproc_cluster, extproc, http2=True)
    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
            "static_resources": {
                "listeners": [{"name": "standin", "address": {"socket_address": {
                    "address": "127.0.0.1", "port_value": listen}},
                    "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                    "typed_config": hcm}]}]}],
                "clusters": list(clusters.values())}}


def render(which: str, listen: int, admin: int, backend: int, extproc: int,
           tweak: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    local = lambda port: Address("127.0.0.1", port)  # noqa: E731
    if which == "envoy.yaml":
        return bootstrap.render(local(listen), local(admin), local(backend), local(extproc), tweak=tweak)
    if which == "compose.yaml":
        return bootstrap.render(local(listen), local(admin), local(backend), local(extproc),
                                base=ROOT / "envoy" / "compose.yaml", tweak=tweak)
    return _istio_standin(which.removeprefix("istio-"), listen, admin, backend, extproc)


@dataclass
class Probe:
    which: str
    stack: Stack
    url: str
    upstream: str
    extproc_log: Callable[[], str]

    def send(self, method: str, path: str, headers: dict[str, str] | None = None,
             body: bytes | None = b'{"max_tokens": 5}') -> httpx.Response:
        """One raw request (the path sent exactly as given, not normalized by the client)."""
        with httpx.Client(timeout=15) as client:
            request = client.build_request(method, self.url + "/", headers=headers or {},
                                           content=body if method != "GET" else None)
            request.url = request.url.copy_with(raw_path=path.encode())
            return client.send(request)

    def upstream_total(self) -> int:
        total: int = httpx.get(self.upstream + "/stats", timeout=5).json()["total"]
        return total

    def record(self, request_id: str, timeout: float = 10.0) -> dict[str, Any]:
        """extproc's decision record for ``request_id`` (written when the request's stream ends)."""
        deadline = time.monotonic() + timeout
        while True:
            for doc in self.records(request_id):
                if doc.get("event") == "decision":
                    return doc
            if time.monotonic() > deadline:
                raise AssertionError(f"no decision record for {request_id}")
            time.sleep(0.05)

    def records(self, request_id: str) -> list[dict[str, Any]]:
        """extproc's log records (JSON lines) about ``request_id``."""
        docs = (json.loads(line) for line in self.extproc_log().splitlines()
                if line.startswith("{") and request_id in line)
        return [doc for doc in docs if doc.get("request_id") == request_id]

    def has_record(self, request_id: str) -> bool:
        return bool(self.records(request_id))


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Probe]]:
    workdir = tmp_path_factory.mktemp("probes")
    policy = workdir / "policy.yaml"
    policy.write_text(POLICY)
    stack = Stack(workdir)
    try:
        upstream = free_port()
        stack.start("upstream", [sys.executable, str(UPSTREAM), str(upstream)])
        wait_http(f"http://127.0.0.1:{upstream}/stats", proc=stack.processes[-1].popen)
        grpc, http = free_port(), free_port()
        extproc = stack.extproc(policy, grpc, http, "--log-format", "json")
        out: dict[str, Probe] = {}
        for which in CONFIGS:
            listen, admin = free_port(), free_port()
            stack.envoy(render(which, listen, admin, upstream, grpc), name=f"envoy-{which}")
            out[which] = Probe(which, stack, f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{upstream}",
                               extproc.output)
        yield out
    finally:
        stack.stop()


_ids = iter(range(1_000_000))


def rid(which: str) -> str:
    return f"probe-{which}-{next(_ids)}"


@pytest.mark.parametrize("which", CONFIGS)
def test_a_forged_lane_header_in_any_case_is_stripped_before_anyone_reads_it(
        probes: dict[str, Probe], which: str) -> None:
    p = probes[which]
    request_id = rid(which)
    r = p.send("POST", "/v1/completions", {"x-request-id": request_id, "x-extproc-lane": "interactive",
                                          "X-EXTPROC-QUEUE-MS": "999", "X-Extproc-Tenant": "acme"})
    assert r.status_code == 200, r.text
    seen = r.json()["headers"]
    assert (seen["x-extproc-lane"], seen["x-extproc-queue-ms"], seen["x-extproc-tenant"]) == (
        "batch", "0", "anonymous")
    record = p.record(request_id)
    assert (record["lane"], record["tenant"], record["rule"]) == ("batch", "anonymous", "completions")
    # The gateway stripped them: extproc never had to.
    assert "stripped" not in record


@pytest.mark.parametrize("which", CONFIGS)
def test_a_forged_tenant_header_is_stripped_and_never_reaches_the_backend(
        probes: dict[str, Probe], which: str) -> None:
    p = probes[which]
    request_id = rid(which)
    r = p.send("POST", "/v1/chat/completions", {"x-request-id": request_id, "x-extproc-client": "acme",
                                               "x-tenant-id": "acme"})
    assert r.status_code == 200
    seen = r.json()["headers"]
    assert "x-extproc-client" not in seen
    assert seen["x-extproc-tenant"] == "anonymous"
    assert p.record(request_id)["tenant"] == "anonymous"


@pytest.mark.parametrize("which", sorted(KEYED))
def test_an_api_key_is_the_trusted_way_to_a_tenant_and_never_reaches_the_backend(
        probes: dict[str, Probe], which: str) -> None:
    p = probes[which]
    request_id = rid(which)
    r = p.send("POST", "/v1/chat/completions", {"x-request-id": request_id, **as_tenant("acme")})
    assert r.status_code == 200
    seen = r.json()["headers"]
    assert "authorization" not in seen
    assert (seen["x-extproc-client"], seen["x-extproc-tenant"], seen["x-extproc-lane"]) == (
        "acme", "acme", "interactive")
    record = p.record(request_id)
    assert (record["tenant"], record["headers"]) == ("acme", {"x-extproc-client": "acme"})
    # A key the gateway does not know is refused there; neither extproc nor the backend sees it.
    before = p.upstream_total()
    request_id = rid(which)
    r = p.send("POST", "/v1/chat/completions", {"x-request-id": request_id,
                                               "authorization": "Bearer sk-not-a-key"})
    assert r.status_code == 401
    assert p.upstream_total() == before
    time.sleep(0.2)
    assert not p.has_record(request_id)


@pytest.mark.parametrize("which", CONFIGS)
def test_an_underscored_header_is_refused_with_400(probes: dict[str, Probe], which: str) -> None:
    p = probes[which]
    before = p.upstream_total()
    request_id = rid(which)
    r = p.send("POST", "/v1/completions", {"x-request-id": request_id, "x_extproc_lane": "interactive"})
    assert r.status_code == 400
    assert p.upstream_total() == before
    time.sleep(0.2)
    assert not p.has_record(request_id)


@pytest.mark.parametrize("which", CONFIGS)
@pytest.mark.parametrize("path", ["/v1/chat/%63ompletions", "//v1/chat/completions", "/v1/./chat/completions",
                                  "/v1/x/../chat/completions"])
def test_an_encoded_path_lands_in_the_lane_of_the_path_it_names(
        probes: dict[str, Probe], which: str, path: str) -> None:
    p = probes[which]
    request_id = rid(which)
    r = p.send("POST", path, {"x-request-id": request_id})
    assert r.status_code == 200, r.text
    assert r.json()["raw_path"] == "/v1/chat/completions"
    assert r.json()["headers"]["x-extproc-lane"] == "interactive"
    assert p.record(request_id)["lane"] == "interactive"


@pytest.mark.parametrize("which", CONFIGS)
def test_an_escaped_slash_is_refused(probes: dict[str, Probe], which: str) -> None:
    p = probes[which]
    before = p.upstream_total()
    assert p.send("POST", "/v1%2Fchat%2Fcompletions").status_code == 400
    assert p.upstream_total() == before


@pytest.mark.parametrize("which", CONFIGS)
def test_client_x_extproc_headers_are_stripped_where_ext_proc_is_off(
        probes: dict[str, Probe], which: str) -> None:
    p = probes[which]
    request_id = rid(which)
    r = p.send("GET", "/health", {"x-request-id": request_id, "x-extproc-lane": "interactive",
                                  "x-extproc-tenant": "acme", "X-Extproc-Queue-Ms": "0"})
    assert r.status_code == 200
    assert not [k for k in r.json()["headers"] if k.startswith("x-extproc-")]
    time.sleep(0.2)
    assert not p.has_record(request_id)


# --- what reaches extproc -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], Recorder]]:
    workdir = tmp_path_factory.mktemp("recorded")
    stack = Stack(workdir)
    grpc = free_port()
    with Recorder(grpc) as recorder:
        try:
            upstream = free_port()
            stack.start("upstream", [sys.executable, str(UPSTREAM), str(upstream)])
            wait_http(f"http://127.0.0.1:{upstream}/stats", proc=stack.processes[-1].popen)
            urls = {}
            for which in CONFIGS:
                listen, admin = free_port(), free_port()
                stack.envoy(render(which, listen, admin, upstream, grpc), name=f"envoy-{which}")
                urls[which] = f"http://127.0.0.1:{listen}"
            yield urls, recorder
        finally:
            stack.stop()


@pytest.mark.parametrize("which", CONFIGS)
def test_extproc_gets_only_allowlisted_headers_and_never_a_credential(
        recorded: tuple[dict[str, str], Recorder], which: str) -> None:
    urls, recorder = recorded
    recorder.seen.clear()
    headers = {**CREDENTIALS, "x-tenant-id": "acme", "x-custom": "1", "x-extproc-client": "forged",
               "x-stainless-retry-count": "1", "content-type": "application/json"}
    if which not in KEYED:
        del headers["authorization"]  # no key map in the mesh: a bearer token is the backend's business
    r = httpx.post(urls[which] + "/v1/chat/completions", content=b'{"max_tokens": 3}', headers=headers,
                   timeout=10)
    assert r.status_code == 200
    (seen,) = recorder.seen
    assert set(seen) <= {":method", ":path", "content-length", "content-encoding", "x-request-id",
                         "x-stainless-retry-count", "x-extproc-client", "x-extproc-usage-filter",
                         "x-extproc-edge", "x-extproc-arrival"}
    # The proxy says it strips a usage event extproc asks for, and that extproc judges the edge in
    # the headers phase (both set after the strip: not the client's).
    assert seen["x-extproc-usage-filter"] == "1"
    assert seen["x-extproc-edge"] == "1"
    # and when it arrived (the overload guard's stamp: epoch seconds, from the proxy's clock).
    assert abs(float(seen["x-extproc-arrival"]) - time.time()) < 3600
    assert not set(seen) & set(CREDENTIALS)
    assert (seen[":method"], seen[":path"], seen["x-stainless-retry-count"]) == (
        "POST", "/v1/chat/completions", "1")
    if which in KEYED:
        assert seen["x-extproc-client"] == "acme"  # from the key, after the strip
    else:
        assert "x-extproc-client" not in seen


@pytest.mark.parametrize("which", CONFIGS)
def test_the_edges_limits_in_extprocs_metadata_become_one_set_of_headers(
        recorded: tuple[dict[str, str], Recorder], which: str) -> None:
    # A request whose response headers extproc did not ask for (--response-sample): its admission's
    # "extproc" metadata carries the edge's x-ratelimit-*, and every shipped config's route
    # configuration adds them to the response, once; without that metadata, none.
    urls, _ = recorded
    with httpx.Client(base_url=urls[which], timeout=10) as client:
        limited = client.post(f"{LIMITED}/v1/chat/completions", content=b'{"max_tokens": 3}')
        plain = client.post("/v1/chat/completions", content=b'{"max_tokens": 3}')
    assert (limited.status_code, plain.status_code) == (200, 200)
    for name, value in RECORDED_LIMITS.items():
        assert limited.headers.get_list(name) == [value], name
        assert name not in plain.headers

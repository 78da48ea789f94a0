"""The files users deploy are valid for the real tools, and agree with the code."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc import bootstrap
from extproc.core import usage as usage_mod
from extproc.core.machine import REQUEST_ID
from extproc.core.overload import SHED_STATUS
from extproc.localstack import ROOT, envoy_binary
from extproc.policy import load_policy
from extproc.policy.ratelimit import RateLimit
from extproc.servers.extproc import LIMIT_KEYS
from extproc.settings import Address

COMPOSE_ENVOY = ROOT / "envoy" / "compose.yaml"
DASHBOARD = ROOT / "compose" / "grafana" / "dashboards" / "extproc.json"
METRIC = re.compile(r"\b(inference_[a-z_]+|extproc_[a-z_]+|vllm:[a-z_]+)\b")


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (make test installs it: see the Makefile's system-deps)")
    return path


@pytest.mark.envoy
@pytest.mark.parametrize("config", [ROOT / "envoy" / "envoy.yaml", COMPOSE_ENVOY], ids=lambda p: p.name)
def test_envoy_configs_validate_with_the_real_envoy(config: Path) -> None:
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(config)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "OK" in result.stdout + result.stderr


@pytest.mark.envoy
def test_envoy_without_extproc_validates_and_has_nothing_that_calls_it(tmp_path: Path) -> None:
    config = bootstrap.render(Address("127.0.0.1", 10000), Address("127.0.0.1", 9901),
                              Address("127.0.0.1", 8000), None)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    # The gateway's own work stays (the strip, API keys); nothing that asks or needs extproc does.
    assert [f["name"] for f in hcm["http_filters"]] == [
        bootstrap.STRIP_FILTER, bootstrap.API_KEY_FILTER, "envoy.filters.http.router"]
    assert "local_reply_config" not in hcm
    assert [c["name"] for c in config["static_resources"]["clusters"]] == ["inference_backend"]
    for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:
        assert set(route.get("typed_per_filter_config", {})) <= {bootstrap.API_KEY_FILTER}
    assert "response_headers_to_add" not in hcm["route_config"]  # (from extproc's metadata)
    path = tmp_path / "baseline.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def _shipped() -> tuple[dict[str, Any], dict[str, Any]]:
    config = yaml.safe_load((ROOT / "envoy" / "envoy.yaml").read_text())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return config, hcm


def test_filter_order_strip_keys_edge_admission_gate() -> None:
    _, hcm = _shipped()
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == [bootstrap.STRIP_FILTER, bootstrap.API_KEY_FILTER, bootstrap.RATELIMIT_FILTER,
                     bootstrap.OVERLOAD_STATUS_FILTER, bootstrap.OVERLOAD_FILTER, bootstrap.EXT_PROC_FILTER,
                     bootstrap.GATE_FILTER, bootstrap.USAGE_FILTER, "envoy.filters.http.router"]
    ext_proc = hcm["http_filters"][5]["typed_config"]
    # Fail-open: a running response never depends on extproc; the gate keeps new ones fail-closed.
    assert ext_proc["failure_mode_allow"] is True
    gate = hcm["http_filters"][6]["typed_config"]["rules"]
    assert gate["action"] == "DENY"
    (principal,) = gate["policies"]["extproc-not-admitted"]["principals"]
    assert principal == {"not_id": {"header": {"name": "x-extproc-lane", "present_match": True}}}
    expressions = [m["filter"]["extension_filter"]["typed_config"]["expression"]
                   for m in hcm["local_reply_config"]["mappers"]]
    assert bootstrap.OVERLOAD_DENIAL in expressions[0]
    assert bootstrap.GATE_DENIAL in expressions[1]


def _mapper(hcm: dict[str, Any], denial: str) -> dict[str, Any]:
    (mapper,) = [m for m in hcm["local_reply_config"]["mappers"]
                 if denial in m["filter"]["extension_filter"]["typed_config"]["expression"]]
    return mapper


@pytest.mark.parametrize(("denial", "reason"), [(bootstrap.GATE_DENIAL, "unavailable"),
                                           (bootstrap.OVERLOAD_DENIAL, "overloaded")])
def test_the_proxys_503s_are_extprocs_own_answers(denial: str, reason: str) -> None:
    from extproc.core.decision import Reason, error_body

    _, hcm = _shipped()
    mapper = _mapper(hcm, denial)
    headers = {h["header"]["key"]: h["header"]["value"] for h in mapper["headers_to_add"]}
    assert mapper["status_code"] == Reason(reason).http_status == 503
    assert headers["x-extproc-reason"] == reason
    assert mapper["body"]["inline_string"].encode() == error_body(
        Reason(reason), None, int(headers["retry-after"]))


def test_extprocs_own_overloaded_answer_says_what_the_shed_says() -> None:
    """extproc's prebuilt refusal and the proxy's shed give a client the same answer."""
    from extproc.servers import extproc as server

    _, hcm = _shipped()
    mapper = _mapper(hcm, bootstrap.OVERLOAD_DENIAL)
    answer = server._OVERLOADED.immediate_response
    own = {h.header.key: h.header.raw_value.decode() for h in answer.headers.set_headers}
    # (529 up to the proxy's extproc.overload_status filter, which makes it the shed's 503.)
    assert answer.status.code == SHED_STATUS
    assert mapper["status_code"] == 503
    assert answer.body.decode() == mapper["body"]["inline_string"]
    for header in mapper["headers_to_add"]:
        assert own[header["header"]["key"]] == header["header"]["value"]


def test_the_overload_shed_counts_only_extprocs_overloaded_and_health_checks_never_meet_it() -> None:
    _, hcm = _shipped()
    (shed,) = [f["typed_config"] for f in hcm["http_filters"] if f["name"] == bootstrap.OVERLOAD_FILTER]
    ranges = shed["success_criteria"]["http_criteria"]["http_success_status"]
    failures = [code for code in range(100, 600) if not any(r["start"] <= code < r["end"] for r in ranges)]
    assert failures == [SHED_STATUS]
    (status,) = [f["typed_config"] for f in hcm["http_filters"]
                 if f["name"] == bootstrap.OVERLOAD_STATUS_FILTER]
    assert f'== "{SHED_STATUS}"' in status["default_source_code"]["inline_string"]
    routes = {r["name"]: r for r in hcm["route_config"]["virtual_hosts"][0]["routes"]}
    assert routes["health"]["typed_per_filter_config"][bootstrap.OVERLOAD_FILTER]["disabled"] is True
    # The stamp the guard reads is the proxy's own, and the backend never sees it.
    (strip,) = [f for f in hcm["http_filters"] if f["name"] == bootstrap.STRIP_FILTER]
    appended = {m["append"]["header"]["key"]: m["append"]["header"]["value"]
                for m in strip["typed_config"]["mutations"]["request_mutations"] if "append" in m}
    assert appended["x-extproc-arrival"] == "%START_TIME(%s.%3f)%"
    assert "x-extproc-arrival" in hcm["route_config"]["virtual_hosts"][0]["request_headers_to_remove"]


def test_fail_open_rendering_drops_only_the_gate() -> None:
    shipped = bootstrap.render(Address("127.0.0.1", 1), Address("127.0.0.1", 2), Address("127.0.0.1", 3),
                               Address("127.0.0.1", 4))
    open_ = bootstrap.render(Address("127.0.0.1", 1), Address("127.0.0.1", 2), Address("127.0.0.1", 3),
                             Address("127.0.0.1", 4), fail_open=True)
    hcm = lambda c: c["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]  # noqa: E731
    names = [f["name"] for f in hcm(open_)["http_filters"]]
    assert bootstrap.GATE_FILTER not in names
    # The overload shed answers alike in both modes; only the gate's mapper goes.
    (mapper,) = hcm(open_)["local_reply_config"]["mappers"]
    assert bootstrap.OVERLOAD_DENIAL in str(mapper["filter"])
    shipped_names = [f["name"] for f in hcm(shipped)["http_filters"]]
    assert [n for n in shipped_names if n != bootstrap.GATE_FILTER] == names


def test_ratelimit_filter_agrees_with_the_policy_defaults() -> None:
    config, hcm = _shipped()
    filters = {f["name"]: f["typed_config"] for f in hcm["http_filters"]}
    ratelimit = filters[bootstrap.RATELIMIT_FILTER]
    defaults = RateLimit()
    assert ratelimit["domain"] == defaults.domain
    # ext_proc behind it still decides every request: the edge may fail open.
    assert ratelimit["failure_mode_deny"] is False
    assert ratelimit["enable_x_ratelimit_headers"] == "DRAFT_VERSION_03"
    assert ratelimit["rate_limit_service"]["transport_api_version"] == "V3"
    cluster_name = ratelimit["rate_limit_service"]["grpc_service"]["envoy_grpc"]["cluster_name"]
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert cluster_name in bootstrap.EXTPROC_CLUSTERS
    endpoint = lambda c: c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]  # noqa: E731
    assert endpoint(clusters[cluster_name]) == endpoint(clusters["extproc"])  # extproc's own port
    assert "http2_protocol_options" in str(clusters[cluster_name]["typed_extension_protocol_options"])


def _descriptors(hcm: dict[str, Any]) -> dict[str, Any]:
    """The inference routes' rate limit descriptors by generic_key (both routes carry the same)."""
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    health = next(r for r in routes if r["match"].get("path") == "/health")
    assert health["typed_per_filter_config"]["envoy.filters.http.ratelimit"]["disabled"] is True
    inference = [r for r in routes if r["match"].get("prefix") == "/"]
    assert [r["name"] for r in inference] == ["inference-keyed", "inference"]
    edge = [r["typed_per_filter_config"]["envoy.filters.http.ratelimit"] for r in inference]
    assert edge[0] == edge[1]
    kinds = {}
    for limit in edge[0]["rate_limits"]:
        generic = next(a["generic_key"]["descriptor_value"] for a in limit["actions"] if "generic_key" in a)
        kinds[generic] = limit
    return kinds


def _proxy_says(hcm: dict[str, Any]) -> list[str]:
    """The headers the strip filter sets after removing every client x-extproc-*."""
    strip = next(f for f in hcm["http_filters"] if f["name"] == bootstrap.STRIP_FILTER)
    mutations = strip["typed_config"]["mutations"]["request_mutations"]
    assert mutations[0] == {"remove_on_match": {"key_matcher": {"prefix": "x-extproc-"}}}
    return [m["append"]["header"]["key"] for m in mutations[1:]]


def test_the_shipped_edge_is_judged_in_ext_proc_and_the_call_form_sends_what_the_service_reads() -> None:
    _, hcm = _shipped()
    defaults = RateLimit()
    # Shipped: no arrival descriptor; the proxy tells ext_proc to judge the edge itself, after the
    # strip (no client can say it), and no backend ever sees that word.
    assert set(_descriptors(hcm)) == {defaults.usage_descriptor}
    assert bootstrap.EDGE_HEADER in _proxy_says(hcm)
    assert bootstrap.EDGE_HEADER in hcm["route_config"]["virtual_hosts"][0]["request_headers_to_remove"]
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == bootstrap.EXT_PROC_FILTER)
    assert ext_proc["typed_config"]["mutation_rules"] == {"allow_envoy": True}  # x-envoy-ratelimited
    # --edge call: the arrival descriptor back, the proxy's word gone.
    local = Address("127.0.0.1", 1)
    called = bootstrap.render(local, local, local, local, edge="call")
    call_hcm = called["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert bootstrap.EDGE_HEADER not in _proxy_says(call_hcm)
    kinds = _descriptors(call_hcm)
    assert set(kinds) == {defaults.request_descriptor, defaults.usage_descriptor}
    assert kinds[defaults.usage_descriptor] == _descriptors(hcm)[defaults.usage_descriptor]
    arrival, usage = kinds[defaults.request_descriptor], kinds[defaults.usage_descriptor]
    sent = {a["request_headers"]["header_name"]: a["request_headers"] for a in arrival["actions"]
            if "request_headers" in a}
    assert sent[":path"]["descriptor_key"] == "path"
    assert sent[":method"]["descriptor_key"] == "method"
    # Each header the example policy trusts goes under its own name, and a missing one
    # must not drop the whole descriptor.
    policy = load_policy(ROOT / "examples" / "policy.yaml")
    for header in policy.trusted_headers:
        assert sent[header] == {"header_name": header, "descriptor_key": header, "skip_if_absent": True}
    # And the retry header: a retry that holds a booked return must reach ext_proc to claim it.
    retry = policy.retry_budget.header
    assert sent[retry] == {"header_name": retry, "descriptor_key": retry, "skip_if_absent": True}
    # And Envoy's request id, which the edge logs with a shed (and never classifies).
    assert sent["x-request-id"] == {"header_name": "x-request-id", "descriptor_key": REQUEST_ID,
                                    "skip_if_absent": True}
    assert not arrival.get("apply_on_stream_done", False)
    assert usage["apply_on_stream_done"] is True
    assert "hits_addend" not in usage  # a response without a header must still be charged
    tenant = policy.tenants.header
    assert any(a.get("request_headers", {}).get("descriptor_key") == tenant for a in usage["actions"])
    # The entries the service reads (core/usage.py): the reported usage, else the estimate's inputs
    # from the metadata ext_proc sets; each with a default, or Envoy drops the whole descriptor.
    meta = {a["metadata"]["descriptor_key"]: a["metadata"] for a in usage["actions"] if "metadata" in a}
    assert set(meta) == set(usage_mod.USAGE_ENTRIES)
    for key, action in meta.items():
        assert action["source"] == "DYNAMIC"
        # Only the admission record has no default: a response ext_proc did not record for a token
        # budget makes no call at stream end (one rate limit call per request, not two).
        assert action.get("default_value") == (None if key == usage_mod.ADMITTED_MS else usage_mod.ABSENT)
        namespace = usage_mod.USAGE_NAMESPACE if key == usage_mod.USAGE else usage_mod.NAMESPACE
        path = usage_mod.USAGE_KEY if key == usage_mod.USAGE else key
        assert action["metadata_key"] == {"key": namespace, "path": [{"key": path}]}


def _usage_sources() -> list[tuple[str, str]]:
    """Every inlined copy of envoy/usage.lua: envoy.yaml's, compose.yaml's, the Istio patches'."""
    out = []
    for name, text in [("envoy.yaml", (ROOT / "envoy" / "envoy.yaml").read_text()),
                       ("compose.yaml", COMPOSE_ENVOY.read_text())]:
        hcm = yaml.safe_load(text)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        for f in hcm["typed_config"]["http_filters"]:
            if f["name"] == bootstrap.USAGE_FILTER:
                out.append((name, f["typed_config"]["default_source_code"]["inline_string"]))
    for overlay in ("gateway", "sidecar"):
        doc = yaml.safe_load((ROOT / "istio" / "overlays" / overlay / "envoyfilter.yaml").read_text())
        for patch in doc["spec"]["configPatches"]:
            value = patch["patch"].get("value", {})
            if value.get("name") == bootstrap.USAGE_FILTER:
                out.append((overlay, value["typed_config"]["default_source_code"]["inline_string"]))
    return out


def test_every_inlined_usage_filter_is_envoy_usage_lua() -> None:
    source = (ROOT / "envoy" / "usage.lua").read_text()
    copies = _usage_sources()
    assert [name for name, _ in copies] == ["envoy.yaml", "compose.yaml", "gateway", "sidecar"]
    for name, text in copies:
        assert text == source, f"{name}: its extproc.usage script differs from envoy/usage.lua"


def test_ext_proc_may_set_the_metadata_the_usage_filter_and_descriptor_read() -> None:
    _, hcm = _shipped()
    filters = {f["name"]: f["typed_config"] for f in hcm["http_filters"]}
    namespaces = filters[bootstrap.EXT_PROC_FILTER]["metadata_options"]["receiving_namespaces"]["untyped"]
    assert usage_mod.NAMESPACE in namespaces


def shipped_ratelimit_headers() -> list[dict[str, Any]]:
    """What envoy/envoy.yaml's route configuration adds to every response from extproc's metadata."""
    _, hcm = _shipped()
    added: list[dict[str, Any]] = hcm["route_config"]["response_headers_to_add"]
    return added


def test_the_route_adds_each_x_ratelimit_header_from_the_metadata_extproc_sets() -> None:
    # The edge's x-ratelimit-* of a request whose response headers extproc did not ask for
    # (--response-sample): each header from the key extproc writes it under, in the namespace the
    # ext_proc filter lets in; never a second copy beside one already there (extproc's own answer to
    # the response headers, the backend's), and nothing when the value is empty.
    added = shipped_ratelimit_headers()
    assert {h["header"]["key"]: h["header"]["value"] for h in added} == {
        header: f"%DYNAMIC_METADATA({usage_mod.NAMESPACE}:{key})%" for header, key in LIMIT_KEYS.items()}
    for header in added:
        assert header["append_action"] == "OVERWRITE_IF_EXISTS_OR_ADD"
        assert not header.get("keep_empty_value", False)
    _, hcm = _shipped()
    filters = {f["name"]: f["typed_config"] for f in hcm["http_filters"]}
    assert usage_mod.NAMESPACE in \
        filters[bootstrap.EXT_PROC_FILTER]["metadata_options"]["receiving_namespaces"]["untyped"]


def test_compose_envoy_config_is_generated_from_the_shipped_one() -> None:
    expected = bootstrap.render(Address("0.0.0.0", 10000), Address("0.0.0.0", 9901),
                                Address("backend", 8000), Address("extproc", 50051))
    assert yaml.safe_load(COMPOSE_ENVOY.read_text()) == expected, (
        "envoy/compose.yaml is stale: regenerate it with the command in its header"
    )


def test_docker_compose_file_is_valid() -> None:
    result = subprocess.run([tool("docker-compose"), "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert set(services) >= {"envoy", "extproc", "backend", "redis", "prometheus", "grafana"}
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            assert (ROOT / source).exists(), f"compose mounts {source}, which does not exist"


def test_prometheus_config_is_valid() -> None:
    result = subprocess.run([tool("promtool"), "check", "config", str(ROOT / "compose" / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    # (promtool checks the rule files the config loads too.)
    assert "rules.yml" in result.stdout + result.stderr


def test_the_compose_prometheus_loads_the_shipped_alert_rules() -> None:
    """compose/rules.yml is istio/base/prometheusrule.yaml's groups, so the demo's Prometheus evaluates
    the alerts a cluster gets. To regenerate: python -c 'import yaml; from pathlib import Path;
    g = yaml.safe_load(Path("istio/base/prometheusrule.yaml").read_text())["spec"]["groups"];
    print(yaml.safe_dump({"groups": g}, sort_keys=False, width=100))' (keep the comment at its top)."""
    shipped = yaml.safe_load((ROOT / "istio" / "base" / "prometheusrule.yaml").read_text())["spec"]["groups"]
    assert yaml.safe_load((ROOT / "compose" / "rules.yml").read_text()) == {"groups": shipped}
    assert yaml.safe_load((ROOT / "compose" / "prometheus.yml").read_text())["rule_files"] == ["rules.yml"]


def test_dockerfile_copies_files_that_exist() -> None:
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"


# The Grafana dashboard's queries are checked against a real extproc's /metrics, with the
# alerts' and KEDA's, in test_k8s_manifests.py.


SHIPPED_POLICIES = sorted((ROOT / "examples").glob("*.yaml")) + sorted((ROOT / "istio").rglob("policy.yaml"))


def test_every_example_policy_passes_policy_check() -> None:
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    result = subprocess.run([sys.executable, "-m", "extproc", "policy", "check", *map(str, examples)],
                            capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": ok — ") == len(examples)


def test_the_fleet_policy_says_its_fleet_size_and_how_to_run_it() -> None:
    text = (ROOT / "examples" / "fleet-policy.yaml").read_text()
    size = re.search(r"FLEET of N = (\d+) replicas", text)
    assert size is not None
    n = size.group(1)
    assert f"--store-fleet-size {n}" in text
    assert f"EXTPROC_STORE_FLEET_SIZE={n}" in text
    policy = load_policy(ROOT / "examples" / "fleet-policy.yaml")
    assert policy.ratelimit.budgets.any
    assert policy.retry_budget.enabled
    assert policy.tenants.weights


def _allowed(patterns: list[dict[str, str]], header: str) -> bool:
    return any(p.get("exact") == header or header.startswith(p.get("prefix", "\0")) for p in patterns)


@pytest.mark.parametrize("path", SHIPPED_POLICIES, ids=lambda p: str(p.relative_to(ROOT)))
def test_extproc_is_sent_every_header_a_shipped_policy_reads(path: Path) -> None:
    policy = load_policy(path)
    _, hcm = _shipped()
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == bootstrap.EXT_PROC_FILTER)["typed_config"]
    patterns = ext_proc["forward_rules"]["allowed_headers"]["patterns"]
    needed = {*policy.trusted_headers, ":method", ":path", ":status", "content-length", "content-encoding"}
    if policy.estimation.model_header:
        needed.add(policy.estimation.model_header)
    if policy.retry_budget.enabled:
        needed.add(policy.retry_budget.header)
    assert [h for h in sorted(needed) if not _allowed(patterns, h)] == []
    # And nothing that carries credentials.
    for secret in ("authorization", "proxy-authorization", "cookie", "x-api-key", "api-key"):
        assert not _allowed(patterns, secret)


def test_compose_publishes_only_the_listener_and_grafana_beyond_loopback() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    public, local = set(), set()
    for name, service in services.items():
        for port in service.get("ports", []):
            parts = str(port).split(":")
            host_port = int(parts[-2])
            if len(parts) == 3 and parts[0] == "127.0.0.1":
                local.add((name, host_port))
            else:
                public.add((name, host_port))
    assert public == {("envoy", 10000), ("grafana", 3000)}
    assert ("envoy", 9901) in local  # Envoy's admin can stop Envoy: never beyond the host
    # No clash with extproc's own default ports on a host that runs it too.
    assert not {port for _, port in local} & {9090, 9091, 50051}

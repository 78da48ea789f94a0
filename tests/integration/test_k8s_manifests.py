"""The Kubernetes and Istio manifests under istio/ build, validate, and agree with the code.

Every check uses the real tool: ``kubectl kustomize`` builds each kustomization,
``kubernetes-validate`` checks every built resource against the Kubernetes schemas
(strictly: unknown fields are errors), a real Envoy validates every EnvoyFilter patch (the
ratelimit and ext_proc filters, the edge shed's route descriptors and opt-outs, applied in
the order Istio applies them), ``extproc policy check`` the policy in each ConfigMap,
``promtool`` the alert rules (and unit-tests them on synthetic series), and a real extproc's
``/metrics`` every metric name used by alerts, KEDA and the dashboard. The EnvoyFilters'
filters and descriptors equal envoy/envoy.yaml's (the tested local setup); the edge shed
runs before ext_proc, fails open, and asks for the domain and descriptors of the policy in
the ConfigMap. A real extproc started with the Deployment's flags follows its policy
ConfigMap through updates made the way the kubelet makes them (hot reload, no rollout).

The Redis component points extproc at its own Service (the URL is derived from the rendered
Service), frees the autoscaler only where the replicas share limits, and is reachable from
extproc and nothing else; a real ``redis-server`` started with its arguments serves a real
extproc started with the Deployment's store settings, which keeps deciding (degraded, still
ready) when Redis dies.

The seed scenario's cluster signals are checked the same way: every PromQL query parses
(``promtool``) and answers the one number it should on synthetic series (``promtool test
rules``), selects only metrics and labels that exist (extproc's, the simulated vLLM's, and
Kueue's as its source defines them) and ClusterQueues of kueue.yaml, and every signal
source the policy names is reachable through the NetworkPolicies that select extproc.
"""

from __future__ import annotations

import copy
import hashlib
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import httpx
import kubernetes_validate
import pytest
import redis
import yaml

from extproc import bootstrap
from extproc.api.admin.v1 import admin_pb2 as pb
from extproc.api.document import from_document
from extproc.localstack import ROOT, Stack, envoy_binary, free_port, wait_http
from extproc.policy import load_policy
from extproc.policy.schema import Policy
from extproc.settings import Address

ISTIO = ROOT / "istio"
#: Every kustomization shipped, by name. A new one must be added here (a test checks).
SHIPPED = {
    "base": ISTIO / "base",
    "gateway": ISTIO / "overlays" / "gateway",
    "sidecar": ISTIO / "overlays" / "sidecar",
    "seed-scenario": ISTIO / "examples" / "seed-scenario",
}
#: Compositions that include the optional components (built from a temporary kustomization).
WITH_COMPONENTS = {
    "gateway+redis": ("gateway", ["redis"]),
    "sidecar+sidecar-scope": ("sidecar", ["sidecar-scope"]),
    "seed-scenario+signals-egress": ("seed-scenario", ["signals-egress"]),
    # Everything at once: the shared store where egress is restricted.
    "seed-scenario+redis+signals-egress": ("seed-scenario", ["redis", "signals-egress"]),
}
ALL = [*SHIPPED, *WITH_COMPONENTS]
#: Compositions that wire extproc into the mesh (EnvoyFilters, a policy ConfigMap of their own).
WIRED = [name for name in ALL if name != "base"]
#: Compositions that include the shared store (components/redis).
WITH_REDIS = [name for name, (_, components) in WITH_COMPONENTS.items() if "redis" in components]
#: The oldest Kubernetes the manifests claim, and the newest kubernetes-validate knows.
K8S_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
#: API groups whose kinds are CRDs (no schema in kubernetes-validate): parsed and checked here.
CRD_GROUPS = {"networking.istio.io", "monitoring.coreos.com", "keda.sh", "kueue.x-k8s.io"}
HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
EXT_PROC = "envoy.filters.http.ext_proc"
RATELIMIT = "envoy.filters.http.ratelimit"
ROUTER = "envoy.filters.http.router"
STRIP = bootstrap.STRIP_FILTER
#: The proxy's own headers to extproc (and the rate limit call's mark): dropped before any backend.
PROXY_WORDS = ["x-extproc-usage-filter", "x-extproc-edge", "x-extproc-edge-judged", "x-extproc-arrival"]
GATE = bootstrap.GATE_FILTER
#: In envoy/envoy.yaml only: the local demo's API keys. In the mesh, a tenant comes from a JWT
#: claim (RequestAuthentication outputClaimToHeaders), set after the strip.
API_KEYS = bootstrap.API_KEY_FILTER
Doc = dict[str, Any]
Rendered = dict[str, list[Doc]]
PROMQL_WORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
                "offset", "bool", "inf", "nan"}


def tool(name: str) -> str:
    """A tool next to this interpreter (installed by pip into the venv), else from PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (see the Makefile's SYSTEM_TOOLS and pyproject's test extra)")
    return path


def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, **kwargs)


def kustomize(directory: Path) -> list[Doc]:
    result = run([tool("kubectl"), "kustomize", str(directory)])
    assert result.returncode == 0, f"kubectl kustomize {directory}:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def composition(tmp: Path, overlay: str, components: list[str]) -> Path:
    """A kustomization of a shipped overlay plus components (kustomize wants relative paths)."""
    tmp.mkdir(parents=True, exist_ok=True)
    def rel(path: Path) -> str:
        return os.path.relpath(path, tmp)

    (tmp / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [rel(SHIPPED[overlay])],
        "components": [rel(ISTIO / "components" / c) for c in components],
    }))
    return tmp


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    out = {name: kustomize(path) for name, path in SHIPPED.items()}
    for name, (overlay, components) in WITH_COMPONENTS.items():
        out[name] = kustomize(composition(tmp_path_factory.mktemp(name), overlay, components))
    return out


def of_kind(docs: list[Doc], kind: str, name: str | None = None) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    found = of_kind(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def policy_of(docs: list[Doc], tmp: Path) -> tuple[Path, Policy]:
    configmap = one([d for d in docs if d["metadata"]["name"].startswith("extproc-policy")], "ConfigMap")
    path = tmp / "policy.yaml"
    path.write_text(configmap["data"]["policy.yaml"])
    return path, load_policy(str(path))


def filter_patches(docs: list[Doc], name: str) -> list[tuple[str, dict[str, Any]]]:
    """(context, filter) for every HTTP filter called ``name`` an EnvoyFilter inserts."""
    return [(p["match"]["context"], p["patch"]["value"])
            for f in of_kind(docs, "EnvoyFilter") for p in f["spec"]["configPatches"]
            if p["applyTo"] == "HTTP_FILTER" and p["patch"]["value"]["name"] == name]


def route_patches(envoyfilter: Doc) -> dict[str, Doc]:
    """What each HTTP_ROUTE patch of one EnvoyFilter puts on a route, by the route's name
    (the route it MERGEs into, or the one it inserts)."""
    out = {}
    for patch in envoyfilter["spec"]["configPatches"]:
        if patch["applyTo"] == "HTTP_ROUTE":
            value = patch["patch"]["value"]
            name = value["name"] if patch["patch"]["operation"] == "INSERT_BEFORE" else \
                patch["match"]["routeConfiguration"]["vhost"]["route"]["name"]
            assert name not in out, f"two patches for route {name}"
            out[name] = value
    return out


def seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)
    assert match, f"not a duration: {duration}"
    return float(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def shipped_hcm() -> Doc:
    """The HTTP connection manager of envoy/envoy.yaml, the tested local setup."""
    config = yaml.safe_load((ROOT / "envoy" / "envoy.yaml").read_text())
    hcm: Doc = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def shipped_filter(name: str) -> Doc:
    typed: Doc = next(f for f in shipped_hcm()["http_filters"] if f["name"] == name)["typed_config"]
    return typed


def shipped_ext_proc() -> Doc:
    return shipped_filter(EXT_PROC)


def shipped_route(name: str) -> Doc:
    """The per-filter configs of envoy/envoy.yaml's route called ``name``, less the API keys'
    (which the mesh does not have)."""
    [vhost] = shipped_hcm()["route_config"]["virtual_hosts"]
    per_filter: Doc = next(r for r in vhost["routes"] if r["name"] == name)["typed_per_filter_config"]
    return {key: value for key, value in per_filter.items() if key != API_KEYS}


# --- building and schemas -------------------------------------------------------------------


def test_every_kustomization_is_covered() -> None:
    found = {p.parent for p in ISTIO.rglob("kustomization.yaml")}
    components = {ISTIO / "components" / c for _, cs in WITH_COMPONENTS.values() for c in cs}
    assert found == set(SHIPPED.values()) | components, "add new kustomizations to SHIPPED/WITH_COMPONENTS"


@pytest.mark.parametrize("name", ALL)
def test_builds_into_well_formed_unique_resources(rendered: Rendered, name: str) -> None:
    docs = rendered[name]
    assert docs
    keys = []
    for doc in docs:
        for field in ("apiVersion", "kind"):
            assert doc.get(field), doc
        assert doc.get("metadata", {}).get("name"), doc
        keys.append((doc["kind"], doc["metadata"].get("namespace"), doc["metadata"]["name"]))
    assert len(keys) == len(set(keys)), f"duplicate resources in {name}"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", ALL)
def test_resources_validate_against_kubernetes_schemas(
        rendered: Rendered, name: str, version: str) -> None:
    problems, checked = [], 0
    for doc in rendered[name]:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
            checked += 1
        except kubernetes_validate.SchemaNotFoundError:
            group = doc["apiVersion"].split("/")[0]
            if group not in CRD_GROUPS:
                problems.append(f"{where}: no schema for {doc['apiVersion']} (a typo, or a CRD not listed)")
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{where}: {exc.message} at {'.'.join(map(str, exc.path))}")
    assert not problems, "\n".join(problems)
    assert checked >= 5


# --- the extproc Deployment and its neighbours ------------------------------------------------


def test_deployment_is_hardened_and_drains_within_its_grace(rendered: Rendered) -> None:
    docs = rendered["base"]
    pod = one(docs, "Deployment", "extproc")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"] if a.startswith("--"))
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    probe_ports = {container[p]["httpGet"]["port"] for p in ("readinessProbe", "livenessProbe")}
    assert probe_ports == {"http-metrics"}
    assert args["http"].endswith(":9090")
    assert args["grpc"].endswith(":50051")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 50051, "http-metrics": 9090}
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][kind])
    # The kubelet must not SIGKILL before preStop + extproc's drain are over.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + float(args["shutdown-grace"])
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    # The policy file extproc reads is the ConfigMap's policy.yaml.
    mount = next(m for m in container["volumeMounts"] if m["name"] == "policy")
    assert args["policy"] == f"{mount['mountPath']}/policy.yaml"


#: The kustomizations that own a policy file: that file, and an edit to make in it.
POLICY_FILES = {
    "base": (ISTIO / "base" / "policy.yaml", "max_queued: 300 ", "max_queued: 301 "),
    "seed-scenario": (ISTIO / "examples" / "seed-scenario" / "policy.yaml",
                      "max_queued: 700", "max_queued: 701"),
}


def policy_wiring(docs: list[Doc]) -> tuple[Doc, Doc, Doc, dict[str, str]]:
    """The policy ConfigMap, the extproc Deployment, its policy volume mount, and its flags."""
    configmap = one([d for d in docs if d["metadata"]["name"].startswith("extproc-policy")], "ConfigMap")
    deployment = one(docs, "Deployment", "extproc")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "policy"]
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"] if a.startswith("--"))
    return configmap, deployment, mount, args


@pytest.mark.parametrize("name", sorted(POLICY_FILES))
def test_a_policy_edit_updates_the_configmap_in_place(tmp_path: Path, name: str) -> None:
    """Hot reload, not a rollout: same ConfigMap name, same pod template, new content."""
    shipped, old, new = POLICY_FILES[name]
    shutil.copytree(ISTIO, tmp_path / "istio")
    edited = tmp_path / "istio" / shipped.relative_to(ISTIO)
    assert edited.read_text().count(old) == 1
    edited.write_text(edited.read_text().replace(old, new))
    before = policy_wiring(kustomize(SHIPPED[name]))
    after = policy_wiring(kustomize(tmp_path / "istio" / SHIPPED[name].relative_to(ISTIO)))
    assert before[0]["metadata"]["name"] == after[0]["metadata"]["name"] == "extproc-policy"
    assert before[0]["data"] != after[0]["data"]
    assert after[0]["data"]["policy.yaml"] == edited.read_text()
    # Nothing in the Deployment changes, so nothing rolls: the replicas reload the file.
    assert before[1] == after[1]
    volumes = after[1]["spec"]["template"]["spec"]["volumes"]
    assert next(v for v in volumes if v["name"] == "policy")["configMap"]["name"] == "extproc-policy"


@pytest.mark.parametrize("name", ALL)
def test_the_policy_is_a_directory_mount_that_sees_configmap_updates(rendered: Rendered, name: str) -> None:
    configmap, deployment, mount, args = policy_wiring(rendered[name])
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    volume = next(v for v in volumes if v["name"] == "policy")["configMap"]
    assert volume["name"] == configmap["metadata"]["name"] == "extproc-policy"
    # A subPath mount is a bind mount of the file as it was: the kubelet's updates never reach it.
    assert "subPath" not in mount
    assert "subPathExpr" not in mount
    assert "items" not in volume  # every key is a file of its own name
    policy = PurePosixPath(args["policy"])
    assert policy.parent == PurePosixPath(mount["mountPath"])
    assert policy.name in configmap["data"]
    assert float(args.get("watch-interval", "1")) > 0, "0 turns the file watch off"


def kubelet_projection(directory: Path, files: dict[str, str]) -> None:
    """Write ``files`` into ``directory`` the way the kubelet writes and updates a ConfigMap volume.

    The content lives in a timestamped directory; ``..data`` is a symlink to it and each
    key a symlink through ``..data``. An update writes a new timestamped directory and
    renames a new ``..data`` symlink over the old one: one atomic swap for all keys.
    """
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "..data"
    old = data.resolve() if data.is_symlink() else None
    stamp = directory / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{time.monotonic_ns()}"
    stamp.mkdir()
    for key, text in files.items():
        (stamp / key).write_bytes(text.encode())
    staged = directory / "..data_tmp"
    staged.symlink_to(stamp.name)
    os.replace(staged, data)
    for key in files:
        if not (directory / key).is_symlink():
            (directory / key).symlink_to(f"..data/{key}")
    if old is not None:
        shutil.rmtree(old)


def sample(text: str, name: str, **labels: str) -> float | None:
    """One sample's value in a /metrics page (None if it is not there)."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    for line in text.splitlines():
        match = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        if match and match.group(1) == name and set(filter(None, (match.group(2) or "").split(","))) == want:
            return float(match.group(3))
    return None


def test_a_configmap_update_reaches_the_running_extproc(rendered: Rendered, tmp_path: Path) -> None:
    """extproc started with the Deployment's flags and env, its policy volume laid out and
    updated as the kubelet does it: a good edit is swapped in, a bad one rejected and signalled."""
    configmap, deployment, mount, args = policy_wiring(rendered["base"])
    shipped = configmap["data"]["policy.yaml"]
    # What the guide tells operators to compare against: sha256sum of the file they applied.
    assert shipped.encode() == POLICY_FILES["base"][0].read_bytes()
    root = tmp_path / "pod"
    mounted = root / mount["mountPath"].lstrip("/")
    kubelet_projection(mounted, configmap["data"])
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    grpc, http, admin = free_port(), free_port(), free_port()
    # The pod's addresses and paths, moved onto this machine's loopback and a temporary root.
    moved = {"grpc": f"127.0.0.1:{grpc}", "http": f"127.0.0.1:{http}", "admin": f"127.0.0.1:{admin}",
             "admin-grpc": f"127.0.0.1:{free_port()}", "policy": str(root / args["policy"].lstrip("/"))}
    assert container["args"][0] == "serve"
    assert moved.keys() <= args.keys(), "the Deployment sets every address and the policy path"
    argv = ["serve", *(f"--{key}={moved.get(key, value)}" for key, value in args.items())]
    stack = Stack(tmp_path)
    try:
        stack.start("extproc", [sys.executable, "-m", "extproc", *argv],
                    env={e["name"]: e["value"] for e in container.get("env", [])})
        wait_http(f"http://127.0.0.1:{http}/readyz", proc=stack.processes[0].popen)
        metrics, state_url = f"http://127.0.0.1:{http}/metrics", f"http://127.0.0.1:{admin}/admin/state"

        def until(check: Callable[[], bool], what: str) -> None:
            deadline = time.monotonic() + 15  # the shipped watch interval (1 s) and then some
            while not check():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                time.sleep(0.1)

        def policy_state() -> pb.Policy:
            return from_document(httpx.get(state_url, timeout=5).json(), pb.State).policy

        assert policy_state().sha256 == hashlib.sha256(shipped.encode()).hexdigest()
        loaded = sample(httpx.get(metrics).text, "extproc_policy_loaded_timestamp_seconds")
        assert loaded

        _, old, new = POLICY_FILES["base"]
        edited = shipped.replace(old, new)
        kubelet_projection(mounted, {"policy.yaml": edited})
        until(lambda: policy_state().sha256 == hashlib.sha256(edited.encode()).hexdigest(), "the edit")
        page = httpx.get(metrics).text
        assert sample(page, "extproc_policy_reloads_total", result="ok") == 1
        assert (sample(page, "extproc_policy_loaded_timestamp_seconds") or 0) > loaded
        assert sample(page, "extproc_policy_reload_failing") == 0

        broken = edited.replace("max_inflight: 28 ", "max_inflight: lots ")
        line = next(n for n, text in enumerate(broken.splitlines(), 1) if "max_inflight: lots" in text)
        kubelet_projection(mounted, {"policy.yaml": broken})
        until(lambda: sample(httpx.get(metrics).text, "extproc_policy_reload_failing") == 1, "the rejection")
        page = httpx.get(metrics).text
        assert sample(page, "extproc_policy_reloads_total", result="error") == 1
        state = policy_state()
        assert state.sha256 == hashlib.sha256(edited.encode()).hexdigest(), "the edit stays in force"
        [problem] = state.last_error
        assert problem.startswith(f"{moved['policy']}:{line}: capacity.max_inflight"), problem
        assert httpx.get(f"http://127.0.0.1:{http}/readyz").status_code == 200

        kubelet_projection(mounted, {"policy.yaml": edited})  # the revert
        until(lambda: sample(httpx.get(metrics).text, "extproc_policy_reload_failing") == 0, "the revert")
        assert "policy reload rejected" in stack.processes[0].output()
    finally:
        stack.stop()


def test_service_declares_grpc_for_istio(rendered: Rendered) -> None:
    service = one(rendered["base"], "Service", "extproc")
    grpc = [p for p in service["spec"]["ports"] if p["targetPort"] == "grpc"]
    assert len(grpc) == 1
    assert grpc[0].get("appProtocol") == "grpc" or grpc[0]["name"].startswith("grpc-")


def test_destination_rule_never_caps_held_streams(rendered: Rendered,
                                                   tmp_path: Path) -> None:
    shipped = yaml.safe_load((ROOT / "envoy" / "envoy.yaml").read_text())
    cluster = next(c for c in shipped["static_resources"]["clusters"] if c["name"] == "extproc")
    shipped_max = cluster["circuit_breakers"]["thresholds"][0]["max_requests"]
    for name in WIRED:
        docs = rendered[name]
        service = one(docs, "Service", "extproc")
        rule = one(docs, "DestinationRule", "extproc")
        assert rule["spec"]["host"] == f"extproc.{service['metadata']['namespace']}.svc.cluster.local"
        pool = rule["spec"]["trafficPolicy"]["connectionPool"]
        _, policy = policy_of(docs, tmp_path)
        replicas = one(docs, "HorizontalPodAutoscaler", "extproc")["spec"]["maxReplicas"]
        # Every held or in-flight request of every replica holds one stream.
        queued = policy.capacity.max_queued or sum(lane.max_queued for lane in policy.lanes)
        most = replicas * (policy.total_capacity + queued)
        assert pool["http"]["http2MaxRequests"] >= max(shipped_max, most), name
        assert pool["http"]["http1MaxPendingRequests"] >= max(shipped_max, most), name
        assert pool["tcp"]["maxConnections"] >= shipped_max
        assert pool["http"].get("maxRequestsPerConnection", 0) == 0


@pytest.fixture(scope="module")
def serve_help() -> str:
    return run([sys.executable, "-m", "extproc", "serve", "--help"]).stdout


@pytest.mark.parametrize("name", ALL)
def test_autoscaling_and_disruption_budget_fit_the_deployment(
        rendered: Rendered, serve_help: str, name: str) -> None:
    docs = rendered[name]
    deployment = one(docs, "Deployment", "extproc")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    hpa, pdb = one(docs, "HorizontalPodAutoscaler", "extproc"), one(docs, "PodDisruptionBudget", "extproc")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "extproc"}
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    assert hpa["spec"]["minReplicas"] >= 2 > pdb["spec"]["maxUnavailable"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # argparse reads only the variables it was told to: an env name serve does not know
    # would leave the component's store setting silently unused.
    assert {"--store", "EXTPROC_STORE;", "EXTPROC_STORE_FAIL;"} <= set(serve_help.split()), serve_help
    if store_of(docs) is None:
        # Without a shared store each replica enforces the limits alone: more replicas = more capacity.
        assert hpa["spec"]["maxReplicas"] == hpa["spec"]["minReplicas"], (
            f"{name}: limits are per replica without a shared store: autoscaling extproc would "
            "multiply admitted capacity")
    else:
        assert hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"], (
            f"{name}: the replicas share one set of limits: let the HPA add decision throughput")


def test_network_policies_admit_the_proxies_and_the_scrapers(rendered: Rendered) -> None:
    for name in WIRED:
        docs = rendered[name]
        pod = one(docs, "Deployment", "extproc")["spec"]["template"]
        named_ports = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
        labels = pod["metadata"]["labels"].items()
        extproc_policies = [p for p in of_kind(docs, "NetworkPolicy")
                            if p["spec"]["podSelector"]["matchLabels"].items() <= labels
                            and "Ingress" in policy_types(p)]
        assert extproc_policies, f"{name}: no NetworkPolicy for extproc"
        ports = {port["port"] for p in extproc_policies
                 for rule in p["spec"]["ingress"] for port in rule["ports"]}
        assert ports == named_ports == {"grpc", "http-metrics"}


# --- egress: what extproc may connect to ------------------------------------------------------
#
# NetworkPolicies add up: a pod selected by no policy with an Egress type may connect
# anywhere; once one selects it, only what some rule of some such policy allows gets out.
# These helpers read the rules the way Kubernetes does, but prove only what the manifests
# show: a destination pod's labels are unknown unless the manifests render that pod (the
# Redis of components/redis), and its port names always are, so a rule that needs them (a
# non-empty podSelector of an unknown pod, a named port) proves nothing.


@dataclass(frozen=True)
class Destination:
    """A connection as a NetworkPolicy sees it: the destination pod's namespace (None when
    unknown or outside the cluster), its IP when the URL gives one, the pod's port."""

    what: str
    namespace: str | None
    ip: str | None
    port: int
    protocol: str = "TCP"
    labels: tuple[tuple[str, str], ...] | None = None
    """The destination pod's labels, when the manifests render that pod."""


#: Where a pod's DNS queries go: kube-dns pods in kube-system, or NodeLocal DNSCache's
#: link-local address on the node. Both must be allowed, or names stop resolving on some clusters.
DNS = [Destination("DNS (kube-dns)", "kube-system", None, 53, "UDP"),
       Destination("DNS (NodeLocal DNSCache)", None, "169.254.20.10", 53, "UDP")]


def destination_of(url: str, own_namespace: str) -> Destination:
    """Where a URL leads: a Service name ``svc[.ns[.svc[.domain]]]`` leads to pods of that
    namespace. The Service port is taken to be the pods' port (true of Prometheus's own
    Service; not in general, so a Service that maps ports needs a rule for its targetPort)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        return Destination(url, None, str(ipaddress.ip_address(host)), port)
    except ValueError:
        pass
    labels = host.split(".")
    if len(labels) == 1:
        return Destination(url, own_namespace, None, port)
    if len(labels) == 2 or labels[2] == "svc":
        return Destination(url, labels[1], None, port)
    return Destination(url, None, None, port)  # outside the cluster


def selects(selector: Doc | None, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (an empty one selects everything)."""
    selector = selector or {}
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        present = key in labels
        if not {"In": present and labels.get(key) in values,
                "NotIn": not present or labels.get(key) not in values,
                "Exists": present, "DoesNotExist": not present}[operator]:
            return False
    return True


def policy_types(policy: Doc) -> list[str]:
    spec = policy["spec"]
    types: list[str] = spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])]
    return types


def _port_allows(port: Doc, to: Destination) -> bool:
    if port.get("protocol", "TCP") != to.protocol:
        return False
    number = port.get("port")
    if number is None:
        return True  # every port of the protocol
    if isinstance(number, str):
        return False  # a named port of a pod we know nothing about
    end: int = port.get("endPort") or number
    return bool(number <= to.port <= end)


def _peer_allows(peer: Doc, policy_namespace: str, to: Destination) -> bool:
    if "ipBlock" in peer:
        if to.ip is None:
            return False
        ip = ipaddress.ip_address(to.ip)
        block = peer["ipBlock"]
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(cidr) for cidr in block.get("except", []))
    if to.namespace is None:
        return False
    if "namespaceSelector" in peer:
        namespace_ok = selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": to.namespace})
    else:
        namespace_ok = to.namespace == policy_namespace
    return namespace_ok and selects(peer.get("podSelector"), dict(to.labels or ()))


def egress_policies(docs: list[Doc]) -> list[Doc]:
    """The NetworkPolicies that restrict the extproc pods' egress."""
    pod = one(docs, "Deployment", "extproc")
    namespace, labels = pod["metadata"]["namespace"], pod["spec"]["template"]["metadata"]["labels"]
    return [p for p in of_kind(docs, "NetworkPolicy")
            if p["metadata"].get("namespace") == namespace and selects(p["spec"]["podSelector"], labels)
            and "Egress" in policy_types(p)]


def egress_allows(docs: list[Doc], to: Destination) -> bool:
    policies = egress_policies(docs)
    if not policies:
        return True
    return any(
        (not rule.get("ports") or any(_port_allows(port, to) for port in rule["ports"]))
        and (not rule.get("to") or any(_peer_allows(peer, policy["metadata"]["namespace"], to)
                                       for peer in rule["to"]))
        for policy in policies for rule in policy["spec"].get("egress") or [])


def signal_destinations(docs: list[Doc], policy: Policy) -> list[Destination]:
    """Every place the policy's signals are read from, plus DNS if any of them is a name."""
    namespace = one(docs, "Deployment", "extproc")["metadata"]["namespace"]
    urls: list[str] = []
    for source in policy.signals.sources.values():
        if source.prometheus is not None:
            urls.append(source.prometheus.url)
        elif source.scrape is not None:
            urls.extend(source.scrape.targets)
    found = [destination_of(url, namespace) for url in urls]
    return found + DNS if any(d.ip is None for d in found) else found


def egress_blocked(docs: list[Doc], policy: Policy) -> list[Destination]:
    return [d for d in signal_destinations(docs, policy) if not egress_allows(docs, d)]


def test_egress_rules_are_read_the_way_kubernetes_reads_them() -> None:
    def docs(*policies: Doc) -> list[Doc]:
        deployment = {"kind": "Deployment", "metadata": {"name": "extproc", "namespace": "extproc"},
                      "spec": {"template": {"metadata": {"labels": {"app": "extproc"}}}}}
        return [deployment, *({"kind": "NetworkPolicy", "metadata": {"name": f"p{i}", "namespace": "extproc"},
                               "spec": {"podSelector": {"matchLabels": {"app": "extproc"}}, **p}}
                              for i, p in enumerate(policies))]

    prometheus = destination_of("http://prometheus-operated.monitoring.svc.cluster.local:9090", "extproc")
    assert (prometheus.namespace, prometheus.ip, prometheus.port) == ("monitoring", None, 9090)
    assert destination_of("http://prometheus", "extproc").namespace == "extproc"
    assert destination_of("https://10.0.0.7/metrics", "extproc").ip == "10.0.0.7"
    assert destination_of("https://10.0.0.7/metrics", "extproc").port == 443
    assert destination_of("https://metrics.example.com/", "extproc").namespace is None
    monitoring = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    to_monitoring = {"to": [{"namespaceSelector": monitoring}]}

    assert egress_allows(docs(), prometheus)                                     # nothing restricts egress
    assert egress_allows(docs({"policyTypes": ["Ingress"], "ingress": []}), prometheus)
    assert not egress_allows(docs({"policyTypes": ["Egress"]}), prometheus)      # deny all
    assert not egress_allows(docs({"egress": []}), prometheus)                   # Egress implied by the key
    assert egress_allows(docs({"policyTypes": ["Egress"], "egress": [{}]}), prometheus)
    assert egress_allows(docs({"policyTypes": ["Egress"]}, {"policyTypes": ["Egress"], "egress": [
        {**to_monitoring, "ports": [{"port": 9000, "endPort": 9100}]}]}), prometheus)  # policies add up
    for rule, why in [
        ({**to_monitoring, "ports": [{"port": 9090, "protocol": "UDP"}]}, "another protocol"),
        ({**to_monitoring, "ports": [{"port": "web"}]}, "a named port proves nothing"),
        ({"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}}}]},
         "another namespace"),
        ({"to": [{"podSelector": {}}]}, "a podSelector alone means the policy's own namespace"),
        ({"to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "prometheus"}}}]},
         "the destination pods' labels are unknown"),
        ({"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}, "an ipBlock cannot match a Service name"),
    ]:
        assert not egress_allows(docs({"policyTypes": ["Egress"], "egress": [rule]}), prometheus), why
    assert egress_allows(docs({"policyTypes": ["Egress"], "egress": [{"to": [{"namespaceSelector": {
        "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In",
                              "values": ["monitoring"]}]}}]}]}), prometheus)
    engine = destination_of("http://10.1.2.3:8000/metrics", "extproc")
    block = {"policyTypes": ["Egress"], "egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/8",
                                                                        "except": ["10.1.0.0/16"]}}]}]}
    assert not egress_allows(docs(block), engine)
    assert egress_allows(docs(block), destination_of("http://10.2.0.1:8000/metrics", "extproc"))


@pytest.mark.parametrize("name", WIRED)
def test_extproc_may_reach_every_signal_source_and_dns(rendered: Rendered, name: str, tmp_path: Path) -> None:
    docs = rendered[name]
    _, policy = policy_of(docs, tmp_path)
    blocked = egress_blocked(docs, policy)
    assert not blocked, f"{name}: extproc's NetworkPolicies block its signal sources: {blocked}"


def test_the_egress_check_follows_the_policy(rendered: Rendered, tmp_path: Path) -> None:
    """The egress check is not vacuous: where egress is restricted, moving the policy's
    Prometheus elsewhere, or dropping the DNS rule, leaves extproc blind."""
    docs = copy.deepcopy(rendered["seed-scenario+signals-egress"])
    assert egress_policies(docs), "the signals-egress component restricts extproc's egress"
    assert not egress_policies(rendered["seed-scenario"]), "without it egress is not restricted"
    _, policy = policy_of(docs, tmp_path)
    [url] = [s.prometheus.url for s in policy.signals.sources.values() if s.prometheus]
    assert not egress_blocked(docs, policy)

    configmap = one(docs, "ConfigMap", "extproc-policy")
    shipped = configmap["data"]["policy.yaml"]
    assert shipped.count(url) == 1
    configmap["data"]["policy.yaml"] = shipped.replace(url, url.replace(".monitoring.", ".observability."))
    (tmp_path / "moved").mkdir()
    _, moved = policy_of(docs, tmp_path / "moved")
    assert [d.namespace for d in egress_blocked(docs, moved)] == ["observability"]
    configmap["data"]["policy.yaml"] = shipped

    [egress] = egress_policies(docs)
    egress["spec"]["egress"] = [r for r in egress["spec"]["egress"]
                                if not any(p.get("port") == 53 for p in r.get("ports", []))]
    assert egress_blocked(docs, policy) == DNS


@pytest.mark.parametrize("name", ALL)
def test_the_admin_port_stays_on_loopback(rendered: Rendered, name: str) -> None:
    """Drain and pause are reached with kubectl port-forward, never through a Service or a policy:
    the HTTP admin port and the gRPC admin API alike."""
    docs = rendered[name]
    _, deployment, _, args = policy_wiring(docs)
    admins = [Address.parse(args["admin"]), Address.parse(args["admin-grpc"])]
    assert all(ipaddress.ip_address(admin.host).is_loopback for admin in admins)
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert not {"EXTPROC_ADMIN", "EXTPROC_ADMIN_GRPC", "EXTPROC_ADMIN_TOKEN"} & {
        e["name"] for e in container.get("env", [])}
    declared = container["ports"]
    assert not {admin.port for admin in admins} & {p["containerPort"] for p in declared}
    assert not [p for p in declared if "admin" in p["name"]]
    names = {p["name"] for p in declared}  # what a Service or NetworkPolicy may name
    for service in of_kind(docs, "Service"):
        for port in service["spec"]["ports"]:
            for admin in admins:
                assert admin.port not in (port["port"], port.get("targetPort")), service["metadata"]["name"]
            assert "admin" not in port["name"]
    labels = deployment["spec"]["template"]["metadata"]["labels"].items()
    for policy in of_kind(docs, "NetworkPolicy"):
        if not policy["spec"]["podSelector"].get("matchLabels", {}).items() <= labels:
            continue  # another workload's (Redis)
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                # Only declared ports by name; the admin port is declared nowhere (above).
                assert port["port"] in names, f"{policy['metadata']['name']} opens {port['port']}"


# --- EnvoyFilters -----------------------------------------------------------------------------


def extproc_cluster(docs: list[Doc]) -> str:
    """Istio's outbound cluster for the extproc Service's gRPC port (ext_proc and the rate
    limit service alike)."""
    service = one(docs, "Service", "extproc")
    port = next(p["port"] for p in service["spec"]["ports"] if p["targetPort"] == "grpc")
    return f"outbound|{port}||extproc.{service['metadata']['namespace']}.svc.cluster.local"


def envoyfilters(rendered: Rendered) -> dict[tuple[str, str], Doc]:
    """Every EnvoyFilter shipped (in any composition), by namespace and name."""
    return {(f["metadata"]["namespace"], f["metadata"]["name"]): f
            for name in ALL for f in of_kind(rendered[name], "EnvoyFilter")}


def test_envoyfilters_cover_gateway_and_sidecar_with_the_shipped_ext_proc_config(
        rendered: Rendered, tmp_path: Path) -> None:
    contexts = set()
    expected = shipped_ext_proc()
    for name in WIRED:
        docs = rendered[name]
        cluster = extproc_cluster(docs)
        _, policy = policy_of(docs, tmp_path)
        patches = filter_patches(docs, EXT_PROC)
        assert patches, f"{name}: no ext_proc EnvoyFilter"
        for context, value in patches:
            contexts.add(context)
            typed = copy.deepcopy(value["typed_config"])
            assert typed["grpc_service"]["envoy_grpc"]["cluster_name"] == cluster
            typed["grpc_service"]["envoy_grpc"]["cluster_name"] = "extproc"
            assert typed == expected, f"{name}: ext_proc config drifted from envoy/envoy.yaml"
            # A hold can last as long as the policy allows, and no longer.
            assert seconds(typed["max_message_timeout"]) == policy.capacity.max_hold, name
    assert contexts == {"GATEWAY", "SIDECAR_INBOUND"}
    for f in of_kind(rendered["gateway"] + rendered["sidecar"], "EnvoyFilter"):
        for patch in f["spec"]["configPatches"]:
            if patch["applyTo"] != "HTTP_FILTER":
                continue
            if patch["patch"]["value"]["name"] == STRIP:
                # First of all, before Istio's own filters read any header.
                assert patch["patch"]["operation"] == "INSERT_FIRST"
                assert "subFilter" not in patch["match"]["listener"]["filterChain"]["filter"]
            else:
                assert patch["patch"]["operation"] == "INSERT_BEFORE"
                assert patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == ROUTER


@pytest.mark.parametrize("name", [STRIP, GATE, bootstrap.OVERLOAD_STATUS_FILTER, bootstrap.OVERLOAD_FILTER])
def test_envoyfilters_carry_the_shipped_strip_shed_and_gate(rendered: Rendered, name: str) -> None:
    expected = shipped_filter(name)
    contexts = set()
    for overlay in WIRED:
        patches = filter_patches(rendered[overlay], name)
        assert patches, f"{overlay}: no {name} in its EnvoyFilters"
        for context, value in patches:
            contexts.add(context)
            assert value["typed_config"] == expected, f"{overlay}: {name} drifted from envoy/envoy.yaml"
    assert contexts == {"GATEWAY", "SIDECAR_INBOUND"}


def test_envoyfilters_set_the_shipped_connection_manager_fields(rendered: Rendered) -> None:
    """Path normalization, underscore headers and the gate's 503 do not depend on MeshConfig."""
    shipped = shipped_hcm()
    wanted = ("stream_idle_timeout", "normalize_path", "merge_slashes", "path_with_escaped_slashes_action",
              "common_http_protocol_options", "local_reply_config")
    for overlay in WIRED:
        merges = [p["patch"]["value"]["typed_config"] for f in of_kind(rendered[overlay], "EnvoyFilter")
                  for p in f["spec"]["configPatches"] if p["applyTo"] == "NETWORK_FILTER"]
        assert len(merges) == 1, overlay
        (merge,) = merges
        assert {key: merge.get(key) for key in wanted} == {key: shipped[key] for key in wanted}, overlay


def test_envoyfilters_carry_the_shipped_ratelimit_filter_failing_open(rendered: Rendered) -> None:
    expected = shipped_filter(RATELIMIT)
    shipped_cluster = expected["rate_limit_service"]["grpc_service"]["envoy_grpc"]["cluster_name"]
    contexts = set()
    for name in WIRED:
        docs = rendered[name]
        patches = filter_patches(docs, RATELIMIT)
        assert patches, f"{name}: no ratelimit filter in its EnvoyFilters"
        for context, value in patches:
            contexts.add(context)
            typed = copy.deepcopy(value["typed_config"])
            grpc = typed["rate_limit_service"]["grpc_service"]["envoy_grpc"]
            # extproc's one gRPC port serves the rate limit service too: ext_proc's cluster.
            assert grpc["cluster_name"] == extproc_cluster(docs), name
            grpc["cluster_name"] = shipped_cluster
            assert typed == expected, f"{name}: ratelimit filter config drifted from envoy/envoy.yaml"
            # Fail open, and said so rather than left to the default: ext_proc behind it still
            # decides every request, so a slow or absent rate limit service costs only the shed.
            assert value["typed_config"]["failure_mode_deny"] is False, name
    assert contexts == {"GATEWAY", "SIDECAR_INBOUND"}


def test_the_edge_shed_runs_before_ext_proc(rendered: Rendered) -> None:
    filters = envoyfilters(rendered)
    assert len(filters) >= 2
    for (_, name), envoyfilter in filters.items():
        patches = [p for p in envoyfilter["spec"]["configPatches"] if p["applyTo"] == "HTTP_FILTER"]
        # Istio inserts INSERT_BEFORE patches in the order listed: the ratelimit patch comes first.
        assert [p["patch"]["value"]["name"] for p in patches] == [
            STRIP, RATELIMIT, bootstrap.OVERLOAD_STATUS_FILTER, bootstrap.OVERLOAD_FILTER, EXT_PROC, GATE,
            bootstrap.USAGE_FILTER], name
        _, shed, status, overload, admit, gate, usage = patches
        assert shed["match"] == status["match"] == overload["match"] == admit["match"] == gate["match"] \
            == usage["match"], \
            f"{name}: the filters must land on the same listeners"
        assert shed["patch"]["operation"] == admit["patch"]["operation"] == "INSERT_BEFORE"
        # Applied the way Istio applies them, the chain is envoy/envoy.yaml's (less the demo's keys).
        chain = [f["name"] for f in bootstrap_hcm(envoy_bootstrap(envoyfilter))["http_filters"]]
        shipped = [f["name"] for f in shipped_hcm()["http_filters"] if f["name"] != API_KEYS]
        assert chain == [STRIP, RATELIMIT, bootstrap.OVERLOAD_STATUS_FILTER, bootstrap.OVERLOAD_FILTER,
                         EXT_PROC, GATE, bootstrap.USAGE_FILTER, ROUTER] == shipped


def ratelimit_problems(docs: list[Doc], policy: Policy) -> list[str]:
    """Where the EnvoyFilters' edge shed disagrees with ``policy``: a domain or a descriptor
    extproc does not judge (answered OK, so nothing is ever shed), or a trusted header the rate
    limit service is not sent (it would classify requests unlike ext_proc)."""
    config, problems = policy.ratelimit, []
    for envoyfilter in of_kind(docs, "EnvoyFilter"):
        where = envoyfilter["metadata"]["name"]
        for patch in envoyfilter["spec"]["configPatches"]:
            value = patch["patch"]["value"]
            if patch["applyTo"] == "HTTP_FILTER" and value["name"] == RATELIMIT:
                domain = value["typed_config"].get("domain")
                if domain != config.domain:
                    problems.append(f"{where}: domain {domain!r}, but the policy's ratelimit.domain "
                                    f"is {config.domain!r}")
        for route, value in route_patches(envoyfilter).items():
            per_route = value.get("typed_per_filter_config", {}).get(RATELIMIT, {})
            for i, limit in enumerate(per_route.get("rate_limits", [])):
                at = f"{where}: route {route}: rate_limits[{i}]"
                actions = limit["actions"]
                keys = [a["generic_key"]["descriptor_value"] for a in actions if "generic_key" in a]
                on_done = limit.get("apply_on_stream_done", False)
                wanted = config.usage_descriptor if on_done else config.request_descriptor
                if keys != [wanted]:
                    problems.append(f"{at}: generic_key {keys}, the policy expects [{wanted!r}]")
                if on_done:
                    continue
                sent = {(a["request_headers"]["header_name"], a["request_headers"]["descriptor_key"])
                        for a in actions if "request_headers" in a}
                # The retry header too: a retry holding a booked return is let through to ext_proc.
                retry = policy.retry_budget.header
                for header, key in [(":method", "method"), (":path", "path"), (retry, retry),
                                    *((h, h) for h in policy.trusted_headers)]:
                    if (header, key) not in sent:
                        problems.append(f"{at}: {header} is not sent as {key!r}")
    return problems


@pytest.mark.parametrize("name", WIRED)
def test_the_edge_shed_asks_for_the_policys_domain_and_descriptors(
        rendered: Rendered, name: str, tmp_path: Path) -> None:
    docs = rendered[name]
    path, policy = policy_of(docs, tmp_path)
    written = (yaml.safe_load(path.read_text()) or {}).get("ratelimit") or {}
    if "domain" not in written:
        assert policy.ratelimit.domain == "extproc"  # what the EnvoyFilters then must say
    assert filter_patches(docs, RATELIMIT)
    assert not ratelimit_problems(docs, policy), name


def test_the_edge_shed_check_follows_the_policy(rendered: Rendered) -> None:
    """The check above is not vacuous: each way a policy can part from the EnvoyFilters is caught,
    and a policy without a ratelimit key agrees with them (its domain is "extproc")."""
    docs = rendered["gateway"]
    shipped = yaml.safe_load(one(docs, "ConfigMap", "extproc-policy")["data"]["policy.yaml"])
    assert "ratelimit" in shipped, "the base policy names its domain (the seed scenario's does not)"

    def problems(**changes: Any) -> list[str]:
        doc = {key: value for key, value in shipped.items() if key != "ratelimit"}
        return ratelimit_problems(docs, Policy.model_validate({**doc, **changes}))

    assert problems() == []
    assert problems(ratelimit={"mode": "shadow"}) == []
    assert problems(trusted_headers=["x-extproc-client"]) == []
    [domain] = problems(ratelimit={"domain": "gpu"})
    assert "domain 'extproc', but the policy's ratelimit.domain is 'gpu'" in domain
    [usage] = problems(ratelimit={"usage_descriptor": "tokens"})
    assert "rate_limits[0]: generic_key ['gpu_inference_tokens']" in usage
    # The edge is judged in ext_proc (x-extproc-edge): no arrival descriptor names the request
    # descriptor or must list the trusted headers, so neither can part from the policy.
    assert problems(ratelimit={"request_descriptor": "arrivals"}) == []
    assert problems(trusted_headers=["x-team"]) == []
    for overlay in ("gateway", "sidecar"):
        patches = one(rendered[overlay], "EnvoyFilter")["spec"]["configPatches"]
        [strip] = [patch["patch"]["value"] for patch in patches
                   if patch["applyTo"] == "HTTP_FILTER" and patch["patch"]["value"]["name"] == STRIP]
        set_by_proxy = [m["append"]["header"] for m in strip["typed_config"]["mutations"]["request_mutations"]
                        if "append" in m]
        assert {"key": "x-extproc-edge", "value": "1"} in set_by_proxy, overlay


def test_health_routes_skip_both_filters_and_inference_routes_are_shed_and_never_time_out(
        rendered: Rendered) -> None:
    health = shipped_route("health")
    shed = shipped_route("inference-keyed")
    assert set(health) == {RATELIMIT, bootstrap.OVERLOAD_FILTER, EXT_PROC, GATE}
    assert set(shed) == {RATELIMIT}
    docs = rendered["gateway"]
    routes = {r["name"]: r for r in one(docs, "VirtualService", "inference")["spec"]["http"]}
    patched = route_patches(one(docs, "EnvoyFilter"))
    # As in envoy/envoy.yaml: the inference route carries the descriptors, health turns both off.
    assert {name: value["typed_per_filter_config"] for name, value in patched.items()} == \
        {"health": health, "inference": shed}
    assert set(patched) <= set(routes)
    assert routes["health"]["match"][0]["uri"]["exact"] == "/health"
    inference = routes["inference"]
    assert inference["timeout"] == "0s"
    assert not re.search(r"5xx|gateway-error|retriable-status", inference["retries"]["retryOn"])
    # The sidecar overlay adds its own /health route before Istio's inbound catch-all, which
    # carries the descriptors.
    patched = route_patches(one(rendered["sidecar"], "EnvoyFilter"))
    assert set(patched) == {"extproc-health-bypass", "default"}
    assert patched["extproc-health-bypass"]["match"] == {"path": "/health"}
    assert patched["extproc-health-bypass"]["typed_per_filter_config"] == health
    assert patched["default"] == {"typed_per_filter_config": shed, "request_headers_to_remove": PROXY_WORDS}
    # The proxy's word to extproc never reaches a backend, on any route patched here.
    for overlay in ("gateway", "sidecar"):
        for name, value in route_patches(one(rendered[overlay], "EnvoyFilter")).items():
            assert value["request_headers_to_remove"] == PROXY_WORDS, (overlay, name)


def route_configuration_patches(envoyfilter: Doc) -> list[Doc]:
    return [p for p in envoyfilter["spec"]["configPatches"] if p["applyTo"] == "ROUTE_CONFIGURATION"]


def test_every_route_configuration_ext_proc_runs_on_adds_the_shipped_x_ratelimit_headers(
        rendered: Rendered) -> None:
    """The edge's x-ratelimit-* of a request whose response headers extproc did not ask for (extproc
    serve --response-sample) come from its metadata: each overlay adds them as envoy/envoy.yaml does,
    on the route configurations of the listeners its ext_proc filter runs on (in the mesh the routes
    are the users' VirtualServices': patched at the level above them)."""
    config = yaml.safe_load((ROOT / "envoy" / "envoy.yaml").read_text())
    shipped = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["response_headers_to_add"]
    for overlay in ("gateway", "sidecar"):
        envoyfilter = one(rendered[overlay], "EnvoyFilter")
        [patch] = route_configuration_patches(envoyfilter)
        assert patch["patch"] == {"operation": "MERGE",
                                  "value": {"response_headers_to_add": shipped}}, overlay
        ext_proc = next(p for p in envoyfilter["spec"]["configPatches"]
                        if p["applyTo"] == "HTTP_FILTER" and p["patch"]["value"]["name"] == EXT_PROC)
        assert patch["match"]["context"] == ext_proc["match"]["context"], overlay
        # The same port as the listener ext_proc is on (the sidecar's; the gateway's: all of them).
        assert patch["match"].get("routeConfiguration", {}).get("portNumber") == \
            ext_proc["match"]["listener"].get("portNumber"), overlay


def _static_cluster(name: str, port: int, *, http2: bool = False) -> Doc:
    cluster: dict[str, Any] = {
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]},
    }
    if http2:
        options = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
        cluster["typed_extension_protocol_options"] = {options: {
            "@type": f"type.googleapis.com/{options}",
            "explicit_http_config": {"http2_protocol_options": {}}}}
    return cluster


def _merge(into: dict[str, Any], value: dict[str, Any]) -> None:
    """Istio's MERGE: proto merge semantics (messages merge, scalars replace)."""
    for key, item in value.items():
        if isinstance(item, dict) and isinstance(into.get(key), dict):
            _merge(into[key], item)
        else:
            into[key] = copy.deepcopy(item)


def _grpc_clusters(config: Any) -> list[str]:
    """Every cluster an ``envoy_grpc`` service in a filter config names, wherever it sits
    (ext_proc's ``grpc_service``, the ratelimit filter's ``rate_limit_service.grpc_service``)."""
    if isinstance(config, list):
        return [name for item in config for name in _grpc_clusters(item)]
    if not isinstance(config, dict):
        return []
    own = [config["envoy_grpc"]["cluster_name"]] if "envoy_grpc" in config else []
    nested = (item for key, item in config.items() if key != "envoy_grpc")
    return own + [name for item in nested for name in _grpc_clusters(item)]


def envoy_bootstrap(envoyfilter: dict[str, Any]) -> Doc:
    """A minimal bootstrap with every patch of one EnvoyFilter applied the way Istio would."""
    http_filters: list[Doc] = []
    hcm: dict[str, Any] = {"@type": HCM, "stat_prefix": "test"}
    routes: list[Doc] = [{"name": "default", "match": {"prefix": "/"},
                          "route": {"cluster": "backend", "timeout": "0s"}}]
    clusters = {"backend": _static_cluster("backend", 8000)}
    route_config: dict[str, Any] = {"name": "test"}
    for patch in envoyfilter["spec"]["configPatches"]:
        apply_to, operation = patch["applyTo"], patch["patch"]["operation"]
        value = copy.deepcopy(patch["patch"]["value"])
        if apply_to == "HTTP_FILTER":
            assert operation in ("INSERT_BEFORE", "INSERT_FIRST")
            if operation == "INSERT_FIRST":
                http_filters.insert(0, value)
            else:
                http_filters.append(value)
            for name in _grpc_clusters(value["typed_config"]):
                clusters[name] = _static_cluster(name, 50051, http2=True)
        elif apply_to == "NETWORK_FILTER":
            assert operation == "MERGE"
            assert value["typed_config"]["@type"] == HCM
            _merge(hcm, value["typed_config"])
        elif apply_to == "ROUTE_CONFIGURATION":
            assert operation == "MERGE"
            _merge(route_config, value)
        elif apply_to == "HTTP_ROUTE":
            target = patch["match"]["routeConfiguration"]["vhost"]["route"]["name"]
            existing = [r for r in routes if r["name"] == target]
            if operation == "MERGE":
                if existing:
                    _merge(existing[0], value)
                else:
                    route = {"name": target, "match": {"path": f"/{target}"}, "route": {"cluster": "backend"}}
                    _merge(route, value)
                    routes.insert(0, route)
            else:
                assert operation == "INSERT_BEFORE"
                routes.insert(routes.index(existing[0]), value)
                cluster = value["route"]["cluster"]
                clusters.setdefault(cluster, _static_cluster(cluster, 8000))
        else:
            pytest.fail(f"no Envoy check for applyTo {apply_to}: extend envoy_bootstrap")
    hcm["http_filters"] = [*http_filters, {"name": ROUTER, "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]
    hcm["route_config"] = {**route_config,
                           "virtual_hosts": [{"name": "test", "domains": ["*"], "routes": routes}]}
    def local() -> Doc:
        return {"socket_address": {"address": "127.0.0.1", "port_value": free_port()}}

    listener = {"name": "test", "address": local(), "filter_chains": [{"filters": [
        {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}]}
    return {"admin": {"address": local()},
            "static_resources": {"listeners": [listener], "clusters": list(clusters.values())}}


def bootstrap_hcm(bootstrap: Doc) -> Doc:
    hcm: Doc = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


@pytest.mark.envoy
def test_every_envoyfilter_patch_validates_with_the_real_envoy(
        rendered: Rendered, tmp_path: Path) -> None:
    filters = envoyfilters(rendered)
    assert len(filters) >= 2
    running = []
    for (namespace, name), envoyfilter in filters.items():
        bootstrap = envoy_bootstrap(envoyfilter)
        # What is validated includes the edge shed: its filter and the descriptors on a route.
        hcm = bootstrap_hcm(bootstrap)
        assert {STRIP, RATELIMIT, EXT_PROC, GATE} <= {f["name"] for f in hcm["http_filters"]}
        per_route = [r.get("typed_per_filter_config", {}).get(RATELIMIT, {})
                     for r in hcm["route_config"]["virtual_hosts"][0]["routes"]]
        assert any(c.get("rate_limits") for c in per_route), name
        assert any(c.get("disabled") for c in per_route), name
        assert hcm["route_config"]["response_headers_to_add"], name
        path = tmp_path / f"{namespace}-{name}.yaml"
        path.write_text(yaml.safe_dump(bootstrap))
        running.append((name, path, subprocess.Popen(
            [envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "warn"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    for name, path, process in running:
        output, _ = process.communicate(timeout=120)
        assert process.returncode == 0, f"{name} ({path}):\n{output[-3000:]}"
        assert "OK" in output, output


def _break_ext_proc(envoyfilter: Doc) -> str:
    for patch in envoyfilter["spec"]["configPatches"]:
        if patch["applyTo"] == "HTTP_FILTER" and patch["patch"]["value"]["name"] == EXT_PROC:
            patch["patch"]["value"]["typed_config"]["processing_mode"]["response_trailer_mode"] = "SENT"
    return "SENT"


def _break_ratelimit_filter(envoyfilter: Doc) -> str:
    for patch in envoyfilter["spec"]["configPatches"]:
        if patch["applyTo"] == "HTTP_FILTER" and patch["patch"]["value"]["name"] == RATELIMIT:
            patch["patch"]["value"]["typed_config"]["enable_x_ratelimit_headers"] = "DRAFT_VERSION_3"
    return "DRAFT_VERSION_3"


def _break_descriptors(envoyfilter: Doc) -> str:
    for value in route_patches(envoyfilter).values():
        for limit in value["typed_per_filter_config"].get(RATELIMIT, {}).get("rate_limits", []):
            limit["apply_on_stream_end"] = limit.pop("apply_on_stream_done", False)
    return "apply_on_stream_end"


def _break_route_headers(envoyfilter: Doc) -> str:
    for patch in route_configuration_patches(envoyfilter):
        patch["patch"]["value"]["response_headers_to_add"][0]["append_action"] = "OVERWRITE_IF_EXIST"
    return "OVERWRITE_IF_EXIST"


@pytest.mark.envoy
@pytest.mark.parametrize("overlay", ["gateway", "sidecar"])
@pytest.mark.parametrize("breakage", [_break_ext_proc, _break_ratelimit_filter, _break_descriptors,
                                      _break_route_headers],
                         ids=["ext_proc enum", "ratelimit enum", "descriptor field", "route header enum"])
def test_envoy_check_rejects_a_broken_patch(
        rendered: Rendered, tmp_path: Path, overlay: str, breakage: Callable[[Doc], str]) -> None:
    """The Envoy check above can fail: a misspelt enum or field in any patch is refused."""
    envoyfilter = copy.deepcopy(one(rendered[overlay], "EnvoyFilter"))
    culprit = breakage(envoyfilter)
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(envoy_bootstrap(envoyfilter)))
    result = run([envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "warn"])
    assert result.returncode != 0
    assert culprit in result.stdout + result.stderr


# --- policies ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", WIRED)
def test_policy_in_the_configmap_passes_policy_check(rendered: Rendered, name: str,
                                                     tmp_path: Path) -> None:
    path, _ = policy_of(rendered[name], tmp_path)
    result = run([sys.executable, "-m", "extproc", "policy", "check", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert ": ok — " in result.stdout


def test_seed_scenario_lanes_match_kueue_and_keda_targets_the_model_server(
        rendered: Rendered, tmp_path: Path) -> None:
    docs = rendered["seed-scenario"]
    _, policy = policy_of(docs, tmp_path)
    queues = {q["metadata"]["name"] for q in of_kind(docs, "ClusterQueue")}
    assert queues == {f"inference-{lane.name}" for lane in policy.lanes}
    assert {q["spec"]["cohort"] for q in of_kind(docs, "ClusterQueue")} == {"inference"}
    local = {q["metadata"]["name"]: q["spec"]["clusterQueue"] for q in of_kind(docs, "LocalQueue")}
    assert set(local.values()) == queues
    scaled = one(docs, "ScaledObject")
    target = one(docs, "Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    assert target["metadata"]["namespace"] == scaled["metadata"]["namespace"]
    assert target["spec"]["template"]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] in local
    assert "replicas" not in target["spec"], "KEDA owns the model-server replica count"
    queries = [t["metadata"]["query"] for t in scaled["spec"]["triggers"]]
    assert any("inference_queue_wait_seconds_bucket" in query for query in queries)


# --- the shared store (components/redis) ------------------------------------------------------


def env_of(deployment: Doc) -> dict[str, str]:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container.get("env", [])}


def store_of(docs: list[Doc]) -> str | None:
    """The store extproc is pointed at: its --store flag, else EXTPROC_STORE (what serve reads then)."""
    _, deployment, _, args = policy_wiring(docs)
    return args.get("store") or env_of(deployment).get("EXTPROC_STORE") or None


def runs_redis(deployment: Doc) -> bool:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return any(c.get("args", [""])[0] == "redis-server" for c in containers)


def redis_of(docs: list[Doc]) -> tuple[Doc, str, Destination]:
    """The Redis Deployment, the URL that reaches it through its Service (cluster DNS name
    and Service port), and where that connection lands as a NetworkPolicy sees it (the
    pods' namespace, labels and the container port the Service's targetPort names)."""
    [deployment] = [d for d in of_kind(docs, "Deployment") if runs_redis(d)]
    pod = deployment["spec"]["template"]
    [service] = [s for s in of_kind(docs, "Service")
                 if s["spec"].get("selector") and selects({"matchLabels": s["spec"]["selector"]},
                                                          pod["metadata"]["labels"])]
    [port] = service["spec"]["ports"]
    target = port.get("targetPort", port["port"])
    [container] = pod["spec"]["containers"]
    [pod_port] = [p["containerPort"] for p in container["ports"] if target in (p["name"], p["containerPort"])]
    namespace = service["metadata"]["namespace"]
    url = f"redis://{service['metadata']['name']}.{namespace}.svc.cluster.local:{port['port']}/0"
    labels = tuple(sorted(pod["metadata"]["labels"].items()))
    return deployment, url, Destination(f"Redis {url}", namespace, None, pod_port, labels=labels)


def ingress_allows(docs: list[Doc], deployment: Doc, namespace: str, labels: dict[str, str],
                   port: int) -> bool:
    """May a pod (namespace, labels) open a TCP connection to ``port`` of this Deployment's pods?

    An ipBlock counts as allowing: pod IPs are unknown here, so only a policy without one
    proves that nobody else gets in.
    """
    pod = deployment["spec"]["template"]
    own = deployment["metadata"]["namespace"]
    named = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    policies = [p for p in of_kind(docs, "NetworkPolicy") if p["metadata"].get("namespace") == own
                and selects(p["spec"]["podSelector"], pod["metadata"]["labels"])
                and "Ingress" in policy_types(p)]
    if not policies:
        return True

    def port_ok(rule_port: Doc) -> bool:
        number = rule_port.get("port")
        if rule_port.get("protocol", "TCP") != "TCP":
            return False
        if number is None:
            return True
        if isinstance(number, str):
            return named.get(number) == port
        return bool(number <= port <= (rule_port.get("endPort") or number))

    def peer_ok(peer: Doc) -> bool:
        if "ipBlock" in peer:
            return True
        if "namespaceSelector" in peer:
            namespace_ok = selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace})
        else:
            namespace_ok = namespace == own
        return namespace_ok and selects(peer.get("podSelector"), labels)

    return any((not rule.get("ports") or any(port_ok(p) for p in rule["ports"]))
               and (not rule.get("from") or any(peer_ok(p) for p in rule["from"]))
               for policy in policies for rule in policy["spec"].get("ingress") or [])


@pytest.mark.parametrize("name", ALL)
def test_extproc_uses_the_components_redis_exactly_where_it_is_included(
        rendered: Rendered, name: str) -> None:
    docs = rendered[name]
    store = store_of(docs)
    if name not in WITH_REDIS:
        assert store is None, f"{name}: a store without components/redis"
        assert not [d for d in of_kind(docs, "Deployment") if runs_redis(d)]
        return
    _, url, _ = redis_of(docs)
    assert store == url, f"{name}: extproc's store is not the component's Service"
    deployment, base = one(docs, "Deployment", "extproc"), one(rendered["base"], "Deployment", "extproc")
    env = env_of(deployment)
    assert env["EXTPROC_STORE_FAIL"] == "open"
    # The patch merges into the base's env and touches nothing else of the pod.
    assert env.items() >= env_of(base).items()
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    [base_container] = base["spec"]["template"]["spec"]["containers"]
    assert {k: v for k, v in container.items() if k != "env"} == \
        {k: v for k, v in base_container.items() if k != "env"}


def test_only_extproc_reaches_the_redis_and_its_egress_lets_it(rendered: Rendered) -> None:
    assert WITH_REDIS
    assert any(egress_policies(rendered[name]) for name in WITH_REDIS), \
        "one composition restricts extproc's egress, so the egress check below is not vacuous"
    for name in WITH_REDIS:
        docs = rendered[name]
        target, _, to = redis_of(docs)
        extproc = one(docs, "Deployment", "extproc")
        namespace = extproc["metadata"]["namespace"]
        labels = extproc["spec"]["template"]["metadata"]["labels"]
        assert egress_allows(docs, to), f"{name}: extproc's NetworkPolicies block its store"
        assert all(egress_allows(docs, dns) for dns in DNS), f"{name}: the store's name cannot be resolved"
        if egress_policies(docs):
            cut = copy.deepcopy(docs)
            for policy in egress_policies(cut):
                policy["spec"]["egress"] = [r for r in policy["spec"]["egress"]
                                            if not any(p.get("port") == to.port for p in r.get("ports", []))]
            assert not egress_allows(cut, to), f"{name}: the check does not depend on the Redis rule"
        assert ingress_allows(docs, target, namespace, labels, to.port), f"{name}: Redis refuses extproc"
        assert not ingress_allows(docs, target, namespace, labels, to.port + 1)
        others = {
            "another pod of extproc's namespace": (namespace, {"app.kubernetes.io/name": "debug"}),
            "the ingress gateway": ("istio-system", {"istio": "ingressgateway"}),
            "a model server": ("inference", {"app.kubernetes.io/name": "model-server",
                                             "extproc-admission": "enabled"}),
            "a pod labelled like extproc elsewhere": ("default", labels),
            "Prometheus": ("monitoring", {"app.kubernetes.io/name": "prometheus"}),
        }
        for who, (elsewhere, their_labels) in others.items():
            assert not ingress_allows(docs, target, elsewhere, their_labels, to.port), \
                f"{name}: {who} reaches Redis"


def test_the_ingress_check_reads_policies_the_way_kubernetes_does(rendered: Rendered) -> None:
    docs = copy.deepcopy(rendered["gateway+redis"])
    target, _, to = redis_of(docs)
    extproc = {"app.kubernetes.io/name": "extproc"}
    other = {"app.kubernetes.io/name": "debug"}
    policy = one(docs, "NetworkPolicy", "extproc-redis")
    cases: list[tuple[list[Doc], str, dict[str, str], bool, str]] = [
        ([{"from": [{"podSelector": {}}]}], "extproc", other, True, "every pod of the namespace"),
        ([{"from": [{"podSelector": {}}]}], "default", other, False, "... of its own namespace only"),
        ([{"ports": [{"port": to.port}]}], "default", other, True, "no `from`: anyone"),
        ([{"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}], "default", other, True, "an ipBlock: any pod"),
        ([{"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": extproc}}]}],
         "default", extproc, True, "extproc's labels in any namespace"),
        ([{"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": extproc}}]}],
         "default", other, False, "other labels"),
        ([{"from": [{"podSelector": {"matchLabels": extproc}}], "ports": [{"port": "redis"}]}],
         "extproc", extproc, True, "a named port of a rendered pod resolves"),
        ([{"from": [{"podSelector": {"matchLabels": extproc}}], "ports": [{"port": "nope"}]}],
         "extproc", extproc, False, "an unknown port name opens nothing"),
        ([{"ports": [{"port": to.port, "protocol": "UDP"}]}], "extproc", extproc, False, "UDP"),
        ([], "extproc", extproc, False, "selected, nothing allowed"),
    ]
    for ingress, namespace, labels, expected, why in cases:
        policy["spec"]["ingress"] = ingress
        assert ingress_allows(docs, target, namespace, labels, to.port) is expected, why
    docs.remove(policy)
    assert ingress_allows(docs, target, "default", other, to.port), "selected by no policy: open to all"


def start_component_redis(docs: list[Doc], workdir: Path) -> tuple[subprocess.Popen[bytes], redis.Redis]:
    """A real redis-server with the component's arguments, on this machine's loopback."""
    [container] = redis_of(docs)[0]["spec"]["template"]["spec"]["containers"]
    port = free_port()
    process = subprocess.Popen([tool("redis-server"), *container["args"][1:], "--port", str(port),
                                "--bind", "127.0.0.1", "--dir", str(workdir),
                                "--logfile", str(workdir / "redis.log")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_timeout=2, decode_responses=True)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return process, client
        except redis.ConnectionError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"redis-server did not start: {(workdir / 'redis.log').read_text()}")
            time.sleep(0.05)


def serve_with_the_deployments_store(stack: Stack, docs: list[Doc], client: redis.Redis) -> str:
    """extproc serve with the Deployment's env, its store moved from the Service's cluster
    address onto the local Redis; its HTTP base URL."""
    env = env_of(one(docs, "Deployment", "extproc"))
    local = f"127.0.0.1:{client.connection_pool.connection_kwargs['port']}"
    env["EXTPROC_STORE"] = urllib.parse.urlsplit(env["EXTPROC_STORE"])._replace(netloc=local).geturl()
    http = free_port()
    process = stack.start("extproc", [sys.executable, "-m", "extproc", "serve",
                                      "--policy", str(ISTIO / "base" / "policy.yaml"),
                                      "--grpc", f"127.0.0.1:{free_port()}", "--http", f"127.0.0.1:{http}",
                                      "--admin", f"127.0.0.1:{free_port()}",
                                      "--admin-grpc", f"127.0.0.1:{free_port()}"], env=env)
    wait_http(f"http://127.0.0.1:{http}/readyz", proc=process.popen)
    return f"http://127.0.0.1:{http}"


def test_extproc_shares_the_components_redis_and_keeps_deciding_without_it(
        rendered: Rendered, tmp_path: Path) -> None:
    docs = rendered["gateway+redis"]
    server, client = start_component_redis(docs, tmp_path)
    stack = Stack(tmp_path)
    try:
        # No persistence, and a full Redis refuses writes rather than dropping a lease.
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        assert client.config_get("save") == {"save": ""}
        base = serve_with_the_deployments_store(stack, docs, client)

        def until(name: str, value: float, what: str) -> None:
            deadline = time.monotonic() + 15
            while sample(httpx.get(f"{base}/metrics").text, name) != value:
                assert time.monotonic() < deadline, f"{what}\n{stack.processes[0].output()[-3000:]}"
                time.sleep(0.1)

        # The first heartbeat registers the replica (and the store's gauges appear).
        until("extproc_cluster_replicas", 1, "extproc did not join the component's Redis")
        assert sample(httpx.get(f"{base}/metrics").text, "extproc_store_degraded") == 0
        assert client.keys("*"), "nothing written to the store"

        server.kill()
        server.wait(10)
        until("extproc_store_degraded", 1, "extproc did not notice that Redis is gone")
        ready = httpx.get(f"{base}/readyz")
        assert ready.status_code == 200, "an outage must not empty the endpoints"
        assert "shared store unreachable" in ready.json()["detail"]
    finally:
        stack.stop()
        if server.poll() is None:
            server.kill()
            server.wait(10)


# --- alerts, KEDA queries, dashboards ---------------------------------------------------------


def rule_groups(docs: list[Doc]) -> list[Doc]:
    groups: list[Doc] = one(docs, "PrometheusRule")["spec"]["groups"]
    return groups


def test_alert_rules_pass_promtool(rendered: Rendered, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": rule_groups(rendered["base"])}))
    result = run([tool("promtool"), "check", "rules", str(rules)])
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = {r["alert"] for g in rule_groups(rendered["base"]) for r in g["rules"] if "alert" in r}
    assert {"InferenceQueueWaitP95High", "InferenceRejectionsRising", "InferenceKVCacheSaturated",
            "InferencePendingRequestsGrowing", "InferenceTenantRejectionsHigh", "ExtprocRateLimitIgnored",
            "ExtprocReplicaDrained", "ExtprocLanePaused", "ExtprocPolicyReloadFailing", "ExtprocSignalStale",
            "ExtprocStoreDegraded", "ExtprocCapacitySignalsStale", "ExtprocCapacityScrapeDown",
            "ExtprocCapacityTargetUnreachable", "ExtprocCapacityAtMinimum"} <= alerts


#: Synthetic series (one sample a minute) and the alerts they must raise, no more, no fewer.
ALERT_CASES: dict[str, tuple[dict[str, str], str, list[dict[str, str]]]] = {
    "InferenceQueueWaitP95High": ({
        # interactive: every wait between 5 s and 10 s (p95 ≈ 9.75 s > 5 s); batch: under 1 s.
        'inference_queue_wait_seconds_bucket{lane="interactive",le="5.0"}': "0+0x40",
        'inference_queue_wait_seconds_bucket{lane="interactive",le="10.0"}': "0+10x40",
        'inference_queue_wait_seconds_bucket{lane="interactive",le="+Inf"}': "0+10x40",
        'inference_queue_wait_seconds_bucket{lane="batch",le="1.0"}': "0+10x40",
        'inference_queue_wait_seconds_bucket{lane="batch",le="+Inf"}': "0+10x40",
    }, "20m", [{"lane": "interactive", "severity": "warning"}]),
    "InferenceRejectionsRising": ({
        # batch: 20 of 120 finished decisions rejected, 15 by the edge's tenant budgets; interactive:
        # only draining rejections; lane "*" (edge sheds whose model decides the lane): 30 of every
        # lane's 270 decisions, a share of them all (never of its own, which is always 1).
        'inference_admission_decisions_total{lane="batch",outcome="admitted"}': "0+100x40",
        'inference_admission_decisions_total{lane="batch",outcome="rejected"}': "0+20x40",
        'inference_admission_decisions_total{lane="batch",outcome="queued"}': "0+50x40",
        'inference_admission_rejections_total{lane="batch",reason="queue_full"}': "0+5x40",
        'inference_admission_rejections_total{lane="batch",reason="tenant_request_budget"}': "0+15x40",
        'inference_admission_decisions_total{lane="interactive",outcome="admitted"}': "0+100x40",
        'inference_admission_decisions_total{lane="interactive",outcome="rejected"}': "0+20x40",
        'inference_admission_rejections_total{lane="interactive",reason="draining"}': "0+20x40",
        'inference_admission_decisions_total{lane="*",outcome="rejected"}': "0+30x40",
        'inference_admission_rejections_total{lane="*",reason="tenant_token_budget"}': "0+30x40",
    }, "20m", [{"lane": "batch", "severity": "warning"}, {"lane": "*", "severity": "warning"}]),
    "InferenceTenantRejectionsHigh": ({
        # free: 12 of its 20 requests a minute refused by its budget; acme: 2 of 100; tiny: all of its
        # few; rolling: only draining; every unnamed tenant together: most, but in the lane ratios.
        'extproc_tenant_requests_total{tenant="free"}': "0+20x40",
        'extproc_tenant_rejections_total{tenant="free",reason="tenant_request_budget"}': "0+12x40",
        'extproc_tenant_requests_total{tenant="acme"}': "0+100x40",
        'extproc_tenant_rejections_total{tenant="acme",reason="queue_full"}': "0+2x40",
        'extproc_tenant_requests_total{tenant="tiny"}': "0+0.5x40",
        'extproc_tenant_rejections_total{tenant="tiny",reason="tenant_request_budget"}': "0+0.5x40",
        'extproc_tenant_requests_total{tenant="rolling"}': "0+10x40",
        'extproc_tenant_rejections_total{tenant="rolling",reason="draining"}': "0+10x40",
        'extproc_tenant_requests_total{tenant="(other)"}': "0+50x40",
        'extproc_tenant_rejections_total{tenant="(other)",reason="fair_share"}': "0+40x40",
    }, "25m", [{"tenant": "free", "severity": "warning"}]),
    "InferenceKVCacheSaturated": ({
        'vllm:kv_cache_usage_perc{model_name="llama",pod="a"}': "0.99x40",
        'vllm:kv_cache_usage_perc{model_name="llama",pod="b"}': "0.97x40",
        'vllm:kv_cache_usage_perc{model_name="small",pod="c"}': "0.50x40",
    }, "20m", [{"model_name": "llama", "severity": "warning"}]),
    "InferencePendingRequestsGrowing": ({
        'inference_pending_requests{lane="batch",pod="a"}': "0+2x60",
        'inference_pending_requests{lane="interactive",pod="a"}': "50x60",
    }, "40m", [{"lane": "batch", "severity": "warning"}]),
    "ExtprocDown": ({'up{job="extproc",instance="a"}': "1x10 0x30"}, "30m", [{"severity": "critical"}]),
    "ExtprocUndecidedRequests": ({
        # As many undecided streams as decisions: the body never comes (a filter without
        # allow_mode_override). A few clients leaving before their bodies stay under the share.
        'extproc_stream_errors_total{kind="undecided"}': "0x5 0+10x20",
        'extproc_stream_errors_total{kind="exception"}': "0+1x25",
        'inference_admission_decisions_total{lane="a",outcome="admitted"}': "0+10x25",
    }, "10m", [{"severity": "critical"}]),
    "ExtprocSlotsReclaimed": ({"extproc_slots_reclaimed_total": "0x5 2x20"},
                              "10m", [{"severity": "warning"}]),
    "ExtprocStreamsResetAfterClose": ({
        # Pod a: a proxy without the flag (every stream, 5 a minute); pod b: 3 stray resets (a stop).
        'extproc_stream_resets_after_close_total{namespace="extproc",pod="a"}': "0+5x40",
        'extproc_stream_resets_after_close_total{namespace="extproc",pod="b"}': "0x5 3x35",
    }, "30m", [{"namespace": "extproc", "pod": "a", "severity": "warning"}]),
    "ExtprocOverloaded": ({
        # Pod a refuses 5 requests a minute as overloaded, for half an hour; pod b had one burst.
        'extproc_intake_rejections_total{namespace="extproc",pod="a",reason="overloaded"}': "0+5x40",
        'extproc_intake_rejections_total{namespace="extproc",pod="b",reason="overloaded"}': "0x5 30x35",
        'extproc_intake_rejections_total{namespace="extproc",pod="b",reason="bad_request"}': "0+50x40",
    }, "30m", [{"namespace": "extproc", "pod": "a", "severity": "warning"}]),
    "ExtprocPolicyReloadFailing": ({
        # Pod a has had a bad file for 10 minutes; pod b for 3 (still pending: `for: 5m`);
        # pod c had one for 3 minutes, then a fixed file.
        'extproc_policy_reload_failing{namespace="extproc",pod="a",instance="10.0.0.1:9090"}': "0x5 1x20",
        'extproc_policy_reload_failing{namespace="extproc",pod="b",instance="10.0.0.2:9090"}': "0x12 1x20",
        'extproc_policy_reload_failing{namespace="extproc",pod="c",instance="10.0.0.3:9090"}': "0x5 1x3 0x20",
    }, "15m", [{"namespace": "extproc", "pod": "a", "severity": "warning"}]),
    "ExtprocShadowWouldReject": ({
        # batch: enforcing would reject 20 of 100 admitted; interactive: 1 of 100 (under 5 %).
        'inference_admission_decisions_total{lane="batch",outcome="admitted"}': "0+100x40",
        'extproc_shadow_decisions_total{lane="batch",outcome="rejected",reason="queue_full"}': "0+20x40",
        'extproc_shadow_decisions_total{lane="batch",outcome="queued",reason=""}': "0+50x40",
        'inference_admission_decisions_total{lane="interactive",outcome="admitted"}': "0+100x40",
        'extproc_shadow_decisions_total{lane="interactive",outcome="rejected",reason="queue_full"}': "0+1x40",
    }, "30m", [{"lane": "batch", "severity": "info"}]),
    "ExtprocRateLimitIgnored": ({
        # Pod a's proxies call with another domain, 10 descriptors a minute; pod b saw one stray call.
        'extproc_ratelimit_ignored_total{namespace="extproc",pod="a",kind="unknown_domain"}': "0+10x40",
        'extproc_ratelimit_ignored_total{namespace="extproc",pod="b",kind="unknown_descriptor"}': "0x5 1x35",
    }, "30m", [{"namespace": "extproc", "pod": "a", "kind": "unknown_domain", "severity": "warning"}]),
    "ExtprocReplicaDrained": ({
        # Pod a was drained by hand 25 minutes ago; pod b drained for a minute as it shut down.
        'extproc_draining{namespace="extproc",pod="a"}': "0x5 1x35",
        'extproc_draining{namespace="extproc",pod="b"}': "0x20 1 0x19",
    }, "30m", [{"namespace": "extproc", "pod": "a", "severity": "warning"}]),
    "ExtprocLanePaused": ({
        # Pod a's batch lane paused 45 minutes ago; pod b's for 10 minutes of maintenance, then resumed.
        'extproc_lane_paused{namespace="extproc",pod="a",lane="batch"}': "0x5 1x60",
        'extproc_lane_paused{namespace="extproc",pod="a",lane="interactive"}': "0x65",
        'extproc_lane_paused{namespace="extproc",pod="b",lane="batch"}': "0x5 1x10 0x50",
    }, "50m", [{"namespace": "extproc", "pod": "a", "lane": "batch", "severity": "warning"}]),
    "ExtprocSignalStale": ({
        # Pod a has been blind to kueue_pending for 10 minutes; pod b for 3 (still pending:
        # `for: 5m`); kv_cache is read fine on both.
        'extproc_signal_stale{namespace="extproc",pod="a",signal="kueue_pending"}': "0x5 1x20",
        'extproc_signal_stale{namespace="extproc",pod="b",signal="kueue_pending"}': "0x12 1x20",
        'extproc_signal_stale{namespace="extproc",pod="a",signal="kv_cache"}': "0x25",
        'extproc_signal_stale{namespace="extproc",pod="b",signal="kv_cache"}': "0x25",
    }, "15m", [{"namespace": "extproc", "pod": "a", "signal": "kueue_pending", "severity": "warning"}]),
    "ExtprocStoreDegraded": ({
        # Pod a has been without Redis for 10 minutes; pod b for 1 (still pending: `for: 2m`);
        # pod c lost it for a minute and got it back; pod d never lost it.
        'extproc_store_degraded{namespace="extproc",pod="a"}': "0x5 1x20",
        'extproc_store_degraded{namespace="extproc",pod="b"}': "0x14 1x20",
        'extproc_store_degraded{namespace="extproc",pod="c"}': "0x5 1 0x20",
        'extproc_store_degraded{namespace="extproc",pod="d"}': "0x25",
    }, "15m", [{"namespace": "extproc", "pod": "a", "severity": "warning"}]),
    "ExtprocCapacitySignalsStale": ({
        # Pod a's limit has been blind for 10 minutes; pod b's for 3 (still pending: `for: 5m`).
        'extproc_capacity_signals_stale{namespace="extproc",pod="a"}': "0x5 1x20",
        'extproc_capacity_signals_stale{namespace="extproc",pod="b"}': "0x12 1x20",
    }, "15m", [{"namespace": "extproc", "pod": "a", "severity": "warning"}]),
    "ExtprocCapacityScrapeDown": ({
        # Pod a cannot fetch the engine target its limit reads; it also cannot fetch a Kueue target,
        # but no signal of the limit comes from that source.
        'extproc_scrape_target_up{namespace="extproc",pod="a",source="engines",target="http://e1:8000/metrics"}':
            "1x5 0x20",
        'extproc_scrape_target_up{namespace="extproc",pod="a",source="engines",target="http://e2:8000/metrics"}':
            "1x25",
        'extproc_scrape_target_up{namespace="extproc",pod="a",source="kueue",target="http://k:8080/metrics"}':
            "0x25",
        'extproc_capacity_source{namespace="extproc",pod="a",source="engines"}': "1x25",
    }, "15m", [{"namespace": "extproc", "pod": "a", "source": "engines", "target": "http://e1:8000/metrics",
                "severity": "warning"}]),
    "ExtprocCapacityTargetUnreachable": ({
        # Pod a's TPOT target has been out of reach at the min for 20 minutes; pod b's for 5.
        'extproc_capacity_target_unreachable{namespace="extproc",pod="a"}': "0x5 1x20",
        'extproc_capacity_target_unreachable{namespace="extproc",pod="b"}': "0x20 1x5",
    }, "25m", [{"namespace": "extproc", "pod": "a", "severity": "warning"}]),
    "ExtprocCapacityAtMinimum": ({
        # Pod a's enforced limit sits at its min (4) for 20 minutes; pod b's dips there for 5; pod c only
        # computes one in shadow mode at its min.
        'extproc_capacity_limit{namespace="extproc",pod="a",mode="enforce"}': "32x5 4x20",
        'extproc_capacity_limit_bounds{namespace="extproc",pod="a",bound="min"}': "4x25",
        'extproc_capacity_limit{namespace="extproc",pod="b",mode="enforce"}': "32x10 4x5 16x10",
        'extproc_capacity_limit_bounds{namespace="extproc",pod="b",bound="min"}': "4x25",
        'extproc_capacity_limit{namespace="extproc",pod="c",mode="shadow"}': "4x25",
        'extproc_capacity_limit_bounds{namespace="extproc",pod="c",bound="min"}': "4x25",
    }, "25m", [{"namespace": "extproc", "pod": "a", "severity": "warning"}]),
}


def test_alerts_fire_on_the_situations_they_describe(rendered: Rendered,
                                                     tmp_path: Path) -> None:
    groups = copy.deepcopy(rule_groups(rendered["base"]))
    alerts = {r["alert"] for g in groups for r in g["rules"] if "alert" in r}
    assert alerts == set(ALERT_CASES), "every alert needs a case in ALERT_CASES"
    for group in groups:
        for rule in group["rules"]:
            rule.pop("annotations", None)  # templated text; `promtool check rules` parses it
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    tests = []
    for alert, (series, at, expected) in ALERT_CASES.items():
        tests.append({
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in series.items()],
            "alert_rule_test": [{"eval_time": at, "alertname": alert,
                                 "exp_alerts": [{"exp_labels": labels} for labels in expected]},
                                # Before anything happened: quiet.
                                {"eval_time": "1m", "alertname": alert, "exp_alerts": []}],
        })
    tests.append({  # a healthy system raises nothing
        "interval": "1m",
        "input_series": [
            {"series": 'up{job="extproc",instance="a"}', "values": "1x40"},
            {"series": 'inference_pending_requests{lane="interactive"}', "values": "3 4 3 5 2 3 4 3 2 4x30"},
            {"series": 'inference_admission_decisions_total{lane="interactive",outcome="admitted"}',
             "values": "0+100x40"},
            {"series": 'inference_admission_rejections_total{lane="interactive",reason="queue_full"}',
             "values": "0+1x40"},
            # An edge shed whose lane the model decides, now and then: a small share of all decisions.
            {"series": 'inference_admission_decisions_total{lane="*",outcome="rejected"}',
             "values": "0+1x40"},
            {"series": 'inference_admission_rejections_total{lane="*",reason="queue_full"}',
             "values": "0+1x40"},
            {"series": 'extproc_tenant_requests_total{tenant="acme"}', "values": "0+100x40"},
            {"series": 'extproc_tenant_rejections_total{tenant="acme",reason="queue_full"}',
             "values": "0+1x40"},
            {"series": 'extproc_ratelimit_ignored_total{pod="a",kind="unknown_domain"}', "values": "0x40"},
            {"series": 'extproc_draining{pod="a"}', "values": "0x40"},
            {"series": 'extproc_lane_paused{pod="a",lane="batch"}', "values": "0x40"},
            {"series": 'vllm:kv_cache_usage_perc{model_name="llama"}', "values": "0.7x40"},
            {"series": 'extproc_policy_reload_failing{pod="a"}', "values": "0x40"},
            {"series": 'extproc_signal_stale{pod="a",signal="kueue_pending"}', "values": "0x40"},
            {"series": 'extproc_store_degraded{pod="a"}', "values": "0x40"},
            {"series": 'extproc_capacity_signals_stale{pod="a"}', "values": "0x40"},
            {"series": 'extproc_capacity_target_unreachable{pod="a"}', "values": "0x40"},
            {"series": 'extproc_capacity_limit{pod="a",mode="enforce"}', "values": "24x40"},
            {"series": 'extproc_capacity_limit_bounds{pod="a",bound="min"}', "values": "4x40"},
            {"series": 'extproc_capacity_source{pod="a",source="engines"}', "values": "1x40"},
            {"series": 'extproc_scrape_target_up{pod="a",source="engines",target="e1"}', "values": "1x40"},
        ],
        "alert_rule_test": [{"eval_time": "35m", "alertname": alert, "exp_alerts": []}
                            for alert in sorted(alerts)],
    })
    spec = tmp_path / "alerts_test.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "30s",
                                    "tests": tests}))
    result = run([tool("promtool"), "test", "rules", str(spec)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_alert_has_a_runbook_section_in_the_operator_guide(rendered: Rendered) -> None:
    guide = ROOT / "docs" / "operator-guide.md"
    anchors = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", guide.read_text(), flags=re.M)}
    assert github_anchor("ExtprocDown (critical)") == "extprocdown-critical"
    for group in rule_groups(rendered["base"]):
        for rule in group["rules"]:
            if "alert" in rule:
                page, _, anchor = rule["annotations"]["runbook"].partition("#")
                assert ROOT / page == guide, rule["alert"]
                assert anchor == rule["alert"].lower(), rule["alert"]
                assert anchor in anchors, f"{rule['alert']}: no section '### {rule['alert']}' in {guide.name}"


@pytest.mark.parametrize("name", WIRED)
def test_queue_wait_alerts_name_real_lanes_below_their_deadline(
        rendered: Rendered, name: str, tmp_path: Path) -> None:
    docs = rendered[name]
    _, policy = policy_of(docs, tmp_path)
    [rule] = [r for g in rule_groups(docs) for r in g["rules"]
              if r.get("alert") == "InferenceQueueWaitP95High"]
    thresholds = re.findall(r'lane="([^"]+)"\}\s*>\s*([\d.]+)', rule["expr"])
    assert thresholds
    for lane, threshold in thresholds:
        assert float(threshold) < policy.lane(lane).deadline, f"{lane}: alert at or past its deadline"


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (a small lexer: enough for these rules)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)            # string literals
    text = re.sub(r"\{[^}]*\}", "", text)                        # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)                       # ranges and subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        following = text[match.end():].lstrip()
        if following.startswith("(") or match.group().lower() in PROMQL_WORDS:
            continue  # a function or aggregation, or a keyword
        if match.start() > 0 and (text[match.start() - 1].isdigit() or text[match.start() - 1] == "."):
            continue  # the unit of a number like 0.95 or 1e3
        names.add(match.group())
    return names


def test_metric_name_lexer() -> None:
    expr = ('histogram_quantile(0.95, sum by (lane, le) (rate(inference_queue_wait_seconds_bucket'
            '{lane="a",le=~"1.*"}[5m]))) > 5 or vector(0) and on (lane) vllm:kv_cache_usage_perc '
            '/ ignoring(x) group_left() lane:rec:ratio_5m offset 5m')
    assert metric_names(expr) == {"inference_queue_wait_seconds_bucket", "vllm:kv_cache_usage_perc",
                                  "lane:rec:ratio_5m"}


@pytest.fixture(scope="module")
def scraped(rendered: Rendered, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The /metrics pages of a real extproc and of the simulated vLLM backend, one after the other.

    extproc runs with the Redis component's store settings, against a real Redis started with
    its arguments: the store's metrics (extproc_store_degraded …) exist only with a store.
    """
    workdir = tmp_path_factory.mktemp("k8s-metrics")
    docs = rendered["gateway+redis"]
    server, client = start_component_redis(docs, workdir)
    stack = Stack(workdir)
    try:
        backend = free_port()
        stack.start("backend", [sys.executable, "-m", "extproc", "sim", "backend", "--profile", "test",
                                "--listen", f"127.0.0.1:{backend}"])
        extproc = serve_with_the_deployments_store(stack, docs, client)
        wait_http(f"http://127.0.0.1:{backend}/health", proc=stack.processes[0].popen)
        deadline = time.monotonic() + 15  # the store's gauges appear with the first heartbeat
        while "extproc_store_degraded" not in httpx.get(f"{extproc}/metrics").text:
            assert time.monotonic() < deadline, stack.processes[1].output()[-3000:]
            time.sleep(0.1)
        return httpx.get(f"{extproc}/metrics").text + httpx.get(f"http://127.0.0.1:{backend}/metrics").text
    finally:
        stack.stop()
        server.kill()
        server.wait(10)


@pytest.fixture(scope="module")
def exported(scraped: str) -> set[str]:
    """Every sample name a real extproc (and the simulated vLLM backend) can export.

    Names come from the ``# TYPE`` lines, not from samples: a labelled counter has no sample
    until its first increment (extproc_shadow_decisions_total needs a shadow lane under
    overload), but its family is announced on every scrape from the start.
    """
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                "summary": ["_sum", "_count"]}
    names: set[str] = set()
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", scraped, flags=re.M):
        # The text format names a counter's family with or without _total (client versions differ).
        family = family.removesuffix("_total") if kind == "counter" else family
        names.update(family + suffix for suffix in suffixes.get(kind, [""]))
    return names


def test_every_metric_used_by_alerts_keda_and_dashboards_is_exported(
        rendered: Rendered, exported: set[str], tmp_path: Path) -> None:
    assert {"inference_queue_wait_seconds_bucket", "inference_pending_requests",
            "inference_admission_rejections_total", "vllm:kv_cache_usage_perc",
            "extproc_policy_reload_failing", "extproc_shadow_decisions_total",
            "extproc_signal_stale", "extproc_store_degraded"} <= exported
    groups = rule_groups(rendered["base"])
    recorded = {r["record"] for g in groups for r in g["rules"] if "record" in r}
    queries = {f"rule {r.get('alert') or r.get('record')}": r["expr"] for g in groups for r in g["rules"]}
    for scaled in of_kind(rendered["seed-scenario"], "ScaledObject"):
        for trigger in scaled["spec"]["triggers"]:
            queries[f"KEDA {trigger['name']}"] = trigger["metadata"]["query"]
    dashboard = json.loads((ROOT / "compose" / "grafana" / "dashboards" / "extproc.json").read_text())
    for panel in dashboard["panels"]:
        for i, target in enumerate(panel.get("targets", [])):
            queries[f"dashboard {panel['title']} #{i}"] = target["expr"]
    # Prometheus parses every query (KEDA's and the dashboard's too, as recording rules).
    parse = tmp_path / "queries.yaml"
    parse.write_text(yaml.safe_dump({"groups": [{"name": "parse", "rules": [
        {"record": f"check:query_{i}", "expr": expr} for i, expr in enumerate(queries.values())]}]}))
    result = run([tool("promtool"), "check", "rules", str(parse)])
    assert result.returncode == 0, result.stdout + result.stderr
    synthetic = {"up"}  # set by Prometheus for every target
    missing = {where: sorted(metric_names(expr) - exported - recorded - synthetic)
               for where, expr in queries.items()}
    missing = {where: names for where, names in missing.items() if names}
    assert not missing, f"metrics nothing exports: {missing}"
    assert any(where.startswith("KEDA") for where in queries)


# --- cluster signals of the seed scenario -----------------------------------------------------

#: Kueue's kueue_pending_workloads as kubernetes-sigs/kueue defines it (pkg/metrics/metrics.go,
#: PendingWorkloads): labels cluster_queue and status, whose values are "active" (in the
#: admission queue) and "inadmissible" (set aside after a failed attempt until capacity
#: changes); newer releases add replica_role (leader, follower, standalone), because every
#: replica of an HA install exports it.
KUEUE_METRICS = {"kueue_pending_workloads": {"cluster_queue", "status", "replica_role"}}
KUEUE_STATUSES = {"active", "inadmissible"}
#: Labels the Prometheus Operator gives every series of a ServiceMonitor's targets.
TARGET_LABELS = {"job", "instance", "namespace", "service", "pod", "container", "endpoint"}


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """Every ``metric{label op "value", …}`` of a PromQL expression, with its matchers."""
    found = []
    for match in re.finditer(r'([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{((?:[^{}"]|"(?:[^"\\]|\\.)*")*)\}', expr):
        matcher = r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"'
        found.append((match.group(1), re.findall(matcher, match.group(2))))
    return found


def test_selector_lexer() -> None:
    expr = ('sum(max by (a) (kueue_pending_workloads{cluster_queue="q", status=~"x|y"})) '
            '/ max(vllm:kv_cache_usage_perc{namespace!="a,b}"})')
    assert selectors(expr) == [
        ("kueue_pending_workloads", [("cluster_queue", "=", "q"), ("status", "=~", "x|y")]),
        ("vllm:kv_cache_usage_perc", [("namespace", "!=", "a,b}")]),
    ]


def chosen(matchers: list[tuple[str, str, str]], label: str, universe: set[str]) -> tuple[set[str], set[str]]:
    """Which of ``universe`` the matchers on ``label`` select, and literal values they name
    that are not in it (a typo selects nothing, silently)."""
    selected, unknown = set(universe), set[str]()
    for name, op, value in matchers:
        if name != label:
            continue
        literals = value.split("|") if re.fullmatch(r"[\w.-]+(\|[\w.-]+)*", value) else []
        unknown.update(v for v in literals if v not in universe)
        if op in ("=", "!="):
            selected = {v for v in selected if (v == value) == (op == "=")}
        else:  # PromQL regexes are anchored, like fullmatch
            selected = {v for v in selected if (re.fullmatch(value, v) is not None) == (op == "=~")}
    return selected, unknown


def sample_labels(text: str) -> dict[str, set[str]]:
    """Label names of each sample name on a /metrics page."""
    labels: dict[str, set[str]] = {}
    for name, inside in re.findall(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? \S+", text, flags=re.M):
        labels.setdefault(name, set()).update(re.findall(r'([a-zA-Z_]\w*)="', inside))
    return labels


def seed_policy(rendered: Rendered, tmp_path: Path) -> tuple[list[Doc], Path, Policy]:
    docs = rendered["seed-scenario"]
    path, policy = policy_of(docs, tmp_path)
    return docs, path, policy


def test_seed_signals_query_metrics_labels_and_queues_that_exist(
        rendered: Rendered, exported: set[str], scraped: str, tmp_path: Path) -> None:
    docs, _, policy = seed_policy(rendered, tmp_path)
    queries = {name: signal.query for name, signal in policy.signals.read.items() if signal.query}
    assert queries, "the seed policy reads its signals from Prometheus"
    known = {**{name: labels | TARGET_LABELS for name, labels in sample_labels(scraped).items()},
             **KUEUE_METRICS}
    queues = {q["metadata"]["name"]: q["spec"] for q in of_kind(docs, "ClusterQueue")}
    monitored = {m["metadata"]["namespace"] for m in of_kind(docs, "ServiceMonitor")}
    problems = []
    for signal, query in queries.items():
        missing = metric_names(query) - exported - set(KUEUE_METRICS)
        if missing:
            problems.append(f"{signal}: no extproc, vLLM or Kueue metric is named {sorted(missing)}")
        for metric, matchers in selectors(query):
            for label, _, value in matchers:
                if label not in known.get(metric, set()):
                    problems.append(f"{signal}: {metric} has no label {label!r}")
                if label == "namespace" and metric.startswith("vllm:") and value not in monitored:
                    problems.append(f"{signal}: no ServiceMonitor scrapes namespace {value!r}")
            if metric not in KUEUE_METRICS:
                continue
            selected, unknown = chosen(matchers, "cluster_queue", set(queues))
            if unknown or not selected or selected == set(queues):
                problems.append(f"{signal}: cluster_queue must name ClusterQueues of kueue.yaml "
                                f"(unknown: {sorted(unknown)}, selected: {sorted(selected)})")
            statuses, unknown = chosen(matchers, "status", KUEUE_STATUSES)
            if unknown:
                problems.append(f"{signal}: Kueue has no status {sorted(unknown)}")
            for queue in selected:
                # Under BestEffortFIFO (Kueue's default) a workload that does not fit waits as
                # "inadmissible" after its first attempt: "active" alone reads 0 while pods wait.
                if queues[queue].get("queueingStrategy", "BestEffortFIFO") == "BestEffortFIFO" and \
                        "inadmissible" not in statuses:
                    problems.append(f"{signal}: {queue} is BestEffortFIFO; count status inadmissible too")
    assert not problems, "\n".join(problems)
    # Prometheus parses every query (as recording rules: promtool checks PromQL without a server).
    rules = tmp_path / "signals.yaml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "signals", "rules": [
        {"record": f"check:signal_{i}", "expr": query} for i, query in enumerate(queries.values())]}]}))
    result = run([tool("promtool"), "check", "rules", str(rules)])
    assert result.returncode == 0, result.stdout + result.stderr


#: For each signal of the seed policy: situations as Prometheus would hold them (one sample a
#: minute) and the one number the query must answer then (None: no series, so the signal goes
#: stale and its on_stale applies). extproc needs a scalar or exactly one series.
SEED_SIGNAL_CASES: dict[str, list[tuple[str, dict[str, str], float | None]]] = {
    "kueue_pending": [
        ("an HA Kueue (two replicas export the same counts): 1 pod queued, 2 set aside; batch "
         "Jobs waiting for their own GPUs do not count", {
             'kueue_pending_workloads{cluster_queue="inference-interactive",status="active",'
             'replica_role="leader",pod="kueue-a"}': "1x5",
             'kueue_pending_workloads{cluster_queue="inference-interactive",status="inadmissible",'
             'replica_role="leader",pod="kueue-a"}': "2x5",
             'kueue_pending_workloads{cluster_queue="inference-interactive",status="active",'
             'replica_role="follower",pod="kueue-b"}': "1x5",
             'kueue_pending_workloads{cluster_queue="inference-interactive",status="inadmissible",'
             'replica_role="follower",pod="kueue-b"}': "2x5",
             'kueue_pending_workloads{cluster_queue="inference-batch",status="inadmissible",'
             'replica_role="leader",pod="kueue-a"}': "7x5",
         }, 3.0),
        ("nothing waits", {
            'kueue_pending_workloads{cluster_queue="inference-interactive",status="active"}': "0x5",
            'kueue_pending_workloads{cluster_queue="inference-interactive",status="inadmissible"}': "0x5",
        }, 0.0),
        ("Kueue's metrics are not in Prometheus", {
            'kueue_pending_workloads{cluster_queue="inference-batch",status="active"}': "4x5",
        }, None),
    ],
    "kv_cache": [
        ("the fullest model server counts; another namespace's engines do not", {
            'vllm:kv_cache_usage_perc{namespace="inference",pod="model-server-a",model_name="m"}': "0.5x5",
            'vllm:kv_cache_usage_perc{namespace="inference",pod="model-server-b",model_name="m"}': "0.97x5",
            'vllm:kv_cache_usage_perc{namespace="research",pod="other",model_name="n"}': "0.99x5",
        }, 0.97),
        ("no model server scraped", {}, None),
    ],
}


def test_seed_signals_answer_one_number_in_the_situations_they_describe(
        rendered: Rendered, tmp_path: Path) -> None:
    _, _, policy = seed_policy(rendered, tmp_path)
    assert set(SEED_SIGNAL_CASES) == set(policy.signals.read), "every signal needs a case"
    tests = []
    for name, cases in SEED_SIGNAL_CASES.items():
        query = policy.signals.read[name].query
        assert query is not None
        for _, series, expected in cases:
            tests.append({
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series.items()]
                or [{"series": "unrelated", "values": "1x5"}],
                "promql_expr_test": [{"expr": query, "eval_time": "3m", "exp_samples": [] if expected is None
                                      else [{"labels": "{}", "value": expected}]}],
            })
    (tmp_path / "none.yaml").write_text("groups: []\n")
    spec = tmp_path / "signals_test.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": ["none.yaml"], "evaluation_interval": "1m",
                                    "tests": tests}))
    result = run([tool("promtool"), "test", "rules", str(spec)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # The saturated situations are the ones the rules act on.
    for rule in policy.signals.saturation:
        value = SEED_SIGNAL_CASES[rule.signal][0][2]
        assert value is not None
        assert value > rule.above, f"{rule.name}: its first case does not trigger it"


def test_seed_saturation_rules_tighten_lower_lanes_without_flapping(
        rendered: Rendered, tmp_path: Path) -> None:
    _, path, policy = seed_policy(rendered, tmp_path)
    rules = policy.signals.saturation
    assert {rule.signal for rule in rules} == set(policy.signals.read), "every signal feeds a rule"
    top = max(policy.lanes, key=lambda lane: lane.priority).name
    for rule in rules:
        lanes = {*rule.shed, *rule.shrink}
        assert lanes, f"{rule.name} only reports: a dry run left in the shipped example"
        assert top not in lanes, f"{rule.name} tightens {top}, the lane the scenario protects"
        assert rule.release < rule.above or rule.min_active > 0, f"{rule.name} can flap"
    # The loader refuses a rule on a lane that does not exist, so a reload keeps the old policy.
    doc = yaml.safe_load(path.read_text())
    doc["signals"]["saturation"][0]["shed"] = ["bulk"]
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(doc))
    result = run([sys.executable, "-m", "extproc", "policy", "check", str(broken)])
    assert result.returncode == 1, result.stdout + result.stderr
    assert "signals.saturation[0].shed[0]: unknown lane 'bulk'" in result.stdout + result.stderr


def test_seed_policy_and_keda_ask_the_same_prometheus(rendered: Rendered, tmp_path: Path) -> None:
    docs, _, policy = seed_policy(rendered, tmp_path)
    urls = {s.prometheus.url for s in policy.signals.sources.values() if s.prometheus is not None}
    servers = {t["metadata"]["serverAddress"] for scaled in of_kind(docs, "ScaledObject")
               for t in scaled["spec"]["triggers"] if t["type"] == "prometheus"}
    assert urls
    assert urls == servers

"""Every proxy that runs ext_proc gets the Envoy runtime flag that ends ext_proc streams gracefully.

Without ``envoy.reloadable_features.ext_proc_graceful_grpc_close`` Envoy ends each ext_proc
stream by half-closing it and resetting it at once, and grpc.aio keeps ~120 bytes of every
stream reset that way (grpc/grpc#43360): extproc's memory grows with every request. The filter
reads the flag when its config is built, so it must be in the bootstrap. The source is
envoy/envoy.yaml's static runtime layer; its carriers are envoy/compose.yaml (generated from it),
the two Istio patches for the pods that run ext_proc (the ingress gateway's, the model servers'),
the mesh-wide istiod Helm values and IstioOperator overlay under istio/mesh/, and the seed
scenario's model-server pods. Istio turns a pod's ``proxy.istio.io/config`` ``runtimeValues``
(strings) into the bootstrap's static runtime layer.

Static checks: every carrier holds exactly the source's runtime values, as Istio's API wants
them (a JSON object of strings); rendered the way Istio renders them, they are the source's
layer; each patch applies as the docs say (``kubectl patch --local``, a kustomize patch) and,
being a strategic merge of one annotation, replaces a ``proxy.istio.io/config`` the pods had
(the reason the docs say to merge by hand).

With the real Envoy: each overlay's EnvoyFilter applied to a stand-in bootstrap (as the probe
suite does), its ``layered_runtime`` made from the runtime values parsed out of that overlay's
patch and rendered as Istio renders them, in front of a real extproc. Its admin ``/runtime``
shows the flag, and it ends no ext_proc stream with a reset (the extproc cluster's
``upstream_rq_tx_reset`` stays 0). Two controls show that the stat tells the cases apart and
why /runtime alone does not prove the flag works: without the flag, and with a value spelled
``"True"`` (which Istio passes on as a string: /runtime shows it, Envoy ignores it), Envoy resets
one stream per request.

Left to Istio and untested here: pilot-agent reading the annotation (downward API) or the mesh
config, and writing the bootstrap. ``istio_renders`` mirrors pilot-agent's
``extractRuntimeFlags`` (istio/istio pkg/bootstrap/config.go: ``""`` drops a default,
``"true"``/``"false"`` become booleans, anything else stays a string) and the layer names of
its bootstrap template; Istio's own default runtime flags are left out.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from extproc.localstack import ROOT, Stack, free_port, wait_http
from tests.integration.conftest import UPSTREAM
from tests.integration.test_k8s_manifests import ISTIO, kustomize, run, tool
from tests.integration.test_probes import POLICY, _istio_standin

#: The flag this file is about. Only to check that the source still sets it: every carrier is
#: compared with the source's whole layer, never with this name.
FLAG = "envoy.reloadable_features.ext_proc_graceful_grpc_close"
ENVOY_YAML = ROOT / "envoy" / "envoy.yaml"
COMPOSE_YAML = ROOT / "envoy" / "compose.yaml"
PROXY_CONFIG = "proxy.istio.io/config"
#: The per-pod patches, shipped beside each overlay (not applied by it), by overlay.
PATCHES = {
    "gateway": ISTIO / "overlays" / "gateway" / "ingressgateway-proxy-config.yaml",
    "sidecar": ISTIO / "overlays" / "sidecar" / "model-server-proxy-config.yaml",
}
ISTIOD_VALUES = ISTIO / "mesh" / "istiod-values.yaml"
ISTIO_OPERATOR = ISTIO / "mesh" / "istio-operator.yaml"
SEED = ISTIO / "examples" / "seed-scenario"
#: Where the docs tell users to run `kubectl patch … --patch-file`.
DOCS = [ROOT / "docs" / "operator-guide.md", ISTIO / "README.md",
        ISTIO / "overlays" / "gateway" / "kustomization.yaml",
        ISTIO / "overlays" / "sidecar" / "kustomization.yaml", *PATCHES.values()]
#: Requests sent through each Envoy: every one is one ext_proc stream.
REQUESTS = 10
Doc = dict[str, Any]


def shipped_layer() -> dict[str, Any]:
    """envoy/envoy.yaml's static runtime layer: the one source of the runtime values."""
    config = yaml.safe_load(ENVOY_YAML.read_text())
    layers = config.get("layered_runtime", {}).get("layers", [])
    static = [layer["static_layer"] for layer in layers if "static_layer" in layer]
    assert len(static) == 1, f"{ENVOY_YAML}: expected one static runtime layer, found {len(static)}"
    layer: dict[str, Any] = static[0]
    return layer


def as_runtime_values(layer: dict[str, Any]) -> dict[str, str]:
    """The ProxyConfig ``runtimeValues`` (a map of strings) that Istio renders into ``layer``."""
    out = {}
    for key, value in layer.items():
        if isinstance(value, bool):
            out[key] = "true" if value else "false"
        elif isinstance(value, (int, float, str)):
            out[key] = str(value)
        else:
            raise AssertionError(f"{ENVOY_YAML}: runtime value {key}={value!r} has no string form in Istio")
    return out


def istio_renders(values: dict[str, str]) -> dict[str, Any]:
    """The static runtime layer pilot-agent writes for ``runtimeValues`` (without Istio's defaults)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if value == "":
            continue  # Istio's way to drop one of its defaults
        out[key] = {"true": True, "false": False}.get(value, value)
    return out


def runtime_values_of(annotations: dict[str, str] | None, where: str) -> dict[str, str]:
    """The runtimeValues of a pod template's proxy.istio.io/config annotation, checked as Istio reads it."""
    annotations = annotations or {}
    assert PROXY_CONFIG in annotations, f"{where}: no {PROXY_CONFIG} annotation on the pod template"
    try:
        config = json.loads(annotations[PROXY_CONFIG])
    except json.JSONDecodeError as exc:
        raise AssertionError(f"{where}: {PROXY_CONFIG} is not valid JSON: {exc}") from None
    # The patch replaces any proxy.istio.io/config the pods had: it must set nothing else.
    assert set(config) == {"runtimeValues"}, f"{where}: {PROXY_CONFIG} sets more than runtimeValues"
    values: dict[str, str] = config["runtimeValues"]
    return mesh_values(values, where)


def mesh_values(values: Any, where: str) -> dict[str, str]:
    """A runtimeValues map as Istio's API takes it: strings only (a bare true fails Istio's parse)."""
    assert isinstance(values, dict), f"{where}: runtimeValues is not a map"
    assert values, f"{where}: runtimeValues is empty"
    bad = {k: v for k, v in values.items() if not isinstance(v, str)}
    assert not bad, f"{where}: runtimeValues must be strings (quote them): {bad}"
    return values


def template_annotations(deployment: Doc) -> dict[str, str] | None:
    annotations: dict[str, str] | None = deployment["spec"]["template"]["metadata"].get("annotations")
    return annotations


def load(path: Path) -> Doc:
    doc: Doc = yaml.safe_load(path.read_text())
    return doc


def seed_model_server() -> Doc:
    docs = kustomize(SEED)
    [deployment] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "model-server"]
    return deployment


def patch_values(overlay: str) -> dict[str, str]:
    """The runtimeValues of the overlay's shipped patch, as its pods get them."""
    return runtime_values_of(template_annotations(load(PATCHES[overlay])), f"{overlay} patch")


#: Every Istio carrier: its runtimeValues (a map of strings), read where Istio reads them.
ISTIO_CARRIERS: dict[str, Callable[[], dict[str, str]]] = {
    "gateway-patch": lambda: patch_values("gateway"),
    "sidecar-patch": lambda: patch_values("sidecar"),
    "istiod-values": lambda: mesh_values(
        load(ISTIOD_VALUES)["meshConfig"]["defaultConfig"]["runtimeValues"], str(ISTIOD_VALUES)),
    "istio-operator": lambda: mesh_values(
        load(ISTIO_OPERATOR)["spec"]["meshConfig"]["defaultConfig"]["runtimeValues"], str(ISTIO_OPERATOR)),
    # As kubectl kustomize renders it: on the pod template (a Deployment's own annotations reach no pod).
    "seed-scenario": lambda: runtime_values_of(template_annotations(seed_model_server()),
                                               "seed scenario's model-server pods"),
}


# --- static: one set of runtime values everywhere ---------------------------------------------


def test_the_source_sets_the_flag_as_a_boolean() -> None:
    # A string "true" here would show in Envoy's /runtime and do nothing (the controls below).
    assert shipped_layer().get(FLAG) is True, f"{ENVOY_YAML}: its static runtime layer must set {FLAG}: true"


def test_compose_carries_the_same_runtime_layers() -> None:
    shipped = yaml.safe_load(ENVOY_YAML.read_text())["layered_runtime"]
    assert yaml.safe_load(COMPOSE_YAML.read_text())["layered_runtime"] == shipped


@pytest.mark.parametrize("carrier", list(ISTIO_CARRIERS))
def test_every_istio_carrier_holds_exactly_the_shipped_runtime_values(carrier: str) -> None:
    values = ISTIO_CARRIERS[carrier]()
    assert values == as_runtime_values(shipped_layer()), f"{carrier}: runtimeValues differ from {ENVOY_YAML}"
    # ... and what Envoy gets from them is the local config's layer, booleans included.
    assert istio_renders(values) == shipped_layer()


def test_the_seed_scenarios_annotated_pods_are_the_ones_the_sidecar_envoyfilter_selects() -> None:
    envoyfilter = load(ISTIO / "overlays" / "sidecar" / "envoyfilter.yaml")
    selector = envoyfilter["spec"]["workloadSelector"]["labels"]
    labels = seed_model_server()["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items(), f"model-server pods {labels} not selected by {selector}"


@pytest.mark.parametrize("overlay", list(PATCHES))
def test_each_patch_is_for_pods_in_its_envoyfilters_namespace(overlay: str) -> None:
    patch = load(PATCHES[overlay])
    envoyfilter = load(ISTIO / "overlays" / overlay / "envoyfilter.yaml")
    assert (patch["apiVersion"], patch["kind"]) == ("apps/v1", "Deployment")
    # An EnvoyFilter with a workloadSelector applies to the pods of its own namespace only.
    assert patch["metadata"]["namespace"] == envoyfilter["metadata"]["namespace"]


def _documented_patch_commands() -> list[tuple[Path, str, str, str]]:
    """(file, namespace, deployment, patch file) of every `kubectl -n NS patch deployment NAME
    --patch-file PATH` the docs and comments tell users to run (across a line continuation)."""
    pattern = re.compile(r"kubectl -n (\S+) patch deployment (\S+)\s*\\\s*\n[#\s]*--patch-file (\S+)")
    out = []
    for path in DOCS:
        for match in pattern.finditer(path.read_text()):
            namespace, name, patch = match.groups()
            out.append((path, namespace, name, patch))
    return out


def test_documented_patch_commands_apply_the_shipped_patches_to_the_pods_they_name() -> None:
    commands = _documented_patch_commands()
    named = {patch for _, _, _, patch in commands}
    assert named == {str(p.relative_to(ROOT)) for p in PATCHES.values()}, named
    for path, namespace, name, patch in commands:
        metadata = load(ROOT / patch)["metadata"]
        # The API server refuses a patch whose body names another object than the one patched.
        assert (namespace, name) == (metadata["namespace"], metadata["name"]), f"{path}: {patch}"


def _standin(patch: Doc, annotations: dict[str, str]) -> Doc:
    """A minimal Deployment of the name and namespace the patch is for, with ``annotations``."""
    labels = {"app": patch["metadata"]["name"]}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": dict(patch["metadata"]),
            "spec": {"selector": {"matchLabels": labels}, "template": {
                "metadata": {"labels": labels, "annotations": annotations},
                "spec": {"containers": [{"name": "app", "image": "app"}]}}}}


@pytest.mark.parametrize("overlay", list(PATCHES))
def test_kubectl_patch_sets_the_annotation_and_replaces_one_the_pods_had(
        overlay: str, tmp_path: Path) -> None:
    patch = load(PATCHES[overlay])
    # Pods with an annotation of their own: the reason the docs say to merge by hand.
    mine = {"prometheus.io/port": "15020", PROXY_CONFIG: '{"concurrency": 2}'}
    target = tmp_path / "deployment.yaml"
    target.write_text(yaml.safe_dump(_standin(patch, mine)))
    result = run([tool("kubectl"), "patch", "--local", "-f", str(target),
                  "--patch-file", str(PATCHES[overlay]), "-o", "json"])
    assert result.returncode == 0, result.stderr
    annotations = json.loads(result.stdout)["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "15020"  # other annotations stay
    assert annotations[PROXY_CONFIG] == (template_annotations(patch) or {}).get(PROXY_CONFIG)
    assert "concurrency" not in json.loads(annotations[PROXY_CONFIG])  # theirs is gone: merge by hand


@pytest.mark.parametrize("overlay", list(PATCHES))
def test_a_patch_works_as_a_kustomize_patch(overlay: str, tmp_path: Path) -> None:
    patch = load(PATCHES[overlay])
    standin = _standin(patch, {"prometheus.io/port": "15020"})
    (tmp_path / "deployment.yaml").write_text(yaml.safe_dump(standin))
    shutil.copy(PATCHES[overlay], tmp_path / "patch.yaml")  # kustomize reads patches under its root only
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["deployment.yaml"], "patches": [{"path": "patch.yaml"}]}))
    [deployment] = kustomize(tmp_path)
    assert runtime_values_of(template_annotations(deployment), f"{overlay} via kustomize") == \
        as_runtime_values(shipped_layer())


# --- a real Envoy given the same runtime layer ------------------------------------------------


@dataclass
class Proxy:
    url: str
    admin: str
    extproc_cluster: str

    def runtime(self) -> Doc:
        doc: Doc = httpx.get(f"{self.admin}/runtime", timeout=5).json()
        return doc

    def counter(self, name: str) -> int:
        stats = httpx.get(f"{self.admin}/stats", params={"format": "json", "filter": "upstream_rq_"},
                          timeout=5).json()["stats"]
        full = f"cluster.{self.extproc_cluster}.{name}"
        return next((int(s["value"]) for s in stats if s.get("name") == full), 0)

    def send_requests(self) -> None:
        with httpx.Client(timeout=15) as client:
            for _ in range(REQUESTS):
                response = client.post(f"{self.url}/v1/chat/completions", json={"max_tokens": 5})
                assert response.status_code == 200, (response.status_code, response.text)
        # A graceful close ends after the response, when extproc's status arrives: wait for it.
        deadline = time.monotonic() + 5
        while self.counter("upstream_rq_completed") < REQUESTS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.counter("upstream_rq_completed") >= REQUESTS, "the ext_proc streams did not end"


def _extproc_cluster(overlay: str) -> str:
    text = (ISTIO / "overlays" / overlay / "envoyfilter.yaml").read_text()
    return next(word for word in text.replace('"', " ").split() if word.startswith("outbound|"))


#: name -> (overlay whose EnvoyFilter the stand-in runs, the runtimeValues its pods carry).
PROXIES: dict[str, tuple[str, Callable[[], dict[str, str]]]] = {
    "gateway": ("gateway", lambda: patch_values("gateway")),
    "sidecar": ("sidecar", lambda: patch_values("sidecar")),
    # Controls: no flag; and the flag spelled "True", which Istio passes on as a string.
    "no-flag": ("gateway", dict),
    "spelled-True": ("gateway", lambda: {key: "True" for key in patch_values("gateway")}),
}


@pytest.fixture(scope="module")
def proxies(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proxy]]:
    workdir = tmp_path_factory.mktemp("graceful")
    policy = workdir / "policy.yaml"
    policy.write_text(POLICY)
    stack = Stack(workdir)
    try:
        upstream = free_port()
        stack.start("upstream", [sys.executable, str(UPSTREAM), str(upstream)])
        wait_http(f"http://127.0.0.1:{upstream}/stats", proc=stack.processes[-1].popen)
        grpc, http = free_port(), free_port()
        stack.extproc(policy, grpc, http)
        out = {}
        for name, (overlay, values) in PROXIES.items():
            listen, admin = free_port(), free_port()
            config = _istio_standin(overlay, listen, admin, upstream, grpc)
            # Istio's bootstrap template: its runtime flags in a static layer, then the admin layer.
            config["layered_runtime"] = {"layers": [
                {"name": "global config", "static_layer": istio_renders(values())},
                {"name": "admin", "admin_layer": {}}]}
            stack.envoy(config, name=f"envoy-{name}")
            out[name] = Proxy(f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{admin}",
                              _extproc_cluster(overlay))
        yield out
    finally:
        stack.stop()


@pytest.mark.envoy
@pytest.mark.parametrize("name", ["gateway", "sidecar"])
def test_envoy_with_the_patchs_runtime_shows_the_flag_and_resets_no_ext_proc_stream(
        proxies: dict[str, Proxy], name: str) -> None:
    proxy = proxies[name]
    runtime = proxy.runtime()
    assert runtime["layers"] == ["global config", "admin"]
    for key, value in as_runtime_values(shipped_layer()).items():
        assert runtime["entries"].get(key) == {"final_value": value, "layer_values": [value, ""]}, key
    proxy.send_requests()
    assert proxy.counter("upstream_rq_tx_reset") == 0, "Envoy reset ext_proc streams: the flag is not on"


@pytest.mark.envoy
@pytest.mark.parametrize("name", ["no-flag", "spelled-True"])
def test_without_the_boolean_flag_envoy_resets_every_ext_proc_stream(
        proxies: dict[str, Proxy], name: str) -> None:
    proxy = proxies[name]
    entry = proxy.runtime()["entries"].get(FLAG)
    if name == "spelled-True":
        # What an operator would see: the flag "set" in /runtime, and not in effect.
        assert entry == {"final_value": "True", "layer_values": ["True", ""]}
    else:
        assert entry is None
    proxy.send_requests()
    assert proxy.counter("upstream_rq_tx_reset") == REQUESTS  # one reset, one leak, per request

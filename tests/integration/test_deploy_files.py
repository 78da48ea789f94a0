"""The files users deploy are valid for the real tools, and agree with the code."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from extproc import bootstrap
from extproc.localstack import ROOT, envoy_binary
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


def test_dockerfile_copies_files_that_exist() -> None:
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"


# The Grafana dashboard's queries are checked against a real extproc's /metrics, with the
# alerts' and KEDA's, in test_k8s_manifests.py.

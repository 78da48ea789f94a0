"""The admin and metrics ports against a browser-borne attacker and a stranger, on a real extproc.

DNS rebinding (a page whose name now resolves to 127.0.0.1 sends its own Host), cross-site
POSTs (a foreign Origin, Sec-Fetch-Site: cross-site), a missing token, and what loopback
without a token still allows: any local process may read and act, which is why the admin
port never leaves loopback without a token (extproc refuses to start that way).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from extproc.localstack import Stack, free_port

POLICY = """
lanes: [{name: a, max_inflight: 2, max_queued: 10, deadline: 5s}]
classification: {default_lane: a}
"""


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(tmp_path)
    try:
        yield stack
    finally:
        stack.stop()


def start(stack: Stack, tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[str, str]:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    grpc, http, admin = free_port(), free_port(), free_port()
    stack.extproc(policy, grpc, http, *extra, admin=admin, env=env)
    return f"http://127.0.0.1:{admin}", f"http://127.0.0.1:{http}"


def test_a_foreign_host_reads_nothing_and_does_nothing(serve: Stack, tmp_path: Path) -> None:
    admin, http = start(serve, tmp_path)
    rebound = {"Host": "evil.example:9091"}
    assert httpx.get(admin + "/admin/state", headers=rebound, timeout=5).status_code == 421
    assert httpx.post(admin + "/admin/drain", headers=rebound, timeout=5).status_code == 421
    # The metrics port on loopback refuses it too; its own names still work.
    assert httpx.get(http + "/metrics", headers=rebound, timeout=5).status_code == 421
    port = admin.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost"):
        assert httpx.get(admin + "/admin/state", headers={"Host": host}, timeout=5).status_code == 200, host
    assert httpx.get(admin + "/admin/state", timeout=5).json()["draining"] is False


def test_a_cross_origin_post_is_refused_and_no_cors_header_is_ever_sent(serve: Stack, tmp_path: Path) -> None:
    admin, _ = start(serve, tmp_path)
    for headers in ({"Origin": "https://evil.example"}, {"Origin": "null"},
                    {"Sec-Fetch-Site": "cross-site"}):
        r = httpx.post(admin + "/admin/drain", headers=headers, timeout=5)
        assert r.status_code == 403, headers
        assert not [k for k in r.headers if k.lower().startswith("access-control-")]
    state = httpx.get(admin + "/admin/state", headers={"Origin": "https://evil.example"}, timeout=5)
    assert not [k for k in state.headers if k.lower().startswith("access-control-")]
    assert state.json()["draining"] is False
    # Same origin (a page the admin port itself would serve) and tools that send none are fine.
    port = admin.rsplit(":", 1)[1]
    assert httpx.post(admin + "/admin/drain", headers={"Origin": f"http://127.0.0.1:{port}"},
                      timeout=5).status_code == 200
    assert httpx.post(admin + "/admin/undrain", timeout=5).status_code == 200


def test_loopback_without_a_token_lets_any_local_process_read_and_act(serve: Stack, tmp_path: Path) -> None:
    admin, _ = start(serve, tmp_path)
    assert httpx.get(admin + "/admin/state", timeout=5).status_code == 200
    assert httpx.post(admin + "/admin/drain", timeout=5).json() == {"draining": True}
    assert httpx.post(admin + "/admin/undrain", timeout=5).json() == {"draining": False}


def test_with_a_token_every_admin_call_needs_it_and_metrics_can_need_one_too(
        serve: Stack, tmp_path: Path) -> None:
    metrics_token = tmp_path / "metrics-token"
    metrics_token.write_text("m3tr1cs\n")
    admin, http = start(serve, tmp_path, "--metrics-token-file", str(metrics_token),
                        env={"EXTPROC_ADMIN_TOKEN": "s3cret"})
    assert httpx.get(admin + "/admin/state", timeout=5).status_code == 401
    assert httpx.post(admin + "/admin/drain", timeout=5).status_code == 401
    good = {"Authorization": "Bearer s3cret"}
    assert httpx.get(admin + "/admin/state", headers=good, timeout=5).status_code == 200
    # A cross-origin POST is refused even with the token (a browser would not have it anyway).
    assert httpx.post(admin + "/admin/drain", headers={**good, "Origin": "https://evil.example"},
                      timeout=5).status_code == 403
    assert httpx.get(http + "/metrics", timeout=5).status_code == 401
    metrics = httpx.get(http + "/metrics", headers={"Authorization": "Bearer m3tr1cs"}, timeout=5)
    assert metrics.status_code == 200
    # Probes need no token.
    assert httpx.get(http + "/healthz", timeout=5).status_code == 200
    assert httpx.get(http + "/readyz", timeout=5).status_code == 200

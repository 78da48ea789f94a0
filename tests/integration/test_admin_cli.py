"""`extproc admin` against the real admin gRPC port of `extproc serve` on loopback: every action, the
token and address from flags or the environment, one clear line and a non-zero exit for each failure;
and a drain behind a real Envoy with no retry budget left, which still never says x-should-retry: false."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from extproc.localstack import free_port, stack
from extproc.tools.admin import EXIT_FAILED, EXIT_USAGE, add_arguments, command
from tests.integration.conftest import Env

TOKEN = "s3cret-admin-token"
POLICY = """
lanes:
  - {name: interactive, priority: 10, max_inflight: 4, max_queued: 20, deadline: 20s}
  - {name: batch, max_inflight: 2, max_queued: 10, deadline: 20s}
capacity: {max_hold: 60s}
classification:
  default_lane: interactive
  rules: [{match: {path_prefix: /batch}, lane: batch}]
"""


@dataclass
class Extproc:
    grpc: str
    """The admin gRPC address."""
    ext_proc: str
    """The ext_proc port (gRPC, but not the admin API)."""
    http_admin: str
    policy: Path
    token_file: Path


@pytest.fixture(scope="module")
def extproc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Extproc]:
    workdir = tmp_path_factory.mktemp("admin-cli")
    token_file = workdir / "admin-token"
    token_file.write_text(TOKEN + "\n")
    policy = workdir / "policy.yaml"
    policy.write_text(POLICY)
    ext_proc, admin, admin_grpc = free_port(), free_port(), free_port()
    with stack(workdir) as s:
        s.extproc(policy, ext_proc, free_port(), "--admin-token-file", str(token_file),
                  "--watch-interval", "0", admin=admin, admin_grpc=admin_grpc)
        yield Extproc(f"127.0.0.1:{admin_grpc}", f"127.0.0.1:{ext_proc}", f"127.0.0.1:{admin}", policy,
                      token_file)


@pytest.fixture(autouse=True)
def _no_ambient_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("EXTPROC_ADMIN_GRPC", "EXTPROC_ADMIN_TOKEN", "EXTPROC_ADMIN_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def configured(extproc: Extproc, monkeypatch: pytest.MonkeyPatch) -> Extproc:
    """The address and the token file from the environment, as `extproc serve` reads them."""
    monkeypatch.setenv("EXTPROC_ADMIN_GRPC", extproc.grpc)
    monkeypatch.setenv("EXTPROC_ADMIN_TOKEN_FILE", str(extproc.token_file))
    return extproc


def admin(*argv: str) -> tuple[int, str]:
    """`extproc admin ARGV` in this process: (exit code, stdout)."""
    parser = argparse.ArgumentParser(prog="extproc admin")
    add_arguments(parser)
    out = io.StringIO()
    code = command(parser.parse_args(list(argv)), out=out)
    return code, out.getvalue()


def http_state(extproc: Extproc) -> dict[str, object]:
    """The state as the HTTP admin port serves it: what the gRPC actions did, seen from elsewhere."""
    r = httpx.get(f"http://{extproc.http_admin}/admin/state", headers={"Authorization": f"Bearer {TOKEN}"},
                  timeout=5)
    r.raise_for_status()
    doc: dict[str, object] = r.json()
    return doc


def paused(extproc: Extproc) -> dict[str, bool]:
    lanes = http_state(extproc)["lanes"]
    assert isinstance(lanes, list)
    return {lane["name"]: lane["paused"] for lane in lanes}


def test_state_names_the_replica_its_policy_and_each_lane(configured: Extproc) -> None:
    code, text = admin("state")
    assert code == 0
    lines = text.splitlines()
    assert lines[0].startswith(f"{configured.grpc}: admitting; policy {configured.policy} @")
    assert lines[0].endswith("(0 reloads ok, 0 failed)")
    assert lines[1:] == ["lane interactive  0/4 in flight, 0/20 queued",
                         "lane batch        0/2 in flight, 0/10 queued"]
    code, text = admin("state", "--json")
    assert code == 0
    doc = json.loads(text)
    assert [lane["name"] for lane in doc["lanes"]] == ["interactive", "batch"]
    assert doc["policy"]["sha256"] == http_state(configured)["policy"]["sha256"]  # type: ignore[index]


def test_drain_and_undrain(configured: Extproc) -> None:
    try:
        code, text = admin("drain")
        assert (code, text) == (0, f"{configured.grpc}: draining: admits nothing; queued requests get 503, "
                                    "running ones finish\n")
        assert http_state(configured)["draining"] is True
        assert admin("state")[1].startswith(f"{configured.grpc}: DRAINING (admits nothing); policy ")
        code, text = admin("undrain", "--json")
        assert (code, json.loads(text)) == (0, {"draining": False})
        assert http_state(configured)["draining"] is False
    finally:
        admin("undrain")


def test_pause_and_resume_a_lane(configured: Extproc) -> None:
    try:
        assert admin("pause", "batch") == (0, f"{configured.grpc}: lane batch paused\n")
        assert paused(configured) == {"interactive": False, "batch": True}
        assert "lane batch        0/2 in flight, 0/10 queued, paused" in admin("state")[1].splitlines()
        assert admin("resume", "batch") == (0, f"{configured.grpc}: lane batch resumed\n")
        assert paused(configured) == {"interactive": False, "batch": False}
    finally:
        admin("resume", "batch")


def test_an_unknown_lane_is_one_line_and_exit_1(configured: Extproc,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert admin("pause", "nope") == (EXIT_FAILED, "")
    assert capsys.readouterr().err == ("extproc admin: unknown lane 'nope', expected one of "
                                       "['batch', 'interactive']\n")
    assert paused(configured) == {"interactive": False, "batch": False}


def test_reload_reads_the_file_and_a_bad_one_keeps_the_policy(configured: Extproc,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    before = http_state(configured)["policy"]["sha256"]  # type: ignore[index]
    code, text = admin("reload")
    assert (code, text) == (0, f"{configured.grpc}: policy unchanged @{before[:8]}\n")
    try:
        configured.policy.write_text(POLICY.replace("max_inflight: 2", "max_inflight: zero"))
        code, text = admin("reload")
        assert (code, text) == (EXIT_FAILED, "")
        err = capsys.readouterr().err.splitlines()
        assert err[0] == (f"extproc admin: {configured.grpc} refused the policy file; the policy in force "
                          "is kept:")
        assert len(err) == 2
        assert "lanes[1].max_inflight" in err[1]
        assert "! the policy file is invalid, the policy in force is kept: " in admin("state")[1]
        configured.policy.write_text(POLICY.replace("max_inflight: 2", "max_inflight: 3"))
        code, text = admin("reload")
        after = http_state(configured)["policy"]["sha256"]  # type: ignore[index]
        assert after != before
        assert (code, text) == (0, f"{configured.grpc}: policy reloaded @{after[:8]}\n")
        assert "lane batch        0/3 in flight, 0/10 queued" in admin("state")[1].splitlines()
    finally:
        configured.policy.write_text(POLICY)
        admin("reload")


def test_flags_may_stand_before_or_after_the_action(extproc: Extproc) -> None:
    # Nothing from the environment: the flags alone, in either place.
    token = ("--token-file", str(extproc.token_file))
    assert admin("--grpc", extproc.grpc, *token, "state")[0] == 0
    assert admin("state", "--grpc", extproc.grpc, *token)[0] == 0
    assert admin("--grpc", "127.0.0.1:1", "state", "--grpc", extproc.grpc, "--token", TOKEN)[0] == 0


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_a_missing_or_wrong_token_is_one_line_and_exit_1(extproc: Extproc, token: str | None,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    flags = ("--token", token) if token else ()
    assert admin("drain", "--grpc", extproc.grpc, *flags) == (EXIT_FAILED, "")
    why = "token rejected" if token else "token required (EXTPROC_ADMIN_TOKEN, --token-file or --token)"
    assert capsys.readouterr().err == f"extproc admin: UNAUTHENTICATED: {why}\n"
    assert http_state(extproc)["draining"] is False  # the refused drain did nothing


def test_nothing_listening_is_connection_refused(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    assert admin("state", "--grpc", f"127.0.0.1:{port}") == (EXIT_FAILED, "")
    assert capsys.readouterr().err == f"extproc admin: cannot reach 127.0.0.1:{port}: connection refused\n"


def test_a_port_without_the_admin_api_says_so(extproc: Extproc, capsys: pytest.CaptureFixture[str]) -> None:
    assert admin("drain", "--grpc", extproc.ext_proc, "--token", TOKEN) == (EXIT_FAILED, "")
    assert capsys.readouterr().err == (f"extproc admin: UNIMPLEMENTED: {extproc.ext_proc} does not serve the "
                                       "extproc admin API (not its admin gRPC port?)\n")


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    assert admin("state", "--grpc", "localhost") == (EXIT_USAGE, "")
    assert capsys.readouterr().err == ("extproc admin: expected HOST:PORT, got 'localhost' (--grpc, or env "
                                       "EXTPROC_ADMIN_GRPC)\n")
    monkeypatch.setenv("EXTPROC_ADMIN_GRPC", "off")
    assert admin("state") == (EXIT_USAGE, "")
    assert "got 'off' (--grpc, or env EXTPROC_ADMIN_GRPC)" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert admin("state", "--token-file", str(empty)) == (EXIT_USAGE, "")
    assert capsys.readouterr().err == (f"extproc admin: cannot read the admin token: the token file {empty} "
                                       "is empty\n")


def test_the_installed_command_line_prints_no_traceback(extproc: Extproc) -> None:
    run = [sys.executable, "-m", "extproc", "admin"]
    bare = {"PATH": "/usr/bin:/bin"}  # no token, no address from this environment
    ok = subprocess.run([*run, "state", "--grpc", extproc.grpc], capture_output=True, text=True, timeout=30,
                        env={**bare, "EXTPROC_ADMIN_TOKEN": TOKEN})
    assert (ok.returncode, ok.stderr) == (0, "")
    assert ok.stdout.startswith(f"{extproc.grpc}: admitting; policy ")
    for argv, code, why in (
            ([*run, "pause", "nope", "--grpc", extproc.grpc, "--token", TOKEN], EXIT_FAILED, "unknown lane"),
            ([*run, "drain", "--grpc", extproc.grpc], EXIT_FAILED, "UNAUTHENTICATED: token required"),
            ([*run, "drain", "--grpc", f"127.0.0.1:{free_port()}"], EXIT_FAILED, "connection refused"),
            ([*run, "drain", "--grpc", "nowhere"], EXIT_USAGE, "expected HOST:PORT")):
        failed = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=bare)
        assert (failed.returncode, failed.stdout) == (code, ""), failed.stderr
        (line,) = failed.stderr.splitlines()  # one line, no traceback
        assert line.startswith("extproc admin: ")
        assert why in line
    usage = subprocess.run([*run, "pause"], capture_output=True, text=True, timeout=30, env=bare)
    assert usage.returncode == EXIT_USAGE
    assert usage.stderr.splitlines()[-1] == (
        "extproc admin pause: error: the following arguments are required: LANE")


# --- a drain behind a real Envoy, the retry budget spent ------------------------------------------

TIGHT = """
lanes:
  - {name: a, max_inflight: 1, max_queued: 5, deadline: 20s}
capacity: {max_hold: 60s}
classification: {default_lane: a}
retry_budget: {ratio: 0, min_per_second: 0}
"""


def post(env: Env, retry: int = 0, delay_ms: int = 0) -> httpx.Response:
    return httpx.post(env.url + "/v1/x", json={"max_tokens": 5},
                      headers={"x-stainless-retry-count": str(retry), "x-test-delay-ms": str(delay_ms)},
                      timeout=30)


def wait_for(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.envoy
def test_a_drain_never_says_do_not_retry_though_the_retry_budget_is_spent(
        make_env: Callable[..., Env]) -> None:
    env = make_env(TIGHT)
    # Before: no budget at all, so a retry is refused and told not to come back.
    refused = post(env, retry=1)
    assert (refused.status_code, refused.headers["x-extproc-reason"]) == (429, "retry_budget")
    assert refused.headers["x-should-retry"] == "false"
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(post, env, 0, 1500)
        wait_for(lambda: env.metric("inference_inflight_requests", lane="a") == 1, "one running")
        queued = pool.submit(post, env)
        wait_for(lambda: env.metric("inference_pending_requests", lane="a") == 1, "one queued")
        assert admin("drain", "--grpc", env.admin_grpc)[0] == 0
        drained = [queued.result(), post(env), post(env, retry=1)]
        assert running.result().status_code == 200  # running requests finish
    for r in drained:  # the queued one, a new one, a retry: another replica will take each
        assert (r.status_code, r.headers["x-extproc-reason"]) == (503, "draining")
        assert "x-should-retry" not in r.headers
        assert int(r.headers["retry-after"]) >= 1

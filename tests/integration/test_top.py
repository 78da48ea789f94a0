"""`extproc top` against real servers on loopback: a JSON state server, and `extproc serve` over its HTTP and
gRPC admin ports; one frame, the state document, and the live view driven through a pseudo-terminal and
through tmux."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import io
import json
import os
import re
import select
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from extproc.api.admin.v1 import admin_pb2 as pb
from extproc.api.document import from_document, to_document
from extproc.localstack import free_port, stack
from extproc.tools.top import EXIT_FETCH, EXIT_USAGE, add_arguments, command

ROOT = Path(__file__).resolve().parents[2]
NOW = 1764680000.0
TOKEN = "s3cret-admin-token"
LANES = ("interactive", "batch", "best-effort")


def document(batch_inflight: int = 4) -> dict[str, Any]:
    """The JSON an admin port serves (every field present, unset ones null), and a key from the future."""
    return {
        "version": 1, "time": NOW, "uptime_s": 3725.0, "draining": False, "shadow": False,
        "policy": {"file": "examples/policy.yaml", "sha256": "0123456789abcdef", "loaded_at": NOW - 60,
                   "reloads_ok": 1, "reloads_failed": 0, "last_error": [], "stale_since": None},
        "capacity": {"limit": 16, "inflight": 6 + batch_inflight, "queued": 7},
        "window_s": 60,
        "lanes": [
            {"name": "interactive", "priority": 100, "inflight": 6, "limit": 8, "effective_limit": 8,
             "borrowed": 0, "queued": 0, "max_queued": 100, "paused": False, "closed": False, "shadow": False,
             "retired": False, "shed": None, "wait_p50_s": 0.004, "wait_p95_s": 0.25, "admit_per_s": 20.5,
             "reject_per_s": 0.0, "shadow_reject_per_s": 0.0, "rejections": {}},
            {"name": "batch", "priority": 10, "inflight": batch_inflight, "limit": 8, "effective_limit": 4,
             "borrowed": 0, "queued": 7, "max_queued": 50, "paused": False, "closed": False, "shadow": False,
             "retired": False, "shed": None, "wait_p50_s": 2.5, "wait_p95_s": 31.0, "admit_per_s": 1.5,
             "reject_per_s": 0.25, "shadow_reject_per_s": 0.0, "rejections": {"queue_full": 15}},
            {"name": "best-effort", "priority": 0, "inflight": 0, "limit": 2, "effective_limit": 2,
             "borrowed": 0, "queued": 0, "max_queued": 10, "paused": False, "closed": False, "shadow": False,
             "retired": False, "shed": "kueue-backlog", "wait_p50_s": None, "wait_p95_s": None,
             "admit_per_s": 0.0, "reject_per_s": 3.0, "shadow_reject_per_s": 0.0, "rejections": {"shed": 90}},
        ],
        "signals": [{"name": "kueue_pending", "source": "prometheus", "kind": "gauge", "value": 12.0,
                     "age_s": 1.5, "stale": False, "error": None}],
        "saturation": [{"rule": "kueue-backlog", "signal": "kueue_pending", "active": True, "since": NOW - 30,
                        "value": None, "stale": False, "error": None, "shed": ["best-effort"],
                        "shrink": {"batch": 0.5}}],
        "tenants": [{"name": "acme", "weight": 2.0, "queued": 7, "queued_by_lane": {"batch": 7}}],
        "a_future_key": {"ignored": True},
    }


class StateServer:
    """An admin port serving a state document on loopback, in a thread with its own event loop."""

    def __init__(self, *, token: str | None = None, port: int = 0) -> None:
        self.token = token
        self.port = port
        self.state: dict[str, Any] = document()
        #: "ok", or how to misbehave: "500", "html", "list", "slow", "mistyped".
        self.mode = "ok"
        self.requests = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="state-server", daemon=True)
        self.runner: web.AppRunner | None = None

    async def _state(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"error": "unauthorized"}, status=401)
        if self.mode == "500":
            return web.Response(status=500, text="state unavailable: store is gone\n")
        if self.mode == "html":
            return web.Response(text="<html>a login page</html>", content_type="text/html")
        if self.mode == "list":
            return web.json_response([1, 2, 3])
        if self.mode == "mistyped":
            return web.json_response({**self.state, "capacity": {"limit": "sixteen"}})
        if self.mode == "slow":
            await asyncio.sleep(2)
        return web.json_response(self.state)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/admin/state", self._state)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        self.port = self.runner.addresses[0][1]

    def start(self) -> StateServer:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)
        return self

    def stop(self) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
def server() -> Iterator[StateServer]:
    s = StateServer().start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def guarded() -> Iterator[StateServer]:
    s = StateServer(token=TOKEN).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(autouse=True)
def _no_ambient_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("EXTPROC_ADMIN", "EXTPROC_ADMIN_TOKEN", "EXTPROC_ADMIN_TOKEN_FILE", "NO_COLOR", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


def run_top(*argv: str, out: io.TextIOBase | None = None) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="extproc top")
    add_arguments(parser)
    buffer = out if out is not None else io.StringIO()
    code = command(parser.parse_args(list(argv)), out=buffer)  # type: ignore[arg-type]
    if isinstance(buffer, io.StringIO):
        return code, buffer.getvalue()
    return code, ""


# --- one frame, the state document ----------------------------------------------------------------


def test_once_prints_one_whole_frame(server: StateServer, capsys: pytest.CaptureFixture[str]) -> None:
    code, text = run_top("--http", server.address, "--once", "--width", "80")
    assert code == 0
    assert capsys.readouterr().err == ""
    lines = text.rstrip("\n").split("\n")
    assert all(len(line) <= 80 for line in lines)
    assert "\x1b" not in text  # not a terminal: plain text
    assert lines[0].startswith(f"extproc top  {server.address}  up 1h02m")
    assert "policy examples/policy.yaml @01234567  reloads 1 ok, 0 failed  loaded 1m00s ago" in text
    assert re.search(r"^interactive +█+·+ +6/8 +·+ +0/100 +4\.0ms/250ms +20\.5 +0", text, re.MULTILINE)
    # No room for the status words beside the numbers: each lane's go whole on a line under its row,
    # rather than wrap in a column or push the line past 80 columns.
    assert re.search(r"^batch +█+ +4/4 +█+·+ +7/50 +2\.50s/31\.0s +1\.5 +0\.25\n  LIMIT 8→4$", text,
                     re.MULTILINE)
    assert re.search(r"^best-effort .*–/– +0 +3\.0\n  SHED kueue-backlog$", text, re.MULTILINE)
    assert "kueue-backlog  ACTIVE 30.0s  kueue_pending  shed best-effort  shrink batch×0.5" in text
    assert re.search(r"^  acme +weight 2  queued 7  batch 7$", text, re.MULTILINE)
    # --once is for scripts: nothing is cut to a screen's height.
    assert "more line" not in text
    assert server.requests == 1


def test_once_in_ascii_for_a_terminal_that_cannot_show_unicode(server: StateServer) -> None:
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="ascii")
    code, _ = run_top("--http", server.address, "--once", "--width", "100", out=out)
    out.flush()
    text = raw.getvalue().decode("ascii")
    assert code == 0
    assert re.search(r"^batch +#+ +4/4 ", text, re.MULTILINE)
    assert "LIMIT 8->4" in text


def test_json_prints_the_state_document(server: StateServer) -> None:
    code, text = run_top("--http", f"http://{server.address}", "--json")
    assert code == 0
    printed = json.loads(text)
    assert printed == to_document(from_document(server.state, pb.State))
    assert printed["lanes"][2]["shed"] == "kueue-backlog"
    assert "a_future_key" not in printed  # what this top does not know, it does not pass on


def test_a_token_is_sent_as_a_bearer_header(guarded: StateServer, monkeypatch: pytest.MonkeyPatch) -> None:
    code, text = run_top("--http", guarded.address, "--once", "--token", TOKEN)
    assert code == 0
    assert "interactive" in text
    monkeypatch.setenv("EXTPROC_ADMIN_TOKEN", TOKEN + "\n")  # as $(cat token-file) would leave it
    code, text = run_top("--http", guarded.address, "--json")
    assert code == 0
    assert json.loads(text)["version"] == 1


def test_a_token_file_and_the_admin_address_come_from_the_environment_too(
        guarded: StateServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    code, text = run_top("--http", guarded.address, "--once", "--token-file", str(token_file))
    assert code == 0
    assert "interactive" in text
    monkeypatch.setenv("EXTPROC_ADMIN", guarded.address)
    monkeypatch.setenv("EXTPROC_ADMIN_TOKEN_FILE", str(token_file))
    code, text = run_top("--json")
    assert code == 0
    assert json.loads(text)["lanes"][0]["name"] == "interactive"


def test_an_unreadable_or_empty_token_file_is_a_usage_error(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    code, _ = run_top("--http", "127.0.0.1:1", "--once", "--token-file", str(empty))
    assert code == EXIT_USAGE
    assert capsys.readouterr().err == (f"extproc top: cannot read the admin token: the token file {empty} "
                                       "is empty\n")
    code, _ = run_top("--grpc", "127.0.0.1:1", "--once", "--token-file", str(tmp_path / "missing"))
    assert code == EXIT_USAGE
    assert "cannot read the admin token: [Errno 2] No such file or directory" in capsys.readouterr().err


def test_without_a_token_the_error_says_one_is_needed(guarded: StateServer,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, text = run_top("--http", guarded.address, "--once")
    assert (code, text) == (EXIT_FETCH, "")
    assert capsys.readouterr().err == ("extproc top: 401: token required (EXTPROC_ADMIN_TOKEN, --token-file "
                                       "or --token)\n")


def test_a_wrong_token_is_reported_as_rejected_and_not_echoed(guarded: StateServer,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = run_top("--http", guarded.address, "--json", "--token", "wrong-token")
    assert code == EXIT_FETCH
    assert capsys.readouterr().err == "extproc top: 401: token rejected\n"


def test_nothing_listening_is_connection_refused(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    code, text = run_top("--http", f"127.0.0.1:{port}", "--once")
    assert (code, text) == (EXIT_FETCH, "")
    assert capsys.readouterr().err == f"extproc top: cannot reach 127.0.0.1:{port}: connection refused\n"


@pytest.mark.parametrize(("mode", "message"), [
    ("500", "500: state unavailable: store is gone"),
    ("html", "did not answer with a JSON object: not a state document"),
    ("list", "did not answer with a JSON object: not a state document"),
    ("mistyped", "sent a state this top cannot read: "),
    ("slow", "did not answer within 200ms"),
])
def test_a_server_that_misbehaves_is_reported(server: StateServer, capsys: pytest.CaptureFixture[str],
                                              mode: str, message: str) -> None:
    server.mode = mode
    code, text = run_top("--http", server.address, "--once", "--timeout", "0.2")
    assert (code, text) == (EXIT_FETCH, "")
    err = capsys.readouterr().err
    assert err.startswith(f"extproc top: {server.address} " if mode in ("html", "list", "mistyped", "slow")
                          else "extproc top: ")
    assert message in err
    if mode == "mistyped":
        assert "limit" in err


def test_a_port_without_the_endpoint_is_a_404_that_says_so(server: StateServer,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = run_top("--http", f"http://{server.address}/elsewhere", "--once")
    assert code == EXIT_FETCH
    assert capsys.readouterr().err == (f"extproc top: 404: {server.address} has no /elsewhere (not extproc's "
                                       "admin port, or an extproc without it)\n")


@pytest.mark.parametrize("flag", ["--http", "--grpc"])
def test_an_unparseable_address_is_a_usage_error(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = run_top(flag, "localhost", "--once")
    assert code == EXIT_USAGE
    assert "expected HOST:PORT" in capsys.readouterr().err


def test_bad_numbers_and_flag_clashes_are_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--interval", "0"], ["--interval", "soon"], ["--timeout", "nan"], ["--width", "5"],
                 ["--token", "a", "--token-file", "b"], ["--once", "--json"],
                 ["--http", "127.0.0.1:1", "--grpc", "127.0.0.1:2"]):
        with pytest.raises(SystemExit) as exc:
            run_top("--once", *argv)
        assert exc.value.code == EXIT_USAGE
        assert re.search(r"expected|not allowed with", capsys.readouterr().err)


def test_the_live_view_needs_a_terminal(server: StateServer, capsys: pytest.CaptureFixture[str]) -> None:
    code, text = run_top("--http", server.address)
    assert (code, text) == (EXIT_USAGE, "")
    assert "use --once or --json" in capsys.readouterr().err
    assert server.requests == 0


def test_grpc_nothing_listening_is_connection_refused(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    code, text = run_top("--grpc", f"127.0.0.1:{port}", "--json", "--timeout", "2")
    assert (code, text) == (EXIT_FETCH, "")
    assert capsys.readouterr().err == f"extproc top: cannot reach 127.0.0.1:{port}: connection refused\n"


# --- against the real admin ports of `extproc serve` --------------------------------------------


class Extproc:
    """A real extproc with the example policy and a token on both admin ports."""

    def __init__(self, http: str, grpc: str) -> None:
        self.http, self.grpc = http, grpc

    def post(self, path: str) -> None:
        httpx.post(f"http://{self.http}{path}", headers={"Authorization": f"Bearer {TOKEN}"},
                   timeout=5).raise_for_status()


@pytest.fixture(scope="module")
def extproc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Extproc]:
    workdir = tmp_path_factory.mktemp("extproc")
    token_file = workdir / "admin-token"
    token_file.write_text(TOKEN + "\n")
    admin, admin_grpc = free_port(), free_port()
    with stack(workdir) as s:
        s.extproc(ROOT / "examples" / "policy.yaml", free_port(), free_port(), "--admin-token-file",
                  str(token_file), admin=admin, admin_grpc=admin_grpc)
        yield Extproc(f"127.0.0.1:{admin}", f"127.0.0.1:{admin_grpc}")


@pytest.mark.parametrize("flag", ["--http", "--grpc"])
def test_the_real_admin_ports_require_the_token(extproc: Extproc, flag: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    address = extproc.http if flag == "--http" else extproc.grpc
    code, _ = run_top(flag, address, "--once")
    assert code == EXIT_FETCH
    assert capsys.readouterr().err == (
        "extproc top: " + ("401" if flag == "--http" else "UNAUTHENTICATED")
        + ": token required (EXTPROC_ADMIN_TOKEN, --token-file or --token)\n")
    code, _ = run_top(flag, address, "--json", "--token", "wrong-token")
    assert code == EXIT_FETCH
    assert "token rejected" in capsys.readouterr().err


def test_grpc_reads_the_same_state_as_http(extproc: Extproc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXTPROC_ADMIN_TOKEN", TOKEN)
    code, over_http = run_top("--http", extproc.http, "--json")
    assert code == 0
    code, over_grpc = run_top("--grpc", extproc.grpc, "--json")
    assert code == 0
    by_http, by_grpc = json.loads(over_http), json.loads(over_grpc)
    names = [lane["name"] for lane in by_grpc["lanes"]]
    assert set(names) >= set(LANES)
    assert names == [lane["name"] for lane in by_http["lanes"]]
    assert by_grpc["version"] == 1
    assert by_grpc["policy"]["sha256"] == by_http["policy"]["sha256"]

    code, text = run_top("--grpc", extproc.grpc, "--once", "--width", "80")
    assert code == 0
    lines = text.rstrip("\n").split("\n")
    assert lines[0].startswith(f"extproc top  {extproc.grpc}  up ")
    for name in names:
        assert any(line.startswith(name + " ") for line in lines), name


def test_the_real_admin_ports_render_operator_actions(extproc: Extproc,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXTPROC_ADMIN_TOKEN", TOKEN)
    extproc.post("/admin/drain")
    extproc.post("/admin/lanes/batch/pause")
    try:
        for flag, address in (("--http", extproc.http), ("--grpc", extproc.grpc)):
            code, text = run_top(flag, address, "--once", "--width", "80")
            assert code == 0
            lines = text.rstrip("\n").split("\n")
            assert all(len(line) <= 80 for line in lines)
            assert lines[0].startswith(f"extproc top  {address}  up ")
            assert lines[0].endswith("DRAINING")
            assert re.search(r"^policy \S*policy\.yaml @[0-9a-f]{8}  reloads 0 ok, 0 failed  loaded ",
                             lines[1])
            assert not any(line.startswith("!") for line in lines)
            batch = next(n for n, line in enumerate(lines) if line.startswith("batch "))
            # Beside its numbers, or on the line under them: whichever fits 80 columns.
            assert lines[batch].endswith("  PAUSED") or lines[batch + 1] == "  PAUSED"
            assert re.search(r"^interactive .* 0/\d+ .* –/– +0 +0$", text, re.MULTILINE)
    finally:
        extproc.post("/admin/undrain")
        extproc.post("/admin/lanes/batch/resume")


# --- the live view in a pseudo-terminal -----------------------------------------------------------

SGR = re.compile(rb"\x1b\[[0-9;]*m")
ALT_ON, ALT_OFF, HOME = b"\x1b[?1049h", b"\x1b[?1049l", b"\x1b[H"


class Terminal:
    """`python -m extproc.tools.top` on a pseudo-terminal of a given size; the test reads what it draws."""

    def __init__(self, *args: str, cols: int = 80, rows: int = 24, colour: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.cols, self.rows = cols, rows
        self.master, self.slave = os.openpty()
        self.resize(cols, rows)
        self.modes = termios.tcgetattr(self.slave)
        environ = {k: v for k, v in os.environ.items()
                   if k not in ("NO_COLOR", "EXTPROC_ADMIN_TOKEN", "COLUMNS", "LINES")}
        environ.update(TERM="xterm-256color", LANG="C.UTF-8", PYTHONUNBUFFERED="1", **(env or {}))
        if not colour:
            environ["NO_COLOR"] = "1"
        self.proc = subprocess.Popen([sys.executable, "-m", "extproc.tools.top", *args], cwd=ROOT,
                                     env=environ, stdin=self.slave, stdout=self.slave, stderr=self.slave,
                                     start_new_session=True)
        self.output = bytearray()

    def resize(self, cols: int, rows: int) -> None:
        self.cols, self.rows = cols, rows
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def pump(self, wait: float) -> None:
        ready, _, _ = select.select([self.master], [], [], wait)
        if ready:
            self.output += os.read(self.master, 65536)

    def frame(self) -> list[str]:
        """The last complete frame drawn at the current size: its lines, colour codes removed."""
        for chunk in reversed(bytes(self.output).split(HOME)[1:]):
            text = SGR.sub(b"", chunk).decode("utf-8", "replace")
            # The terminal's own output processing turns the frame's \n into \r\n.
            lines = [line.rstrip("\r") for line in text.split("\n")]
            if len(lines) >= self.rows and len(lines[self.rows - 1]) >= self.cols:
                return lines[: self.rows]
        return []

    def wait_for(self, check: Callable[[list[str]], bool], timeout: float = 15.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            frame = self.frame()
            if frame and check(frame):
                return frame
            self.pump(0.05)
        raise AssertionError(f"no such frame within {timeout}s; last:\n" + "\n".join(self.frame()))

    def send(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def exit_code(self, timeout: float = 10.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.pump(0.05)
        self.pump(0)
        return self.proc.wait(timeout=1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)
        os.close(self.master)
        os.close(self.slave)


@pytest.fixture
def terminal() -> Iterator[Callable[..., Terminal]]:
    opened: list[Terminal] = []

    def open_terminal(*args: str, **kwargs: Any) -> Terminal:
        t = Terminal(*args, **kwargs)
        opened.append(t)
        return t

    yield open_terminal
    for t in opened:
        t.close()


def has(*words: str) -> Callable[[list[str]], bool]:
    return lambda frame: all(any(w in line for line in frame) for w in words)


def assert_restored(t: Terminal) -> None:
    """The alternate screen was left, the cursor shown, and the line discipline put back."""
    tail = bytes(t.output[t.output.rfind(ALT_ON):])
    assert tail.endswith(b"\x1b[?25h" + ALT_OFF), tail[-80:]
    assert termios.tcgetattr(t.slave) == t.modes


def test_live_view_draws_full_frames_refreshes_and_quits_on_q(server: StateServer,
                                                              terminal: Callable[..., Terminal]) -> None:
    t = terminal("--http", server.address, "--interval", "0.2")
    frame = t.wait_for(has(*LANES, "kueue-backlog  ACTIVE"))
    assert bytes(t.output).startswith(ALT_ON)
    # Every line is padded to the width, so a frame overwrites the last one without a clear.
    assert len(frame) == 24
    assert all(len(line) == 80 for line in frame), [len(line) for line in frame]
    assert any(re.search(r"^batch +█+ +4/4 +█+·+ +7/50 ", line) for line in frame)
    server.state = document(batch_inflight=2)
    frame = t.wait_for(lambda f: any(re.search(r"^batch +█+·+ +2/4 ", line) for line in f))
    assert any("8/16 in flight" in line for line in frame)
    t.send(b"q")
    assert t.exit_code() == 0
    assert_restored(t)


def test_live_view_shows_the_error_and_keeps_retrying(terminal: Callable[..., Terminal]) -> None:
    port = free_port()
    t = terminal("--http", f"127.0.0.1:{port}", "--interval", "0.2", cols=120)
    t.wait_for(has(f"! cannot reach 127.0.0.1:{port}: connection refused; retrying every 0.2s"))
    late = StateServer(port=port).start()
    try:
        frame = t.wait_for(has(*LANES))
        assert not any(line.startswith("!") for line in frame)
        # A state this top cannot read is an error too, shown above the last good one.
        late.mode = "mistyped"
        frame = t.wait_for(has(f"! 127.0.0.1:{port} sent a state this top cannot read: "))
        assert any(line.startswith("batch ") for line in frame)
        late.mode = "ok"
        t.wait_for(lambda f: not any(line.startswith("!") for line in f))
        # Gone again: the error comes back above the last state it had.
        late.stop()
        frame = t.wait_for(has(f"cannot reach 127.0.0.1:{port}", "(showing the state of"))
        assert any(line.startswith("batch ") for line in frame)
    finally:
        if late.thread.is_alive():
            late.stop()
    t.send(b"q")
    assert t.exit_code() == 0
    assert_restored(t)


def test_live_view_asks_for_a_token_in_the_frame(guarded: StateServer,
                                                 terminal: Callable[..., Terminal]) -> None:
    t = terminal("--http", guarded.address, "--interval", "0.2")
    t.wait_for(has("! 401: token required (EXTPROC_ADMIN_TOKEN, --token-file or --token)"))
    t.send(b"Q")
    assert t.exit_code() == 0


def test_live_view_redraws_at_once_when_the_window_is_resized(server: StateServer,
                                                              terminal: Callable[..., Terminal]) -> None:
    # An interval far beyond the test: any redraw seen comes from the resize, not the clock. A
    # stale $COLUMNS must not pin the width either.
    t = terminal("--http", server.address, "--interval", "600", env={"COLUMNS": "80"})
    t.wait_for(has(*LANES))
    t.resize(120, 30)
    os.kill(t.proc.pid, signal.SIGWINCH)  # the kernel sends it only to a terminal's foreground group
    frame = t.wait_for(lambda f: len(f) == 30 and all(len(line) == 120 for line in f))
    assert has(*LANES, "FLAGS")(frame)
    assert server.requests == 1
    t.send(b"q")
    assert t.exit_code() == 0


@pytest.mark.parametrize("key", [b"r", b" "])
def test_r_or_space_fetches_at_once_instead_of_waiting_for_the_interval(
        server: StateServer, terminal: Callable[..., Terminal], key: bytes) -> None:
    t = terminal("--http", server.address, "--interval", "600")
    t.wait_for(has(*LANES))
    server.state = document(batch_inflight=1)
    t.send(key)
    t.wait_for(lambda f: any(re.search(r"^batch +█+·+ +1/4 ", line) for line in f))
    assert server.requests == 2
    t.send(b"q")
    assert t.exit_code() == 0


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 0), (signal.SIGTERM, 128 + signal.SIGTERM),
                                           (signal.SIGHUP, 128 + signal.SIGHUP)])
def test_live_view_restores_the_terminal_on_a_signal(server: StateServer, terminal: Callable[..., Terminal],
                                                     sig: signal.Signals, code: int) -> None:
    t = terminal("--http", server.address, "--interval", "0.2", colour=True)
    t.wait_for(has(*LANES))
    assert re.search(rb"\x1b\[1mextproc top", t.output)  # colour on a terminal when NO_COLOR is unset
    assert re.search(rb"\x1b\[31mACTIVE", t.output)
    t.proc.send_signal(sig)
    assert t.exit_code() == code
    assert_restored(t)


def test_live_view_over_grpc(extproc: Extproc, terminal: Callable[..., Terminal]) -> None:
    t = terminal("--grpc", extproc.grpc, "--interval", "0.2", env={"EXTPROC_ADMIN_TOKEN": TOKEN})
    frame = t.wait_for(has(*LANES))
    assert frame[0].startswith(f"extproc top  {extproc.grpc}  up ")
    t.send(b"q")
    assert t.exit_code() == 0
    assert_restored(t)


# --- the live view in tmux ------------------------------------------------------------------------


class Tmux:
    """A private tmux server (its own socket) with one 80x24 window."""

    def __init__(self, name: str) -> None:
        self.base = ["tmux", "-L", name, "-f", "/dev/null"]

    def __call__(self, *args: str) -> str:
        done = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=10, check=True)
        return done.stdout

    def screen(self) -> list[str]:
        return self("capture-pane", "-p", "-t", "top").rstrip("\n").split("\n")

    def wait_for(self, check: Callable[[list[str]], bool], timeout: float = 15.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if check(screen):
                return screen
            time.sleep(0.05)
        raise AssertionError(f"no such screen within {timeout}s; last:\n" + "\n".join(self.screen()))


@pytest.fixture
def tmux() -> Iterator[Tmux]:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux); the pseudo-terminal tests cover the loop")
    t = Tmux(f"extproc-top-test-{os.getpid()}")
    try:
        yield t
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            t("kill-server")


@pytest.mark.parametrize("key", ["q", "C-c"])
def test_in_tmux_80x24_every_lane_is_readable_and_quitting_restores_the_screen(
        server: StateServer, tmux: Tmux, key: str, tmp_path: Path) -> None:
    top = shlex.join([sys.executable, "-m", "extproc.tools.top", "--http", server.address,
                      "--interval", "0.2"])
    status_file = tmp_path / "status"
    # The shell records the exit status (tmux itself sometimes reaps a pane's process late);
    # its trap keeps Ctrl-C from ending the shell while it waits, and is reset for top itself.
    script = (f"trap : INT; cd {shlex.quote(str(ROOT))} && NO_COLOR=1 LANG=C.UTF-8 {top}; "
              f"echo $? > {shlex.quote(str(status_file))}")
    tmux("new-session", "-d", "-s", "top", "-x", "80", "-y", "24", script, ";",
         "set-option", "-g", "remain-on-exit", "on")
    screen = tmux.wait_for(has(*LANES, "SIGNALS"))
    assert len(screen) <= 24  # capture-pane leaves out blank lines at the bottom
    assert all(len(line) <= 80 for line in screen)
    assert screen[0].startswith(f"extproc top  {server.address}  up 1h02m")
    assert any(re.search(r"^interactive +█+·+ +6/8 +·+ +0/100 +4\.0ms/250ms +20\.5 +0$", line)
               for line in screen)
    best_effort = next(n for n, line in enumerate(screen) if line.startswith("best-effort "))
    assert re.search(r" 3\.0$", screen[best_effort])
    assert screen[best_effort + 1] == "  SHED kueue-backlog"
    server.state = document(batch_inflight=3)
    tmux.wait_for(lambda s: any(re.search(r"^batch +█+·+ +3/4 ", line) for line in s))
    tmux("send-keys", "-t", "top", key)
    deadline = time.monotonic() + 10
    while not status_file.exists() or not status_file.read_text().endswith("\n"):
        assert time.monotonic() < deadline, "top did not exit"
        time.sleep(0.05)
    assert status_file.read_text() == "0\n"
    # Back on the normal screen: the frame went away with the alternate screen.
    assert not has("interactive")(tmux.screen())

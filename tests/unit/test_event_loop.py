"""Which event loop ``extproc serve`` runs on (``--event-loop``), and choices read from the environment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from extproc.cli import EXIT_STARTUP, build_parser, loop_factory

ROOT = Path(__file__).resolve().parents[2]


def test_auto_and_uvloop_run_on_uvloop_asyncio_on_asyncios() -> None:
    uvloop = pytest.importorskip("uvloop")  # a dependency everywhere but Windows
    for choice in ("auto", "uvloop"):
        factory = loop_factory(choice)
        assert factory is uvloop.new_event_loop
        loop = factory()
        try:
            assert isinstance(loop, uvloop.Loop)
        finally:
            loop.close()
    assert loop_factory("asyncio") is None  # asyncio.Runner's own loop
    with pytest.raises(ValueError, match="unknown event loop 'trio'"):
        loop_factory("trio")


def test_without_uvloop_auto_falls_back_and_uvloop_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if it were not installed
    assert loop_factory("auto") is None
    with pytest.raises(ValueError, match="uvloop is not installed"):
        loop_factory("uvloop")


@pytest.mark.parametrize(("flag", "env", "value"), [
    ("--event-loop", "EXTPROC_EVENT_LOOP", "trio"),
    # A typo must not turn fail-open into fail-closed (or back) without a word.
    ("--store-fail", "EXTPROC_STORE_FAIL", "clsoed"),
    ("--store-share", "EXTPROC_STORE_SHARE", "fleets"),
    ("--log-format", "EXTPROC_LOG_FORMAT", "jsonl"),
])
def test_a_choice_from_the_environment_is_checked_like_a_flag(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flag: str, env: str, value: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", flag, value])
    assert exit_.value.code == 2
    assert f"{value!r} is not one of" in capsys.readouterr().err
    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {value!r} is not one of" in err
    assert f"env {env}" in err


def test_valid_choices_from_the_environment_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXTPROC_EVENT_LOOP", "asyncio")
    monkeypatch.setenv("EXTPROC_STORE_FAIL", "closed")
    args = build_parser().parse_args(["serve"])
    assert (args.event_loop, args.store_fail, args.store_share) == ("asyncio", "closed", "fleet")


def test_serve_without_uvloop_asked_for_it_exits_before_serving(tmp_path: Path) -> None:
    # As if uvloop were not installed: the import of it fails, and serve says so and stops (exit 3).
    code = ("import sys; sys.modules['uvloop'] = None; from extproc.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    result = subprocess.run(
        [sys.executable, "-c", code, "serve", "--policy", str(ROOT / "examples" / "policy.yaml"),
         "--grpc", "127.0.0.1:0", "--http", "127.0.0.1:0", "--admin", "off", "--admin-grpc", "off",
         "--event-loop", "uvloop"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == EXIT_STARTUP
    assert "uvloop is not installed" in result.stderr
    assert '"event": "serving"' not in result.stderr

"""Which event loop ``extproc serve`` runs on (``--event-loop``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import uvloop

from extproc.cli import loop_factory


def test_auto_and_uvloop_run_on_uvloop_asyncio_on_asyncios() -> None:
    for choice in ("auto", "uvloop"):
        factory = loop_factory(choice)
        assert factory is uvloop.new_event_loop
        loop = factory()
        try:
            assert isinstance(loop, uvloop.Loop)
        finally:
            loop.close()
    assert loop_factory("asyncio") is None  # asyncio.Runner's own loop


def test_without_uvloop_auto_falls_back_and_uvloop_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if it were not installed
    assert loop_factory("auto") is None
    with pytest.raises(ValueError, match="uvloop is not installed"):
        loop_factory("uvloop")


def test_an_unknown_choice_is_refused_by_the_command_line() -> None:
    result = subprocess.run([sys.executable, "-m", "extproc", "serve", "--event-loop", "trio"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "invalid choice: 'trio'" in result.stderr


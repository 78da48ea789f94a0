"""The log's two writers: structlog's chain for every line, and the decision line's own (``Lines``),
which must say what the chain would have said."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from extproc import log


@pytest.fixture(autouse=True)
def restored() -> Iterator[None]:
    """Each test configures logging its own way; the process's set-up is put back after."""
    config = structlog.get_config()
    out = log._OUTPUT
    saved = (out.fmt, out.level, out.file)
    try:
        yield
    finally:
        structlog.configure(**config)
        out.fmt, out.level, out.file = saved


def stream() -> io.TextIOWrapper:
    return io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)


def lines_of(text: io.TextIOWrapper) -> list[str]:
    text.flush()
    buffer = text.buffer
    assert isinstance(buffer, io.BytesIO)
    return buffer.getvalue().decode().splitlines()


FIELDS: dict[str, Any] = {
    "request_id": "r-1", "policy": "ab" * 32, "lane": "interactive", "tenant": "acme", "rule": None,
    "outcome": "admitted", "reason": None, "model": "m", "arrival": 1796456639.25, "method": "POST",
    "path": "/v1/chat/completions", "status": 200, "headers": {"x-extproc-client": "acme"}, "queue_ms": 0,
    "predicted_ms": 1200, "service_ms": 35, "prompt_tokens": 7, "output_tokens": 32, "retry": True,
    "stripped": ["x-extproc-lane"], "capacity_limit": 12, "body": "café",
}


def test_a_decision_line_says_what_the_chain_would_in_the_same_order() -> None:
    out = stream()
    log.configure("json", "info", file=out)
    structlog.get_logger("extproc.decision").bind().info("decision", **FIELDS)
    log.Lines("extproc.decision").info("decision", **FIELDS)
    chain, own = (json.loads(line) for line in lines_of(out))
    assert list(own) == list(chain) == [*FIELDS, "event", "level", "timestamp"]
    assert {k: v for k, v in own.items() if k != "timestamp"} == {
        k: v for k, v in chain.items() if k != "timestamp"}
    assert own["timestamp"].endswith("Z")
    assert own["timestamp"][:4] == chain["timestamp"][:4]


def test_a_line_orjson_refuses_is_written_all_the_same() -> None:
    # A JSON body's "\ud800" is a lone surrogate once read; an integer may outgrow 64 bits.
    out = stream()
    log.configure("json", "info", file=out)
    log.Lines("extproc.decision").info("decision", model="\ud800", prompt_tokens=2**70)
    [line] = lines_of(out)
    assert json.loads(line)["model"] == "\ud800"
    assert json.loads(line)["prompt_tokens"] == 2**70


def test_above_info_no_decision_line_is_written() -> None:
    out = stream()
    log.configure("json", "warning", file=out)
    log.Lines("extproc.decision").info("decision", **FIELDS)
    structlog.get_logger("x").bind().warning("kept")
    assert [json.loads(line)["event"] for line in lines_of(out)] == ["kept"]


def test_the_console_format_goes_through_the_chain() -> None:
    out = io.StringIO()  # (no byte buffer: a text stream of any kind)
    log.configure("console", "info", file=out)
    log.Lines("extproc.decision").info("decision", lane="interactive", outcome="admitted")
    line = out.getvalue()
    assert "decision" in line
    assert "lane=interactive" in line
    assert "outcome=admitted" in line
    assert not line.startswith("{")


def test_a_text_stream_without_a_byte_buffer_gets_the_same_line() -> None:
    out = io.StringIO()
    log.configure("json", "info", file=out)
    log.Lines("extproc.decision").info("decision", lane="é")
    assert json.loads(out.getvalue())["lane"] == "é"

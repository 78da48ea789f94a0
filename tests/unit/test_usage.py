"""Token usage: asking a stream for its usage, and what a finished request is charged."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.body import read_body
from extproc.core.usage import (
    ADMITTED_MS,
    OUTPUT,
    PROMPT,
    SERVICE_MS,
    STRIP,
    USAGE,
    admission_metadata,
    ask_for_usage,
    charged,
)


def ask(doc: object | bytes) -> bytes | None:
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return ask_for_usage(body, read_body(body, True))


def test_a_stream_that_did_not_ask_gets_include_usage_and_keeps_every_other_byte() -> None:
    body = b'  {"model": "m", "stream": true, "messages": [{"role": "user", "content": "\\u00e9t\\u00e9"}]}'
    out = ask(body)
    assert out is not None
    assert out == b'  {"stream_options":{"include_usage":true},' + body[3:]
    assert json.loads(out)["stream_options"] == {"include_usage": True}
    assert json.loads(out)["messages"] == json.loads(body)["messages"]


@pytest.mark.parametrize("doc", [
    {"model": "m", "stream": False},
    {"model": "m"},
    {"model": "m", "stream": "true"},
    {"model": "m", "stream": True, "stream_options": {"include_usage": True}},
])
def test_no_change_when_not_streamed_or_the_client_asked(doc: dict[str, object]) -> None:
    assert ask(doc) is None


def test_stream_options_without_include_usage_are_kept_and_completed() -> None:
    out = ask({"model": "m", "stream": True, "stream_options": {"continuous_usage_stats": False}})
    assert out is not None
    assert json.loads(out)["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    out = ask({"model": "m", "stream": True, "stream_options": {"include_usage": False}})
    assert out is not None
    assert json.loads(out)["stream_options"] == {"include_usage": True}
    out = ask({"model": "m", "stream": True, "stream_options": None})
    assert out is not None
    assert json.loads(out)["stream_options"] == {"include_usage": True}


def test_a_key_named_stream_options_inside_a_prompt_takes_the_careful_path() -> None:
    doc = {"stream": True, "messages": [{"role": "user", "content": '"stream_options"'}]}
    out = ask(doc)
    assert out is not None
    parsed = json.loads(out)
    assert parsed["stream_options"] == {"include_usage": True}
    assert parsed["messages"] == doc["messages"]


@pytest.mark.parametrize("body", [
    b'{"stream": true, "messages": [',                       # cut short: never rewritten
    b'[{"stream": true}]',                                   # not an object
    b'{"stream": true, "stream_options": "yes"}',            # the server refuses it anyway
    b"not json at all",
])
def test_bodies_that_cannot_be_changed_safely_are_left_alone(body: bytes) -> None:
    assert ask_for_usage(body, read_body(body, True)) is None
    assert ask_for_usage(body, read_body(body, False, 10_000)) is None


@given(st.dictionaries(st.sampled_from(["model", "max_tokens", "messages", "stream_options", "n", "x"]),
                       st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=20),
                                 st.dictionaries(st.text(max_size=5), st.booleans(), max_size=3)),
                       max_size=5))
def test_whatever_the_body_the_rewrite_is_the_same_request_asking_for_usage(doc: dict[str, object]) -> None:
    doc = {**doc, "stream": True}
    body = json.dumps(doc).encode()
    out = ask_for_usage(body, read_body(body, True))
    options = doc.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        assert out is None
        return
    if options is not None and not isinstance(options, dict):
        assert out is None
        return
    assert out is not None
    parsed = json.loads(out)
    assert parsed.pop("stream_options") == {**(options or {}), "include_usage": True}  # type: ignore[dict-item]
    assert parsed == {k: v for k, v in doc.items() if k != "stream_options"}


def test_a_reported_usage_is_charged_as_reported() -> None:
    meta = admission_metadata(100, 400, 8.0, 1000.0, strip=False)
    assert charged({USAGE: "321", **meta}, 1001.0).tokens == 321
    assert charged({USAGE: "321", **meta}, 1001.0).source == "reported"
    assert charged({USAGE: "12.0"}, 0).tokens == 12  # a number rendered as a float


def test_without_usage_the_estimate_is_the_prompt_and_the_share_of_the_output_that_ran() -> None:
    meta = admission_metadata(100, 400, 8.0, 1000.0, strip=True)
    assert meta[STRIP] == "1"
    assert meta[SERVICE_MS] == "8000"
    assert meta[ADMITTED_MS] == "1000000"
    entries = {USAGE: "none", **meta}
    assert charged(entries, 1002.0) == charged(entries, 1002.0)
    assert charged(entries, 1002.0).tokens == 100 + 100  # a quarter of its predicted time
    assert charged(entries, 1002.0).source == "estimated"
    assert charged(entries, 1100.0).tokens == 500  # never more than it was sized for
    assert charged(entries, 990.0).tokens == 100  # a clock behind: the prompt alone


@pytest.mark.parametrize("entries", [
    {},
    {USAGE: "none"},
    {USAGE: "none", PROMPT: "none", OUTPUT: "none"},
    {USAGE: "-5", PROMPT: "x"},
    {USAGE: "nan", PROMPT: "inf", OUTPUT: "1"},
])
def test_garbage_or_nothing_charges_nothing(entries: dict[str, str]) -> None:
    charge = charged(entries, 1.0)
    assert charge.tokens == 0
    assert charge.source == "unknown"


def test_a_huge_report_is_capped() -> None:
    assert charged({USAGE: "9" * 40}, 0).tokens == 4_000_000_000


def test_real_epoch_times_are_not_capped_like_token_counts() -> None:
    meta = admission_metadata(36, 400, 6.022, 1_796_318_233.542, strip=False)
    assert charged(meta, 1_796_318_233.5643756).tokens == 36 + 1  # 22 ms of 6 s


def test_a_missing_service_time_charges_the_whole_estimate() -> None:
    assert charged({PROMPT: "10", OUTPUT: "20"}, 5.0).tokens == 30

"""Token usage: asking a stream for its usage, and what a finished request is charged."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.body import BodyFacts, lax_true, read_body
from extproc.core.usage import (
    ADMITTED_MS,
    FILTER_HEADER,
    NOTHING,
    OUTPUT,
    PROMPT,
    SERVICE_MS,
    STRIP,
    USAGE,
    Charge,
    Plan,
    admission_metadata,
    ask_for_usage,
    charged,
    plan,
)
from extproc.policy.ratelimit import RateLimit


def ask(doc: object | bytes) -> bytes | None:
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return ask_for_usage(body, read_body(body, True))


def test_a_stream_that_did_not_ask_gets_include_usage_and_keeps_every_other_byte() -> None:
    body = b'  {"model": "m", "stream": true, "messages": [{"role": "user", "content": "\\u00e9"}]} \n'
    out = ask(body)
    assert out is not None
    # Added last, so that it is also the last of any duplicate key a parser might keep.
    assert out == body[:-3] + b',"stream_options":{"include_usage":true}}' + body[-2:]
    assert json.loads(out)["stream_options"] == {"include_usage": True}
    assert json.loads(out)["messages"] == json.loads(body)["messages"]


@pytest.mark.parametrize("doc", [
    {"model": "m", "stream": False},
    {"model": "m"},
    {"model": "m", "stream": "no"},
    {"model": "m", "stream": 0},
    {"model": "m", "stream": True, "stream_options": {"include_usage": True}},
    {"model": "m", "stream": True, "stream_options": {"include_usage": "yes"}},
])
def test_no_change_when_not_streamed_or_the_client_asked(doc: dict[str, object]) -> None:
    assert ask(doc) is None


@pytest.mark.parametrize("flag", ["true", "True", " yes", "on", "1", 1, 1.0, "t", "y"])
def test_a_stream_is_what_the_model_server_takes_for_one(flag: object) -> None:
    # vLLM's request model reads these as true (pydantic, lax): the client streams all the same.
    out = ask({"model": "m", "stream": flag})
    assert out is not None
    assert json.loads(out)["stream_options"] == {"include_usage": True}


def test_an_escaped_stream_options_key_cannot_opt_out() -> None:
    body = b'{"stream": true, "stream\\u005foptions": {"include_usage": false}}'
    out = ask(body)
    assert out is not None
    assert json.loads(out)["stream_options"] == {"include_usage": True}


def test_a_body_with_a_lone_surrogate_is_rewritten_or_left_alone_never_an_error() -> None:
    body = b'{"stream": true, "stream_options": {}, "messages": [{"content": "\\ud800"}]}'
    out = ask(body)
    assert out is not None
    assert json.loads(out)["messages"] == json.loads(body)["messages"]


def test_utf16_json_is_left_alone() -> None:
    body = '{"stream": true}'.encode("utf-16-le")
    assert ask_for_usage(body, read_body(body, True)) is None


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


#: Any code point, lone surrogates included (json.dumps escapes them), drawn as a number: st.characters()
#: builds Hypothesis's Unicode tables on first use, seconds on a fresh clone, and st.text() uses them too.
any_char = st.one_of(st.integers(0, 0x7F), st.integers(0, 0x10FFFF)).map(chr)


def any_text(max_size: int) -> st.SearchStrategy[str]:
    return st.lists(any_char, max_size=max_size).map("".join)


@given(st.dictionaries(st.sampled_from(["model", "max_tokens", "messages", "stream_options", "n", "x"]),
                       st.one_of(st.none(), st.booleans(), st.integers(), any_text(20),
                                 # stream_options as an object: with include_usage (true or false) or not.
                                 st.dictionaries(st.one_of(st.just("include_usage"), any_text(5)),
                                                 st.booleans(), max_size=3)),
                       max_size=5))
def test_whatever_the_body_the_rewrite_is_the_same_request_asking_for_usage(doc: dict[str, object]) -> None:
    doc = {**doc, "stream": True}
    body = json.dumps(doc).encode()
    out = ask_for_usage(body, read_body(body, True))
    options = doc.get("stream_options")
    if isinstance(options, dict) and lax_true(options.get("include_usage")):
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
    meta = admission_metadata(100, 400, 400, 8.0, 1000.0, strip=False)
    assert charged({USAGE: "321", **meta}, 1001.0).tokens == 321
    assert charged({USAGE: "321", **meta}, 1001.0).source == "reported"
    assert charged({USAGE: "12.0"}, 0).tokens == 12  # a number rendered as a float


def test_without_usage_the_estimate_is_the_prompt_and_the_share_of_the_output_that_ran() -> None:
    meta = admission_metadata(100, 400, 400, 8.0, 1000.0, strip=True)
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
    assert charged({USAGE: "9" * 400}, 0) == Charge(4_000_000_000, "reported")  # not inf, not an estimate


def test_without_max_tokens_a_longer_run_is_charged_longer() -> None:
    # Sized at the policy's default output (256) for 4 s; it ran 8 s: twice that, as it had no cap.
    uncapped = admission_metadata(10, 256, None, 4.0, 1000.0, strip=False)
    assert charged(uncapped, 1008.0).tokens == 10 + 512
    capped = admission_metadata(10, 256, 300, 4.0, 1000.0, strip=False)
    assert charged(capped, 1008.0).tokens == 10 + 300


def test_the_plan_asks_only_where_it_is_safe_and_someone_is_charged() -> None:
    config = RateLimit.model_validate({"budgets": {"tenants": {"acme": {"tokens": 1000}}}})
    stream = BodyFacts(stream=True)
    proxy = {FILTER_HEADER: "1"}
    chat = "/v1/chat/completions?x=1"
    assert plan(config, "acme", chat, proxy, stream) == Plan(record=True, ask=True)
    assert plan(config, "globex", chat, proxy, stream) is NOTHING  # no token budget: nothing allocated
    assert plan(config, "acme", chat, {}, stream) == Plan(record=True, ask=False)  # an older proxy config
    assert plan(config, "acme", "/v1/embeddings", proxy, stream).ask is False
    assert plan(config, "acme", chat, proxy, BodyFacts(stream=True, usage_asked=True)).ask is False
    assert plan(config, "acme", chat, {**proxy, "content-encoding": "gzip"}, stream).ask is False
    assert plan(config, "acme", chat, proxy, None).ask is False  # body not read
    shadow = config.model_copy(update={"mode": "shadow"})
    assert plan(shadow, "acme", chat, proxy, stream) == Plan(record=True, ask=False)
    off = config.model_copy(update={"mode": "off"})
    assert plan(off, "acme", chat, proxy, stream) == Plan(record=False, ask=False)
    never = config.model_copy(update={"ask_usage": False})
    assert plan(never, "acme", chat, proxy, stream) == Plan(record=True, ask=False)


def test_real_epoch_times_are_not_capped_like_token_counts() -> None:
    meta = admission_metadata(36, 400, 400, 6.022, 1_796_318_233.542, strip=False)
    assert charged(meta, 1_796_318_233.5643756).tokens == 36 + 1  # 22 ms of 6 s


def test_a_missing_service_time_charges_the_whole_estimate() -> None:
    assert charged({PROMPT: "10", OUTPUT: "20"}, 5.0).tokens == 30

"""read_body: lenient facts from client-supplied (possibly huge, cut, or hostile) JSON bodies."""

from __future__ import annotations

import gzip
import json
import sys
import time
import tracemalloc
import zlib
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from extproc.core.body import BodyFacts, read_body, read_request_body


def body(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def test_chat_with_string_content() -> None:
    facts = read_body(body({
        "model": "llama-3.1-70b",
        "max_tokens": 200,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello there"},
        ],
    }), complete=True)
    assert facts == BodyFacts(model="llama-3.1-70b", max_tokens=200,
                              prompt_chars=len("You are terse.") + len("Hello there"))
    assert facts.note == ""


def test_chat_with_content_parts() -> None:
    facts = read_body(body({
        "model": "vision",
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "describe"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 5000}},
                {"type": "text", "text": " this"},
            ]},
            {"role": "assistant", "content": None},
            "not a message",
            {"role": "user"},
        ],
    }), complete=True)
    assert facts.prompt_chars == len("describe") + len(" this")
    assert facts.model == "vision"
    assert facts.max_tokens is None
    assert facts.prompt_tokens is None


def test_completions_with_string_prompt() -> None:
    facts = read_body(body({"model": "m", "prompt": "Once upon a time", "max_tokens": 16}), complete=True)
    assert (facts.prompt_chars, facts.prompt_tokens, facts.max_tokens) == (16, None, 16)


def test_completions_with_list_of_string_prompts() -> None:
    facts = read_body(body({"prompt": ["abc", "defg"]}), complete=True)
    assert (facts.prompt_chars, facts.prompt_tokens) == (7, None)


def test_completions_with_token_id_prompt() -> None:
    facts = read_body(body({"model": "m", "prompt": [101, 2023, 2003, 102]}), complete=True)
    assert facts.prompt_tokens == 4
    assert facts.prompt_chars == 0


#: Bodies' token limits, the output limit read from them, and whether the model servers refuse them:
#: read as their request models read them (pydantic, lax mode), ``max_completion_tokens or
#: max_tokens`` as SGLang and vLLM take them.
LIMITS: list[tuple[dict[str, Any], int | None, bool]] = [
    ({"max_tokens": 2000}, 2000, False),
    ({"max_tokens": "2000"}, 2000, False),
    ({"max_tokens": 2000.0}, 2000, False),
    ({"max_tokens": " 2000 "}, 2000, False),
    ({"max_tokens": "2000.0"}, 2000, False),
    ({"max_tokens": "+2000"}, 2000, False),
    ({"max_tokens": True}, 1, False),
    ({"max_tokens": False}, 0, False),
    ({"max_tokens": 0}, 0, False),
    ({"max_tokens": 10**30}, 10**30, False),
    ({"max_tokens": None}, None, False),
    ({}, None, False),
    ({"max_completion_tokens": 50, "max_tokens": 500}, 50, False),
    ({"max_tokens": 500, "max_completion_tokens": 50}, 50, False),
    ({"max_completion_tokens": "50", "max_tokens": 500}, 50, False),
    # A zero (or null) max_completion_tokens falls back to max_tokens, as the engines do.
    ({"max_completion_tokens": 0, "max_tokens": 2000}, 2000, False),
    ({"max_completion_tokens": None, "max_tokens": 2000}, 2000, False),
    ({"max_completion_tokens": False, "max_tokens": 40}, 40, False),
    ({"max_completion_tokens": True, "max_tokens": 40}, 1, False),
    ({"max_completion_tokens": 0}, None, False),
    ({"max_completion_tokens": 0, "max_tokens": 0}, 0, False),
    ({"max_completion_tokens": 2000.0, "max_tokens": 0}, 2000, False),
    # Limits the servers refuse (400): so does extproc.
    ({"max_tokens": "abc"}, None, True),
    ({"max_tokens": ""}, None, True),
    ({"max_tokens": "2e3"}, None, True),
    ({"max_tokens": 12.5}, None, True),
    ({"max_tokens": "12.5"}, None, True),
    ({"max_tokens": -5}, None, True),
    ({"max_tokens": "-5"}, None, True),
    ({"max_tokens": float("nan")}, None, True),
    ({"max_tokens": float("inf")}, None, True),
    ({"max_tokens": 1e300}, None, True),
    ({"max_tokens": [100]}, None, True),
    ({"max_tokens": {"n": 100}}, None, True),
    ({"max_completion_tokens": -1, "max_tokens": 40}, 40, True),
    ({"max_completion_tokens": 50, "max_tokens": "abc"}, 50, True),
    # max_new_tokens is no field of theirs: read when neither of theirs gives a limit, never refused.
    ({"max_tokens": 500, "max_new_tokens": 7}, 500, False),
    ({"max_new_tokens": 7}, 7, False),
    ({"max_new_tokens": "7"}, 7, False),
    ({"max_new_tokens": "abc"}, None, False),
    ({"max_new_tokens": -7}, None, False),
]


@pytest.mark.parametrize(("fields", "expected", "refused"), LIMITS)
def test_token_limits_read_as_the_model_servers_read_them(fields: dict[str, Any], expected: int | None,
                                                          refused: bool) -> None:
    facts = read_body(body({"model": "m", **fields}), complete=True)
    assert facts.max_tokens == expected
    assert bool(facts.invalid) == refused, facts.invalid
    if refused:
        # Says which key and what was wrong with it.
        assert facts.invalid.split(" ")[0] in fields


class Engine(BaseModel):
    """The part of the model servers' request model that reads token limits (pydantic, lax mode)."""

    max_tokens: int | None = None
    max_completion_tokens: int | None = None


@pytest.mark.parametrize(("fields", "expected", "refused"), [row for row in LIMITS
                                                             if "max_new_tokens" not in row[0]])
def test_the_table_is_what_a_lax_request_model_reads(fields: dict[str, Any], expected: int | None,
                                                      refused: bool) -> None:
    """The table's rows are the engines' own reading: a lax pydantic model of the two fields, then
    ``max_completion_tokens or max_tokens``; a negative number fails their own checks."""
    try:
        engine = Engine.model_validate(json.loads(body(fields)))
    except ValidationError:
        assert refused
        return
    negative = any(v is not None and v < 0 for v in (engine.max_tokens, engine.max_completion_tokens))
    assert refused == negative
    if not refused:
        assert (engine.max_completion_tokens or engine.max_tokens) == expected


@pytest.mark.parametrize(("prefix", "expected"), [
    (b'{"max_tokens": "2000", "messages": [{"content": "', 2000),
    (b'{"max_tokens": 2000.0, "messages": [{"content": "', 2000),
    (b'{"max_completion_tokens": 0, "max_tokens": 300, "messages": [{"content": "', 300),
    (b'{"max_tokens": 300, "max_completion_tokens": 0, "messages": [{"content": "', 300),
    (b'{"max_completion_tokens": 40, "max_tokens": 300, "prompt": "', 40),
    (b'{"max_tokens": true, "prompt": "', 1),
    # Refused by the servers, but a cut body is never refused: the limit is then unknown.
    (b'{"max_tokens": "abc", "prompt": "', None),
    (b'{"max_tokens": 12.5, "prompt": "', None),
    (b'{"max_tokens": "12.5", "prompt": "', None),
])
def test_a_cut_body_reads_its_token_limits_alike(prefix: bytes, expected: int | None) -> None:
    facts = read_body(prefix + b"x" * 100, complete=False, content_length=100_000)
    assert (facts.max_tokens, facts.invalid) == (expected, "")


@pytest.mark.parametrize("model", [None, 42, ["a"], {"name": "a"}, True])
def test_non_string_model_is_ignored(model: Any) -> None:
    assert read_body(body({"model": model}), complete=True).model is None


def test_long_model_name_is_truncated() -> None:
    assert read_body(body({"model": "m" * 10_000}), complete=True).model == "m" * 256


@pytest.mark.parametrize("raw", [b"", b"not json", b"{", b'{"model": "m",}', b"\x00\x01", b"NaN"])
def test_non_json(raw: bytes) -> None:
    facts = read_body(raw, complete=True)
    assert facts.note in ("body is not JSON", "body is not a JSON object")
    assert (facts.model, facts.max_tokens) == (None, None)
    assert facts.prompt_chars == len(raw)


@pytest.mark.parametrize("raw", [b"[1, 2, 3]", b'"a string"', b"42", b"null", b"true"])
def test_json_that_is_not_an_object(raw: bytes) -> None:
    facts = read_body(raw, complete=True)
    assert facts.note == "body is not a JSON object"
    assert facts.prompt_chars == len(raw)
    assert facts.model is None


@pytest.mark.parametrize("complete", [True, False])
def test_deeply_nested_json_does_not_raise(complete: bool) -> None:
    raw = b"[" * 100_000 + b"]" * 100_000
    facts = read_body(raw, complete=complete)
    assert facts.model is None
    assert facts.note


def test_deeply_nested_prompt_that_parses_does_not_raise() -> None:
    """Nesting the JSON parser accepts must not overflow the prompt-size walk either."""
    limit = sys.getrecursionlimit()
    for depth in (10, limit // 4, limit // 2, int(limit * 0.7), limit, limit * 10):
        nested = b"[" * depth + b'"abc"' + b"]" * depth
        raw = b'{"model": "m", "messages": [{"role": "user", "content": ' + nested + b"}]}"
        facts = read_body(raw, complete=True)
        if facts.note == "":
            assert (facts.model, facts.prompt_chars) == ("m", 3), depth
        else:
            assert facts.note == "body is not JSON", depth
    # The parser accepts at least moderate nesting, so the walk above was exercised.
    shallow = b'{"messages": [{"content": ' + b"[" * (limit // 2) + b'"ab"' + b"]" * (limit // 2) + b"}]}"
    assert read_body(shallow, complete=True).prompt_chars == 2


def test_truncated_prefix_uses_regex_and_content_length() -> None:
    prefix = (b'{"model": "llama-3.1-70b", "max_tokens": 128, "messages": '
              b'[{"role": "user", "content": "' + b"x" * 5000)
    facts = read_body(prefix, complete=False, content_length=100_000)
    assert facts.model == "llama-3.1-70b"
    assert facts.max_tokens == 128
    assert facts.prompt_chars == 100_000 - 64
    assert facts.prompt_tokens is None
    assert facts.note == "body read in part"


def test_truncated_prefix_without_content_length_uses_prefix_length() -> None:
    prefix = b'{"messages": [{"role": "user", "content": "' + b"y" * 1000
    facts = read_body(prefix, complete=False)
    assert facts.prompt_chars == len(prefix) - 64
    assert (facts.model, facts.max_tokens) == (None, None)
    assert read_body(b'{"mo', complete=False, content_length=10).prompt_chars == 0


def test_truncated_prefix_with_escaped_model_and_other_token_keys() -> None:
    prefix = b'{"max_completion_tokens" : 77, "model" : "we\\"ird\\u00e9", "messages": [{"content": "'
    facts = read_body(prefix, complete=False, content_length=5000)
    assert facts.model == 'we"ird\u00e9'
    assert facts.max_tokens == 77


def test_truncated_prefix_ignores_negative_max_tokens() -> None:
    facts = read_body(b'{"max_tokens": -3, "prompt": "', complete=False, content_length=100)
    assert facts.max_tokens is None


def best_time(work: Callable[[], object], repeats: int = 5) -> float:
    """The fastest of a few runs: what ``work`` costs on this machine, its hiccups left out."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def parse_time(size: int) -> float:
    """A yardstick measured in the same run: one pass of the JSON parser over a body of ``size`` bytes."""
    doc = body({"messages": [{"role": "user", "content": "w" * size}]})
    return best_time(lambda: json.loads(doc))


# A cut body is scanned for two fields, never parsed: its cost is one pass over the bytes at
# most, whatever they hold (here 1/1000 of the yardstick with the fields up front, 2-5 times it
# without them, up to 12 times on a loaded machine). A scan that backtracks or retries from every
# position costs thousands of times the yardstick on 3 MB; 50x it leaves room for machines whose
# regex and JSON speeds differ, and for load, and still catches that.


def test_three_megabyte_prefix() -> None:
    head = b'{"model": "big-model", "max_tokens": 4096, "messages": [{"role": "user", "content": "'
    prefix = head + b"z" * (3 * 1024 * 1024 - len(head))
    facts = read_body(prefix, complete=False, content_length=8 * 1024 * 1024)
    assert (facts.model, facts.max_tokens) == ("big-model", 4096)
    assert facts.prompt_chars == 8 * 1024 * 1024 - 64
    cost = best_time(lambda: read_body(prefix, complete=False, content_length=8 * 1024 * 1024))
    assert cost < 50 * parse_time(len(prefix))


def test_three_megabyte_prefix_without_fields_is_fast() -> None:
    prefix = b'"model" "max_tokens"' * (3 * 1024 * 1024 // 20)
    facts = read_body(prefix, complete=False)
    assert (facts.model, facts.max_tokens) == (None, None)
    assert best_time(lambda: read_body(prefix, complete=False)) < 50 * parse_time(len(prefix))


def test_three_megabyte_complete_body() -> None:
    text = "w" * (3 * 1024 * 1024)
    facts = read_body(body({"model": "m", "messages": [{"role": "user", "content": text}]}), complete=True)
    assert facts.prompt_chars == len(text)


def test_invalid_utf8_complete_body() -> None:
    facts = read_body(b'{"model": "\xff\xfe", "max_tokens": 5}', complete=True)
    assert facts.note == "body is not JSON"
    assert facts.model is None


def test_invalid_utf8_in_truncated_model() -> None:
    facts = read_body(b'{"model": "ab\xffcd", "max_tokens": 9, "messages": [', complete=False)
    assert facts.model is None
    assert facts.max_tokens == 9


def test_utf8_model_in_truncated_body() -> None:
    facts = read_body('{"model": "mod\u00e8le-\u00fc", "messages": ['.encode(), complete=False)
    assert facts.model == "mod\u00e8le-\u00fc"


# --- encoded bodies ---------------------------------------------------------------------------

CHAT = {"model": "llama-3.1-70b", "max_tokens": 77, "messages": [{"role": "user", "content": "hi" * 50}]}


@pytest.mark.parametrize("encoding", ["gzip", "x-gzip", "deflate"])
def test_gzip_and_deflate_bodies_are_inflated(encoding: str) -> None:
    import gzip
    import zlib

    raw = body(CHAT)
    packed = gzip.compress(raw) if "gzip" in encoding else zlib.compress(raw)
    facts = read_body(packed, complete=True, content_length=len(packed), encoding=encoding)
    assert facts == read_body(raw, complete=True)
    assert (facts.model, facts.max_tokens, facts.note) == ("llama-3.1-70b", 77, "")


def test_raw_deflate_is_read_too() -> None:
    import zlib

    packer = zlib.compressobj(wbits=-15)
    packed = packer.compress(body(CHAT)) + packer.flush()
    assert read_body(packed, complete=True, encoding="deflate").max_tokens == 77


def test_a_zip_bomb_inflates_to_the_limit_and_no_further() -> None:
    import gzip

    # 64 MiB of zeros after the fields that matter: about 64 KB compressed.
    bomb = gzip.compress(b'{"model": "m", "max_tokens": 5, "prompt": "' + b"0" * (64 << 20) + b'"}')
    assert len(bomb) < 100_000
    # Memory, not time, shows where inflating stopped: the limit and a copy of it at most (the
    # whole 64 MiB, inflated and then cut, would peak above 64 MiB), on any machine.
    tracemalloc.start()
    try:
        facts = read_body(bomb, complete=True, content_length=len(bomb), encoding="gzip", limit=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20
    assert (facts.model, facts.max_tokens) == ("m", 5)
    assert facts.note == "gzip body read in part"
    assert facts.prompt_chars <= 1 << 20


def test_a_cut_gzip_body_is_read_as_far_as_it_goes() -> None:
    import gzip

    packed = gzip.compress(body(CHAT))
    facts = read_body(packed[: len(packed) // 2], complete=False, content_length=len(packed), encoding="gzip")
    assert facts.model == "llama-3.1-70b"
    assert facts.note == "gzip body read in part"


@pytest.mark.parametrize(("encoding", "data", "note"), [
    ("gzip", b"not gzip at all", "body is not valid gzip"),
    ("br", b"\x1b\x03", "content-encoding 'br' is not one extproc decodes"),
    ("zstd", b"(\xb5/\xfd", "content-encoding 'zstd' is not one extproc decodes"),
])
def test_other_or_broken_encodings_are_unreadable_with_a_reason(encoding: str, data: bytes,
                                                                note: str) -> None:
    facts = read_body(data, complete=True, content_length=len(data), encoding=encoding)
    assert facts.note == note
    assert facts.unreadable
    assert (facts.model, facts.max_tokens) == (None, None)


SECRET = {"model": "llama-3.1-70b", "max_tokens": 2000, "messages": [{"role": "user", "content": "w" * 8000}]}


@pytest.mark.parametrize("encoding", [
    "x-foo", "GZIP2", "identity;q=1", "identity, identity", "identity,identity", "gzip, gzip",
    "gzip,identity", "br", "compress", "gzip;q=1", "gzip,", ",gzip", "*",
])
def test_an_encoding_extproc_does_not_decode_leaves_the_body_unread(encoding: str) -> None:
    """Unknown, stacked or decorated: not read, whatever a backend that ignores encodings would read
    in it (here the plain JSON itself); its prompt is sized from its length as sent."""
    raw = body(SECRET)
    facts = read_request_body(raw, True, {"content-encoding": encoding, "content-length": str(len(raw))},
                              1 << 20)
    assert facts.unreadable
    assert (facts.model, facts.max_tokens) == (None, None)
    assert facts.prompt_chars == len(raw) - 64
    assert repr(encoding.lower()) in facts.note


@pytest.mark.parametrize(("encoding", "pack"), [
    ("", lambda raw: raw), ("identity", lambda raw: raw), (" Identity ", lambda raw: raw),
    ("gzip", gzip.compress), ("GZIP", gzip.compress), ("x-gzip", gzip.compress), ("Deflate", zlib.compress),
])
def test_the_encodings_extproc_decodes_are_read(encoding: str, pack: Callable[[bytes], bytes]) -> None:
    packed = pack(body(SECRET))
    facts = read_request_body(packed, True, {"content-encoding": encoding}, 1 << 20)
    assert (facts.model, facts.max_tokens, facts.unreadable) == ("llama-3.1-70b", 2000, False)


def test_plain_json_that_says_it_is_gzip_is_unreadable() -> None:
    """A backend that ignores request encodings would read it in full: not a cheap request."""
    raw = body(SECRET)
    facts = read_request_body(raw, True, {"content-encoding": "gzip"}, 1 << 20)
    assert facts.unreadable
    assert facts.prompt_chars == len(raw) - 64


def test_an_unreadable_body_is_never_sized_below_what_came() -> None:
    raw = body(SECRET)
    facts = read_request_body(raw, True, {"content-encoding": "x-foo", "content-length": "10"}, 1 << 20)
    assert facts.prompt_chars == len(raw) - 64


@pytest.mark.parametrize("length", ["-5", "1" * 400, "abc", ""])
def test_a_content_length_no_proxy_passes_is_ignored(length: str) -> None:
    prefix = b'{"max_tokens": 5, "prompt": "' + b"p" * 1000
    facts = read_request_body(prefix, False, {"content-length": length}, 1 << 20)
    assert facts.prompt_chars == len(prefix) - 64


def test_identity_is_plain() -> None:
    assert read_body(body(CHAT), complete=True, encoding="identity").max_tokens == 77

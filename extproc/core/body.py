"""Lenient reading of an OpenAI-style JSON request body.

The body is client input: it may be huge, cut short (Envoy hands over only the
first buffered chunk), not JSON at all, or JSON of the wrong shape. None of that
is an error here; whatever cannot be read falls back to the policy's defaults.
A complete body is parsed as JSON; a truncated prefix is scanned for the few
fields that matter (``model``, ``max_tokens``), and its prompt size is taken
from the declared content length.

A body sent with ``Content-Encoding: gzip`` or ``deflate`` is inflated first, never
to more than the policy's ``max_body_bytes`` (a 1 KB zip bomb inflates to at most
that, then counts as cut short); other encodings are not read, and say so.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_MODEL = re.compile(rb'"model"\s*:\s*"((?:[^"\\]|\\.){1,256})"')
_MAX_TOKENS = re.compile(rb'"(?:max_tokens|max_completion_tokens|max_new_tokens)"\s*:\s*(\d{1,9})')
#: Overhead of the JSON envelope that is not prompt text (keys, quotes, roles).
_ENVELOPE_BYTES = 64


@dataclass(frozen=True, slots=True)
class BodyFacts:
    model: str | None = None
    max_tokens: int | None = None
    prompt_chars: int = 0
    prompt_tokens: int | None = None
    """Exact count when the prompt was given as token ids."""
    note: str = ""
    """Why the body could not be fully read ("" when it was)."""
    stream: bool = False
    """The request asks for a streamed answer (``"stream": true``, or anything the model server
    reads as true; known only from a whole body)."""
    usage_asked: bool = False
    """The client asked for the usage event itself (``stream_options.include_usage`` true)."""
    stream_options: bool = False
    """The body has a ``stream_options`` key (whatever its value, however its name was escaped)."""


def _text_len(value: Any) -> int:
    # A loop, not recursion: the client chooses the nesting depth.
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            # Chat content parts: {"type": "text", "text": "..."}; other parts (images) count 0.
            stack.append(item.get("text"))
            stack.append(item.get("content"))
    return total


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})


def lax_true(value: object) -> bool:
    """Whether the model server's request model (pydantic, lax) reads ``value`` as true."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value == 1
    return isinstance(value, str) and value.strip().lower() in _TRUE


def _from_json(doc: dict[str, Any]) -> BodyFacts:
    model = doc.get("model")
    max_tokens: int | None = None
    for key in ("max_completion_tokens", "max_tokens", "max_new_tokens"):
        value = doc.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            max_tokens = value
            break
    prompt_tokens: int | None = None
    chars = 0
    messages = doc.get("messages")
    if isinstance(messages, list):
        chars = sum(_text_len(m.get("content")) for m in messages if isinstance(m, dict))
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompt_tokens = len(prompt)
    elif prompt is not None:
        chars += _text_len(prompt)
    options = doc.get("stream_options")
    return BodyFacts(
        model=model[:256] if isinstance(model, str) else None,
        max_tokens=max_tokens,
        prompt_chars=chars,
        prompt_tokens=prompt_tokens,
        stream=lax_true(doc.get("stream")),
        usage_asked=isinstance(options, dict) and lax_true(options.get("include_usage")),
        stream_options="stream_options" in doc,
    )


#: Inflates an encoded body: gzip (or zlib) headers detected, or raw deflate.
_WBITS = {"gzip": 47, "x-gzip": 47, "deflate": 15}


def _inflate(data: bytes, encoding: str, limit: int) -> tuple[bytes, bool] | None:
    """At most ``limit`` bytes of ``data`` decoded, and whether that is all of it (None: not decodable)."""
    wbits = _WBITS[encoding]
    for bits in (wbits, -15) if encoding == "deflate" else (wbits,):
        inflater = zlib.decompressobj(bits)
        try:
            out = inflater.decompress(data, limit + 1)
        except zlib.error:
            continue
        return out[:limit], inflater.eof and len(out) <= limit
    return None


def read_body(prefix: bytes, complete: bool, content_length: int | None = None, *,
              encoding: str | None = None, limit: int = 1 << 20) -> BodyFacts:
    """Facts from a request body, or from the first part of it when ``complete`` is false.

    ``encoding`` is the request's ``Content-Encoding`` (lower case); ``limit`` bounds what an
    encoded body may inflate to.
    """
    if encoding and encoding != "identity":
        if encoding not in _WBITS:
            return BodyFacts(prompt_chars=max(0, (content_length or len(prefix)) - _ENVELOPE_BYTES),
                             note=f"body is {encoding[:32]}-encoded; not read")
        inflated = _inflate(prefix, encoding, limit)
        if inflated is None:
            return BodyFacts(prompt_chars=len(prefix), note=f"body is not valid {encoding}")
        plain, whole = inflated
        facts = read_body(plain, complete and whole)
        if complete and whole:
            return facts
        return BodyFacts(facts.model, facts.max_tokens, facts.prompt_chars, facts.prompt_tokens,
                         f"{encoding} body read in part")
    if complete:
        try:
            doc = json.loads(prefix)
        except (ValueError, RecursionError):
            return BodyFacts(prompt_chars=len(prefix), note="body is not JSON")
        if not isinstance(doc, dict):
            return BodyFacts(prompt_chars=len(prefix), note="body is not a JSON object")
        return _from_json(doc)
    model_match = _MODEL.search(prefix)
    tokens_match = _MAX_TOKENS.search(prefix)
    model: str | None = None
    if model_match is not None:
        try:
            model = json.loads(b'"' + model_match.group(1) + b'"')
        except ValueError:
            model = None
    total = content_length if content_length is not None else len(prefix)
    return BodyFacts(
        model=model,
        max_tokens=int(tokens_match.group(1)) if tokens_match else None,
        prompt_chars=max(0, total - _ENVELOPE_BYTES),
        note="body read in part",
    )


def read_request_body(chunk: bytes, end_of_stream: bool, headers: Mapping[str, str], limit: int) -> BodyFacts:
    """What the first body chunk Envoy hands over says, read as every path reads it.

    ``headers`` are the request's (lower-case names): ``content-length`` tells a cut body's
    full size, ``content-encoding`` how to decode it. At most ``limit`` bytes are parsed.
    """
    try:
        content_length: int | None = int(headers.get("content-length", ""))
    except ValueError:
        content_length = None
    encoding = headers.get("content-encoding", "").strip().lower() or None
    complete = end_of_stream and len(chunk) <= limit
    return read_body(chunk[:limit], complete, content_length, encoding=encoding, limit=limit)


class SlowBodies:
    """Requests waiting for their body, per client: a client that announces bodies and never sends
    them must not hold streams (and memory) without bound."""

    #: A body later than this counts as slow (a normal one arrives within milliseconds).
    SLOW_S = 1.0

    def __init__(self) -> None:
        self._waiting: dict[str, dict[int, float]] = {}

    def too_many(self, client: str | None, cap: int, now: float) -> bool:
        if client is None or cap <= 0:
            return False
        waiting = self._waiting.get(client)
        if waiting is None or len(waiting) < cap:
            return False
        return sum(1 for since in waiting.values() if now - since > self.SLOW_S) >= cap

    def enter(self, client: str | None, key: int, now: float) -> None:
        if client is not None:
            self._waiting.setdefault(client, {})[key] = now

    def leave(self, client: str | None, key: int) -> None:
        if client is None:
            return
        waiting = self._waiting.get(client)
        if waiting is not None:
            waiting.pop(key, None)
            if not waiting:
                del self._waiting[client]

    def __len__(self) -> int:
        return sum(len(w) for w in self._waiting.values())

"""Lenient reading of an OpenAI-style JSON request body.

The body is client input: it may be huge, cut short (Envoy hands over only the
first buffered chunk), not JSON at all, or JSON of the wrong shape. None of that
is an error here; whatever cannot be read falls back to the policy's defaults.
A complete body is parsed as JSON; a truncated prefix is scanned for the few
fields that matter (``model``, ``max_tokens``), and its prompt size is taken
from the declared content length.

The token limit is read the way the model servers read it, because what they
generate is what the estimate must size: their request models (pydantic, lax mode)
take ``"2000"``, ``2000.0`` and ``true`` as whole numbers, and SGLang and vLLM
alike take ``max_completion_tokens or max_tokens`` (a 0 falls back to the other).
A limit they refuse (``"abc"``, ``12.5``, NaN, a negative number) is said in
``invalid``: they answer such a request 400, and so does extproc (``Intake.refusal``).

A body sent with ``Content-Encoding: gzip`` or ``deflate`` is inflated first, never
to more than the policy's ``max_body_bytes`` (a 1 KB zip bomb inflates to at most
that, then counts as cut short). Any other encoding, stacked encodings, or bytes
that do not decode as their encoding says are ``unreadable``: never a cheap
request, since a backend that ignores request encodings would serve them in full
(the policy's ``estimation.unreadable_body`` says what happens to them).
"""

from __future__ import annotations

import json
import re
import reprlib
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pydantic import TypeAdapter, ValidationError

_MODEL = re.compile(rb'"model"\s*:\s*"((?:[^"\\]|\\.){1,256})"')
#: A token limit in a cut body: a short JSON string, number or literal (read as a whole body's would be).
#: (No group for the key: a capture there makes the scan of a huge prefix a fifth slower.)
_LIMIT = re.compile(rb'"(?:max_tokens|max_completion_tokens|max_new_tokens)"\s*:\s*'
                    rb'("(?:[^"\\]|\\.){0,64}"|-?[0-9][0-9.eE+-]{0,31}|true|false|null)')
_LIMIT_KEYS = ("max_completion_tokens", "max_tokens", "max_new_tokens")
#: The model servers' own reading of a whole number (their request models are pydantic, lax mode).
_LAX_INT: TypeAdapter[int] = TypeAdapter(int)
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
    unreadable: bool = False
    """The body could not be decoded (``note`` says why): it is sized as the largest job the policy
    expects, or refused, never taken for a small one."""
    invalid: str = ""
    """Why the model servers refuse the body's token limit ("" when they do not; only a whole body)."""


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


def _token_limit(key: str, value: object) -> tuple[int | None, str]:
    """A body's token limit ``key`` as the model servers read ``value``: the number (None: not given,
    or refused) and why they refuse it ("" when they do not)."""
    if value is None:
        return None, ""
    if type(value) is int:
        number = value
    else:
        try:
            number = _LAX_INT.validate_python(value)
        except ValidationError as exc:
            return None, f"{key} {reprlib.repr(value)}: {exc.errors()[0]['msg']}"
    if number < 0:
        return None, f"{key} {reprlib.repr(number)}: must not be negative"
    return number, ""


def _limit(doc: Mapping[str, object]) -> tuple[int | None, str]:
    """The output limit the model servers take from a body, and why they refuse it ("" when they do
    not): ``max_completion_tokens or max_tokens``, else ``max_new_tokens`` (no field of theirs: read
    when it is a number, never a reason to refuse)."""
    completion, wrong = _token_limit("max_completion_tokens", doc.get("max_completion_tokens"))
    tokens, wrong_too = _token_limit("max_tokens", doc.get("max_tokens"))
    chosen = completion or tokens
    if chosen is None:
        chosen = _token_limit("max_new_tokens", doc.get("max_new_tokens"))[0]
    return chosen, wrong or wrong_too


def _from_json(doc: dict[str, Any]) -> BodyFacts:
    model = doc.get("model")
    max_tokens, invalid = _limit(doc)
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
        invalid=invalid,
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
            return _unreadable(prefix, content_length, f"content-encoding {encoding[:64]!r} is not one "
                                                       f"extproc decodes")
        inflated = _inflate(prefix, encoding, limit)
        if inflated is None:
            return _unreadable(prefix, content_length, f"body is not valid {encoding}")
        plain, whole = inflated
        facts = read_body(plain, complete and whole)
        if complete and whole:
            return facts
        return replace(facts, note=f"{encoding} body read in part")
    if complete:
        try:
            doc = json.loads(prefix)
        except (ValueError, RecursionError):
            return BodyFacts(prompt_chars=len(prefix), note="body is not JSON")
        if not isinstance(doc, dict):
            return BodyFacts(prompt_chars=len(prefix), note="body is not a JSON object")
        return _from_json(doc)
    model_match = _MODEL.search(prefix)
    model: str | None = None
    if model_match is not None:
        try:
            model = json.loads(b'"' + model_match.group(1) + b'"')
        except ValueError:
            model = None
    total = content_length if content_length is not None else len(prefix)
    return BodyFacts(
        model=model,
        # (A limit the servers would refuse is not refused here: a match in a cut body may be a
        # nested key's, and the rest of the body is unknown.)
        max_tokens=_limit(_limits_in(prefix))[0],
        prompt_chars=max(0, total - _ENVELOPE_BYTES),
        note="body read in part",
    )


def _unreadable(data: bytes, content_length: int | None, why: str) -> BodyFacts:
    """A body that cannot be decoded: its prompt sized from its length as sent (never less than what
    came), its output left to the policy (``estimation.unreadable_body``)."""
    size = max(content_length or 0, len(data))
    return BodyFacts(prompt_chars=max(0, size - _ENVELOPE_BYTES), note=why, unreadable=True)


def _limits_in(prefix: bytes) -> dict[str, object]:
    """The first value of each token limit key in a cut body, in one pass (a value that is not JSON,
    such as a number cut short, counts as not given)."""
    found: dict[str, object] = {}
    for match in _LIMIT.finditer(prefix):
        text = match.group()
        key = text[1:text.index(b'"', 1)].decode()
        if key in found:
            continue
        try:
            found[key] = json.loads(match.group(1))
        except ValueError:
            found[key] = None
        if len(found) == len(_LIMIT_KEYS):
            break
    return found


def read_request_body(chunk: bytes, end_of_stream: bool, headers: Mapping[str, str], limit: int) -> BodyFacts:
    """What the first body chunk Envoy hands over says, read as every path reads it.

    ``headers`` are the request's (lower-case names): ``content-length`` tells a cut body's
    full size, ``content-encoding`` how to decode it. At most ``limit`` bytes are parsed.
    """
    try:
        content_length: int | None = int(headers.get("content-length", ""))
    except ValueError:
        content_length = None
    if content_length is not None and not 0 <= content_length < 1 << 63:
        content_length = None  # (no proxy passes it on; a 400-digit one would overflow the estimate)
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

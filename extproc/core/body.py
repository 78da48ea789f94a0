"""Lenient reading of an OpenAI-style JSON request body.

The body is client input: it may be huge, cut short (Envoy hands over only the
first buffered chunk), not JSON at all, or JSON of the wrong shape. None of that
is an error here; whatever cannot be read falls back to the policy's defaults.
A complete body is parsed as JSON; a truncated prefix is scanned for the few
fields that matter (``model``, ``max_tokens``), and its prompt size is taken
from the declared content length.
"""

from __future__ import annotations

import json
import re
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
    return BodyFacts(
        model=model[:256] if isinstance(model, str) else None,
        max_tokens=max_tokens,
        prompt_chars=chars,
        prompt_tokens=prompt_tokens,
    )


def read_body(prefix: bytes, complete: bool, content_length: int | None = None) -> BodyFacts:
    """Facts from a request body, or from the first part of it when ``complete`` is false."""
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

"""Token usage: asking the model server for it, and what a finished request is charged.

How this works: token budgets are charged when a response ends, from the usage the model
server itself reports. vLLM, SGLang and TGI put ``usage.total_tokens`` in a JSON answer; in a
stream, only in one last event, and only when the request asked for it with
``stream_options.include_usage``. Envoy reads that number (the ``sse_to_metadata`` and
``json_to_metadata`` filters, into dynamic metadata ``extproc.usage``) and its rate limit
filter sends it to the edge when the stream ends, as the ``usage`` entry of the usage
descriptor: no response byte passes through extproc.

* :func:`ask_for_usage`: a streamed request that did not ask for usage gets
  ``include_usage`` set by ext_proc, on the body it already reads; the admission answer marks
  the request (``strip_usage``), and Envoy's ``extproc.strip_usage`` filter removes that one
  event again before the client sees it (a client that asked keeps its event).
* :func:`charged`: a response that reported its usage is charged what it reported. One that did
  not (a stream cut short, a failed answer, a body that could not be read) is charged an
  estimate from what ext_proc admitted, carried in the metadata it set (:func:`admission_metadata`):
  its prompt, plus its predicted output in the proportion of its predicted service time it ran
  (never more than prompt + the output it was sized for).

Pure: no I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from extproc.core.body import BodyFacts

#: The dynamic metadata namespace ext_proc writes for each admitted request.
NAMESPACE = "extproc"
#: Where Envoy's usage filters put the reported ``usage.total_tokens`` (a namespace of its own:
#: Envoy replaces a namespace's keys as a whole when ext_proc writes it).
USAGE_NAMESPACE = "extproc.usage"
USAGE_KEY = "total_tokens"
#: Entries of the usage descriptor (as Envoy's ``metadata`` actions name them).
USAGE = "usage"
PROMPT = "prompt_tokens"
OUTPUT = "output_tokens"
SERVICE_MS = "service_ms"
ADMITTED_MS = "admitted_ms"
STRIP = "strip_usage"
USAGE_ENTRIES = (USAGE, PROMPT, OUTPUT, SERVICE_MS, ADMITTED_MS)
#: What a ``metadata`` action sends when the value is absent (``default_value``).
ABSENT = "none"
_MAX_TOKENS = 4_000_000_000
_OPTIONS = b'"stream_options":{"include_usage":true}'

Source = Literal["reported", "estimated", "unknown"]


@dataclass(frozen=True, slots=True)
class Charge:
    tokens: int
    source: Source
    """``reported`` by the model server, ``estimated`` from the admission, ``unknown`` (nothing)."""


def ask_for_usage(body: bytes, facts: BodyFacts) -> bytes | None:
    """The request body with ``stream_options.include_usage`` set, or None when it needs no change
    (not streamed, the client asked) or cannot be changed safely (not whole, not plain JSON)."""
    if not facts.stream or facts.usage_asked or facts.note:
        return None
    start = len(body) - len(body.lstrip())
    if body[start:start + 1] != b"{":
        return None
    if b'"stream_options"' not in body:
        # The usual case: one key in front, the client's bytes untouched.
        rest = body[start + 1:]
        comma = b"" if rest.lstrip().startswith(b"}") else b","
        return body[:start + 1] + _OPTIONS + comma + rest
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    options = doc.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        return None  # the model server refuses it, as it would have anyway
    doc["stream_options"] = {**options, "include_usage": True}
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()


def admission_metadata(prompt_tokens: int, output_tokens: int, predicted_s: float, admitted_unix: float,
                       strip: bool) -> dict[str, str]:
    """What ext_proc records on an admitted request, for its charge when it ends."""
    meta = {PROMPT: str(prompt_tokens), OUTPUT: str(output_tokens),
            SERVICE_MS: str(max(1, round(predicted_s * 1000))), ADMITTED_MS: str(round(admitted_unix * 1000))}
    if strip:
        meta[STRIP] = "1"
    return meta


def _number(text: str | None) -> float | None:
    """A finite, non-negative number, or None (absent or garbage)."""
    if text is None or text == ABSENT or text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _count(text: str | None) -> float | None:
    value = _number(text)
    return None if value is None else min(value, _MAX_TOKENS)


def charged(entries: Mapping[str, str], now_unix: float) -> Charge:
    """What a finished request is charged, from its usage descriptor's entries."""
    reported = _count(entries.get(USAGE))
    if reported is not None:
        return Charge(round(reported), "reported")
    prompt, output = _count(entries.get(PROMPT)), _count(entries.get(OUTPUT))
    if prompt is None or output is None:
        return Charge(0, "unknown")  # never admitted by ext_proc (shed, refused, or it was down)
    service, admitted = _number(entries.get(SERVICE_MS)), _number(entries.get(ADMITTED_MS))
    share = 1.0
    if service is not None and service > 0 and admitted is not None:
        share = min(max((now_unix * 1000 - admitted) / service, 0.0), 1.0)
    return Charge(round(prompt + output * share), "estimated")

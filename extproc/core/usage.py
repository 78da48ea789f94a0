"""Token usage: asking the model server for it, and what a finished request is charged.

How this works: token budgets are charged when a response ends, from the usage the model
server itself reports. vLLM, SGLang and TGI put ``usage.total_tokens`` in a JSON answer; in a
stream, only in one last event, and only when the request asked for it with
``stream_options.include_usage``. Envoy's ``extproc.usage`` filter (``envoy/usage.lua``) reads
that number as the chunks pass into dynamic metadata ``extproc.usage``, and the rate limit
filter sends it to the edge when the stream ends, as the ``usage`` entry of the usage
descriptor: no response byte passes through extproc.

* :func:`ask_for_usage`: a streamed request that did not ask for usage gets
  ``include_usage`` set by ext_proc, on the body it already reads; the admission answer marks
  the request (``strip_usage``), and the proxy's filter removes that one event again before
  the client sees it (a client that asked keeps its event).
* :func:`charged`: a response that reported its usage is charged what it reported. One that did
  not (a stream cut short, a failed answer, a body that could not be read) is charged an
  estimate from what ext_proc admitted, carried in the metadata it set (:func:`admission_metadata`):
  its prompt, plus its predicted output in the proportion of its predicted service time it ran
  (never more than its ``max_tokens``, when it gave one).

Pure: no I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from extproc.core.body import BodyFacts
from extproc.policy.ratelimit import RateLimit

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
MAX_TOKENS = "max_tokens"
SERVICE_MS = "service_ms"
ADMITTED_MS = "admitted_ms"
STRIP = "strip_usage"
USAGE_ENTRIES = (USAGE, PROMPT, OUTPUT, MAX_TOKENS, SERVICE_MS, ADMITTED_MS)
#: Set by the proxy itself (after it strips every client ``x-extproc-*`` header) when it runs the
#: ``extproc.usage`` filter, which removes the usage event ext_proc asks for: without it (an older
#: proxy config) no request is rewritten, so no client ever gets an event it did not ask for.
FILTER_HEADER = "x-extproc-usage-filter"
#: What a ``metadata`` action sends when the value is absent (``default_value``).
ABSENT = "none"
_MAX_TOKENS = 4_000_000_000
_OPTIONS = b',"stream_options":{"include_usage":true}'

Source = Literal["reported", "estimated", "unknown"]


@dataclass(frozen=True, slots=True)
class Charge:
    tokens: int
    source: Source
    """``reported`` by the model server, ``estimated`` from the admission, ``unknown`` (nothing)."""


@dataclass(frozen=True, slots=True)
class Plan:
    record: bool
    """Record the admission (metadata) for the charge when the response ends."""
    ask: bool
    """Ask the model server for the stream's usage on the client's behalf (rewrite its body)."""


#: The plan for a tenant with no token budget (most requests): nothing to record, nothing to ask.
NOTHING = Plan(False, False)


def plan(config: RateLimit, tenant: str, path: str, headers: Mapping[str, str],
         body: BodyFacts | None) -> Plan:
    """What ext_proc does about an admitted request's token usage: only for a tenant with a token
    budget; the body is rewritten only when enforcing, for a streamed completion that did not ask,
    in plain (not encoded) JSON, behind a proxy that says it strips the event again."""
    if config.mode == "off" or config.budgets.of(tenant).tokens is None:
        return NOTHING
    ask = (config.ask_usage and config.mode == "enforce" and body is not None and body.stream
           and not body.usage_asked and path.split("?", 1)[0].endswith("/completions")
           and headers.get(FILTER_HEADER) == "1"
           and headers.get("content-encoding", "identity").strip().lower() in ("", "identity"))
    return Plan(True, ask)


def ask_for_usage(body: bytes, facts: BodyFacts) -> bytes | None:
    """The request body with ``stream_options.include_usage`` set, or None when it needs no change
    (not streamed, the client asked) or cannot be changed safely (not whole, not UTF-8 JSON)."""
    if not facts.stream or facts.usage_asked or facts.note:
        return None
    trimmed = body.rstrip()
    start = len(body) - len(body.lstrip())
    if body[start:start + 1] != b"{" or not trimmed.endswith(b"}") or b"\x00" in body[:4]:
        return None  # not a JSON object in UTF-8 (json.loads also takes UTF-16 and UTF-32)
    if not facts.stream_options:
        # The usual case: one key added last (so it is also the last of any duplicate), the
        # client's bytes untouched.
        return trimmed[:-1] + _OPTIONS + b"}" + body[len(trimmed):]
    try:
        doc = json.loads(body)
        options = doc.get("stream_options") if isinstance(doc, dict) else None
        if not isinstance(doc, dict) or not (options is None or isinstance(options, dict)):
            return None  # the model server refuses it, as it would have anyway
        doc["stream_options"] = {**(options or {}), "include_usage": True}
        return json.dumps(doc, separators=(",", ":")).encode()
    except (ValueError, RecursionError, UnicodeError):
        return None


def admission_metadata(prompt_tokens: int, output_tokens: int, max_tokens: int | None, predicted_s: float,
                       admitted_unix: float, strip: bool) -> dict[str, str]:
    """What ext_proc records on an admitted request, for its charge when it ends: its size (the
    output it was sized for, and the client's ``max_tokens`` if it gave one), its predicted service
    time, when it was admitted (epoch), and whether its usage event is to be removed."""
    meta = {PROMPT: str(prompt_tokens), OUTPUT: str(output_tokens),
            SERVICE_MS: str(max(1, round(predicted_s * 1000))), ADMITTED_MS: str(round(admitted_unix * 1000))}
    if max_tokens is not None:
        meta[MAX_TOKENS] = str(max_tokens)
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
    if text is not None and text.isdigit():
        return min(int(text), _MAX_TOKENS)  # exact, however long (a float would overflow to inf)
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
    cap = _count(entries.get(MAX_TOKENS))
    share = 1.0
    if service is not None and service > 0 and admitted is not None:
        share = max((now_unix * 1000 - admitted) / service, 0.0)
    # Ran longer than predicted: more tokens, up to the client's max_tokens (none given: the
    # sized output was only a default, and the time it ran says more).
    generated = output * share
    if cap is not None:
        generated = min(generated, cap)
    return Charge(round(min(prompt + generated, _MAX_TOKENS)), "estimated")

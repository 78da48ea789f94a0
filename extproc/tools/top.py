"""``extproc top``: a live terminal view of a running extproc, read from its ``/admin/state``.

How this works: ``render`` is a pure function from one state document (and the one
before it) to a frame of plain text lines that fit the terminal; it never sees a
socket or an escape code, so tests assert on frames directly. Everything in the
document is read defensively: a key that is missing, null or of the wrong type
shows as a dash instead of breaking the view, so this viewer keeps working against
an extproc a little older or newer than itself. ``command`` does the I/O: it fetches
the document with aiohttp, and either prints one frame (``--once``) or the raw
document (``--json``), or runs the live loop, which redraws in the terminal's
alternate screen every ``--interval`` (plain ANSI, so it works over SSH in any
80x24 terminal), redraws at once on a resize, reads keys in cbreak mode (``r`` or
space fetches now), and on ``q``, Ctrl-C, SIGTERM or SIGHUP restores the terminal
exactly as it found it. A failed fetch is shown in the frame, above the last good
state, and retried at the next tick.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import math
import os
import re
import shutil
import signal
import sys
import termios
import time
import tty
import unicodedata
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO
from urllib.parse import urlsplit

import aiohttp

from extproc.settings import Address, env, read_token

DEFAULT_ADMIN = "127.0.0.1:9091"
#: The same variables ``extproc serve`` reads, so one environment configures both ends.
ADMIN_ENV, TOKEN_ENV, TOKEN_FILE_ENV = "EXTPROC_ADMIN", "EXTPROC_ADMIN_TOKEN", "EXTPROC_ADMIN_TOKEN_FILE"
STATE_PATH = "/admin/state"
#: The document version this viewer was written against; others are shown with a warning.
STATE_VERSION = 1
#: An admin document is a few kilobytes; anything this large is not one.
_MAX_BODY = 16 * 1024 * 1024

EXIT_FETCH = 1
EXIT_USAGE = 2


# ---------------------------------------------------------------------------------------------
# Reading the document: every accessor returns None (or empty) for a missing or mistyped value.


def _number(m: Mapping[str, Any], key: str) -> float | None:
    value = m.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _flag(m: Mapping[str, Any], key: str) -> bool:
    return m.get(key) is True


def _mapping(m: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = m.get(key)
    return value if isinstance(value, Mapping) else {}


def _records(m: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    value = m.get(key)
    if not isinstance(value, list):
        return []
    return [item for item in value if isinstance(item, Mapping)]


_UNSAFE = re.compile(r"\s+")


def clean(text: object) -> str:
    """``text`` as one line with no control characters.

    The document's strings (error messages above all) reach the terminal; an escape
    sequence or a newline inside one must not be able to move the cursor or recolour
    the screen.
    """
    chars = (" " if unicodedata.category(c).startswith("C") or c in "\u2028\u2029" else c for c in str(text))
    return _UNSAFE.sub(" ", "".join(chars)).strip()


def _text(m: Mapping[str, Any], key: str) -> str | None:
    value = m.get(key)
    if value is None or isinstance(value, Mapping | list):
        return None
    return clean(value)


# ---------------------------------------------------------------------------------------------
# Formatting values for people.


@dataclass(frozen=True)
class Glyphs:
    fill: str
    empty: str
    missing: str
    more: str
    arrow: str
    times: str


UNICODE = Glyphs(fill="█", empty="·", missing="–", more="…", arrow="→", times="×")
#: For terminals whose encoding cannot show the above (a C locale over an old SSH client).
ASCII = Glyphs(fill="#", empty=".", missing="-", more="~", arrow="->", times="x")


def fmt_duration(seconds: float | None, g: Glyphs = UNICODE) -> str:
    """A wait or an age in the unit a person reads fastest: 0.4ms, 12ms, 1.25s, 2m03s, 3h12m, 2d04h."""
    if seconds is None:
        return g.missing
    seconds = max(seconds, 0.0)
    ms = seconds * 1000
    if ms < 9.95:
        return f"{ms:.1f}ms"
    if ms < 999.5:
        return f"{ms:.0f}ms"
    if seconds < 9.995:
        return f"{seconds:.2f}s"
    if seconds < 59.95:
        return f"{seconds:.1f}s"
    whole = round(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def fmt_rate(per_second: float | None, g: Glyphs = UNICODE) -> str:
    """Events per second, short: 0, 0.05, 12.3, 450, 12k."""
    if per_second is None:
        return g.missing
    if per_second <= 0:
        return "0"
    if per_second < 0.995:
        return f"{per_second:.2f}"
    if per_second < 99.95:
        return f"{per_second:.1f}"
    if per_second < 9999.5:
        return f"{per_second:.0f}"
    return f"{per_second / 1000:.0f}k"


def fmt_count(value: float | None, g: Glyphs = UNICODE) -> str:
    return g.missing if value is None else str(round(value))


def fmt_value(value: float | None, g: Glyphs = UNICODE) -> str:
    """A signal's reading: integers as integers, the rest to four significant digits."""
    if value is None:
        return g.missing
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"


def bar(value: float | None, total: float | None, width: int, g: Glyphs = UNICODE) -> str:
    """``width`` cells filled in proportion to value/total.

    Anything above zero shows at least one cell and only a full lane shows a full bar,
    so 1 of 200 and 199 of 200 never look like 0 and 200.
    """
    if width <= 0:
        return ""
    if value is None or total is None or total <= 0 or value <= 0:
        return g.empty * width
    cells = width if value >= total else min(max(round(width * value / total), 1), width - 1)
    return g.fill * cells + g.empty * (width - cells)


def fit(text: str, width: int, g: Glyphs = UNICODE) -> str:
    """``text`` cut to ``width`` characters, with a mark where it was cut."""
    if width <= 0:
        return ""
    if len(text) <= width:
        return text
    if width <= len(g.more):
        return text[:width]
    return text[: width - len(g.more)] + g.more


def _fit_left(text: str, width: int, g: Glyphs) -> str:
    """Like ``fit`` but keeps the end (a path's file name matters more than its directories)."""
    if len(text) <= width:
        return text
    if width <= len(g.more):
        return text[-width:] if width > 0 else ""
    return g.more + text[len(text) - width + len(g.more):]


def _clock(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    try:
        return time.strftime("%H:%M:%S", time.localtime(epoch))
    except (OverflowError, OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# The frame.


_MIN_WIDTH = 20
_MAX_BAR = 16
_MIN_BAR = 3
_GOOD_BAR = 6
_NAME_CAP = 20


@dataclass
class _Lane:
    name: str
    inflight: str
    inflight_bar: tuple[float | None, float | None]
    queued: str
    queued_bar: tuple[float | None, float | None]
    wait: str
    admit: str
    reject: str
    flags: str


def _lane_row(lane: Mapping[str, Any], g: Glyphs) -> _Lane:
    inflight = _number(lane, "inflight")
    limit = _number(lane, "limit")
    effective = _number(lane, "effective_limit")
    shown_limit = effective if effective is not None else limit
    queued = _number(lane, "queued")
    max_queued = _number(lane, "max_queued")
    flags: list[str] = []
    if _flag(lane, "closed"):
        flags.append("CLOSED")
    if _flag(lane, "retired"):
        flags.append("RETIRED")
    if _flag(lane, "paused"):
        flags.append("PAUSED")
    shed = _text(lane, "shed")
    if shed:
        flags.append(f"SHED {shed}")
    if _flag(lane, "shadow"):
        flags.append("SHADOW")
    if effective is not None and limit is not None and effective != limit:
        flags.append(f"LIMIT {fmt_count(limit, g)}{g.arrow}{fmt_count(effective, g)}")
    borrowed = _number(lane, "borrowed")
    if borrowed:
        flags.append(f"BORROW {fmt_count(borrowed, g)}")
    would_reject = _number(lane, "shadow_reject_per_s")
    if would_reject:
        flags.append(f"would reject {fmt_rate(would_reject, g)}/s")
    return _Lane(
        name=_text(lane, "name") or g.missing,
        inflight=f"{fmt_count(inflight, g)}/{fmt_count(shown_limit, g)}",
        inflight_bar=(inflight, shown_limit),
        queued=f"{fmt_count(queued, g)}/{fmt_count(max_queued, g)}",
        queued_bar=(queued, max_queued),
        wait=f"{fmt_duration(_number(lane, 'wait_p50_s'), g)}/{fmt_duration(_number(lane, 'wait_p95_s'), g)}",
        admit=fmt_rate(_number(lane, "admit_per_s"), g),
        reject=fmt_rate(_number(lane, "reject_per_s"), g),
        flags=", ".join(flags),
    )


_GAP = "  "
_HEADS = ("LANE", "IN FLIGHT", "QUEUED", "WAIT p50/p95", "ADM/s", "REJ/s")


def _lane_table(lanes: Sequence[_Lane], width: int, g: Glyphs) -> list[str] | None:
    """One row per lane, bars sized to the room left; None if even bar-less rows do not fit."""
    name_w = max(len(_HEADS[0]), min(max(len(r.name) for r in lanes), _NAME_CAP))
    in_w = max(len(r.inflight) for r in lanes)
    q_w = max(len(r.queued) for r in lanes)
    wait_w = max(len(_HEADS[3]), *(len(r.wait) for r in lanes))
    adm_w = max(len(_HEADS[4]), *(len(r.admit) for r in lanes))
    rej_w = max(len(_HEADS[5]), *(len(r.reject) for r in lanes))
    fixed = name_w + wait_w + adm_w + rej_w + 5 * len(_GAP)
    no_bars = fixed + max(in_w, len(_HEADS[1])) + max(q_w, len(_HEADS[2]))
    if no_bars > width:
        return None
    flags_w = max(len(r.flags) for r in lanes)
    # Bars share what is left after the numbers with the flags: room is kept for the
    # longest flags that still leave readable bars; longer ones go on a line of their own
    # rather than shrinking the bars to nothing.
    room = width - fixed - in_w - q_w - 2  # the two spaces between bar and count
    bar_w = 0
    for reserve in [*sorted({len(_GAP) + len(r.flags) for r in lanes if r.flags}, reverse=True), 0]:
        bar_w = min((room - reserve) // 2, _MAX_BAR)
        if bar_w >= _GOOD_BAR:
            break
    if bar_w < _MIN_BAR:
        bar_w = 0
    in_col = max(len(_HEADS[1]), in_w + (bar_w + 1 if bar_w else 0))
    q_col = max(len(_HEADS[2]), q_w + (bar_w + 1 if bar_w else 0))

    def cell(pair: tuple[float | None, float | None], count: str, count_w: int, col: int) -> str:
        text = count.rjust(count_w)
        if bar_w:
            text = bar(pair[0], pair[1], bar_w, g) + " " + text
        return text.rjust(col)

    # Over a bar the heading starts where the bar does; over a bare count it sits on the count.
    align = str.ljust if bar_w else str.rjust
    head = _GAP.join((_HEADS[0].ljust(name_w), align(_HEADS[1], in_col), align(_HEADS[2], q_col),
                      _HEADS[3].rjust(wait_w), _HEADS[4].rjust(adm_w), _HEADS[5].rjust(rej_w)))
    lines = [head + (_GAP + "FLAGS" if flags_w and len(head) + len(_GAP) + 5 <= width else "")]
    for r in lanes:
        row = _GAP.join((fit(r.name, name_w, g).ljust(name_w), cell(r.inflight_bar, r.inflight, in_w, in_col),
                         cell(r.queued_bar, r.queued, q_w, q_col), r.wait.rjust(wait_w),
                         r.admit.rjust(adm_w), r.reject.rjust(rej_w)))
        if r.flags and len(row) + len(_GAP) + len(r.flags) <= width:
            row += _GAP + r.flags
            r_flags = ""
        else:
            r_flags = r.flags
        lines.append(row)
        if r_flags:
            # Under the numbers, not the name, so it reads as this lane's and not as a lane.
            lines.append(fit(" " * (name_w + len(_GAP)) + r_flags, width, g))
    return lines


def _lane_stack(lanes: Sequence[_Lane], width: int, g: Glyphs) -> list[str]:
    """Two lines per lane, for terminals too narrow for the table."""
    lines: list[str] = []
    for r in lanes:
        lines.append(fit(f"{r.name}  in flight {r.inflight}  queued {r.queued}", width, g))
        detail = f"  wait {r.wait}  admit {r.admit}/s  reject {r.reject}/s"
        if r.flags:
            detail += f"  {r.flags}"
        lines.append(fit(detail, width, g))
    return lines


def _header(state: Mapping[str, Any], width: int, g: Glyphs, source: str) -> list[str]:
    now = _number(state, "time")
    status = [word for word, on in (("DRAINING", _flag(state, "draining")),
                                    ("SHADOW MODE", _flag(state, "shadow"))) if on]
    left = f"extproc top  {source}" if source else "extproc top"
    uptime = _number(state, "uptime_s")
    if uptime is not None:
        left += f"  up {fmt_duration(uptime, g)}"
    clock = _clock(now)
    if clock:
        left += f"  {clock}"
    right = "  ".join(status)
    if right:
        # The status words must survive any width: they are the reason to look.
        room = width - len(right) - 2
        line = (fit(left, room, g) + "  " + right) if room > 0 else fit(right, width, g)
    else:
        line = fit(left, width, g)
    lines = [line]

    policy = _mapping(state, "policy")
    if policy:
        sha = _text(policy, "sha256")
        ok, failed = _number(policy, "reloads_ok"), _number(policy, "reloads_failed")
        tail = ""
        if sha:
            tail += f" @{sha[:8]}"
        tail += f"  reloads {fmt_count(ok, g)} ok, {fmt_count(failed, g)} failed"
        loaded = _number(policy, "loaded_at")
        if loaded is not None and now is not None:
            tail += f"  loaded {fmt_duration(now - loaded, g)} ago"
        file = _text(policy, "file") or g.missing
        room = max(width - len("policy ") - len(tail), 12)
        lines.append(fit("policy " + _fit_left(file, room, g) + tail, width, g))
        errors = policy.get("last_error")
        problems = [clean(e) for e in errors] if isinstance(errors, list) else (
            [clean(errors)] if isinstance(errors, str) else [])
        problems = [p for p in problems if p]
        if problems:
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            stale = _number(policy, "stale_since")
            age = f" for {fmt_duration(now - stale, g)}" if stale is not None and now is not None else ""
            lines.append(fit(f"! file invalid{age}, old policy kept: {problems[0]}{more}", width, g))

    capacity = _mapping(state, "capacity")
    if capacity:
        inflight, limit = _number(capacity, "inflight"), _number(capacity, "limit")
        text = f"{fmt_count(inflight, g)}/{fmt_count(limit, g)} in flight  " \
               f"{fmt_count(_number(capacity, 'queued'), g)} queued"
        window = _number(state, "window_s")
        if window is not None:
            text += f"  rates over {fmt_duration(window, g)}"
        bar_w = min(_MAX_BAR * 2, width - len("capacity ") - len(text) - 2)
        if bar_w >= _MIN_BAR:
            text = bar(inflight, limit, bar_w, g) + "  " + text
        lines.append(fit("capacity " + text, width, g))
    return lines


def _saturation(state: Mapping[str, Any], width: int, g: Glyphs) -> list[str]:
    rules = _records(state, "saturation")
    if not rules:
        return []
    now = _number(state, "time")
    names = [_text(r, "rule") or g.missing for r in rules]
    name_w = min(max(len(n) for n in names), _NAME_CAP)
    rows: list[list[str]] = []
    for rule, name in zip(rules, names, strict=True):
        since = _number(rule, "since")
        if _flag(rule, "active"):
            status = "ACTIVE"
            if since is not None and now is not None:
                status += f" {fmt_duration(now - since, g)}"
        else:
            status = "idle"
        signal_text = _text(rule, "signal") or g.missing
        value = _number(rule, "value")
        if value is not None:
            signal_text += f"={fmt_value(value, g)}"
        parts = [fit(name, name_w, g).ljust(name_w), status, signal_text]
        if _flag(rule, "stale"):
            parts.append("STALE")
        error = _text(rule, "error")
        if error:
            parts.append(f"error: {error}")
        shed = rule.get("shed")
        if isinstance(shed, list) and shed:
            parts.append("shed " + ", ".join(clean(s) for s in shed))
        shrink = _mapping(rule, "shrink")
        factors = [f"{clean(lane)}{g.times}{fmt_value(_number(shrink, lane), g)}" for lane in shrink]
        if factors:
            parts.append("shrink " + ", ".join(factors))
        rows.append(parts)
    status_w = max(len(parts[1]) for parts in rows)
    lines = ["SATURATION"]
    for parts in rows:
        parts[1] = parts[1].ljust(status_w)
        lines.append(fit("  " + "  ".join(parts), width, g))
    return lines


def _signals(state: Mapping[str, Any], width: int, g: Glyphs) -> list[str]:
    signals = _records(state, "signals")
    if not signals:
        return []
    names = [_text(s, "name") or g.missing for s in signals]
    name_w = min(max(len(n) for n in names), _NAME_CAP)
    values = [fmt_value(_number(s, "value"), g) for s in signals]
    value_w = max(len(v) for v in values)
    lines = ["SIGNALS"]
    for s, name, value in zip(signals, names, values, strict=True):
        age = _number(s, "age_s")
        when = f"{fmt_duration(age, g)} ago" if age is not None else "never read"
        parts = [fit(name, name_w, g).ljust(name_w), value.rjust(value_w), when.ljust(12)]
        if _flag(s, "stale"):
            parts.append("STALE")
        error = _text(s, "error")
        if error:
            parts.append(f"error: {error}")
        lines.append(fit("  " + "  ".join(parts).rstrip(), width, g))
    return lines


def _rejection_counts(lane: Mapping[str, Any]) -> dict[str, float]:
    counts = _mapping(lane, "rejections")
    out: dict[str, float] = {}
    for reason in counts:
        value = _number(counts, reason)
        if value is not None:
            out[clean(reason)] = value
    return out


def _rejections(state: Mapping[str, Any], previous: Mapping[str, Any] | None, width: int,
                g: Glyphs) -> list[str]:
    before: dict[str, dict[str, float]] = {}
    if previous is not None:
        for lane in _records(previous, "lanes"):
            name = _text(lane, "name")
            if name:
                before[name] = _rejection_counts(lane)
    rows: list[tuple[str, str]] = []
    for lane in _records(state, "lanes"):
        name = _text(lane, "name") or g.missing
        counts = _rejection_counts(lane)
        if not any(counts.values()):
            continue
        old = before.get(name)
        parts = []
        for reason, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            if not count:
                continue
            # A count that went down means extproc restarted: no delta is better than a negative one.
            delta = count - old.get(reason, 0.0) if old is not None else 0.0
            grew = f" (+{fmt_count(delta, g)})" if delta > 0 else ""
            parts.append(f"{reason} {fmt_count(count, g)}{grew}")
        rows.append((name, "  ".join(parts)))
    if not rows:
        return []
    name_w = min(max(len(n) for n, _ in rows), _NAME_CAP)
    title = "REJECTIONS since start" + (" (+ since the last frame)" if previous is not None else "")
    return [fit(title, width, g)] + [fit(f"  {fit(n, name_w, g).ljust(name_w)}  {text}", width, g)
                                     for n, text in rows]


def render(state: Mapping[str, Any], width: int, height: int, previous: Mapping[str, Any] | None = None,
           *, source: str = "", error: str | None = None, ascii: bool = False) -> str:
    """One frame: at most ``height`` lines of at most ``width`` characters, no escape codes.

    ``previous`` is the state shown in the frame before, for what changed since
    (rejections by reason); ``source`` names the extproc being watched; ``error`` is
    why the latest fetch failed, shown above whatever ``state`` still holds.
    """
    g = ASCII if ascii else UNICODE
    width = max(width, _MIN_WIDTH)
    height = max(height, 1)
    lines: list[str] = []
    if state:
        lines += _header(state, width, g, source)
    else:
        lines.append(fit(f"extproc top  {source}" if source else "extproc top", width, g))
    if error:
        last = _clock(_number(state, "time")) if state else None
        note = f" (showing the state of {last})" if last else ""
        # Right under the title: the numbers below are old, and that must be read first.
        lines.insert(1, fit(f"! {clean(error)}{note}", width, g))
    version = state.get("version", STATE_VERSION)
    if version != STATE_VERSION:
        lines.append(fit(f"! state document version {clean(version)}; this top reads version "
                         f"{STATE_VERSION}: some values may be missing", width, g))
    if not state:
        return "\n".join(lines[:height])

    lanes = [_lane_row(lane, g) for lane in _records(state, "lanes")]
    lines.append("")
    if lanes:
        table = _lane_table(lanes, width, g)
        lines += table if table is not None else _lane_stack(lanes, width, g)
    else:
        lines.append("no lanes")
    for section in (_saturation(state, width, g), _signals(state, width, g),
                    _rejections(state, previous, width, g)):
        if section:
            lines.append("")
            lines += section
    return "\n".join(_fit_height(lines, width, height, g))


def _fit_height(lines: list[str], width: int, height: int, g: Glyphs) -> list[str]:
    if len(lines) <= height:
        return lines
    if height == 1:
        return lines[:1]
    # Blank separators go first: every line of content is worth more than spacing.
    lines = [line for line in lines if line]
    if len(lines) <= height:
        return lines
    hidden = len(lines) - (height - 1)
    plural = "s" if hidden > 1 else ""
    return [*lines[: height - 1], fit(f"{g.more} {hidden} more line{plural}: enlarge the window", width, g)]


# ---------------------------------------------------------------------------------------------
# Colour: applied to a finished frame, outside render, only for a terminal that wants it.

_BOLD, _RED, _YELLOW, _RESET = "\x1b[1m", "\x1b[31m", "\x1b[33m", "\x1b[0m"
_ALARM = re.compile(r"\b(DRAINING|STALE|CLOSED|ACTIVE(?: \S+)?)\b")
_NOTICE = re.compile(r"\b(PAUSED|SHED [^\s,]+|SHADOW(?: MODE)?|RETIRED|LIMIT [^\s,]+|BORROW \d+)(?=[\s,]|$)")
_SECTION = re.compile(r"^(LANE |SATURATION$|SIGNALS$|REJECTIONS )")


def paint(frame: str) -> str:
    """``frame`` with SGR colours: a bold title, red alarms and errors, yellow notices."""
    out = []
    for number, line in enumerate(frame.split("\n")):
        if line.startswith("! "):
            line = _RED + line + _RESET
        elif number == 0 or _SECTION.match(line):
            line = _BOLD + _ALARM.sub(lambda m: _RED + m.group(1) + _RESET + _BOLD, line) + _RESET
        else:
            line = _ALARM.sub(lambda m: _RED + m.group(1) + _RESET, line)
            line = _NOTICE.sub(lambda m: _YELLOW + m.group(1) + _RESET, line)
        out.append(line)
    return "\n".join(out)


def wants_colour(stream: TextIO) -> bool:
    """https://no-color.org: any non-empty NO_COLOR turns colour off; so does a pipe."""
    return stream.isatty() and not os.environ.get("NO_COLOR")


def wants_ascii(stream: TextIO) -> bool:
    """True when the stream's encoding cannot carry the Unicode glyphs (a stream of str can)."""
    encoding = getattr(stream, "encoding", None)
    if not encoding:
        return False
    try:
        "".join(vars(UNICODE).values()).encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return True
    return False


# ---------------------------------------------------------------------------------------------
# Fetching.


class FetchError(Exception):
    """The state could not be read; the message is for the operator as it stands."""


def state_url(target: str) -> tuple[str, str]:
    """(URL of the state document, name to show) from ``HOST:PORT`` or an http(s) URL."""
    if target.startswith(("http://", "https://")):
        parts = urlsplit(target)
        if not parts.netloc:
            raise ValueError(f"expected HOST:PORT or http://HOST:PORT, got {target!r}")
        path = parts.path if parts.path not in ("", "/") else STATE_PATH
        return f"{parts.scheme}://{parts.netloc}{path}", parts.netloc
    address = Address.parse(target)
    return f"http://{address}{STATE_PATH}", str(address)


def _refused(exc: aiohttp.ClientConnectorError) -> str:
    cause = exc.os_error
    if isinstance(cause, ConnectionRefusedError) or cause.errno == errno.ECONNREFUSED:
        return "connection refused"
    if cause.errno:
        return os.strerror(cause.errno).lower()
    return clean(cause) or type(cause).__name__


async def fetch_state(session: aiohttp.ClientSession, url: str, name: str, *, token: str | None,
                      within: float) -> dict[str, Any]:
    """GET the state document; any failure becomes a FetchError with a message fit to show."""
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=within),
                               allow_redirects=False) as response:
            if response.status in (401, 403):
                why = "token rejected" if token else f"token required ({TOKEN_ENV}, --token-file or --token)"
                raise FetchError(f"{response.status}: {why}")
            if response.status == 404:
                raise FetchError(f"404: {name} has no {urlsplit(url).path} (not extproc's admin port, "
                                 "or an extproc without it)")
            body = await response.content.read(_MAX_BODY + 1)
            if response.status != 200:
                detail = clean(body[:200].decode("utf-8", "replace")) or response.reason or ""
                raise FetchError(f"{response.status}: {detail}".rstrip(": "))
    except aiohttp.ClientConnectorDNSError:
        raise FetchError(f"cannot resolve {name}") from None
    except aiohttp.ClientConnectorError as exc:
        raise FetchError(f"cannot reach {name}: {_refused(exc)}") from None
    except TimeoutError:
        raise FetchError(f"{name} did not answer within {fmt_duration(within)}") from None
    except aiohttp.ServerDisconnectedError:
        raise FetchError(f"{name} closed the connection without answering") from None
    except aiohttp.ClientError as exc:
        raise FetchError(f"cannot read {name}: {clean(exc) or type(exc).__name__}") from None
    if len(body) > _MAX_BODY:
        raise FetchError(f"{name} answered with more than {_MAX_BODY // 2**20} MiB: not a state document")
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise FetchError(f"{name} did not answer with a JSON object: not a state document")
    return doc


# ---------------------------------------------------------------------------------------------
# The terminal.

_ALT_ON, _ALT_OFF = "\x1b[?1049h", "\x1b[?1049l"
_HIDE, _SHOW = "\x1b[?25l", "\x1b[?25h"
_HOME, _CLEAR = "\x1b[H", "\x1b[2J"


def _size(stream: TextIO) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(stream.fileno())
    except (OSError, ValueError, AttributeError):
        size = shutil.get_terminal_size()
    return size.columns, size.lines


@contextlib.contextmanager
def _screen(out: TextIO, keys: int | None) -> Iterator[None]:
    """The alternate screen with a hidden cursor and keys unbuffered; all undone on the way out."""
    saved = None
    if keys is not None:
        saved = termios.tcgetattr(keys)
        # cbreak, not raw: Ctrl-C still raises SIGINT, and output post-processing stays on.
        tty.setcbreak(keys, termios.TCSANOW)
    try:
        out.write(_ALT_ON + _HIDE + _CLEAR + _HOME)
        out.flush()
        yield
    finally:
        try:
            # The terminal may be gone (a dropped SSH session): nothing left to restore then.
            with contextlib.suppress(OSError):
                out.write(_SHOW + _ALT_OFF)
                out.flush()
        finally:
            if keys is not None and saved is not None:
                # TCSAFLUSH drops keys typed while quitting instead of leaking them to the shell.
                with contextlib.suppress(termios.error):
                    termios.tcsetattr(keys, termios.TCSAFLUSH, saved)


def _draw(out: TextIO, frame: str, width: int, height: int, colour: bool) -> None:
    lines = frame.split("\n")[:height]
    lines += [""] * (height - len(lines))
    # Padding every line to the full width overwrites the previous frame without a clear,
    # so a redraw never flickers; no newline after the last line, so the screen never scrolls.
    body = "\r\n".join(line.ljust(width) for line in lines)
    out.write(_HOME + (paint(body) if colour else body))
    out.flush()


@dataclass
class _Options:
    url: str
    name: str
    token: str | None
    interval: float
    timeout: float
    ascii: bool


async def _live(opts: _Options, out: TextIO, keys: int | None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    wake = asyncio.Event()
    refresh = asyncio.Event()
    exit_code = [0]

    def on_signal(signum: int) -> None:
        # Ctrl-C is how people leave a viewer: that is a clean exit, not a failure.
        exit_code[0] = 0 if signum == signal.SIGINT else 128 + signum
        stop.set()

    def on_key() -> None:
        assert keys is not None
        try:
            data = os.read(keys, 64)
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(keys)
        elif b"q" in data or b"Q" in data:
            stop.set()
        elif b"r" in data or b" " in data:
            refresh.set()
            wake.set()
        else:
            wake.set()

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    for sig in handled:
        loop.add_signal_handler(sig, on_signal, sig)
    loop.add_signal_handler(signal.SIGWINCH, wake.set)
    colour = wants_colour(out)
    state: dict[str, Any] = {}
    previous: dict[str, Any] | None = None
    error: str | None = None

    def draw() -> None:
        width, height = _size(out)
        frame = render(state, width, height, previous, source=opts.name, error=error, ascii=opts.ascii)
        _draw(out, frame, width, height, colour)

    async def until(*events: asyncio.Event, within: float) -> None:
        waiters = [asyncio.ensure_future(e.wait()) for e in events]
        try:
            await asyncio.wait(waiters, timeout=within, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    try:
        with _screen(out, keys):
            if keys is not None:
                loop.add_reader(keys, on_key)
            draw()
            async with aiohttp.ClientSession() as session:
                while not stop.is_set():
                    started = loop.time()
                    fetch = asyncio.ensure_future(
                        fetch_state(session, opts.url, opts.name, token=opts.token, within=opts.timeout))
                    stopper = asyncio.ensure_future(stop.wait())
                    try:
                        await asyncio.wait((fetch, stopper), return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        stopper.cancel()
                    if not fetch.done():
                        fetch.cancel()
                        with contextlib.suppress(asyncio.CancelledError, FetchError):
                            await fetch
                        break
                    try:
                        new = fetch.result()
                    except FetchError as exc:
                        error = f"{exc}; retrying every {opts.interval:g}s"
                    else:
                        previous, state, error = state or None, new, None
                    draw()
                    refresh.clear()
                    # Sleep out the interval, but redraw at once on a resize or a key.
                    while not stop.is_set() and not refresh.is_set():
                        remaining = started + opts.interval - loop.time()
                        if remaining <= 0:
                            break
                        wake.clear()
                        await until(stop, wake, within=remaining)
                        if wake.is_set() and not stop.is_set():
                            draw()
    finally:
        if keys is not None:
            loop.remove_reader(keys)
        for sig in (*handled, signal.SIGWINCH):
            loop.remove_signal_handler(sig)
    return exit_code[0]


# ---------------------------------------------------------------------------------------------
# The command.


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0.1:
        raise argparse.ArgumentTypeError(f"expected at least 0.1 seconds, got {text!r}")
    return value


def _width(text: str) -> int:
    if not text.isdigit() or int(text) < _MIN_WIDTH:
        raise argparse.ArgumentTypeError(f"expected at least {_MIN_WIDTH} columns, got {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--http", default=env("ADMIN", DEFAULT_ADMIN), metavar="HOST:PORT",
                        help=f"extproc's admin address, or an http(s):// URL (env {ADMIN_ENV}; "
                        "default %(default)s)")
    token = parser.add_mutually_exclusive_group()
    token.add_argument("--token", default=None,
                       help=f"admin bearer token (better: env {TOKEN_ENV} or --token-file; ps shows flags)")
    token.add_argument("--token-file", default=env("ADMIN_TOKEN_FILE", "") or None, metavar="PATH",
                       help=f"file holding the admin token (env {TOKEN_FILE_ENV})")
    parser.add_argument("--interval", type=_positive, default=1.0, metavar="SECONDS",
                        help="refresh period of the live view (default %(default)s)")
    parser.add_argument("--timeout", type=_positive, default=3.0, metavar="SECONDS",
                        help="give up on one fetch after this long (default %(default)s)")
    once = parser.add_mutually_exclusive_group()
    once.add_argument("--once", action="store_true", help="print one frame and exit (for scripts)")
    once.add_argument("--json", action="store_true", help="print the raw state document once and exit")
    parser.add_argument("--width", type=_width, default=None, metavar="COLUMNS",
                        help="frame width for --once (default: the terminal's, or $COLUMNS, or 80)")
    parser.add_argument("--ascii", action="store_true",
                        help="draw with ASCII only (automatic when the terminal's encoding is not Unicode)")


def _token(args: argparse.Namespace) -> str | None:
    """--token, else --token-file, else EXTPROC_ADMIN_TOKEN.

    Stripped: a token file, a mounted Secret or ``$(cat file)`` usually ends in a newline.
    """
    if args.token is not None:
        return str(args.token).strip() or None
    if args.token_file:
        return read_token(args.token_file)
    return os.environ.get(TOKEN_ENV, "").strip() or None


async def _once(opts: _Options) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        return await fetch_state(session, opts.url, opts.name, token=opts.token, within=opts.timeout)


def command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out if out is not None else sys.stdout
    try:
        url, name = state_url(args.http)
    except ValueError as exc:
        print(f"extproc top: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        token = _token(args)
    except (OSError, ValueError) as exc:
        print(f"extproc top: cannot read the admin token: {exc}", file=sys.stderr)
        return EXIT_USAGE
    opts = _Options(url=url, name=name, token=token, interval=args.interval, timeout=args.timeout,
                    ascii=args.ascii or wants_ascii(out))
    if args.once or args.json:
        try:
            state = asyncio.run(_once(opts))
        except FetchError as exc:
            print(f"extproc top: {exc}", file=sys.stderr)
            return EXIT_FETCH
        except KeyboardInterrupt:
            return 128 + signal.SIGINT
        if args.json:
            out.write(json.dumps(state, indent=2) + "\n")
            return 0
        width = args.width or _size(out)[0]
        # A script wants the whole frame, however long; only the live view is cut to the screen.
        frame = render(state, width, 1_000_000, source=name, ascii=opts.ascii)
        out.write((paint(frame) if wants_colour(out) else frame) + "\n")
        return 0
    if not out.isatty():
        print("extproc top: the live view needs a terminal; use --once or --json in scripts", file=sys.stderr)
        return EXIT_USAGE
    keys = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    try:
        return asyncio.run(_live(opts, out, keys))
    except KeyboardInterrupt:  # Ctrl-C before the loop took over SIGINT
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m extproc.tools.top``: the same command without the rest of the command line."""
    parser = argparse.ArgumentParser(prog="extproc top",
                                     description="A live terminal view of a running extproc.")
    add_arguments(parser)
    return command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

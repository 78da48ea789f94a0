"""``extproc top``: a live terminal view of a running extproc, read from its admin API.

How this works: the state is the admin API's ``State`` message, read over HTTP (the JSON of
``/admin/state``, parsed into the message) or over gRPC (``Admin.GetState``). ``View`` is a
rich renderable built from one state (and the one before it, for what changed); rich lays it
out at whatever size it is given, and ``View`` only decides what to leave out when the screen
is too short: blank lines first, then the lowest lines, counted. ``render`` turns a view into
plain text for tests and scripts. The live loop shows the view with rich's ``Live`` on the
alternate screen, redraws it every ``--interval`` and at once on a resize, reads keys in cbreak
mode (``r`` or space fetches now), and on ``q``, Ctrl-C, SIGTERM or SIGHUP restores the terminal
as it found it. A failed fetch is shown under the title, above the last good state, and retried
at the next tick. Every string the server sends goes through ``clean`` before it is drawn, and
never through rich markup, so no value can move the cursor or restyle the screen.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import io
import json
import math
import os
import shutil
import signal
import sys
import termios
import time
import tty
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TextIO
from urllib.parse import urlsplit

import aiohttp
from google.protobuf.message import Message
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.measure import Measurement
from rich.padding import Padding
from rich.segment import Segment, Segments
from rich.table import Table
from rich.text import Text

from extproc.api.admin.v1 import admin_pb2 as pb
from extproc.api.document import from_document, to_document
from extproc.settings import Address, env
from extproc.tools.client import AdminClient, add_token_arguments, clean, token_help, token_of
from extproc.tools.client import AdminError as FetchError

DEFAULT_ADMIN = "127.0.0.1:9091"
#: The same variables ``extproc serve`` reads, so one environment configures both ends.
ADMIN_ENV = "EXTPROC_ADMIN"
STATE_PATH = "/admin/state"
#: The ``State.version`` this viewer was written for. The server's is ``extproc.operations.STATE_VERSION``,
#: which a tool may not import (tests/unit/test_layout.py); a test keeps the two equal. Any other
#: version is drawn with a warning.
READS_VERSION = 1
#: A state document is a few kilobytes; anything this large is not one.
_MAX_BODY = 16 * 1024 * 1024
_MIN_WIDTH = 20

EXIT_FETCH = 1
EXIT_USAGE = 2

ALARM, NOTICE, HEAD = "red", "yellow", "bold"


# ---------------------------------------------------------------------------------------------
# Text for people.

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


def fmt_rate(per_second: float, g: Glyphs = UNICODE) -> str:
    """Events per second, short: 0, 0.05, 12.3, 450, 12k."""
    if not math.isfinite(per_second):
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


def fmt_value(value: float | None, g: Glyphs = UNICODE) -> str:
    """A reading: integers as integers, the rest to four significant digits."""
    if value is None or not math.isfinite(value):
        return g.missing
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"


def bar(value: float, total: float, width: int, g: Glyphs = UNICODE) -> str:
    """``width`` cells filled in proportion: anything above zero shows a cell, only a full lane a full bar."""
    if width <= 0:
        return ""
    if total <= 0 or value <= 0:
        return g.empty * width
    cells = width if value >= total else min(max(round(width * value / total), 1), width - 1)
    return g.fill * cells + g.empty * (width - cells)


def _clock(epoch: float) -> str:
    """The wall clock at ``epoch`` (empty when unknown)."""
    try:
        return time.strftime("%H:%M:%S", time.localtime(epoch)) if epoch else ""
    except (OverflowError, OSError, ValueError):
        return ""


def _optional(message: Message, field: str) -> float | None:
    """An ``optional double`` as a number, or None when unset."""
    return float(getattr(message, field)) if message.HasField(field) else None


def _since(state: pb.State, then: float | None, g: Glyphs) -> str:
    """How long ago ``then`` was at the state's time; empty if either is unknown."""
    return fmt_duration(state.time - then, g) if then is not None and state.time else ""


def _keep_end(text: str, width: int, g: Glyphs) -> str:
    """``text`` cut from the left: of a path, the file name matters most."""
    return text if len(text) <= width else g.more + text[len(text) - width + len(g.more):]


# ---------------------------------------------------------------------------------------------
# The view.

_NAME_CAP = 20


def _cut(text: str, style: str = "") -> Text:
    """One line that is cut with an ellipsis, never wrapped."""
    return Text(text, style=style, no_wrap=True, overflow="ellipsis")


def _words(parts: Iterable[tuple[str, str, bool]], sep: str = "  ", *, wrap: bool = False) -> Text:
    """The (text, style, shown) parts that are shown, in one Text; cut rather than wrapped unless told."""
    joint = Text(sep, no_wrap=not wrap, overflow="fold" if wrap else "ellipsis")
    return joint.join(Text(text, style=style) for text, style, shown in parts if shown)


def _section(title: str, rows: list[list[RenderableType]]) -> RenderableType | None:
    """A heading over borderless rows: a name, values, and a last column that gives way when narrow."""
    if not rows:
        return None
    table = Table(box=None, show_header=False, pad_edge=False, padding=(0, 1))
    table.add_column(no_wrap=True, overflow="ellipsis", max_width=_NAME_CAP)
    for _ in rows[0][2:]:
        table.add_column(no_wrap=True, overflow="ellipsis")
    table.add_column()  # wrappable, so rich shrinks it first; what it holds is cut, never wrapped
    for row in rows:
        table.add_row(*row)
    return Group(_cut(title, HEAD), Padding(table, (0, 0, 0, 2)))


@dataclass
class View:
    """One frame of ``extproc top``: a rich renderable that fits whatever size it is drawn at."""

    state: pb.State | None
    previous: pb.State | None = None
    source: str = ""
    error: str | None = None
    ascii: bool = False

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        g = ASCII if self.ascii else UNICODE
        opts = options.update(width=max(options.max_width, _MIN_WIDTH), height=None)
        top = [line for part in self._header(g, opts.max_width) for line in console.render_lines(part, opts)]
        blocks = [console.render_lines(part, opts) for part in self._sections(console, opts, g)]
        lines = top + [line for block in blocks for line in ([], *block)]
        height = options.height
        if height is not None and len(lines) > height:
            lines = top + [line for block in blocks for line in block]  # spacing goes first
        if height is not None and len(lines) > height:
            hidden = len(lines) - (height - 1)
            note = _cut(f"{g.more} {hidden} more line{'s' if hidden > 1 else ''}: enlarge the window")
            lines = lines[: height - 1] + console.render_lines(note, opts) if height > 1 else lines[:1]
        for line in lines:
            yield from _plain(line, self.ascii)
            yield Segment.line()

    def _header(self, g: Glyphs, width: int) -> Iterator[RenderableType]:
        state = self.state
        title = Text.assemble(("extproc top", HEAD), f"  {clean(self.source)}" if self.source else "")
        status = Text()
        if state is not None:
            title.append(f"  up {fmt_duration(state.uptime_s, g)}")
            title.append(f"  {_clock(state.time)}".rstrip())
            status = _words((("DRAINING", ALARM, state.draining), ("SHADOW MODE", NOTICE, state.shadow)))
        # A grid keeps the status words on the line whatever its width: they are the reason to look.
        line = Table.grid(expand=True, padding=(0, 2))
        line.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
        line.add_column(no_wrap=True, justify="right", overflow="ellipsis")
        line.add_row(title, status)
        yield line
        if self.error:
            seen = _clock(state.time) if state is not None else ""
            seen = f" (showing the state of {seen})" if seen else ""
            # Right under the title: the numbers below are old, and that must be read first.
            yield _cut(f"! {clean(self.error)}{seen}", ALARM)
        if state is None:
            return
        if state.version != READS_VERSION:
            yield _cut(f"! state version {state.version}; this top reads version {READS_VERSION}: "
                       "some values may be missing", ALARM)
        if state.HasField("policy"):
            policy = state.policy
            tail = f" @{clean(policy.sha256)[:8]}" if policy.sha256 else ""
            tail += f"  reloads {policy.reloads_ok} ok, {policy.reloads_failed} failed"
            if policy.loaded_at and state.time:
                tail += f"  loaded {fmt_duration(state.time - policy.loaded_at, g)} ago"
            file = _keep_end(clean(policy.file) or g.missing, max(width - len("policy ") - len(tail), 12), g)
            yield _cut(f"policy {file}{tail}")
            if problems := [p for p in map(clean, policy.last_error) if p]:
                age = _since(state, _optional(policy, "stale_since"), g)
                age = f" for {age}" if age else ""
                more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
                yield _cut(f"! file invalid{age}, old policy kept: {problems[0]}{more}", ALARM)
        if state.HasField("capacity"):
            cap = state.capacity
            text = f"{cap.inflight}/{cap.limit} in flight  {cap.queued} queued"
            text += f"  rates over {fmt_duration(state.window_s, g)}" if state.window_s else ""
            bar_w = min(32, width - len("capacity   ") - len(text))
            shown = bar(cap.inflight, cap.limit, bar_w, g) + "  " if bar_w >= 3 else ""
            yield _cut(f"capacity {shown}{text}")
            if cap.HasField("auto"):
                auto = cap.auto
                mode = "auto, shadow (not enforced)" if auto.mode == "shadow" else "auto"
                role = "" if auto.leader else ", following the fleet"
                age = _since(state, auto.since, g)
                moved = f" {age} ago" if age else ""
                yield _cut(f"limit {auto.limit} ({mode} in [{auto.min}, {auto.max}]{role}): "
                           f"{auto.reason}{moved}: {clean(auto.why)}")
                if auto.stale:
                    yield _cut("! no fresh engine signal: the limit holds, then decays to min", ALARM)
                if auto.HasField("unreachable"):
                    yield _cut(f"! target unreachable: {clean(auto.unreachable)}", ALARM)

    def _sections(self, console: Console, options: ConsoleOptions, g: Glyphs) -> Iterator[RenderableType]:
        if (state := self.state) is None:
            return
        yield _lanes(state, console, options, g) if state.lanes else Text("no lanes")
        for section in (_saturation(state, g), _signals(state, g), _rejections(state, self.previous, g),
                        _tenants(state, g)):
            if section is not None:
                yield section


def _plain(line: list[Segment], ascii: bool) -> Iterator[Segment]:
    """One rendered line without its trailing blanks; in ASCII mode with nothing but ASCII."""
    while line and not line[-1].control and not line[-1].text.rstrip():
        line = line[:-1]
    for n, segment in enumerate(line):
        text = segment.text.rstrip() if n == len(line) - 1 and not segment.control else segment.text
        if ascii:
            # rich cuts with "…" and names may hold anything; an ASCII terminal refuses both. Each
            # character becomes as many "?" as it takes cells, so columns stay aligned.
            text = "".join(c if c.isascii() else ASCII.more if c == "…" else "?" * cell_len(c) for c in text)
        yield Segment(text, segment.style, segment.control)


def _flags(lane: pb.Lane, g: Glyphs) -> list[tuple[str, str]]:
    """A lane's status words as (text, style), each shown whole or not at all: each one is news."""
    parts = (
        ("CLOSED", ALARM, lane.closed), ("RETIRED", NOTICE, lane.retired), ("PAUSED", NOTICE, lane.paused),
        (f"SHED {clean(lane.shed)}", NOTICE, lane.HasField("shed")), ("SHADOW", NOTICE, lane.shadow),
        (f"LIMIT {lane.limit}{g.arrow}{lane.effective_limit}", NOTICE, lane.effective_limit != lane.limit),
        (f"BORROW {lane.borrowed}", NOTICE, lane.borrowed > 0),
        (f"would reject {fmt_rate(lane.shadow_reject_per_s, g)}/s", "", lane.shadow_reject_per_s > 0),
    )
    return [(text, style) for text, style, shown in parts if shown]


_FLAG_SEP = ", "


def _flag_text(flags: list[tuple[str, str]]) -> Text:
    """The status words on one line, cut rather than wrapped (only ever drawn where they fit)."""
    return _words(((text, style, True) for text, style in flags), _FLAG_SEP)


def _flag_lines(flags: list[tuple[str, str]], width: int, indent: str) -> list[Text]:
    """The status words packed into lines of ``width`` cells after ``indent``, broken between words."""
    lines: list[list[tuple[str, str]]] = []
    used = 0
    for text, style in flags:
        size = cell_len(text)
        if lines and cell_len(indent) + used + cell_len(_FLAG_SEP) + size <= width:
            lines[-1].append((text, style))
            used += cell_len(_FLAG_SEP) + size
        else:
            lines.append([(text, style)])
            used = size
    return [Text.assemble(indent, _flag_text(line), no_wrap=True, overflow="ellipsis") for line in lines]


def _lane_table(state: pb.State, g: Glyphs, bar_w: int, flags: list[Text] | None) -> Table:
    table = Table(box=None, pad_edge=False, padding=(0, 1), header_style=HEAD)
    table.add_column("LANE", no_wrap=True, overflow="ellipsis", max_width=_NAME_CAP)
    for head in ("IN FLIGHT", "QUEUED", "WAIT p50/p95", "ADM/s", "REJ/s"):
        table.add_column(head, justify="right", no_wrap=True, overflow="ellipsis")
    if flags is not None:
        table.add_column("FLAGS", no_wrap=True, overflow="ellipsis")
    in_w = max(len(f"{lane.inflight}/{lane.effective_limit}") for lane in state.lanes)
    q_w = max(len(f"{lane.queued}/{lane.max_queued}") for lane in state.lanes)

    def gauge(value: int, total: int, count_w: int) -> str:
        return (bar(value, total, bar_w, g) + " " if bar_w else "") + f"{value}/{total}".rjust(count_w)

    for n, lane in enumerate(state.lanes):
        table.add_row(clean(lane.name) or g.missing, gauge(lane.inflight, lane.effective_limit, in_w),
                      gauge(lane.queued, lane.max_queued, q_w), _wait(lane, g), fmt_rate(lane.admit_per_s, g),
                      fmt_rate(lane.reject_per_s, g), *([flags[n]] if flags is not None else []))
    return table


def _wait(lane: pb.Lane, g: Glyphs) -> str:
    p50, p95 = _optional(lane, "wait_p50_s"), _optional(lane, "wait_p95_s")
    return f"{fmt_duration(p50, g)}/{fmt_duration(p95, g)}"


#: Status words on lines of their own start under the lane's name, indented by this.
_NOTE = "  "


def _lanes(state: pb.State, console: Console, options: ConsoleOptions, g: Glyphs) -> RenderableType:
    """The lane table with the widest bars that fit. The status words go in a FLAGS column when the
    longest fits beside the numbers on one line; else each lane's go on lines of their own under its
    row (a column that wrapped would break the rows apart); stacked lines when even the numbers
    do not fit."""
    flags = [_flags(lane, g) for lane in state.lanes]
    longest = max(_flag_text(f).cell_len for f in flags)
    width = options.max_width
    for beside, bar_w in ((True, 16), (True, 10), (True, 6), (False, 16), (False, 10), (False, 6),
                          (False, 4), (False, 0)):
        if beside and not longest:
            continue
        table = _lane_table(state, g, bar_w, None)
        room = width - (longest + 2 if beside else 0)
        if Measurement.get(console, options.update_width(10_000), table).maximum <= room:
            if beside:
                return _lane_table(state, g, bar_w, [_flag_text(f) for f in flags])
            return _noted(table, [_flag_lines(f, width, _NOTE) for f in flags], console, options)
    stack: list[RenderableType] = []
    for lane, words in zip(state.lanes, flags, strict=True):
        stack += [_cut(f"{clean(lane.name) or g.missing}  in flight {lane.inflight}/{lane.effective_limit}"
                       f"  queued {lane.queued}/{lane.max_queued}", HEAD),
                  _cut(f"  wait {_wait(lane, g)}  admit {fmt_rate(lane.admit_per_s, g)}/s  "
                       f"reject {fmt_rate(lane.reject_per_s, g)}/s")]
        stack += _flag_lines(words, width, _NOTE)
    return Group(*stack)


def _noted(table: Table, notes: list[list[Text]], console: Console,
           options: ConsoleOptions) -> RenderableType:
    """The table's rows, each followed by its lines of status words (rows are one line each: no
    column of the table wraps)."""
    lines = console.render_lines(table, options, pad=False)
    out: list[RenderableType] = [Segments([*lines[0], Segment.line()])]
    for line, below in zip(lines[1:], notes, strict=True):
        out += [Segments([*line, Segment.line()]), *below]
    return Group(*out)


def _saturation(state: pb.State, g: Glyphs) -> RenderableType | None:
    rows: list[list[RenderableType]] = []
    for rule in state.saturation:
        active = f"ACTIVE {_since(state, _optional(rule, 'since'), g)}".rstrip()
        shrink = ", ".join(f"{clean(k)}{g.times}{fmt_value(x, g)}" for k, x in sorted(rule.shrink.items()))
        error = clean(rule.error)
        detail = _words((("STALE", ALARM, rule.stale), (f"error: {error}", ALARM, bool(error)),
                         ("shed " + ", ".join(map(clean, rule.shed)), "", bool(rule.shed)),
                         (f"shrink {shrink}", "", bool(shrink))))
        value = f"={fmt_value(rule.value, g)}" if rule.HasField("value") else ""
        rows.append([clean(rule.rule) or g.missing, _cut(active, ALARM) if rule.active else "idle",
                     (clean(rule.signal) or g.missing) + value, detail])
    return _section("SATURATION", rows)


def _signals(state: pb.State, g: Glyphs) -> RenderableType | None:
    rows: list[list[RenderableType]] = []
    for sig in state.signals:
        age = _optional(sig, "age_s")
        error = clean(sig.error)
        detail = _words((("STALE", ALARM, sig.stale), (f"error: {error}", ALARM, bool(error))))
        value = Text(fmt_value(_optional(sig, "value"), g), justify="right")
        rows.append([clean(sig.name) or g.missing, value,
                     f"{fmt_duration(age, g)} ago" if age is not None else "never read", detail])
    return _section("SIGNALS", rows)


def _rejections(state: pb.State, previous: pb.State | None, g: Glyphs) -> RenderableType | None:
    before = {lane.name: lane.rejections for lane in previous.lanes} if previous is not None else {}
    rows: list[list[RenderableType]] = []
    for lane in state.lanes:
        parts = _counts(lane.rejections, before.get(lane.name))
        rows += [[clean(lane.name) or g.missing, _cut(parts)]] if parts else []
    # Refusals no single lane owns (an edge shed whose model decides its lane, a request refused before
    # it was classified): the metrics' lane "*".
    parts = _counts(state.any_lane_rejections, previous.any_lane_rejections if previous is not None else None)
    rows += [["* (any lane)", _cut(parts)]] if parts else []
    since = " (+ since the last frame)" if previous is not None else ""
    return _section(f"REJECTIONS since start{since}", rows)


def _counts(counts: Mapping[str, int], old: Mapping[str, int] | None) -> str:
    """Counts by reason, most first, each with its rise since ``old`` (None: no frame before)."""
    parts = []
    for reason, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        # A count that went down means extproc restarted: no delta is better than a negative one.
        delta = n - old.get(reason, 0) if old is not None else 0
        parts += [f"{clean(reason)} {n}" + (f" (+{delta})" if delta > 0 else "")] if n else []
    return "  ".join(parts)


def _tenants(state: pb.State, g: Glyphs) -> RenderableType | None:
    """Only while some tenant waits: that is when the fair share between them decides anything."""
    if not any(t.queued for t in state.tenants):
        return None
    return _section("TENANTS", [
        [clean(t.name) or g.missing, f"weight {fmt_value(t.weight, g)}", f"queued {t.queued}",
         _cut(", ".join(f"{clean(lane)} {n}" for lane, n in sorted(t.queued_by_lane.items(),
                                                                    key=lambda kv: (-kv[1], kv[0]))))]
        for t in sorted(state.tenants, key=lambda t: (-t.queued, t.name))])


def make_console(file: TextIO, *, colour: bool, terminal: bool = False, width: int | None = None) -> Console:
    """A console that writes only what it is told: no markup, no highlighting, colour only if asked."""
    return Console(file=file, width=width, force_terminal=terminal or colour, no_color=not colour,
                   color_system="standard" if colour else None, highlight=False, markup=False, emoji=False,
                   legacy_windows=False)


def render(state: pb.State | None, width: int, height: int | None = None, previous: pb.State | None = None,
           *, source: str = "", error: str | None = None, ascii: bool = False, colour: bool = False) -> str:
    """One frame as text: at most ``height`` lines (any number if None) of at most ``width`` cells."""
    buffer = io.StringIO()
    console = make_console(buffer, colour=colour, width=max(width, _MIN_WIDTH))
    console.print(View(state, previous, source=source, error=error, ascii=ascii), height=height)
    return buffer.getvalue().rstrip("\n")


def wants_colour(stream: TextIO) -> bool:
    """https://no-color.org: any non-empty NO_COLOR turns colour off; so does a pipe."""
    return stream.isatty() and not os.environ.get("NO_COLOR")


def wants_ascii(stream: TextIO) -> bool:
    """True when the stream's encoding is not a Unicode one (a stream of str has none: it takes anything)."""
    return not (getattr(stream, "encoding", None) or "utf-8").lower().startswith("utf")


# ---------------------------------------------------------------------------------------------
# Fetching: each source turns every failure into a FetchError with a message fit to show. Over gRPC
# the source is the admin API's client that `extproc admin` uses too (tools/client.py).


class StateSource(Protocol):
    """Where the state comes from; ``state`` raises FetchError and nothing else of its own."""

    async def state(self) -> pb.State: ...

    async def close(self) -> None: ...


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


def parse_state(body: bytes, name: str) -> pb.State:
    """The ``State`` in a JSON document: unknown keys are ignored, a value of the wrong type is not."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise FetchError(f"{name} did not answer with a JSON object: not a state document")
    try:
        return from_document(doc, pb.State)
    except ValueError as exc:
        raise FetchError(f"{name} sent a state this top cannot read: {clean(exc)}") from None


class HttpSource:
    """``GET /admin/state`` (or the URL given) with aiohttp, the JSON parsed into a State."""

    def __init__(self, url: str, name: str, token: str | None, within: float) -> None:
        self.url, self.name, self.token, self.within = url, name, token, within
        self._session: aiohttp.ClientSession | None = None

    async def state(self) -> pb.State:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        name = self.name
        try:
            async with self._session.get(self.url, headers=headers, allow_redirects=False,
                                         timeout=aiohttp.ClientTimeout(total=self.within)) as response:
                if response.status in (401, 403):
                    raise FetchError(f"{response.status}: {token_help(self.token)}")
                if response.status == 404:
                    raise FetchError(f"404: {name} has no {urlsplit(self.url).path} (not extproc's admin "
                                     "port, or an extproc without it)")
                body = await response.content.read(_MAX_BODY + 1)
                if response.status != 200:
                    detail = clean(body[:200].decode("utf-8", "replace")) or response.reason or ""
                    raise FetchError(f"{response.status}: {detail}".rstrip(": "))
        except aiohttp.ClientConnectorDNSError:
            raise FetchError(f"cannot resolve {name}") from None
        except aiohttp.ClientConnectorError as exc:
            cause = exc.os_error
            why = ("connection refused" if isinstance(cause, ConnectionRefusedError)
                   or cause.errno == errno.ECONNREFUSED else
                   os.strerror(cause.errno).lower() if cause.errno else clean(cause) or type(cause).__name__)
            raise FetchError(f"cannot reach {name}: {why}") from None
        except TimeoutError:
            raise FetchError(f"{name} did not answer within {fmt_duration(self.within)}") from None
        except aiohttp.ServerDisconnectedError:
            raise FetchError(f"{name} closed the connection without answering") from None
        except aiohttp.ClientError as exc:
            raise FetchError(f"cannot read {name}: {clean(exc) or type(exc).__name__}") from None
        if len(body) > _MAX_BODY:
            raise FetchError(f"{name} answered with more than {_MAX_BODY // 2**20} MiB: not a state document")
        return parse_state(body, name)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


# ---------------------------------------------------------------------------------------------
# The live view.


def _size(stream: TextIO) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(stream.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        size = shutil.get_terminal_size()
    return size.columns, size.lines


@contextlib.contextmanager
def _cbreak(fd: int | None) -> Iterator[None]:
    """Keys unbuffered while inside; the terminal's modes exactly as they were on the way out."""
    if fd is None:
        yield
        return
    saved = termios.tcgetattr(fd)
    # cbreak, not raw: Ctrl-C still raises SIGINT, and output post-processing stays on.
    tty.setcbreak(fd, termios.TCSANOW)
    try:
        yield
    finally:
        # TCSAFLUSH drops keys typed while quitting instead of leaking them to the shell.
        with contextlib.suppress(termios.error):
            termios.tcsetattr(fd, termios.TCSAFLUSH, saved)


async def _live(source: StateSource, name: str, out: TextIO, keys: int | None, *, interval: float,
                ascii: bool) -> int:
    loop = asyncio.get_running_loop()
    stop, now = asyncio.Event(), asyncio.Event()
    exit_code = 0
    console = make_console(out, colour=wants_colour(out), terminal=True)
    view = View(None, source=name, ascii=ascii)

    def on_signal(signum: int) -> None:
        nonlocal exit_code
        # Ctrl-C is how people leave a viewer: that is a clean exit, not a failure.
        exit_code = 0 if signum == signal.SIGINT else 128 + signum
        stop.set()

    def on_key(fd: int) -> None:
        try:
            data = os.read(fd, 64)
        except OSError:
            data = b""
        if not data:  # the terminal is gone: signals still end the view
            loop.remove_reader(fd)
        elif data[-1:] in b"qQ":
            stop.set()
        elif data[-1:] in b"rR ":
            now.set()

    def draw() -> None:
        # The size from the terminal itself each time, never from a stale $COLUMNS.
        console.size = _size(out)
        live.update(view, refresh=True)

    async def refresh() -> None:
        while True:
            started = loop.time()
            try:
                view.previous, view.state, view.error = view.state, await source.state(), None
            except FetchError as exc:
                view.error = f"{exc}; retrying every {interval:g}s"
            draw()
            now.clear()
            # Sleep out the interval, or until a key asks for a fetch now.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(started + interval - loop.time(), 0)):
                    await now.wait()

    try:
        with _cbreak(keys), Live(view, console=console, screen=True, auto_refresh=False,
                                 redirect_stdout=False, redirect_stderr=False) as live:
            # Handlers and the key reader go when asyncio.run closes the loop, after the terminal is restored.
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.add_signal_handler(sig, on_signal, sig)
            loop.add_signal_handler(signal.SIGWINCH, draw)
            if keys is not None:
                loop.add_reader(keys, on_key, keys)
            draw()
            task = asyncio.ensure_future(refresh())
            task.add_done_callback(lambda _: stop.set())  # a fault in it must end the view, not freeze it
            await stop.wait()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # raises what ended it, if not the cancel
    except OSError:
        # The terminal went away (a dropped SSH session) while quitting: nothing left to restore.
        if not stop.is_set():
            raise
    finally:
        await source.close()
    return exit_code


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
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--http", default=env("ADMIN", DEFAULT_ADMIN), metavar="HOST:PORT",
                       help=f"extproc's HTTP admin address, or an http(s):// URL (env {ADMIN_ENV}; "
                       "default %(default)s)")
    where.add_argument("--grpc", default=None, metavar="HOST:PORT",
                       help="read the state from extproc's gRPC admin API instead (its --admin-grpc address)")
    add_token_arguments(parser)
    parser.add_argument("--interval", type=_positive, default=1.0, metavar="SECONDS",
                        help="refresh period of the live view (default %(default)s)")
    parser.add_argument("--timeout", type=_positive, default=3.0, metavar="SECONDS",
                        help="give up on one fetch after this long (default %(default)s)")
    once = parser.add_mutually_exclusive_group()
    once.add_argument("--once", action="store_true", help="print one frame and exit (for scripts)")
    once.add_argument("--json", action="store_true", help="print the state document once and exit")
    parser.add_argument("--width", type=_width, default=None, metavar="COLUMNS",
                        help="frame width for --once (default: the terminal's, or $COLUMNS, or 80)")
    parser.add_argument("--ascii", action="store_true",
                        help="draw with ASCII only (automatic when the terminal's encoding is not Unicode)")


def _source(args: argparse.Namespace, token: str | None) -> tuple[StateSource, str]:
    if args.grpc:
        name = str(Address.parse(args.grpc))
        return AdminClient(name, token, args.timeout), name
    url, name = state_url(args.http)
    return HttpSource(url, name, token, args.timeout), name


async def _once(source: StateSource) -> pb.State:
    try:
        return await source.state()
    finally:
        await source.close()


def _fail(message: str, code: int) -> int:
    print(f"extproc top: {message}", file=sys.stderr)
    return code


def command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out if out is not None else sys.stdout
    try:
        token = token_of(args)
    except (OSError, ValueError) as exc:
        return _fail(f"cannot read the admin token: {exc}", EXIT_USAGE)
    try:
        source, name = _source(args, token)
    except ValueError as exc:
        return _fail(str(exc), EXIT_USAGE)
    ascii = args.ascii or wants_ascii(out)
    if args.once or args.json:
        try:
            state = asyncio.run(_once(source))
        except FetchError as exc:
            return _fail(str(exc), EXIT_FETCH)
        except KeyboardInterrupt:
            return 128 + signal.SIGINT
        if args.json:
            out.write(json.dumps(to_document(state), indent=2) + "\n")
            return 0
        width = max(args.width or _size(out)[0], _MIN_WIDTH)
        colour = wants_colour(out)
        # A script wants the whole frame, however long; only the live view is cut to the screen.
        make_console(out, colour=colour, width=width).print(View(state, source=name, ascii=ascii))
        return 0
    if not out.isatty():
        return _fail("the live view needs a terminal; use --once or --json in scripts", EXIT_USAGE)
    keys = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    try:
        return asyncio.run(_live(source, name, out, keys, interval=args.interval, ascii=ascii))
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


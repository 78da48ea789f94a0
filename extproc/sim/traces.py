"""Replay recorded traffic: public LLM traces and extproc's own, streamed, in arrival order.

Formats (detected from the CSV header or the first JSON record's keys, or named):

* ``azure`` — Azure LLM inference trace 2023: CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``,
  timestamps with seven fractional digits (one more than ``%f`` parses);
* ``mooncake`` — JSONL ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``
  (``hash_ids`` name shared prompt prefixes; the engine model has no prefix cache, so they are
  read and not used);
* ``burstgpt`` — CSV ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``
  (a failed request has 0 response tokens: it is replayed asking for one);
* ``jsonl`` — extproc's own trace (``extproc sim load --write-trace``);
* ``decision-log`` — extproc's JSON log: its decision records, each request's first attempt.
  Records are written when a request ends, so slightly out of arrival order: a bounded buffer
  puts them back in order (a record later than the buffer can mend is an error).

A public trace has token counts and times only; :class:`Assign` makes each record a request of
one of a workload spec's classes (its path, tenants and API keys, stream flag): by the classes'
shares (seeded), or by a column's value (``Model``, ``Log Type``, …); tenants by their weights in
the class or by a column. Prompts are synthesized to the recorded token counts when sent.

Nothing is loaded whole: a trace is read line by line each time it is iterated. A malformed line
is an error naming the file and its 1-based line number (a CSV header counts as line 1), or with
``skip_bad`` is skipped and counted.
"""

from __future__ import annotations

import argparse
import csv
import heapq
import io
import json
import math
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, get_args

from extproc.sim.workload import Request, WorkloadSpec, make_request

Format = Literal["azure", "mooncake", "burstgpt", "jsonl", "decision-log"]
FORMATS: tuple[str, ...] = get_args(Format)
PUBLIC: frozenset[str] = frozenset({"azure", "mooncake", "burstgpt"})

_AZURE = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_BURSTGPT = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
_MOONCAKE = {"timestamp", "input_length", "output_length"}
_OWN = {"index", "at", "cls", "tenant", "prompt_tokens", "output_tokens"}
#: Decision-log records a request's first attempt may be this far out of order by default.
REORDER = 10_000


class TraceError(ValueError):
    """A trace that cannot be read: the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Record:
    """One line of a public trace, before it becomes a request."""

    line: int
    at: float
    """Seconds from the trace's epoch (its first record's time for azure, as recorded otherwise)."""
    prompt_tokens: int
    output_tokens: int
    columns: Mapping[str, str] = field(default_factory=dict)
    """The other columns (BurstGPT's Model and Log Type), for mapping to classes and tenants."""


@dataclass(frozen=True)
class Assign:
    """How a public trace's records become requests of a workload's classes."""

    spec: WorkloadSpec
    by: str = "ratio"
    """``ratio`` (the classes' shares, seeded) or a column name."""
    mapping: Mapping[str, str] = field(default_factory=dict)
    """With a column: its value → class name (every value seen must be mapped)."""
    tenant_column: str | None = None
    """Tenants from this column's values instead of the class's weights."""

    def problems(self) -> list[str]:
        names = {c.name for c in self.spec.classes}
        out = []
        if self.by == "ratio" and self.mapping:
            out.append("--class-map needs --classes COLUMN (with ratio, the workload's shares decide)")
        if self.by != "ratio" and not self.mapping:
            out.append(f"--classes {self.by!r} needs --class-map VALUE=CLASS,...")
        unknown = sorted(set(self.mapping.values()) - names)
        if unknown:
            out.append(f"--class-map names classes the workload does not have: {', '.join(unknown)} "
                       f"(it has {', '.join(sorted(names))})")
        return out


@dataclass(frozen=True)
class Replay:
    """What to take from a trace and how to play it."""

    speedup: float = 1.0
    """Time runs this many times faster (gaps shrink, the arrival pattern is kept)."""
    rate_scale: float = 1.0
    """Keep each request with this probability (< 1), or send it this many times on average (> 1)."""
    window: tuple[float, float | None] = (0.0, None)
    """Seconds from the trace's start (before speedup): only arrivals in [start, end)."""
    seed: int = 1
    skip_bad: bool = False
    reorder: int = REORDER
    limit: int | None = None
    """At most this many requests."""

    def problems(self) -> list[str]:
        out = []
        if not (self.speedup > 0 and math.isfinite(self.speedup)):
            out.append(f"--speedup must be a positive number, got {self.speedup:g}")
        if not (self.rate_scale > 0 and math.isfinite(self.rate_scale)):
            out.append(f"--rate-scale must be a positive number, got {self.rate_scale:g}")
        start, end = self.window
        if start < 0 or (end is not None and end <= start):
            out.append(f"--window must be START:END with 0 <= START < END, got {start:g}:{end}")
        if self.reorder < 1:
            out.append("--reorder-buffer must be at least 1")
        if self.limit is not None and self.limit < 1:
            out.append("--max-requests must be at least 1")
        return out


def parse_window(text: str) -> tuple[float, float | None]:
    """``START:END`` (seconds; END may be empty: to the end)."""
    start, sep, end = text.partition(":")
    try:
        return float(start or 0), (float(end) if end else None) if sep else None
    except ValueError:
        raise ValueError(f"--window: expected START:END in seconds, got {text!r}") from None


def parse_map(text: str) -> dict[str, str]:
    """``VALUE=CLASS,VALUE=CLASS``."""
    out = {}
    for part in text.split(","):
        value, sep, cls = part.partition("=")
        if not sep or not value.strip() or not cls.strip():
            raise ValueError(f"--class-map: expected VALUE=CLASS[,VALUE=CLASS...], got {text!r}")
        out[value.strip()] = cls.strip()
    return out


def detect(path: str | Path) -> Format:
    """The format of ``path``, from its first line (a CSV header or a JSON record)."""
    with Path(path).open(errors="replace") as source:
        first = next((line for line in source if line.strip()), "")
    text = first.strip().lstrip("\ufeff")
    if not text:
        raise TraceError(f"{path}: empty: no trace records")
    if text.startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError:
            raise TraceError(f"{path}:1: the first line starts a JSON record but is not JSON") from None
        keys = set(doc) if isinstance(doc, dict) else set()
        if keys >= _MOONCAKE:
            return "mooncake"
        if keys >= _OWN:
            return "jsonl"
        if "event" in keys:
            return "decision-log"
        raise TraceError(f"{path}:1: a JSON record with keys {sorted(keys)}: not a Mooncake record "
                         f"({', '.join(sorted(_MOONCAKE))}), an extproc trace or decision log")
    header = tuple(cell.strip() for cell in next(csv.reader([text])))
    if header == _AZURE:
        return "azure"
    if header[:len(_BURSTGPT)] == _BURSTGPT:
        return "burstgpt"
    if _log_follows(path):
        return "decision-log"  # console lines first (start-up messages), then the JSON records
    raise TraceError(f"{path}:1: unknown trace format: header {','.join(header)!r} (Azure: "
                     f"{','.join(_AZURE)}; BurstGPT: {','.join(_BURSTGPT)}); name it with --trace-format")


def _log_follows(path: str | Path, lines: int = 200) -> bool:
    with Path(path).open(errors="replace") as source:
        for _, line in zip(range(lines), source, strict=False):
            if line.lstrip().startswith("{"):
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue
                return isinstance(doc, dict) and "event" in doc
    return False


class Trace:
    """A trace file, read anew each time it is iterated: ``for request in trace``."""

    def __init__(self, path: str | Path, fmt: Format | None = None, *, assign: Assign | None = None,
                 replay: Replay | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise TraceError(f"{path}: no such file")
        self.format: Format = fmt or detect(self.path)
        self.assign = assign
        self.replay = replay or Replay()
        problems = self.replay.problems() + (assign.problems() if assign is not None else [])
        if self.format in PUBLIC and assign is None:
            problems.append(f"a {self.format} trace has no lanes or tenants: give a workload whose classes "
                            "they become")
        if self.format not in PUBLIC and assign is not None and (
                assign.by != "ratio" or assign.mapping or assign.tenant_column):
            problems.append("--classes, --class-map and --tenant-column are for public traces; a "
                            f"{self.format} trace carries each request's own path, headers and tenant")
        if problems:
            raise TraceError("; ".join(problems))
        self.bad = 0
        """Malformed lines skipped in the last pass (with ``skip_bad``)."""
        self.requests = 0
        """Requests yielded in the last complete pass."""

    # -- passes -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Request]:
        self.bad = 0
        count = 0
        rng = random.Random(self.replay.seed)
        for request in self._scaled(self._timed(self._sourced(rng)), rng):
            yield request
            count += 1
        self.requests = count

    def mix(self) -> tuple[int, float, float, float]:
        """One pass over the window at speedup 1: (requests, seconds spanned, mean prompt tokens, mean
        output tokens) — what a load target is computed from."""
        unscaled = Trace(self.path, self.format, assign=self.assign, replay=Replay(
            window=self.replay.window, seed=self.replay.seed, skip_bad=self.replay.skip_bad,
            reorder=self.replay.reorder, limit=self.replay.limit))
        n, prompt, output, first, last = 0, 0, 0, math.inf, -math.inf
        for r in unscaled:
            n, prompt, output = n + 1, prompt + r.prompt_tokens, output + r.output_tokens
            first, last = min(first, r.at), max(last, r.at)
        if n == 0:
            raise TraceError(f"{self.path}: no requests in the window")
        return n, max(last - first, 0.0), prompt / n, output / n

    # -- stages -------------------------------------------------------------------------------

    def _sourced(self, rng: random.Random) -> Iterator[Request]:
        """Requests in arrival order, ``at`` in seconds from the trace's first arrival."""
        if self.format == "jsonl":
            yield from self._own()
        elif self.format == "decision-log":
            yield from self._ordered(self._logged())
        else:
            assert self.assign is not None
            origin: float | None = None
            previous = -math.inf
            make = _Maker(self.assign, rng)
            for record in self._public():
                if origin is None:
                    origin = record.at
                if record.at < previous:
                    raise TraceError(f"{self.path}:{record.line}: out of arrival order ({record.at:g} after "
                                     f"{previous:g})")
                previous = record.at
                yield make(record, record.at - origin)

    def _timed(self, requests: Iterator[Request]) -> Iterator[Request]:
        # A window starts at its start: the gap to its first arrival is kept, as every other gap.
        start, end = self.replay.window
        speedup = self.replay.speedup
        for r in requests:
            if r.at < start:
                continue
            if end is not None and r.at >= end:
                return
            yield r if start == 0 and speedup == 1 else _with(r, at=(r.at - start) / speedup)

    def _scaled(self, requests: Iterator[Request], rng: random.Random) -> Iterator[Request]:
        scale, limit = self.replay.rate_scale, self.replay.limit
        index = 0
        copies: list[Request] = []
        for r in requests:
            n = int(scale) + (1 if rng.random() < scale - int(scale) else 0)
            for _ in range(n):
                copies.append(r)
            for r2 in copies:
                if limit is not None and index >= limit:
                    return
                yield _with(r2, index=index)
                index += 1
            copies.clear()

    # -- readers ------------------------------------------------------------------------------

    def _lines(self) -> Iterator[tuple[int, str]]:
        with self.path.open(newline="", errors="replace") as source:
            for number, line in enumerate(source, 1):
                if line.strip():
                    yield number, line

    def _bad(self, number: int, what: str) -> None:
        if not self.replay.skip_bad:
            raise TraceError(f"{self.path}:{number}: {what} (--skip-bad skips and counts such lines)")
        self.bad += 1

    def _public(self) -> Iterator[Record]:
        parse: Callable[[int, str], Record | None]
        if self.format == "mooncake":
            parse = self._mooncake
            lines = self._lines()
        else:
            lines = self._lines()
            header_number, header_line = next(lines, (0, ""))
            header = [cell.strip() for cell in next(csv.reader([header_line.lstrip("\ufeff")]))]
            expected = _AZURE if self.format == "azure" else _BURSTGPT
            if tuple(header[:len(expected)]) != expected:
                raise TraceError(f"{self.path}:{header_number or 1}: expected the {self.format} header "
                                 f"{','.join(expected)!r}, got {header_line.strip()!r}")
            parse = self._azure if self.format == "azure" else self._burstgpt_of(header)
        for number, line in lines:
            record = parse(number, line)
            if record is not None:
                yield record

    def _azure(self, number: int, line: str) -> Record | None:
        cells = line.rstrip("\r\n").split(",")
        if len(cells) != 3:
            self._bad(number, f"expected 3 columns ({','.join(_AZURE)}), got {len(cells)}")
            return None
        try:
            at = _azure_time(cells[0])
            prompt, output = int(cells[1]), int(cells[2])
        except ValueError as exc:
            self._bad(number, f"not an Azure trace row: {exc}")
            return None
        if prompt < 0 or output < 0:
            self._bad(number, "negative token counts")
            return None
        return Record(number, at, max(prompt, 1), max(output, 1))

    def _burstgpt_of(self, header: list[str]) -> Callable[[int, str], Record | None]:
        width = len(header)

        def parse(number: int, line: str) -> Record | None:
            cells = next(csv.reader(io.StringIO(line)), [])
            if len(cells) != width:
                self._bad(number, f"expected {width} columns, got {len(cells)}")
                return None
            row = dict(zip(header, (c.strip() for c in cells), strict=True))
            try:
                at = float(row["Timestamp"])
                prompt, output = int(float(row["Request tokens"])), int(float(row["Response tokens"]))
            except ValueError as exc:
                self._bad(number, f"not a BurstGPT row: {exc}")
                return None
            if not math.isfinite(at) or at < 0 or prompt < 0 or output < 0:
                self._bad(number, "a negative or non-finite time or token count")
                return None
            extra = {k: v for k, v in row.items()
                     if k not in ("Timestamp", "Request tokens", "Response tokens", "Total tokens")}
            return Record(number, at, max(prompt, 1), max(output, 1), extra)

        return parse

    def _mooncake(self, number: int, line: str) -> Record | None:
        try:
            doc = json.loads(line)
        except ValueError:
            self._bad(number, "not JSON")
            return None
        if not isinstance(doc, dict) or not set(doc) >= _MOONCAKE:
            self._bad(number, f"a Mooncake record needs {', '.join(sorted(_MOONCAKE))}")
            return None
        try:
            at, prompt, output = float(doc["timestamp"]) / 1000.0, int(doc["input_length"]), \
                int(doc["output_length"])
        except (TypeError, ValueError) as exc:
            self._bad(number, f"not a Mooncake record: {exc}")
            return None
        if not math.isfinite(at) or at < 0 or prompt < 0 or output < 0:
            self._bad(number, "a negative or non-finite time or token count")
            return None
        extra = {k: str(v) for k, v in doc.items() if k not in _MOONCAKE and k != "hash_ids"
                 and isinstance(v, str | int | float)}
        return Record(number, at, max(prompt, 1), max(output, 1), extra)

    def _own(self) -> Iterator[Request]:
        previous = -math.inf
        for number, line in self._lines():
            try:
                doc = json.loads(line)
                request = Request(**doc)
            except (ValueError, TypeError) as exc:
                self._bad(number, f"not an extproc trace record: {exc}")
                continue
            if request.at < previous:
                raise TraceError(f"{self.path}:{number}: out of arrival order ({request.at:g} after "
                                 f"{previous:g})")
            previous = request.at
            yield request

    def _logged(self) -> Iterator[tuple[float, int, dict[str, Any]]]:
        for number, line in self._lines():
            text = line.strip()
            if not text.startswith("{"):
                continue  # console lines, start-up messages
            try:
                doc = json.loads(text)
            except ValueError:
                self._bad(number, "a log line that starts a JSON record but is not JSON")
                continue
            if not isinstance(doc, dict) or doc.get("event") != "decision" or "arrival" not in doc:
                continue
            if _is_retry(doc):
                continue  # the replay's own clients retry what was refused: not twice
            try:
                arrival = float(doc["arrival"])
            except (TypeError, ValueError):
                self._bad(number, f"arrival is not a number: {doc.get('arrival')!r}")
                continue
            yield arrival, number, doc

    def _ordered(self, records: Iterator[tuple[float, int, dict[str, Any]]]) -> Iterator[Request]:
        buffer: list[tuple[float, int, dict[str, Any]]] = []
        origin: float | None = None
        last = -math.inf

        def emit(item: tuple[float, int, dict[str, Any]]) -> Request:
            nonlocal origin, last
            arrival, number, doc = item
            if arrival < last:
                raise TraceError(f"{self.path}:{number}: a decision record {last - arrival:.3f}s earlier "
                                 f"than one already replayed: more out of order than the reorder buffer "
                                 f"({self.replay.reorder} records) mends; raise --reorder-buffer")
            last = arrival
            if origin is None:
                origin = arrival
            return _from_log(doc, arrival - origin)

        for item in records:
            heapq.heappush(buffer, item)
            if len(buffer) > self.replay.reorder:
                yield emit(heapq.heappop(buffer))
        while buffer:
            yield emit(heapq.heappop(buffer))


class _Maker:
    """Public trace records → requests of the workload's classes."""

    def __init__(self, assign: Assign, rng: random.Random) -> None:
        self.assign, self.rng = assign, rng
        self.classes = {c.name: c for c in assign.spec.classes}
        self.shares = {c.name: c.share for c in assign.spec.classes}
        self.index = 0

    def __call__(self, record: Record, at: float) -> Request:
        assign = self.assign
        if assign.by == "ratio":
            cls = self.classes[_pick(self.shares, self.rng)]
        else:
            value = record.columns.get(assign.by)
            if value is None:
                raise TraceError(f"line {record.line}: no column {assign.by!r} "
                                 f"(columns: {', '.join(sorted(record.columns)) or 'none'})")
            name = assign.mapping.get(value)
            if name is None:
                raise TraceError(f"line {record.line}: {assign.by} {value!r} is not in --class-map")
            cls = self.classes[name]
        tenant = None
        if assign.tenant_column is not None:
            tenant = record.columns.get(assign.tenant_column)
            if tenant is None:
                raise TraceError(f"line {record.line}: no column {assign.tenant_column!r}")
        request = make_request(assign.spec, cls, self.index, at, record.prompt_tokens, record.output_tokens,
                               self.rng, tenant=tenant)
        self.index += 1
        return request


def _pick(weights: Mapping[str, float], rng: random.Random) -> str:
    names = list(weights)
    return rng.choices(names, weights=[weights[n] for n in names])[0]


def _with(r: Request, **changes: Any) -> Request:
    return replace(r, **changes)


def _azure_time(text: str) -> float:
    """``2023-11-16 18:15:46.6805900`` → POSIX seconds (any number of fractional digits)."""
    text = text.strip()
    whole, _, fraction = text.partition(".")
    if fraction and not fraction.isdigit():
        raise ValueError(f"bad fractional seconds in {text!r}")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
    return base.timestamp() + (float(f"0.{fraction}") if fraction else 0.0)


def _is_retry(doc: Mapping[str, Any]) -> bool:
    """Whether a decision record is a client's retry (extproc's flag, or the SDKs' retry header)."""
    if doc.get("retry") is True:
        return True
    headers = doc.get("headers") or {}
    count = headers.get("x-stainless-retry-count") if isinstance(headers, Mapping) else None
    try:
        return count is not None and int(count) > 0
    except (TypeError, ValueError):
        return False


def _from_log(doc: Mapping[str, Any], at: float) -> Request:
    return Request(
        index=0, at=at, cls=doc.get("lane") or "unknown", tenant=doc.get("tenant") or "default",
        prompt_tokens=max(1, int(doc.get("prompt_tokens") or 1)),
        output_tokens=max(1, int(doc.get("output_tokens") or 1)), path=doc.get("path") or "/",
        headers=dict(doc.get("headers") or {}), stream=True, model=doc.get("model") or "unknown",
    )


# -- command line (extproc simulate --trace, extproc sim load --trace) ------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The trace options ``simulate`` and ``sim load`` share (``--trace`` itself is theirs)."""
    group = parser.add_argument_group("trace replay")
    group.add_argument("--trace-format", choices=("auto", *FORMATS), default="auto",
                       help="the trace's format (default: detected from its header or first record)")
    group.add_argument("--speedup", type=float, default=1.0,
                       help="play the trace this many times faster (the arrival pattern is kept)")
    group.add_argument("--rate-scale", type=float, default=1.0,
                       help="keep each request with this probability (< 1) or send it this many times on "
                       "average (> 1)")
    group.add_argument("--window", type=parse_window, default=(0.0, None), metavar="START:END",
                       help="only arrivals this many seconds from the trace's start (before --speedup)")
    group.add_argument("--max-requests", type=int, default=None, help="at most this many requests")
    group.add_argument("--classes", default="ratio", metavar="ratio|COLUMN",
                       help="public traces: each request becomes one of the workload's classes by their "
                       "shares (ratio), or by this column's value (e.g. Model, 'Log Type') with --class-map")
    group.add_argument("--class-map", type=parse_map, default={}, metavar="VALUE=CLASS,...",
                       help="with --classes COLUMN: which class each value of the column becomes")
    group.add_argument("--tenant-column", default=None,
                       help="public traces: tenants from this column (default: the class's tenant weights)")
    group.add_argument("--skip-bad", action="store_true",
                       help="skip malformed lines and count them (default: stop at the first, naming it)")
    group.add_argument("--reorder-buffer", type=int, default=REORDER, metavar="N",
                       help="decision logs: records may be up to N out of arrival order")


def from_args(args: argparse.Namespace, spec: WorkloadSpec) -> Trace:
    """The trace the arguments name; ``spec``'s classes are what a public trace's records become."""
    fmt = None if args.trace_format == "auto" else args.trace_format
    replay = Replay(speedup=args.speedup, rate_scale=args.rate_scale, window=args.window, seed=args.seed,
                    skip_bad=args.skip_bad, reorder=args.reorder_buffer, limit=args.max_requests)
    return Trace(args.trace, fmt, assign=Assign(spec, args.classes, args.class_map, args.tenant_column),
                 replay=replay)


def with_speedup(trace: Trace, speedup: float) -> Trace:
    """``trace`` played ``speedup`` times faster (instead of its own speedup)."""
    return Trace(trace.path, trace.format, assign=trace.assign,
                 replay=replace(trace.replay, speedup=speedup))

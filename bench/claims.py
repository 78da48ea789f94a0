"""Figures in README.md and docs/*.md, checked against the results files they come from.

How this works. A figure the documents quote from a results file under ``bench/results/`` carries
a marker, an HTML comment right after it (Markdown shows neither):

    interactive TTFT p99 10.0 s<!-- claim: trace_azure.json#runs.policy.lanes.interactive.ttft.p99 -->

* ``<!-- claim: FILE#EXPR -->`` — the figure just before it (a number, then at most a unit without
  spaces, such as ``s``, ``ms``, ``%``, ``×`` or ``/s``, and closing ``*``, ``_`` or ``)``) is EXPR
  evaluated on FILE. ``<!-- claims: FILE -->`` or ``<!-- claims: FILE#BASE -->`` names the file
  (and a base) for the claims after it, up to the next such marker or heading: they read
  ``<!-- claim: #EXPR -->``, and a path in EXPR that starts with ``.`` or ``[`` continues BASE.
* EXPR is a small expression on the file's JSON: keys as attributes (``runs.policy.ttft``) or
  subscripts (``runs["no admission control"]``, ``points[0]``), numbers, ``+ - * /``, and
  ``min``, ``max``, ``abs``, ``len`` and ``numbers`` (the numbers in a text: ``numbers("42/42")[0]``).
  Scales are written in it: a fraction quoted in percent is
  ``x * 100``, seconds quoted in milliseconds ``x * 1000``, a ratio ``a / b``. A Markdown results
  file is read as its tables: ``table.ROW.COLUMN`` (the row named by its first cell).
* **Rounding:** the figure as written must be the value rounded to the decimals written: 1.04
  stands for [1.035, 1.045], 37 for [36.5, 37.5], 1,068 for 1068 (ties either way). A leading
  ``−`` or ``-`` (after a space or an opening bracket) makes it negative, ``+`` is a plus sign.

A figure that comes from a results file and is left unmarked is found as follows. A *results
block* is a paragraph, list item or table (blocks are separated by blank lines, list items and
headings) that names a results file (``bench/results/…`` or a file name found there) or a
benchmark (``bench/NAME.py``), or holds a claim marker, or comes after a ``claims:`` marker in the
same section; the tables and list items after a results paragraph are results blocks too (its
caption, its lead-in). Every number in a results block must be marked, but for these, which are
not figures read from a file:

* numbers in code (fenced blocks, ``code spans``), in HTML comments and in link targets;
* numbers that are part of a name (``70B``, ``H100``, ``p99``, ``#19``, ``x-…-2``, ``v1``), a ratio
  or a split (``3:1``, ``80/20``); a number with ``k`` or ``M`` after it is a figure (``75k``);
* a table's header row and first column (its labels);
* targets and bounds: numbers right after ``≤``, ``≥``, ``<``, ``>`` or ``±`` (or after ``≤ NAME +``),
  and right before ``±``;
* the phrases in :data:`GIVEN` (the inputs of a run: its load, its length, its workload), each
  with the reason it is there.

    .venv/bin/python bench/claims.py [--list] [FILE.md ...]

prints every marked figure that differs from its file (with the file's value) and every unmarked
one; ``--list`` prints every claim. Exit status 1 when anything is wrong. ``make claims`` reruns
the simulator's results (``bench/simulate_claims.py``) and then this.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def documents(root: Path = ROOT) -> list[Path]:
    """The documents whose figures are checked: README.md and docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


#: Numbers in results blocks that are not read from a results file: (phrase, why). A phrase is a
#: regular expression; every number inside one of its matches is exempt.
GIVEN: tuple[tuple[str, str], ...] = (
    (r"\b30 %\s+interactive chat from two tenants, 50 % batch completions, 20 % best-effort; 80 % of\s+"
     r"answers 50 tokens, 20 % 2000 tokens", "the chatbot workload"),
    (r"never runs more than 64 sequences \(the same token\s+throughput as 128\b",
     "the demo policy's capacity, and the engine's batch of the same throughput"),
    (r"\bAzure(?: LLM inference)? 2023\b|\bISCA 2024\b|\bCC-BY 4\.0\b", "names of a trace and its paper"),
    (r"\b[Aa]t \d+(?:\.\d+)?×(?:(?:–| and | or |, )\d+(?:\.\d+)?×)*",
     "the offered load of a run (at 1.5×)"),
    (r"\bat \d+ req/s", "the offered rate of a run"),
    (r"\b\d(?:–\d)?\s+replicas?\b", "a configuration: how many replicas"),
    (r"over the first 30 s, in the simulator", "bench/adaptive.py's cold-start window"),
    (r"\b40k KV tokens", "the llama-8b-l4 profile"),
    (r"a 15 s Redis outage", "bench/chaos.py's outage"),
    (r"for 9 s at 20 req/s", "bench/chaos.py's bad policy, its length and rate"),
    (r"throughout after the first 30 s|sampled every 10 s", "bench/chaos.py's soak, how it samples"),
    (r"\bevery 429\b", "an HTTP status"),
    (r"\(exit \d\)", "an exit status"),
    (r"by more than 10 ms|the 10 ms\s+tolerance|~0\.2 s(?: or sooner)?\)|at most 7 days",
     "settings of the shared store"),
    (r"lapsed ones until swept, within 2 s", "how often bookings are swept"),
    (r"\d+–\d+ requests per second per replica core|about \d+(?:–\d+)? with\s+Redis|≈ \d+ and ≈ \d+ req/s",
     "sizing advice, rounded from the table above it"),
    (r"one lane with a 120 s deadline under sustained 1\.5× load",
     "bench/simulate_claims.py's one-lane policy"),
    (r"the lane's deadline \(1 s\)", "the demo policy's interactive deadline"),
    (r"within 10 minutes with a store", "how old a stored limit may be (a constant)"),
)


# -- markers and figures ---------------------------------------------------------------------------

_MARKER = re.compile(r"<!--\s*(claims?)\s*:\s*(.*?)\s*-->", re.DOTALL)
_HEADING = re.compile(r"^#{1,6}\s")
_FENCE = re.compile(r"^\s*(```|~~~)")
#: What may stand between a figure and its marker: a unit without spaces, closing markup.
_UNIT = r"(?:\s?[^\s\d<>|*_)(]{1,12})?[*_)`]*\s?"
#: The figure a claim marker follows.
_FIGURE = re.compile(
    r"(?:(?<![\w.,])(?P<sign>[-−+]))?(?<![\w.,\d])(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)"
    + _UNIT + "$"
)
_CLAIM_AHEAD = re.compile(_UNIT + r"<!--\s*claim\s*:")
#: Every number, for the unmarked check: not glued to a name on either side.
_NUMBER = re.compile(
    r"(?<![\w.,#@:])(?<!\d/)(?<!HTTP/)(?<!\w[-−])(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)"
    r"(?!(?![kM]\b)\w|[.,/:]\d|-\w)"
)
_BOUND = re.compile(r"[≤≥<>±]\s*(?:[A-Za-z' ]{1,20}\+\s*)?[-−+]?\s*$")
_BAND = re.compile(r"^\s*±")
#: Where a path in a claim's expression starts with ``.`` or ``[``: it continues the scope's base.
_RELATIVE = re.compile(r"(^|[\s(+*/,-])(?=\.[A-Za-z_]|\[)")


@dataclass(frozen=True)
class Claim:
    doc: str
    line: int
    figure: str
    """The number as written (``1,068``, ``−19``)."""
    file: str
    expr: str

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def key(self) -> str:
        return f"{self.file}#{self.expr}"


@dataclass(frozen=True)
class Problem:
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


def written_value(figure: str) -> tuple[float, int]:
    """A figure as written → (its value, decimals written)."""
    sign = -1.0 if figure[0] in "-−" else 1.0
    digits = figure.lstrip("-−+").replace(",", "")
    decimals = len(digits.partition(".")[2])
    return sign * float(digits), decimals


def matches(figure: str, value: float) -> bool:
    """Whether ``figure`` as written is ``value`` rounded to the decimals written (ties either way)."""
    written, decimals = written_value(figure)
    half = 0.5 * 10.0 ** -decimals
    return math.isfinite(value) and abs(value - written) <= half * (1 + 1e-9) + 1e-12


def _masked(text: str) -> str:
    """``text`` with code spans, HTML comments and link targets blanked out (same length and lines)."""
    def blank(m: re.Match[str]) -> str:
        return re.sub(r"[^\n]", " ", m.group())
    text = re.sub(r"<!--.*?-->", blank, text, flags=re.DOTALL)
    text = re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", blank, text, flags=re.DOTALL)
    text = re.sub(r"\]\([^)]*\)", lambda m: "]" + blank(m)[1:], text)
    return re.sub(r"<?https?://\S+", blank, text)


@dataclass
class _Block:
    start: int
    lines: list[tuple[int, str]]
    table: bool
    item: bool
    heading: bool = False

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _blocks(text: str) -> Iterator[_Block]:
    """Paragraphs, list items and tables, outside fenced code; headings end a block."""
    current: _Block | None = None
    fenced = False
    for number, line in enumerate(text.split("\n"), 1):
        if _FENCE.match(line):
            fenced = not fenced
            if current:
                yield current
            current = None
            continue
        if fenced:
            continue
        is_table = line.lstrip().startswith("|")
        starts_item = re.match(r"^\s*(?:[*+-]|\d+\.)\s", line) is not None
        if not line.strip() or _HEADING.match(line) or starts_item or (
                current is not None and current.table != is_table):
            if current:
                yield current
            current = None
            if _HEADING.match(line):
                yield _Block(number, [(number, line)], table=False, item=False, heading=True)
            if not line.strip() or _HEADING.match(line):
                continue
        if current is None:
            current = _Block(number, [], is_table, starts_item)
        current.lines.append((number, line))
    if current:
        yield current


def parse(text: str, doc: str) -> list[Claim | Problem]:
    """Every claim marker in ``text`` with the figure it follows (or a problem with it)."""
    out: list[Claim | Problem] = []
    scope: tuple[str, str] | None = None
    fenced = False
    for number, line in enumerate(text.split("\n"), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        if _HEADING.match(line):
            scope = None
        if re.match(r"\s*(?:[*+-]\s+|\d+\.\s+)?<!--.*?-->\s*\S", line):
            # Markdown reads a line that starts with a comment as raw HTML, text and all.
            out.append(Problem(f"{doc}:{number}", "a marker starts the line and text follows it: the line "
                                                  "would render as raw HTML; put the marker after the text"))
        for m in _MARKER.finditer(line):
            kind, body = m.group(1), m.group(2)
            where = f"{doc}:{number}"
            file, hash_, expr = (part.strip() for part in body.partition("#"))
            if kind == "claims":
                scope = (file, expr) if file else None
                if not file:
                    out.append(Problem(where, f"'claims:' names a results file: {body!r}"))
                continue
            if not hash_ or not expr:
                out.append(Problem(where, f"a claim is FILE#EXPR or #EXPR: {body!r}"))
                continue
            if not file:
                if scope is None:
                    out.append(Problem(where, f"'#{expr}' names no file and no 'claims: FILE' is in force"))
                    continue
                file, base = scope
                relative = _RELATIVE.sub(lambda start, base=base: start.group(1) + base, expr)
                if relative != expr and not base:
                    out.append(Problem(where, f"'#{expr}' continues a base, and 'claims: {file}' names none"))
                    continue
                expr = relative
            before = _masked(line[:m.start()])
            figure = _FIGURE.search(before)
            if figure is None:
                out.append(Problem(where, f"no figure right before the claim {body!r}"))
                continue
            out.append(Claim(doc, number, (figure.group("sign") or "") + figure.group("num"), file, expr))
    return out


# -- results files and expressions ------------------------------------------------------------------


class ClaimError(ValueError):
    """A claim that names no number in its file."""


def _cell(text: str) -> Any:
    text = text.strip().strip("`").strip()
    m = re.fullmatch(r"([-−+]?)(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)(?:\s*\S{1,4})?", text)
    if m is None:
        return text
    value = float(m.group(2).replace(",", ""))
    return -value if m.group(1) in ("-", "−") else value


def read_markdown_tables(text: str) -> dict[str, Any]:
    """A Markdown results file's tables as ``{"table": {row label: {column: value}}}``."""
    table: dict[str, dict[str, Any]] = {}
    header: list[str] | None = None
    for line in text.split("\n"):
        if not line.lstrip().startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [c.strip("`") for c in cells]
        elif not all(re.fullmatch(r":?-+:?", c) for c in cells):
            row = table.setdefault(cells[0].strip("`"), {})
            row.update({h: _cell(c) for h, c in zip(header[1:], cells[1:], strict=False)})
    return {"table": table}


def load_results(file: str, results: Path = RESULTS) -> Any:
    path = results / file
    if not path.is_file():
        raise ClaimError(f"no results file bench/results/{file}")
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)
    if path.suffix == ".md":
        return read_markdown_tables(text)
    raise ClaimError(f"bench/results/{file}: only .json and .md results files are read")


def _numbers(text: str) -> list[float]:
    return [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", str(text))]


_FUNCTIONS: dict[str, Callable[..., Any]] = {"min": min, "max": max, "abs": abs, "len": len,
                                             "numbers": _numbers}
_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b,
}


def evaluate(expr: str, doc: Any) -> float:
    """``expr`` (see the module doc) on a results document; ClaimError if it names nothing there."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise ClaimError(f"not an expression: {expr!r}") from None

    def lookup(container: Any, key: Any, shown: str) -> Any:
        try:
            return container[key]
        except (KeyError, IndexError, TypeError):
            raise ClaimError(f"{shown}: not in the file") from None

    def ev(node: ast.AST) -> Any:
        match node:
            case ast.Expression(body=body):
                return ev(body)
            case ast.Constant(value=bool()):
                pass  # not a number, though an int to Python
            case ast.Constant(value=int() | float() as value):
                return value
            case ast.Name(id=name):
                return lookup(doc, name, name)
            case ast.Attribute(value=value, attr=attr):
                return lookup(ev(value), attr, ast.unparse(node))
            case ast.Subscript(value=value, slice=ast.Constant(value=str() | int() as key)):
                return lookup(ev(value), key, ast.unparse(node))
            case ast.Subscript(value=value, slice=ast.UnaryOp(
                    op=ast.USub(), operand=ast.Constant(value=int() as key))):
                return lookup(ev(value), -key, ast.unparse(node))
            case ast.BinOp(left=left, op=op, right=right) if type(op) in _OPERATORS:
                return _OPERATORS[type(op)](_number(ev(left), left), _number(ev(right), right))
            case ast.UnaryOp(op=ast.USub(), operand=operand):
                return -_number(ev(operand), operand)
            case ast.Call(func=ast.Name(id=name), args=args, keywords=[]) if name in _FUNCTIONS:
                return _FUNCTIONS[name](*(ev(a) for a in args))
        raise ClaimError(f"{ast.unparse(node)!r} is not allowed in a claim")

    try:
        return _number(ev(tree), tree)
    except ZeroDivisionError:
        raise ClaimError(f"{expr}: divides by zero") from None


def _number(value: Any, node: ast.AST) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ClaimError(f"{ast.unparse(node)} is {value!r}, not a number")
    return float(value)


# -- the checks ------------------------------------------------------------------------------------


Values = list[tuple[Claim, float | None]]


def check_claims(items: list[Claim | Problem], results: Path = RESULTS) -> tuple[list[Problem], Values]:
    """Each claim against its file: (problems, [(claim, the file's value)])."""
    problems = [item for item in items if isinstance(item, Problem)]
    cache: dict[str, Any] = {}
    values: Values = []
    for claim in (item for item in items if isinstance(item, Claim)):
        try:
            if claim.file not in cache:
                cache[claim.file] = load_results(claim.file, results)
            value = evaluate(claim.expr, cache[claim.file])
        except (ClaimError, json.JSONDecodeError) as exc:
            problems.append(Problem(claim.where, f"{claim.key}: {exc}"))
            values.append((claim, None))
            continue
        values.append((claim, value))
        if not matches(claim.figure, value):
            problems.append(Problem(claim.where, f"{claim.figure} is written where {claim.key} is "
                                                 f"{value:.6g}"))
    return problems, values


def _names_results(text: str, names: set[str]) -> bool:
    return re.search(r"\bbench/(?:results/|\w+\.py)", text) is not None or any(n in text for n in names)


def unmarked(text: str, doc: str, results: Path = RESULTS) -> list[Problem]:
    """Numbers in results blocks that carry no claim marker and are not exempt (module doc)."""
    names = {p.name for p in results.iterdir() if p.is_file()} if results.is_dir() else set()
    given = [re.compile(pattern) for pattern, _ in GIVEN]
    problems: list[Problem] = []
    lead_in = False  # the paragraph before the list or table in progress is a results block
    scoped = False  # a 'claims: FILE' marker is in force (up to the next heading)
    for block in _blocks(text):
        if block.heading:
            lead_in = scoped = False
            continue
        scoped = scoped or re.search(r"<!--\s*claims\s*:", block.text) is not None
        is_results = scoped or _MARKER.search(block.text) is not None or _names_results(block.text, names)
        if block.table or block.item:
            is_results = is_results or lead_in
        else:
            lead_in = is_results
        if not is_results:
            continue
        whole = _masked(block.text)
        masked_lines = whole.split("\n")
        exempt = [range(m.start(), m.end()) for g in given for m in g.finditer(whole)]
        offset = 0
        for i, ((number, line), masked) in enumerate(zip(block.lines, masked_lines, strict=True)):
            start, offset = offset, offset + len(masked) + 1
            if block.table:
                if i == 0:
                    continue  # the header row
                if re.fullmatch(r"\s*\|?[\s:|-]+", masked):
                    continue  # its rule
                second = masked.find("|", masked.find("|") + 1)
                masked = " " * max(second, 0) + masked[max(second, 0):]  # the first column: labels
            for m in _NUMBER.finditer(masked):
                if (any(start + m.start() in r for r in exempt) or _BOUND.search(masked[:m.start()])
                        or _BAND.match(masked[m.end():])):
                    continue
                if _CLAIM_AHEAD.match(line, m.end()):
                    continue
                problems.append(Problem(f"{doc}:{number}", f"unmarked figure {m.group()!r} in a results "
                                                           f"block: {_context(line, m.start(), m.end())}"))
    return problems


def _context(line: str, start: int, end: int) -> str:
    left = line[max(0, start - 30):start]
    right = line[end:end + 20]
    return f"…{left}[{line[start:end]}]{right}…".replace("\n", " ")


def check(paths: list[Path], results: Path = RESULTS, root: Path = ROOT) -> tuple[list[Problem], Values]:
    """Every document's claims against their files, and its unmarked figures."""
    problems: list[Problem] = []
    values: Values = []
    for path in paths:
        name = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
        text = path.read_text()
        found, got = check_claims(parse(text, name), results)
        problems += found + unmarked(text, name, results)
        values += got
    return problems, values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", type=Path, help="documents (default: README.md and docs/*.md)")
    parser.add_argument("--list", action="store_true", help="print every claim with its file's value")
    args = parser.parse_args()
    paths = [p.resolve() for p in args.paths] or documents()
    problems, values = check(paths)
    if args.list:
        for claim, value in values:
            shown = "-" if value is None else f"{value:.6g}"
            print(f"{claim.where:<28} {claim.figure:>10}  {shown:>12}  {claim.key}")
    for problem in problems:
        print(problem)
    print(f"{len(values)} marked figures, {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

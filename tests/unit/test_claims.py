"""Every figure the docs quote matches its results file, and none is left unmarked.

The checker is ``bench/claims.py`` (its docstring has the marker syntax, the rounding rule and what
counts as a figure that must be marked). Here it is held to small documents first, so each way a
figure can be wrong is seen to fail, then run over README.md and docs/*.md against
bench/results/, and over the real README with one figure changed and one marker dropped.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


claims = _load("claims")


@pytest.fixture
def results(tmp_path: Path) -> Path:
    (tmp_path / "run.json").write_text(json.dumps({
        "load": 1.5,
        "runs": {"no admission control": {"ttft": {"p99": 88.517}},
                 "policy": {"ttft": {"p99": 10.0375}, "ok": 5419, "retried": 253, "share": 0.0467}},
        "points": [{"ms": 0.0317}, {"ms": 1.3}],
        "label": "42/42",
    }))
    (tmp_path / "parts.md").write_text(
        "# parts\n\n| configuration | req/s | CPU µs | vs main |\n|---|---:|---:|---:|\n"
        "| `main` | 909 | 1,218 | |\n| no-op | 2,289 | 429 | −789 µs |\n")
    return tmp_path


def problems(text: str, results: Path) -> list[str]:
    found, _ = claims.check_claims(claims.parse(text, "doc.md"), results)
    return [str(p) for p in found + claims.unmarked(text, "doc.md", results)]


# -- the rounding rule -------------------------------------------------------------------------------


@pytest.mark.parametrize(("figure", "value", "ok"), [
    ("1.04", 1.0375, True), ("1.04", 1.045, True), ("1.04", 1.0349, False), ("1.04", 10.04, False),
    ("10.0", 10.0375, True), ("10", 10.49, True), ("10", 10.51, False),
    ("1,068", 1068, True), ("1,068", 1067.4, False), ("21,770", 21770.0, True),
    ("−19", -18.6, True), ("-19", -18.6, True), ("19", -18.6, False), ("+0.82", 0.82, True),
    ("0.30", 0.301, True), ("0.3", 0.36, False),
])
def test_a_figure_is_its_value_rounded_as_written(figure: str, value: float, ok: bool) -> None:
    assert claims.matches(figure, value) is ok


# -- expressions -------------------------------------------------------------------------------------


def test_expressions_read_keys_and_do_arithmetic(results: Path) -> None:
    doc = claims.load_results("run.json", results)
    assert claims.evaluate('runs["no admission control"].ttft.p99', doc) == pytest.approx(88.517)
    assert claims.evaluate("runs.policy.retried / runs.policy.ok * 100", doc) == pytest.approx(4.669, 1e-3)
    assert claims.evaluate("points[1].ms * 1000", doc) == pytest.approx(1300)
    assert claims.evaluate("max(points[0].ms, points[1].ms) - -1", doc) == pytest.approx(2.3)
    assert claims.evaluate("numbers(label)[1]", doc) == 42
    assert claims.evaluate("points[-1].ms", doc) == pytest.approx(1.3)
    table = claims.load_results("parts.md", results)
    assert claims.evaluate('table.main["CPU µs"]', table) == 1218
    assert claims.evaluate('table["no-op"]["vs main"]', table) == -789


@pytest.mark.parametrize(("expr", "says"), [
    ("runs.policy.missing", "not in the file"),
    ("points[7].ms", "not in the file"),
    ("runs.policy", "not a number"),
    ("label", "not a number"),
    ("__import__('os')", "not allowed"),
    ("runs.policy.ok ** 2", "not allowed"),
    ("runs.policy.ok if load else 0", "not allowed"),
    ("runs.policy.ok / (load - 1.5)", "divides by zero"),
    ("runs.(", "not an expression"),
])
def test_an_expression_that_reads_nothing_is_an_error(results: Path, expr: str, says: str) -> None:
    with pytest.raises(claims.ClaimError, match=re.escape(says)):
        claims.evaluate(expr, claims.load_results("run.json", results))


# -- markers -----------------------------------------------------------------------------------------


def test_a_marked_figure_that_matches_its_file_passes(results: Path) -> None:
    text = ("Interactive TTFT p99 10.0 s<!-- claim: run.json#runs.policy.ttft.p99 --> at "
            "1.5×<!-- claim: run.json#load --> capacity (`bench/results/run.json`).\n")
    assert problems(text, results) == []


def test_a_changed_figure_fails(results: Path) -> None:
    text = "TTFT p99 1.04 s<!-- claim: run.json#runs.policy.ttft.p99 --> (`bench/results/run.json`).\n"
    assert problems(text, results) == [
        "doc.md:1: 1.04 is written where run.json#runs.policy.ttft.p99 is 10.0375"]


def test_a_claim_on_a_missing_file_or_key_fails(results: Path) -> None:
    text = "A 10.0 s<!-- claim: gone.json#x --> and a 10.0 s<!-- claim: run.json#runs.nope -->.\n"
    found = problems(text, results)
    assert [p.split(": ", 1)[1] for p in found] == [
        "gone.json#x: no results file bench/results/gone.json",
        "run.json#runs.nope: runs.nope: not in the file"]


def test_a_marker_must_follow_a_figure(results: Path) -> None:
    text = "Fast, see the file.<!-- claim: run.json#load -->\n"
    assert problems(text, results) == ["doc.md:1: no figure right before the claim 'run.json#load'"]


def test_a_scope_names_the_file_and_a_base_for_the_claims_after_it(results: Path) -> None:
    text = ('<!-- claims: run.json#runs.policy -->\n\n'
            "TTFT p99 10.0 s<!-- claim: #.ttft.p99 -->: 253<!-- claim: #.retried --> of "
            "5,419<!-- claim: #.ok --> (4.7 %<!-- claim: #.retried / .ok * 100 -->) "
            "at 1.5×<!-- claim: #load -->.\n\n"
            "# Another section\n\nHere 88.5 s<!-- claim: #load --> names no file.\n")
    assert problems(text, results) == [
        "doc.md:7: '#load' names no file and no 'claims: FILE' is in force"]


def test_a_marker_that_starts_a_line_before_text_is_refused(results: Path) -> None:
    # Markdown would render the whole line as raw HTML.
    text = "<!-- claims: run.json -->**Measured**: 1.5×<!-- claim: #load -->.\n"
    assert problems(text, results) == [
        "doc.md:1: a marker starts the line and text follows it: the line would render as raw HTML; "
        "put the marker after the text"]


# -- unmarked figures --------------------------------------------------------------------------------


def test_an_unmarked_figure_in_a_results_paragraph_fails(results: Path) -> None:
    text = ("Measured (`bench/results/run.json`): p99 10.0 s<!-- claim: run.json#runs.policy.ttft.p99 -->,\n"
            "88.5 s without admission control.\n")
    found = problems(text, results)
    assert len(found) == 1
    assert found[0].startswith("doc.md:2: unmarked figure '88.5' in a results block")


def test_a_paragraph_that_names_a_results_file_is_a_results_block(results: Path) -> None:
    assert problems("`run.json` says 4.7 % were retried.\n", results) != []
    assert problems("Measured with `bench/fleet.py`: 4.7 % were retried.\n", results) != []
    assert problems("With a marker, 4.7 % and 10.0 s<!-- claim: run.json#runs.policy.ttft.p99 -->.\n",
                    results) != []
    # Elsewhere numbers are the prose's own (defaults, settings, examples).
    assert problems("The default is 0.08, a window of 10 s and 64 slots.\n", results) == []


def test_what_is_not_a_figure_read_from_a_file(results: Path) -> None:
    text = ("From `bench/results/run.json`: llama-70b-2xh100 on H100s, p99 in `--rate 30`, issue #19, "
            "3:1 weights split 80/20, HTTP/2, target ≤ 1.1 and ≥ 0.9, ≤ PING + 0.3 ms, 0.75 ± 0.05, "
            "at 1.5× capacity, 3 replicas, [a link](https://example.com/v1/2.5) and <!-- 12 -->.\n")
    assert problems(text, results) == []
    found = problems("From `bench/results/run.json`: 75k grants a second.\n", results)
    assert len(found) == 1
    assert "unmarked figure '75'" in found[0]


def test_a_table_after_a_results_paragraph_is_checked_but_its_labels_are_not(results: Path) -> None:
    text = ("Measured in `bench/results/run.json`:\n\n"
            "| load, 2 replicas | TTFT p99 at 200 req/s |\n|---|---:|\n"
            "| 1.5× | 10.0 s<!-- claim: run.json#runs.policy.ttft.p99 --> |\n"
            "| 2.0× | 88.5 s |\n")
    assert problems(text, results) == [
        "doc.md:6: unmarked figure '88.5' in a results block: …| 2.0× | [88.5] s |…"]
    # A table of settings after a paragraph about something else is the prose's own.
    settings = "Some settings:\n\n| lane | deadline |\n|---|---:|\n| interactive | 1 s |\n| batch | 8 s |\n"
    assert problems(settings, results) == []


def test_a_scope_makes_its_section_results(results: Path) -> None:
    text = ("<!-- claims: run.json -->\n\nTTFT p99 10.0 s<!-- claim: #runs.policy.ttft.p99 -->.\n\n"
            "Of which 0.99 s waiting.\n\n## Next\n\nA 1 s deadline.\n")
    found = problems(text, results)
    assert [p.split(": ", 1)[0] for p in found] == ["doc.md:5"]
    assert "unmarked figure '0.99'" in found[0]


def test_list_items_take_their_lead_in_and_a_heading_ends_it(results: Path) -> None:
    text = ("Measured with `bench/results/run.json`:\n\n* one fault: 39 completed;\n* another: 0 leaked.\n\n"
            "## Next\n\n* a default of 15 s.\n")
    found = problems(text, results)
    assert [p.split(": ", 1)[1].split(" in ")[0] for p in found] == [
        "unmarked figure '39'", "unmarked figure '0'"]


def test_given_phrases_are_the_runs_inputs(results: Path) -> None:
    text = ("Recorded in `bench/results/run.json`: the chatbot workload (30 % interactive chat from two "
            "tenants, 50 % batch completions, 20 % best-effort; 80 % of answers 50 tokens, "
            "20 % 2000 tokens).\n")
    assert problems(text, results) == []
    assert all(reason for _, reason in claims.GIVEN)


def test_code_spans_across_lines_hide_their_numbers(results: Path) -> None:
    text = "Measured (`bench/results/run.json`, `extproc simulate --trace x.csv\n--load 1.5`).\n"
    assert problems(text, results) == []


# -- the docs ----------------------------------------------------------------------------------------


def test_every_figure_in_the_docs_matches_its_results_file_and_none_is_unmarked() -> None:
    found, values = claims.check(claims.documents())
    assert [str(p) for p in found] == []
    assert len(values) > 400  # the docs are marked; a marker lost to an edit would not go unseen
    assert {claim.doc for claim, _ in values} == {"README.md", "docs/operator-guide.md"}


def _figure(text: str, expr: str) -> re.Match[str]:
    m = re.search(r"([\d.,]+)( ?\w*)<!-- claim: " + re.escape(expr) + " -->", text)
    assert m is not None, expr
    return m


def test_the_real_readme_fails_on_a_changed_figure_and_on_an_unmarked_one() -> None:
    readme = (ROOT / "README.md").read_text()
    m = _figure(readme, "#.ttft.p99")  # the Azure trace's interactive TTFT p99
    changed = readme[:m.start(1)] + "1.04" + readme[m.end(1):]
    found, _ = claims.check_claims(claims.parse(changed, "README.md"))
    assert len(found) == 1
    key = 'trace_azure.json#runs["policy (demo-policy.yaml)"].lanes.interactive.ttft.p99'
    assert found[0].message.startswith(f"1.04 is written where {key} is ")
    dropped = readme[:m.end(2)] + readme[m.end():]
    found = claims.unmarked(dropped, "README.md")
    assert len(found) == 1
    assert f"unmarked figure '{m.group(1)}'" in found[0].message


def test_every_quoted_results_file_is_listed_with_the_command_that_writes_it() -> None:
    rows = re.findall(r"^\| `([^`]+)` \| (.+?) \| (yes|no) \|$", (ROOT / "bench" / "README.md").read_text(),
                      re.MULTILINE)
    listed = {name: rerun == "yes" for name, _, rerun in rows}
    _, values = claims.check(claims.documents())
    quoted = {claim.file for claim, _ in values}
    assert quoted <= set(listed), quoted - set(listed)
    assert all((claims.RESULTS / name).is_file() for name in listed)
    # What `make claims` reruns is what bench/simulate_claims.py writes.
    simulate_claims = _load("simulate_claims")
    writes = {"simulate_claims.json", *(f"{name}.json" for name in simulate_claims.TRACES)}
    assert {name for name, rerun in listed.items() if rerun} == writes
    makefile = (ROOT / "Makefile").read_text()
    recipe = r"^claims:.*\n\t\$\(PY\) bench/simulate_claims\.py\n\t\$\(PY\) bench/claims\.py$"
    assert re.search(recipe, makefile, re.MULTILINE)

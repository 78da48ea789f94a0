"""The policy loader: the example loads, and every bad policy is explained (file, key path, line)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from extproc.policy import Policy, PolicyError, Problem, load_policy, loader, parse_policy
from extproc.policy.loader import MAX_POLICY_BYTES
from tests.unit.conftest import PolicyData, dump, line_of

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "policy.yaml"
SOURCE = "test.yaml"


def problems_of(text: str) -> list[Problem]:
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, SOURCE)
    problems = caught.value.problems
    assert problems, "a PolicyError must carry at least one problem"
    for problem in problems:
        assert problem.file == SOURCE
        assert problem.message
    return problems


def only_problem(text: str) -> Problem:
    problems = problems_of(text)
    assert len(problems) == 1, problems
    return problems[0]


def problem_at(problems: list[Problem], path: str) -> Problem:
    for problem in problems:
        if problem.path == path:
            return problem
    raise AssertionError(f"no problem at {path!r} in {problems}")


# -- the example and the derived properties -----------------------------------------------


def test_example_policy_loads() -> None:
    policy = load_policy(EXAMPLE)
    assert [lane.name for lane in policy.lanes] == ["interactive", "batch", "best-effort"]
    assert policy.lane("interactive").deadline == 10.0
    assert policy.lane("batch").max_borrow == 4
    assert policy.lane("best-effort").evictable
    assert policy.total_capacity == 14
    assert policy.capacity.max_hold == 300.0
    # Safe by default: only the header the gateway sets from a client's API key.
    assert policy.trusted_headers == ("x-extproc-client",)
    assert policy.tenants.header == "x-extproc-client"
    assert policy.classification.lane_header is None
    assert [rule.name for rule in policy.classification.rules] == ["batch-api", "chat", "completions"]
    assert policy.tenants.weights == {"acme": 3.0, "globex": 1.0}
    assert policy.estimation.models["llama-3.1-70b"].decode_ms_per_token == 30.0
    assert policy.needs_body
    assert policy.retry_after.max == 30.0


def test_policy_is_immutable() -> None:
    policy = load_policy(EXAMPLE)
    with pytest.raises(ValueError, match="frozen"):
        policy.lanes[0].max_inflight = 1  # type: ignore[misc]


def test_total_capacity_defaults_to_sum_of_lanes(
    policy_data: PolicyData, build_policy: Callable[[PolicyData], Policy]
) -> None:
    assert build_policy(policy_data).total_capacity == 6
    policy_data["capacity"] = {"max_inflight": 5}
    assert build_policy(policy_data).total_capacity == 5


@pytest.mark.parametrize(
    ("tweak", "expected"),
    [
        ({"queueing": {"sjf_weight": 0}}, False),
        ({}, True),  # SJF ordering (sjf_weight 4 by default) needs job sizes
        ({"queueing": {"sjf_weight": 0}, "estimation": {"models": {"m": {}}}}, True),
        ({"queueing": {"sjf_weight": 0}, "estimation": {"read_body": "always"}}, True),
        ({"estimation": {"read_body": "never", "models": {"m": {}}}}, False),
        (
            {
                "queueing": {"sjf_weight": 0},
                "classification": {
                    "default_lane": "batch",
                    "rules": [{"match": {"models": ["m"]}, "lane": "interactive"}],
                },
            },
            True,
        ),
    ],
)
def test_needs_body(
    policy_data: PolicyData,
    build_policy: Callable[[PolicyData], Policy],
    tweak: dict[str, Any],
    expected: bool,
) -> None:
    policy_data.update(tweak)
    assert build_policy(policy_data).needs_body is expected


@pytest.mark.parametrize(
    ("written", "seconds"),
    [("250ms", 0.25), ("10s", 10.0), ("2m", 120.0), ("1.5s", 1.5), (7, 7.0), (0.5, 0.5), (" 3s ", 3.0)],
)
def test_durations(
    policy_data: PolicyData, build_policy: Callable[[PolicyData], Policy], written: object, seconds: float
) -> None:
    policy_data["lanes"][0]["deadline"] = written
    assert build_policy(policy_data).lanes[0].deadline == pytest.approx(seconds)


def test_header_names_are_lower_cased(
    policy_data: PolicyData, build_policy: Callable[[PolicyData], Policy]
) -> None:
    policy_data["trusted_headers"] = ["X-Tenant-ID", "X-Lane"]
    policy_data["tenants"] = {"header": "X-Tenant-Id"}
    policy_data["classification"]["lane_header"] = "X-LANE"
    policy = build_policy(policy_data)
    assert policy.trusted_headers == ("x-tenant-id", "x-lane")
    assert policy.tenants.header == "x-tenant-id"
    assert policy.classification.lane_header == "x-lane"


# -- strict validation: one bad value, one problem, at the right path and line ------------------


@pytest.mark.parametrize(
    ("tweak", "path", "needle", "message"),
    [
        pytest.param(
            lambda d: d["lanes"][1].update(max_inflght=3),
            "lanes[1].max_inflght", "max_inflght: 3", "unknown key", id="unknown-lane-key",
        ),
        pytest.param(
            lambda d: d.update(lane={"x": 1}), "lane", "lane:", "unknown key", id="unknown-top-key",
        ),
        pytest.param(
            lambda d: d["lanes"][1].update(max_inflight="lots"),
            "lanes[1].max_inflight", "max_inflight: lots", "valid integer", id="wrong-type-int",
        ),
        pytest.param(
            lambda d: d["lanes"][0].update(borrow="sometimes"),
            "lanes[0].borrow", "borrow: sometimes", "boolean", id="wrong-type-bool",
        ),
        pytest.param(
            lambda d: d.update(lanes={"name": "x"}), "lanes", "lanes:", "tuple", id="lanes-not-a-list",
        ),
        pytest.param(
            lambda d: d["lanes"][1].update(max_inflight=0),
            "lanes[1].max_inflight", "max_inflight: 0", "greater than or equal to 1", id="zero-inflight",
        ),
        pytest.param(
            lambda d: d["lanes"][0].update(max_queued=-1),
            "lanes[0].max_queued", "max_queued: -1", "greater than or equal to 0", id="negative-queued",
        ),
        pytest.param(
            lambda d: d["lanes"][0].update(priority=-5),
            "lanes[0].priority", "priority: -5", "greater than or equal to 0", id="negative-priority",
        ),
        pytest.param(
            lambda d: d["lanes"][1].update(deadline=0),
            "lanes[1].deadline", "deadline: 0", "greater than 0", id="zero-deadline",
        ),
        pytest.param(
            lambda d: d["lanes"][1].update(deadline="-3s"),
            "lanes[1].deadline", "deadline: -3s", "expected a duration", id="negative-deadline",
        ),
        pytest.param(
            lambda d: d["lanes"][1].update(deadline="10x"),
            "lanes[1].deadline", "deadline: 10x", "expected a duration", id="bad-duration-unit",
        ),
        pytest.param(
            lambda d: d["lanes"][1].update(deadline=True),
            "lanes[1].deadline", "deadline: true", "expected a duration", id="bool-duration",
        ),
        pytest.param(
            lambda d: d.update(capacity={"max_request_duration": "forever"}),
            "capacity.max_request_duration", "max_request_duration: forever", "expected a duration",
            id="bad-duration-word",
        ),
        pytest.param(
            lambda d: d.update(capacity={"max_inflight": 0}),
            "capacity.max_inflight", "max_inflight: 0", "greater than or equal to 1", id="zero-capacity",
        ),
        pytest.param(
            lambda d: d["lanes"][0].update(name="Bad Name"),
            "lanes[0].name", "name: Bad Name", "pattern", id="bad-lane-name",
        ),
        pytest.param(
            lambda d: d.update(version=2), "version", "version: 2", "1", id="unknown-version",
        ),
        pytest.param(
            lambda d: (
                d["lanes"][1].update(name="interactive"),
                d["classification"].update(default_lane="interactive"),
            ),
            "lanes[1].name", ("name: interactive", 2), "duplicate lane name 'interactive'",
            id="duplicate-lane",
        ),
        pytest.param(
            lambda d: d["classification"].update(default_lane="gold"),
            "classification.default_lane", "default_lane: gold", "unknown lane 'gold'",
            id="unknown-default-lane",
        ),
        pytest.param(
            lambda d: d["classification"].update(rules=[{"lane": "batch"}, {"lane": "gold"}]),
            "classification.rules[1].lane", "lane: gold", "unknown lane 'gold'", id="unknown-rule-lane",
        ),
        pytest.param(
            lambda d: d["classification"].update(
                rules=[{"match": {"headers": {"x-extproc-lane": "fast"}}, "lane": "interactive"}]
            ),
            "classification.rules[0].match.headers.x-extproc-lane", "x-extproc-lane: fast",
            "not in trusted_headers", id="rule-on-untrusted-header",
        ),
        pytest.param(
            lambda d: d["classification"].update(lane_header="x-extproc-lane"),
            "classification.lane_header", "lane_header: x-extproc-lane", "not in trusted_headers",
            id="untrusted-lane-header",
        ),
        pytest.param(
            lambda d: d.update(tenants={"header": "x-tenant-id"}),
            "tenants.header", "header: x-tenant-id", "not in trusted_headers", id="untrusted-tenant-header",
        ),
        pytest.param(
            lambda d: d["lanes"][1].update(deadline="300s"),
            "lanes[1].deadline", "deadline: 300s", "must be below capacity.max_hold",
            id="deadline-at-max-hold",
        ),
        pytest.param(
            lambda d: (d.update(capacity={"max_hold": "20s"}), d["lanes"][1].update(deadline="25s")),
            "lanes[1].deadline", "deadline: 25s", "must be below capacity.max_hold",
            id="deadline-over-max-hold",
        ),
        pytest.param(
            lambda d: d.update(capacity={"max_inflight": 3}),
            "lanes[0].max_inflight", "max_inflight: 4", "exceeds capacity.max_inflight (3)",
            id="lane-over-capacity",
        ),
        pytest.param(
            lambda d: d["lanes"][1].update(max_borrow=2),
            "lanes[1].max_borrow", "max_borrow: 2", "borrow is false", id="max-borrow-without-borrow",
        ),
        pytest.param(
            lambda d: d.update(capacity={"max_inflight": 9}),
            "capacity.max_inflight", "max_inflight: 9", "no lane may borrow", id="unusable-capacity",
        ),
        pytest.param(
            lambda d: d.update(retry_after={"min": 10, "max": 5}),
            "retry_after", "retry_after:", "must not exceed max", id="retry-min-over-max",
        ),
        pytest.param(
            lambda d: d.update(retry_after={"max": 61}),
            "retry_after.max", "max: 61", "less than or equal to 60", id="retry-max-over-60",
        ),
        pytest.param(
            lambda d: d.update(retry_after={"min": "500ms"}),
            "retry_after.min", "min: 500ms", "greater than or equal to 1", id="retry-min-under-1s",
        ),
        pytest.param(
            lambda d: d["classification"].update(
                rules=[{"match": {"path_regex": "/v1/(chat"}, "lane": "batch"}]
            ),
            "classification.rules[0].match.path_regex", "path_regex:", "not a valid regular expression",
            id="bad-regex",
        ),
        pytest.param(
            lambda d: d["classification"].update(
                rules=[{"match": {"methods": ["post", "FETCH"]}, "lane": "batch"}]
            ),
            "classification.rules[0].match.methods", "methods:", "unknown HTTP method(s) ['FETCH']",
            id="bad-method",
        ),
        pytest.param(
            lambda d: d["classification"].update(rules=[{"match": {"path": "/x"}}]),
            "classification.rules[0].lane", "match:", "required key is missing", id="missing-rule-lane",
        ),
        pytest.param(
            lambda d: d.update(estimation={"read_body": "sometimes"}),
            "estimation.read_body", "read_body: sometimes", "'auto', 'always' or 'never'", id="bad-literal",
        ),
        pytest.param(
            lambda d: d.update(estimation={"unreadable_body": "ignore"}),
            "estimation.unreadable_body", "unreadable_body: ignore", "'estimate' or 'refuse'",
            id="bad-unreadable-body",
        ),
        pytest.param(
            lambda d: d.update(estimation={"max_output_tokens": 0}),
            "estimation.max_output_tokens", "max_output_tokens: 0", "greater than or equal to 1",
            id="zero-max-output-tokens",
        ),
        pytest.param(
            lambda d: d.update(estimation={"default_max_tokens": 4096, "max_output_tokens": 1024}),
            "estimation", "estimation:", "default_max_tokens (4096) must not exceed max_output_tokens (1024)",
            id="default-over-max-output-tokens",
        ),
        pytest.param(
            lambda d: d.update(tenants={"weights": {"acme": 0}}),
            "tenants.weights.acme", "acme: 0", "greater than 0", id="zero-weight",
        ),
    ],
)
def test_one_bad_value_is_explained(
    policy_data: PolicyData,
    tweak: Callable[[PolicyData], object],
    path: str,
    needle: str | tuple[str, int],
    message: str,
) -> None:
    tweak(policy_data)
    text = dump(policy_data)
    fragment, occurrence = needle if isinstance(needle, tuple) else (needle, 1)
    problem = only_problem(text)
    assert problem.path == path
    assert problem.line == line_of(text, fragment, occurrence), text
    assert message in problem.message
    assert str(problem) == f"{SOURCE}:{problem.line}: {path}: {problem.message}"


def test_missing_required_keys_are_each_reported() -> None:
    problems = problems_of("version: 1\n")
    assert {p.path for p in problems} == {"lanes", "classification"}
    assert all(p.message == "required key is missing" for p in problems)
    assert all(p.line == 1 for p in problems)


def test_several_cross_field_problems_are_reported_together(policy_data: PolicyData) -> None:
    policy_data["classification"] = {
        "default_lane": "gold",
        "lane_header": "x-lane",
        "rules": [{"lane": "silver"}],
    }
    text = dump(policy_data)
    problems = problems_of(text)
    assert [p.path for p in problems] == [
        "classification.default_lane",
        "classification.rules[0].lane",
        "classification.lane_header",
    ]
    assert problem_at(problems, "classification.rules[0].lane").line == line_of(text, "lane: silver")
    assert problem_at(problems, "classification.lane_header").line == line_of(text, "lane_header:")
    error_text = str(PolicyError(problems))
    assert error_text.count("\n") == 2
    assert f"{SOURCE}:{line_of(text, 'default_lane: gold')}: classification.default_lane:" in error_text


def test_duplicate_yaml_key_names_the_second_line() -> None:
    text = (
        "lanes:\n"
        "  - {name: a, max_inflight: 1, deadline: 1s}\n"
        "classification:\n"
        "  default_lane: a\n"
        "classification:\n"
        "  default_lane: b\n"
    )
    problem = only_problem(text)
    assert problem.line == 5
    assert "duplicate key 'classification' (first on line 3)" in problem.message


def test_duplicate_nested_yaml_key() -> None:
    text = "lanes:\n  - name: a\n    max_inflight: 1\n    max_inflight: 2\n    deadline: 1s\n"
    problem = only_problem(text)
    assert problem.line == 4
    assert "duplicate key 'max_inflight' (first on line 3)" in problem.message


def test_unhashable_yaml_key_is_a_policy_error() -> None:
    problem = only_problem("lanes: []\n? [a, b]\n: 1\n")
    assert problem.line == 2
    assert "not valid YAML" in problem.message


def test_deeply_nested_yaml_is_a_policy_error() -> None:
    problem = only_problem("lanes: " + "[" * 600 + "]" * 600 + "\n")
    assert problem.message == "not valid YAML: nested too deeply"


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("- a\n- b\n", "list"),
        ("just a string\n", "str"),
        ("42\n", "int"),
        ("", "NoneType"),
        ("# only\n", "NoneType"),
    ],
)
def test_top_level_must_be_a_mapping(text: str, kind: str) -> None:
    problem = only_problem(text)
    assert problem.path == ""
    assert problem.line == 1
    assert f"expected a mapping of policy keys, got {kind}" in problem.message
    assert "(top level)" in str(problem)


def test_invalid_yaml_names_the_line_and_column() -> None:
    text = "lanes:\n  - name: a\n\tmax_inflight: 1\n"
    problem = only_problem(text)
    assert (problem.line, problem.column, problem.path) == (3, 1, "")
    assert problem.message.startswith("not valid YAML:")
    assert "\\t" in problem.message or "tab" in problem.message
    # A place in the text, not a key path: no "(top level)".
    assert str(problem) == f"{SOURCE}:3:1: {problem.message}"


@pytest.mark.parametrize(("text", "line", "column", "message"), [
    ("lanes: [1, 2\nclassification: {}\n", 2, 15,
     "not valid YAML: expected ',' or ']', but got ':' (while parsing a flow sequence at line 1, column 8)"),
    ("lanes:\n  - name: a\n    deadline: 1s: 2s\n", 3, 17,
     "not valid YAML: mapping values are not allowed here"),
    ("lanes:\n  - name: a\n    max_inflight: 1\n    max_inflight: 2\n", 4, 5,
     "not valid YAML: duplicate key 'max_inflight' (first on line 3)"),
    ("classification: {default_lane: \"a}\n", 2, 1,
     "not valid YAML: found unexpected end of stream (while scanning a quoted scalar at line 1, column 32)"),
])
def test_invalid_yaml_says_where_the_parser_stopped(text: str, line: int, column: int, message: str) -> None:
    problem = only_problem(text)
    assert (problem.line, problem.column, problem.message) == (line, column, message)
    assert str(problem) == f"{SOURCE}:{line}:{column}: {message}"


def test_a_schema_problem_has_a_key_path_and_no_column() -> None:
    text = "lanes:\n  - {name: a, max_inflight: 0, deadline: 1s}\nclassification: {default_lane: a}\n"
    problem = only_problem(text)
    assert (problem.line, problem.column, problem.path) == (2, None, "lanes[0].max_inflight")
    assert str(problem).startswith(f"{SOURCE}:2: lanes[0].max_inflight: ")


@pytest.mark.parametrize("argv", [
    ["policy", "check", "{bad}"],
    ["policy", "diff", "{bad}", "{good}"],
    ["policy", "explain", "{bad}", "--path", "/v1/chat/completions"],
    ["simulate", "--policy", "{bad}"],
], ids=lambda argv: " ".join(argv[:2]))
def test_every_command_that_loads_a_policy_shows_line_and_column(
        argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from extproc.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("lanes:\n  - name: a\n\tmax_inflight: 1\n")
    code = main([arg.format(bad=bad, good=EXAMPLE) for arg in argv])
    out, err = capsys.readouterr()
    assert code in (1, 2)
    assert f"{bad}:3:1: not valid YAML: found character '\\t' that cannot start any token" in out + err
    assert "(top level)" not in out + err


# -- files ----------------------------------------------------------------------------------------


def test_load_policy_reads_a_file(tmp_path: Path, policy_data: PolicyData) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(dump(policy_data), encoding="utf-8")
    assert load_policy(path).lane("batch").deadline == 30.0
    assert load_policy(str(path)).total_capacity == 6


def test_file_errors_name_the_file(tmp_path: Path, policy_data: PolicyData) -> None:
    policy_data["lanes"][0]["max_inflight"] = -1
    text = dump(policy_data)
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    (problem,) = caught.value.problems
    assert problem.file == str(path)
    assert problem.path == "lanes[0].max_inflight"
    assert problem.line == line_of(text, "max_inflight: -1")
    assert str(caught.value).startswith(f"{path}:{problem.line}: lanes[0].max_inflight: ")


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.yaml"
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    (problem,) = caught.value.problems
    assert problem.file == str(path)
    assert problem.line is None
    assert problem.message == "cannot read file: No such file or directory"


def test_directory_is_not_a_policy(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as caught:
        load_policy(tmp_path)
    assert caught.value.problems[0].message.startswith("cannot read file:")


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("lanes: []\nclassification: {default_lane: caf\u00e9}\n".encode("latin-1"))
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    (problem,) = caught.value.problems
    assert problem.file == str(path)
    assert problem.line is None
    assert problem.message.startswith("not UTF-8 text:")


def test_oversized_file(tmp_path: Path, policy_data: PolicyData) -> None:
    path = tmp_path / "huge.yaml"
    text = dump(policy_data)
    path.write_text(text + "#" * (MAX_POLICY_BYTES + 1 - len(text)), encoding="utf-8")
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    (problem,) = caught.value.problems
    assert problem.file == str(path)
    assert problem.message == (
        f"file is {MAX_POLICY_BYTES + 1} bytes; a policy is at most {MAX_POLICY_BYTES} bytes"
    )


def test_size_limit_is_inclusive(
    tmp_path: Path, policy_data: PolicyData, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = dump(policy_data)
    monkeypatch.setattr(loader, "MAX_POLICY_BYTES", len(text.encode()))
    path = tmp_path / "policy.yaml"
    path.write_text(text, encoding="utf-8")
    assert load_policy(path).total_capacity == 6
    path.write_text(text + "#", encoding="utf-8")
    with pytest.raises(PolicyError, match="a policy is at most"):
        load_policy(path)

"""`extproc policy diff`: what changed between two policies, in words, and which changes are risky."""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from extproc.policy import Policy, load_policy, parse_policy
from extproc.policy.schema import Duration
from extproc.tools import diff as df

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
Data = dict[str, Any]


def example_data(name: str) -> Data:
    data: Data = yaml.safe_load((EXAMPLES / name).read_text())
    return data


def build(data: Data) -> Policy:
    return parse_policy(yaml.safe_dump(data, sort_keys=False), "test.yaml")


def edited(name: str, edit: Callable[[Data], None]) -> tuple[Policy, Policy]:
    """The example policy, and a copy of it with ``edit`` applied."""
    data = example_data(name)
    changed = copy.deepcopy(data)
    edit(changed)
    return build(data), build(changed)


def lines(a: Policy, b: Policy) -> list[str]:
    return [c.text for c in df.diff(a, b).changes]


def lane(data: Data, name: str) -> Data:
    found: Data = next(item for item in data["lanes"] if item["name"] == name)
    return found


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    df.add_arguments(parser)
    code = df.command(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- the example policies -----------------------------------------------------------------------------


def test_example_policy_against_demo_policy() -> None:
    result = df.diff(load_policy(EXAMPLES / "policy.yaml"), load_policy(EXAMPLES / "demo-policy.yaml"))
    by_section: dict[str, list[str]] = {}
    for change in result.changes:
        by_section.setdefault(change.section, []).append(change.text)
    assert list(by_section) == ["lanes", "classification", "estimation", "capacity", "retry_after"]
    assert by_section["lanes"] == [
        "interactive: max_inflight 8 → 50 (+525%)",
        "interactive: max_queued 64 → 256 (+300%)",
        "interactive: deadline 10s → 1s (−90%)",
        "interactive: borrow true → false",
        "interactive: sjf_weight unset → 1",
        "batch: max_inflight 4 → 10 (+150%)",
        "batch: max_queued 256 → 512 (+100%)",
        "batch: deadline 60s → 8s (−87%)",
        "batch: max_borrow 4 → 6 (+50%)",
        "best-effort: max_inflight 2 → 4 (+100%)",
        "best-effort: max_queued 16 → 32 (+100%)",
        "best-effort: deadline 5s → 4s (−20%)",
    ]
    assert by_section["classification"] == [
        "rule batch-api removed (it sent path under /v1/batches to batch)",
        "rule chat: match.methods: removed POST",
        "rule completions: match.methods: removed POST",
        "rule free-tier added as rules[0] (tenant free → best-effort)",
    ]
    assert ("estimation.models.llama-3.1-70b removed (was {prefill_ms_per_token 0.08, "
            "decode_ms_per_token 30, overhead_ms 30})") in by_section["estimation"]
    assert "estimation.default.decode_ms_per_token 8 → 3 (−62%)" in by_section["estimation"]
    assert by_section["capacity"] == ["capacity.max_inflight 14 → 64 (+357%)",
                                      "capacity.max_queued 300 → 600 (+100%)"]
    assert by_section["retry_after"] == ["retry_after.max 30s → 10s (−67%)",
                                         "retry_after.jitter 0.2 → 0.3 (+50%)"]
    assert [risk.path for risk in result.risks] == [
        "lanes.interactive.deadline", "lanes.interactive.borrow", "lanes.batch.deadline",
        "lanes.batch.max_borrow",
        "lanes.best-effort.deadline", "classification.rules.free-tier", "classification.rules.batch-api",
        "classification.rules.chat.match.methods", "classification.rules.completions.match.methods",
    ]
    assert result.risks[0].text == ("interactive: deadline 10s → 1s: more requests rejected as "
                                    "deadline_unmeetable or expired in the queue")
    assert result.risks[5].text == ("rule free-tier added as rules[0] (tenant free → best-effort): chat, "
                                    "completions after it no longer get the requests it matches")
    assert result.risks[7].text == ("rule chat: match.methods [POST] removed: it now matches every method, "
                                    "taking requests from later rules or the default lane best-effort")
    assert result.changes[0].path == "lanes.interactive.max_inflight"


def test_demo_policy_against_single_lane() -> None:
    result = df.diff(load_policy(EXAMPLES / "demo-policy.yaml"), load_policy(EXAMPLES / "single-lane.yaml"))
    texts = [c.text for c in result.changes]
    assert texts[:4] == [
        "interactive removed (priority 100, max_inflight 50, max_queued 256, deadline 1s, sjf_weight 1)",
        "batch removed (priority 50, max_inflight 10, max_queued 512, deadline 8s, borrow true, "
        "max_borrow 6)",
        "best-effort removed (max_inflight 4, max_queued 32, deadline 4s, evictable true)",
        "default added (max_inflight 32, max_queued 128, deadline 20s)",
    ]
    assert "classification.default_lane best-effort → default" in texts
    assert "rule chat removed (it sent path /v1/chat/completions to interactive)" in texts
    assert "trusted_headers: removed x-extproc-client" in texts
    assert "tenants.weights.acme removed (was 3)" in texts
    assert "queueing.sjf_weight 4 → 0 (−100%)" in texts
    assert "request bodies are no longer read (every request is sized as default_max_tokens)" in texts
    assert ("total slots 64 → 32 (−50%); where capacity.max_inflight is unset, it is the lanes' "
            "max_inflight summed") in texts
    assert [risk.path for risk in result.risks] == [
        "classification.default_lane", "classification.rules.free-tier", "classification.rules.chat",
        "classification.rules.completions", "tenants.header", "tenants.default", "estimation.read_body",
        "estimation.default", "capacity.max_inflight",
    ]
    assert result.risks[4].text == ("tenants.header x-extproc-client → unset: every request is now tenant "
                                    "'default': one budget and one fair share for all")


@pytest.mark.parametrize("name", ["policy.yaml", "demo-policy.yaml", "single-lane.yaml"])
def test_a_policy_against_itself_has_no_changes(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(EXAMPLES / name)
    code, out, err = run([path, path], capsys)
    assert (code, out, err) == (0, f"{path} → {path}: no changes\n", "")


def test_same_meaning_written_differently_is_no_change(tmp_path: Path) -> None:
    data = example_data("policy.yaml")
    data["trusted_headers"] = ["X-Extproc-Client"]  # other case
    lane(data, "interactive")["deadline"] = "10000ms"
    data["capacity"]["max_hold"] = "5m"
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(data, default_flow_style=True))
    assert df.diff(load_policy(EXAMPLES / "policy.yaml"), load_policy(other)).same


# -- lanes -------------------------------------------------------------------------------------------


def test_lane_limits_in_words() -> None:
    def edit(d: Data) -> None:
        lane(d, "interactive").update(max_inflight=32, deadline="2s")

    a, b = edited("demo-policy.yaml", edit)
    assert lines(a, b) == ["interactive: max_inflight 50 → 32 (−36%)",
                           "interactive: deadline 1s → 2s (+100%)"]


def test_a_lane_renamed_with_its_rules_and_default() -> None:
    def edit(d: Data) -> None:
        lane(d, "best-effort")["name"] = "spare"
        d["classification"]["default_lane"] = "spare"
        d["classification"]["rules"].append({"name": "old", "match": {"path": "/old"}, "lane": "spare"})

    a, b = edited("policy.yaml", edit)
    assert lines(a, b) == [
        "best-effort → spare: looks renamed (same settings)",
        "classification.default_lane best-effort → spare",
        "rule old added as rules[3] (path /old → spare)",
    ]


def test_rules_that_follow_a_renamed_lane_are_not_changes() -> None:
    def edit(d: Data) -> None:
        lane(d, "batch")["name"] = "offline"
        for rule in d["classification"]["rules"]:
            if rule["lane"] == "batch":
                rule["lane"] = "offline"

    a, b = edited("policy.yaml", edit)
    assert lines(a, b) == ["batch → offline: looks renamed (same settings)"]


def test_a_renamed_lane_with_other_changes() -> None:
    def edit(d: Data) -> None:
        lane(d, "best-effort").update(name="spare", max_queued=8)
        d["classification"]["default_lane"] = "spare"

    a, b = edited("policy.yaml", edit)
    assert lines(a, b)[:2] == ["best-effort → spare: looks renamed (other changes below)",
                               "spare: max_queued 16 → 8 (−50%)"]


def test_an_unlike_lane_is_added_not_renamed() -> None:
    def edit(d: Data) -> None:
        d["lanes"].append({"name": "bulk", "priority": 10, "max_inflight": 1, "deadline": "120s",
                           "evictable": True})
        d["capacity"]["max_inflight"] = 15

    a, b = edited("policy.yaml", edit)
    assert lines(a, b) == [
        "bulk added (priority 10, max_inflight 1, deadline 120s, evictable true)",
        "capacity.max_inflight 14 → 15 (+7%)",
    ]


def test_priority_order_change() -> None:
    def edit(d: Data) -> None:
        lane(d, "batch")["priority"] = 150

    a, b = edited("policy.yaml", edit)
    assert lines(a, b) == [
        "batch: priority 50 → 150",
        "priority order interactive > batch > best-effort → batch > interactive > best-effort "
        "(queued work of higher lanes gets freed slots first)",
    ]


# -- rules, tenants, headers --------------------------------------------------------------------------


def test_rules_reordered_added_removed_and_resent() -> None:
    def edit(d: Data) -> None:
        batch_api, chat, completions = d["classification"]["rules"]
        completions["lane"] = "interactive"
        chat["match"]["path"] = "/v2/chat/completions"
        embed = {"match": {"path_prefix": "/v1/embed"}, "lane": "batch"}
        d["classification"]["rules"] = [chat, batch_api, embed]
        del completions

    a, b = edited("policy.yaml", edit)
    assert lines(a, b) == [
        "rule chat: match.path /v1/chat/completions → /v2/chat/completions",
        "rule completions removed (it sent path /v1/completions, method POST to batch)",
        "rule (path under /v1/embed → batch) added as rules[2]",
        "rules reordered (the first match wins): batch-api, chat → chat, batch-api",
    ]


def test_a_rule_sent_elsewhere() -> None:
    def edit(d: Data) -> None:
        d["classification"]["rules"][2]["lane"] = "interactive"

    a, b = edited("policy.yaml", edit)
    assert lines(a, b) == ["rule completions now sends to interactive (was batch)"]


def test_tenant_weights_and_trusted_headers() -> None:
    def edit(d: Data) -> None:
        d["tenants"]["weights"] = {"acme": 5, "initech": 2}
        d["trusted_headers"].append("x-team")

    a, b = edited("policy.yaml", edit)
    assert lines(a, b) == [
        "trusted_headers: added x-team",
        "tenants.weights.acme 3 → 5 (+67%)",
        "tenants.weights.globex removed (was 1)",
        "tenants.weights.initech added: 2",
    ]
    assert [(r.path, r.text) for r in df.diff(a, b).risks] == [
        ("trusted_headers", "x-team is now trusted: make sure your gateway sets or strips it, or clients "
         "can send it themselves"),
        ("tenants.weights.acme", "tenant acme: weight 3 → 5: other tenants' queued requests get a smaller "
         "share of freed slots"),
        ("tenants.weights.initech", "tenant initech: weight 1 → 2: other tenants' queued requests get a "
         "smaller share of freed slots"),
    ]


def test_estimation_models_added() -> None:
    def edit(d: Data) -> None:
        d["estimation"]["models"]["mistral-7b"] = {"decode_ms_per_token": 4}

    a, b = edited("policy.yaml", edit)
    assert lines(a, b) == ["estimation.models.mistral-7b added: {decode_ms_per_token 4}"]


# -- risks (each kind of change → risk: tests/unit/test_policy_risk.py) ----------------------------------


def test_capacity_below_the_lanes_limits() -> None:
    def edit(d: Data) -> None:
        d["capacity"]["max_inflight"] = 12

    a, b = edited("policy.yaml", edit)
    assert [r.text for r in df.diff(a, b).risks] == [
        "capacity.max_inflight 14 → 12: fewer requests run at once across all lanes; the rest queue or are "
        "rejected",
        "capacity (12 slots) is below the lanes' max_inflight summed (14): the lanes cannot all reach their "
        "limits at once",
    ]


def test_shadow_mode_on_and_off() -> None:
    def on(d: Data) -> None:
        d["shadow"] = True

    a, b = edited("policy.yaml", on)
    assert lines(a, b) == ["shadow false → true"]
    assert [r.text for r in df.diff(a, b).risks] == [
        "policy.shadow turns on: nothing is enforced any more; overload reaches the backend"]
    assert [r.text for r in df.diff(b, a).risks] == [
        "policy.shadow turns off: every lane not in shadow itself starts enforcing (queueing and rejecting)"]

    def lane_on(d: Data) -> None:
        lane(d, "batch")["shadow"] = True

    a, b = edited("policy.yaml", lane_on)
    assert lines(a, b) == ["batch: shadow false → true"]
    assert [r.text for r in df.diff(b, a).risks] == [
        "batch leaves shadow mode: it starts enforcing (queueing and rejecting)"]


def test_budgets_are_said_with_their_period() -> None:
    def edit(d: Data) -> None:
        d["ratelimit"]["budgets"]["tenants"]["free"] = {"requests": 20}
        d["ratelimit"]["budgets"]["default"] = {"requests": 300, "per": "minute", "burst": 2}
        d["ratelimit"]["budgets"]["tenants"]["acme"]["per"] = "hour"

    a, b = edited("fleet-policy.yaml", edit)
    assert [c.text for c in df.diff(a, b).changes if c.section == "ratelimit"] == [
        "ratelimit.budgets.default 600 requests per minute → 300 requests per minute, burst 2",
        "ratelimit.budgets.tenants.acme 6000 requests per minute → 6000 requests per hour",
        "ratelimit.budgets.tenants.free added: 20 requests per minute",
    ]
    assert [(r.path, r.text) for r in df.diff(a, b).risks] == [
        ("ratelimit.budgets.default", "ratelimit.budgets.default 600 requests per minute → 300 requests per "
         "minute, burst 2: tenants without a budget of their own: more of its requests are refused at the "
         "edge (429)"),
        ("ratelimit.budgets.tenants.acme", "tenant acme's budget 6000 requests per minute → 6000 requests "
         "per hour: more of its requests are refused at the edge (429)"),
        ("ratelimit.budgets.tenants.free", "tenant free's budget 600 requests per minute (the default) → 20 "
         "requests per minute: more of its requests are refused at the edge (429)"),
    ]


# -- fields the schema may gain ---------------------------------------------------------------------------


class _Descriptor(BaseModel):
    name: str
    limit: int


class _Signals(BaseModel):
    url: str
    interval: Duration = 15.0


class _Future(BaseModel):
    signals: _Signals | None = None
    descriptors: tuple[_Descriptor, ...] = ()
    keys: tuple[str, ...] = ()
    weights: dict[str, float] = {}


def test_unknown_models_are_walked_generically() -> None:
    old = _Future(descriptors=(_Descriptor(name="a", limit=10), _Descriptor(name="b", limit=1)), keys=("k",),
                  weights={"x": 2.0})
    new = _Future(signals=_Signals(url="http://prom", interval=30.0),
                  descriptors=(_Descriptor(name="a", limit=5), _Descriptor(name="c", limit=1)),
                  keys=("k", "j"), weights={"x": 2.5})
    assert [c.text for c in df.compare(old, new, "ratelimit")] == [
        "ratelimit.signals added (url http://prom, interval 30s)",
        "ratelimit.descriptors.a.limit 10 → 5 (−50%)",
        "ratelimit.descriptors.b removed (limit 1)",
        "ratelimit.descriptors.c added (limit 1)",
        "ratelimit.keys: added j",
        "ratelimit.weights.x 2 → 2.5 (+25%)",
    ]
    later = new.model_copy(update={"signals": _Signals(url="http://prom", interval=0.5)})
    assert [(c.path, c.text) for c in df.compare(new, later, "ratelimit")] == [
        ("ratelimit.signals.interval", "ratelimit.signals.interval 30s → 500ms (−98%)")]
    assert [c.text for c in df.compare(new, _Future(), "x")] == [
        "x.signals removed (was url http://prom, interval 30s)",
        "x.descriptors.a removed (limit 5)",
        "x.descriptors.c removed (limit 1)",
        "x.keys: removed k, j",
        "x.weights.x removed (was 2.5)",
    ]


# -- the command --------------------------------------------------------------------------------------


def test_command_text_and_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    a, b = str(EXAMPLES / "policy.yaml"), str(EXAMPLES / "demo-policy.yaml")
    code, out, _ = run([a, b], capsys)
    assert code == 1
    # Risks first: what to read before applying; then every change, section by section.
    assert out.startswith(
        f"{a} → {b}: 26 changes, 9 risks\n\n"
        "risks: what can refuse or reorder more traffic than before\n"
        "  ! interactive: deadline 10s → 1s: more requests rejected as deadline_unmeetable or expired in the "
        "queue\n")
    text = out.split("\n")
    risks_end = text.index("", 3)
    assert risks_end - 3 == 9
    assert all(line.startswith("  ! ") for line in text[3:risks_end])
    assert text[risks_end + 1:risks_end + 3] == ["lanes", "  interactive: max_inflight 8 → 50 (+525%)"]
    assert out.index("\nretry_after\n") > out.index("\nlanes\n") > out.index("\nrisks: ")


def test_command_text_without_risks(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    data = example_data("policy.yaml")
    lane(data, "batch")["deadline"] = "90s"
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(data))
    a = str(EXAMPLES / "policy.yaml")
    code, out, _ = run([a, str(other)], capsys)
    assert (code, out) == (
        1, f"{a} → {other}: 1 change, no risks\n\nlanes\n  batch: deadline 60s → 90s (+50%)\n")


def test_command_json(capsys: pytest.CaptureFixture[str]) -> None:
    a, b = str(EXAMPLES / "demo-policy.yaml"), str(EXAMPLES / "policy.yaml")
    code, out, _ = run([a, b, "--json"], capsys)
    assert code == 1
    doc = json.loads(out)
    assert (doc["a"], doc["b"], doc["same"]) == (a, b, False)
    assert {"section": "lanes", "path": "lanes.interactive.deadline",
            "text": "interactive: deadline 1s → 10s (+900%)"} in doc["changes"]
    assert doc["risks"][:2] == [
        {"path": "lanes.interactive.max_inflight",
         "text": "interactive: max_inflight 50 → 8: fewer of its requests run at once; the rest queue or are "
                 "rejected"},
        {"path": "lanes.interactive.max_queued",
         "text": "interactive: max_queued 256 → 64: its queue fills sooner, then requests are rejected "
                 "(queue_full)"},
    ]
    assert len(doc["risks"]) == 18
    code, out, _ = run([a, a, "--json"], capsys)
    assert (code, json.loads(out)["same"], json.loads(out)["changes"], json.loads(out)["risks"]) == (
        0, True, [], [])


def test_command_bad_policies_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("lanes:\n  - {name: a, max_inflight: 0, deadline: 1s}\n"
                   "classification: {default_lane: a}\n")
    missing = tmp_path / "missing.yaml"
    code, out, err = run([str(missing), str(bad)], capsys)
    assert (code, out) == (2, "")
    assert f"{missing}: 1 problem(s)\n  {missing}: (top level): cannot read file" in err
    assert f"{bad}: 1 problem(s)\n  {bad}:2: lanes[0].max_inflight:" in err


def test_the_operator_guide_example_is_what_diff_prints(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    guide = (ROOT / "docs" / "operator-guide.md").read_text()
    start = guide.index("   in-force.yaml → policy.yaml:")
    block = guide[start:guide.index("   ```", start)]
    shown = "\n".join(line.removeprefix("   ") for line in block.splitlines())
    data = example_data("fleet-policy.yaml")
    (tmp_path / "in-force.yaml").write_text(yaml.safe_dump(data))
    lane(data, "batch")["deadline"] = "30s"
    data["classification"]["rules"].insert(0, {"name": "free-tier", "match": {"tenants": ["free"]},
                                               "lane": "best-effort"})
    data["ratelimit"]["budgets"]["tenants"]["free"] = {"requests": 20}
    data["ratelimit"]["budgets"]["max_tenants"] = 50_000
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(data))
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        code, out, _ = run(["in-force.yaml", "policy.yaml"], capsys)
    assert (code, out) == (1, shown + "\n")

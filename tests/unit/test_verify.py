"""``simulate --verify`` on a log that spans several policies and operator actions: each span is
replayed under the policy that decided it (matched by the sha256 of the policy file's bytes), the
logged drains and reloads are applied where they happened, and a log naming a policy the replay was
not given is refused with its spans named."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from extproc.cli import main
from extproc.policy import Policy, load_policy
from extproc.policy.loader import decode_policy
from extproc.sim.verify import Log, PolicyMissing, policies_by_hash, read_log, replay, resolve, spans

STRICT = """\
lanes:
  - {name: a, max_inflight: 1, max_queued: 0, deadline: 5s}
classification: {default_lane: a}
"""
ROOMY = STRICT.replace("max_inflight: 1", "max_inflight: 8")
A = hashlib.sha256(STRICT.encode()).hexdigest()
B = hashlib.sha256(ROOMY.encode()).hexdigest()


def decision(at: float, policy: str, outcome: str, reason: str | None = None, service_ms: int = 10_000
             ) -> dict[str, Any]:
    record: dict[str, Any] = {
        "event": "decision", "request_id": f"r{at}", "policy": policy, "lane": "a", "tenant": "default",
        "outcome": outcome, "reason": reason, "arrival": at, "method": "POST", "path": "/v1/chat/completions",
        "headers": {}, "status": 200 if outcome == "admitted" else 429, "queue_ms": 0, "predicted_ms": 500}
    if outcome == "admitted":
        record["service_ms"] = service_ms
    return record


def operator(at: float, action: str, policy: str, **fields: str) -> dict[str, Any]:
    return {"event": "operator", "action": action, "at": at, "policy": policy, "trigger": "admin", **fields}


#: A strict policy (one slot, no queue), then a reload to a roomy one, a drain and an undrain.
RECORDS = [
    decision(100.0, A, "admitted"),
    decision(101.0, A, "rejected", "queue_full"),  # the one slot is taken until 110
    operator(102.0, "reload", B, previous=A),
    decision(103.0, B, "admitted"),
    decision(104.0, B, "admitted"),
    operator(105.0, "drain", B),
    decision(106.0, B, "rejected", "draining"),
    operator(107.0, "undrain", B),
    decision(108.0, B, "admitted"),
]


def as_log(records: list[dict[str, Any]]) -> Log:
    # Written when each request ended: out of arrival order in the file.
    return read_log([json.dumps(r) for r in reversed(records)] + ["not a record"])


def policies() -> dict[str, Policy]:
    return {A: _load(STRICT), B: _load(ROOMY)}


def _load(text: str) -> Policy:
    return decode_policy(text.encode(), "<test>")


def test_the_log_reads_attempts_and_actions_in_time_order() -> None:
    log = as_log(RECORDS)
    assert [a.at for a in log.attempts] == [100.0, 101.0, 103.0, 104.0, 106.0, 108.0]
    assert [(a.action, a.policy) for a in log.actions] == [("reload", B), ("drain", B), ("undrain", B)]
    assert [(s.policy, s.attempts) for s in spans(log.attempts)] == [(A, 2), (B, 4)]


def test_each_span_replays_under_the_policy_that_decided_it_with_the_operators_actions() -> None:
    log = as_log(RECORDS)
    summary = replay(log, resolve(log, policies())).summary()
    assert summary["outcome_agreement"] == 1.0
    assert summary["disagreements"] == {}
    assert summary["actions"] == {"drain": 1, "reload": 1, "undrain": 1}
    assert [(s["policy"], s["attempts"]) for s in summary["spans"]] == [(A, 2), (B, 4)]


def test_a_log_of_responses_asked_for_on_a_sample_verifies_alike() -> None:
    # extproc serve --response-sample: an admitted request whose response headers were not asked
    # for is logged with status null and sampled false; the replay reads it as live handled it (its
    # release teaches nothing) and agrees all the same.
    # (One in many asked for: the first admitted request's, and none after it.)
    sampled = [{**r, "status": None, "sampled": False}
               if r.get("outcome") == "admitted" and r["arrival"] > 100 else r for r in RECORDS]
    log = as_log(sampled)
    assert [a.status for a in log.attempts] == [200, 429, None, None, 429, None]
    summary = replay(log, resolve(log, policies())).summary()
    assert summary["outcome_agreement"] == 1.0
    assert summary["disagreements"] == {}


def test_one_policy_for_the_whole_log_or_no_drain_disagrees_with_what_happened() -> None:
    log = as_log(RECORDS)
    # The old way: one policy for everything (the strict one refuses what the roomy one admitted).
    strict_only = replay(log.attempts, _load(STRICT)).summary()
    assert strict_only["outcome_agreement"] < 1.0
    # Without the operator records the policy still follows the records' hashes, but the drain is lost.
    undrained = replay(Log(log.attempts), resolve(log, policies())).summary()
    assert undrained["disagreements"] == {"rejected:draining -> admitted": 1}


def test_a_log_naming_a_policy_not_given_is_refused_with_its_spans_named() -> None:
    log = as_log(RECORDS)
    with pytest.raises(PolicyMissing) as info:
        resolve(log, {B: _load(ROOMY)})
    message = str(info.value)
    assert f"policy {A[:12]}: 2 attempts, 1970-01-01T00:01:40Z–1970-01-01T00:01:41Z" in message
    assert B[:12] not in message


def test_a_log_without_hashes_replays_under_its_one_policy_and_no_other() -> None:
    log = as_log([{k: v for k, v in r.items() if k != "policy"} for r in RECORDS if r["event"] == "decision"])
    assert resolve(log, {B: _load(ROOMY)}) == {"": _load(ROOMY)}
    with pytest.raises(PolicyMissing, match="no policy hash"):
        resolve(log, policies())


def test_the_command_takes_every_policy_by_flag_and_refuses_a_missing_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    strict, roomy = tmp_path / "strict.yaml", tmp_path / "roomy.yaml"
    trace, out = tmp_path / "decisions.log", tmp_path / "v.json"
    strict.write_text(STRICT)
    roomy.write_text(ROOMY)
    trace.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    assert set(policies_by_hash([str(strict), str(roomy)], load_policy)) == {A, B}
    base = ["simulate", "--verify", "--trace", str(trace), "--json", str(out)]
    assert main([*base, "--policy", str(roomy)]) == 2
    err = capsys.readouterr().err
    assert "not given" in err
    assert f"policy {A[:12]}: 2 attempts" in err
    assert main([*base, "--policy", str(strict), "--policy", str(roomy)]) == 0
    printed = capsys.readouterr().out
    assert "outcome 100.0%" in printed
    assert "under strict.yaml" in printed
    assert "under roomy.yaml" in printed
    verify = json.loads(out.read_text())["verify"]
    assert verify["outcome_agreement"] == 1.0
    assert len(verify["spans"]) == 2

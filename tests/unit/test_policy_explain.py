"""`extproc policy explain`: rule, lane, tenant, estimate and decisions for a sample request."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry

from extproc.controller import Controller
from extproc.core.classify import Classification, Classifier, RequestFacts
from extproc.core.decision import Outcome, Reason
from extproc.core.estimate import Job
from extproc.metrics import Metrics
from extproc.policy import Policy, load_policy
from extproc.policy.ratelimit import RateLimit
from extproc.servers.extproc import ExternalProcessor, _Request
from extproc.tools import explain as ex
from extproc.tools.explain import ExplainError, sample_request
from extproc.tools.scenario import LaneLoad, StateError, busy, parse_state

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
#: 10 ms per output token and nothing else: 100 tokens take exactly 1 s.
COST = {"prefill_ms_per_token": 0, "decode_ms_per_token": 10, "overhead_ms": 0}
CHAT_BODY = json.dumps({"model": "llama-3.1-70b", "max_tokens": 200,
                        "messages": [{"role": "user", "content": "x" * 36}]})


def example(name: str) -> Policy:
    return load_policy(EXAMPLES / name)


def small_policy(lanes: list[dict[str, Any]], **extra: Any) -> Policy:
    data: dict[str, Any] = {
        "lanes": lanes,
        "classification": {"default_lane": lanes[0]["name"]},
        "queueing": {"sjf_weight": 0},
        "estimation": {"default": COST, "learning_rate": 0, "occupancy_slowdown": 0,
                       "default_max_tokens": 100},
    }
    data.update(extra)
    return Policy.model_validate(data)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    ex.add_arguments(parser)
    code = ex.command(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- the example policies -----------------------------------------------------------------------------


def test_chat_request_on_the_example_policy() -> None:
    policy = example("policy.yaml")
    request = sample_request(path="/v1/chat/completions", headers=["X-Extproc-Client: acme"], body=CHAT_BODY)
    expl = ex.explain(policy, request, source="examples/policy.yaml")

    view = expl.classification
    assert (view.lane, view.rule, view.rule_index, view.tenant) == ("interactive", "chat", 1, "acme")
    assert view.lane_header is None  # the example policy trusts no lane header
    assert [(c.name, c.lane, c.matched) for c in view.checks] == [
        ("batch-api", "batch", False), ("chat", "interactive", True)]
    assert view.checks[0].why == ("path /v1/chat/completions is not under /v1/batches",)
    assert (view.tenant_weight, view.tenant_from) == (3, "header x-extproc-client")
    assert view.weight_from == "tenants.weights"

    est = expl.estimate
    assert est.job == Job("llama-3.1-70b", 9, 200)
    assert est.costs_from == "estimation.models.llama-3.1-70b"
    assert est.output_from == "max_tokens from the body"
    # overhead 30 ms + 9 prompt tokens × 0.08 ms + 200 × 30 ms at no slowdown.
    assert est.predicted_s == pytest.approx((30 + 9 * 0.08 + 200 * 30) / 1000)

    text = ex.render(expl)
    assert "classification → lane interactive, tenant acme" in text
    assert "rule 0 batch-api (→ batch; path under /v1/batches): no: path /v1/chat/completions is not under " \
           "/v1/batches" in text
    assert "rule 1 chat (→ interactive; path /v1/chat/completions, method POST): MATCH" in text
    assert "rules after chat are not tried: the first match wins" in text
    assert "tenant    acme from header x-extproc-client; weight 3 (tenants.weights)" in text
    assert "30 ms overhead + 9 × 0.08 ms prefill + 200 × 30 ms decode × 1.00 slowdown = 6031 ms" in text


def test_default_scenarios_on_the_example_policy() -> None:
    policy = example("policy.yaml")
    request = sample_request(path="/v1/chat/completions", headers=["x-extproc-client: acme"], body=CHAT_BODY)
    idle, at_limit, busy, full = ex.explain(policy, request).scenarios

    assert (idle.name, idle.reached, idle.outcome, idle.borrowed) == ("idle", {}, Outcome.ADMITTED, False)
    assert idle.predicted_s == pytest.approx(6.03072)

    # interactive may borrow: with batch and best-effort idle it takes one of their slots.
    assert at_limit.name == "interactive at its in-flight limit"
    assert at_limit.reached == {"interactive": LaneLoad(8)}
    assert (at_limit.outcome, at_limit.borrowed) == (Outcome.ADMITTED, True)

    assert busy.name == "all 14 slots busy"
    assert busy.reached == {"interactive": LaneLoad(8), "batch": LaneLoad(4), "best-effort": LaneLoad(2)}
    assert busy.outcome is Outcome.QUEUED
    # The first interactive request to finish (the one admitted on an idle backend) frees its slot.
    assert (busy.then, busy.then_reason) == (Outcome.ADMITTED, None)
    assert busy.then_after_s == pytest.approx(6.03072)

    # Six-second jobs on eight slots: a 10 s deadline cannot be met from the 8th place on, so the
    # queue of 64 never fills with requests like this one.
    assert full.name == "all 14 slots busy, interactive's queue full (64)"
    assert full.asked["interactive"] == LaneLoad(8, 64)
    assert full.reached["interactive"] == LaneLoad(8, 7)
    assert (full.outcome, full.reason) == (Outcome.REJECTED, Reason.DEADLINE_UNMEETABLE)
    assert full.retry_after is not None
    assert 1 <= full.retry_after <= 30
    assert full.notes == (
        "interactive: only 7 of 64 can be queued: the next is rejected (deadline_unmeetable)",)


def test_example_policy_queue_full_with_small_fill_requests() -> None:
    policy = example("policy.yaml")
    request = sample_request(path="/v1/chat/completions", body=CHAT_BODY)
    full = ex.explain(policy, request, fill_tokens=1).scenarios[-1]
    assert full.reached["interactive"] == LaneLoad(8, 64)
    assert full.notes == ()
    assert (full.outcome, full.reason) == (Outcome.REJECTED, Reason.QUEUE_FULL)
    # The live path meets the edge first: with every slot busy and the queue full, the rate limit
    # service sheds it before ext_proc is asked.
    assert full.at == "edge"
    text = ex.render(ex.explain(policy, request, fill_tokens=1))
    assert "REJECTED at the edge 429 queue_full, Retry-After" in text


def test_demo_policy_interactive_does_not_borrow() -> None:
    policy = example("demo-policy.yaml")
    request = sample_request(path="/v1/chat/completions", headers=["x-extproc-client: globex"],
                             body='{"max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}')
    expl = ex.explain(policy, request)
    assert (expl.classification.rule, expl.classification.lane) == ("chat", "interactive")
    assert (expl.classification.tenant, expl.classification.tenant_weight) == ("globex", 1)
    assert expl.estimate.predicted_s == pytest.approx(0.155)  # 5 ms + 50 × 3 ms
    names = [s.name for s in expl.scenarios]
    assert names == ["idle", "interactive at its in-flight limit", "all 64 slots busy",
                     "all 64 slots busy, interactive's queue full (256)"]
    at_limit = expl.scenarios[1]
    assert (at_limit.outcome, at_limit.then) == (Outcome.QUEUED, Outcome.ADMITTED)
    assert at_limit.then_after_s == pytest.approx(0.155)
    assert "lane      interactive: priority 100, 50 in flight, 256 queued, deadline 1s" in ex.render(expl)


def test_demo_policy_completions_go_to_batch_after_chat_does_not_match() -> None:
    expl = ex.explain(example("demo-policy.yaml"), sample_request(path="/v1/completions"))
    view = expl.classification
    assert (view.lane, view.rule, view.rule_index) == ("batch", "completions", 2)
    assert view.checks[1].why == ("path /v1/completions is not /v1/chat/completions",)
    assert "lane      batch: priority 50, 10 in flight, 512 queued, deadline 8s, may borrow up to 6" \
        in ex.render(expl)


def test_single_lane_policy_reads_no_body_and_trusts_no_header() -> None:
    policy = example("single-lane.yaml")
    request = sample_request(path="/v1/completions", headers=["x-tenant-id: acme", "x-extproc-lane: batch"],
                             body='{"model": "m", "max_tokens": 10}')
    expl = ex.explain(policy, request)
    assert not expl.intake.body_read
    assert expl.intake.body_why.startswith("not read: read_body auto and nothing uses it")
    assert expl.intake.stripped == ("x-extproc-lane",)
    assert "x-extproc-lane" not in expl.intake.facts.headers
    assert expl.classification.ignored == (
        "x-extproc-lane is not in trusted_headers: stripped before classification, so it cannot pick a lane",
        "x-tenant-id is not in trusted_headers, so it cannot pick a lane or tenant",
    )
    assert (expl.classification.lane, expl.classification.rule, expl.classification.tenant) == (
        "default", "default", "default")
    # Not read, so neither the body's model nor its max_tokens count.
    assert expl.estimate.job == Job(None, 0, 256)
    # A token budget reads it: a stream must be asked for its usage.
    budgeted = policy.model_copy(update={"ratelimit": RateLimit.model_validate(
        {"budgets": {"default": {"tokens": 1000}}})})
    with_budget = ex.explain(budgeted, request)
    assert with_budget.intake.body_read
    assert "token budgets: a streamed request is asked for its usage" in with_budget.intake.body_why
    assert expl.estimate.prompt_from == "body not read"
    # One lane that is the whole capacity: "all slots busy" would repeat "at its limit".
    names = [s.name for s in expl.scenarios]
    assert names == ["idle", "default at its in-flight limit",
                     "all 32 slots busy, default's queue full (128)"]
    text = ex.render(expl)
    assert "the policy has no rules, so classification.default_lane default takes it" in text
    assert "ignored   x-tenant-id is not in trusted_headers, so it cannot pick a lane or tenant" in text


# -- classification details ---------------------------------------------------------------------------


def with_lane_header(policy: Policy) -> Policy:
    """The policy, trusting x-extproc-lane (set by a gateway after the strip) as its lane header."""
    data = policy.model_dump()
    data["trusted_headers"] = [*data["trusted_headers"], "x-extproc-lane"]
    data["classification"]["lane_header"] = "x-extproc-lane"
    return Policy.model_validate(data)


def test_trusted_lane_header_decides_before_the_rules() -> None:
    expl = ex.explain(with_lane_header(example("policy.yaml")), sample_request(path="/v1/chat/completions",
                                                             headers=["x-extproc-lane: batch"]))
    view = expl.classification
    assert (view.lane, view.rule, view.rule_index, view.checks) == ("batch", "lane_header", None, ())
    assert view.lane_header == "x-extproc-lane: batch names lane batch; the rules are not tried"


def test_lane_header_naming_no_lane_leaves_it_to_the_rules() -> None:
    expl = ex.explain(with_lane_header(example("policy.yaml")), sample_request(path="/v1/other", method="get",
                                                             headers=["x-extproc-lane: gold"]))
    view = expl.classification
    assert view.lane_header == ("x-extproc-lane: 'gold' names no lane (lanes: interactive, batch, "
                                "best-effort), so the rules decide")
    assert (view.lane, view.rule) == ("best-effort", "default")
    assert [c.why for c in view.checks] == [
        ("path /v1/other is not under /v1/batches",),
        ("path /v1/other is not /v1/chat/completions", "method GET is not POST"),
        ("path /v1/other is not /v1/completions", "method GET is not POST"),
    ]
    assert "no rule matches, so classification.default_lane best-effort takes it" in ex.render(expl)


def test_unmet_conditions_of_every_kind_are_named() -> None:
    policy = Policy.model_validate({
        "lanes": [{"name": "a", "max_inflight": 1, "deadline": "1s"}, {"name": "b", "max_inflight": 1,
                                                                        "deadline": "1s"}],
        "trusted_headers": ["x-team", "x-tenant"],
        "tenants": {"header": "x-tenant"},
        "classification": {"default_lane": "a", "rules": [
            {"match": {"path_regex": "/v[0-9]+/x", "headers": {"x-team": ["ml"]}, "models": ["big"],
                       "tenants": ["acme"]}, "lane": "b"},
            {"name": "team", "match": {"headers": {"x-team": "ml"}}, "lane": "b"},
        ]},
    })
    request = sample_request(path="/v1/y?q=1", headers=["x-team: web", "x-tenant: " + "t" * 200],
                             body='{"model": "small"}')
    view = ex.explain(policy, request).classification
    assert view.checks[0].name == "rules[0]"
    assert view.checks[0].conditions == "path ~ /v[0-9]+/x, x-team: ml, model big, tenant acme"
    assert view.checks[0].why == ("path /v1/y does not match /v[0-9]+/x", "x-team: web is not ml",
                                  "model small is not big", f"tenant {'t' * 128} is not acme")
    assert view.checks[1].why == ("x-team: web is not ml",)
    assert view.tenant_from == "header x-tenant, cut to tenants.max_tenant_length (128)"
    no_team = ex.explain(policy, sample_request(path="/v1/x")).classification
    assert no_team.checks[1].why == ("x-team not sent (wants ml)",)
    assert "no model known (wants big)" in no_team.checks[0].why


def test_model_header_names_the_model_before_the_body() -> None:
    policy = small_policy([{"name": "a", "max_inflight": 1, "deadline": "1s"}],
                          estimation={"default": COST, "model_header": "x-model", "read_body": "always",
                                      "models": {"big": {"decode_ms_per_token": 20}}})
    request = sample_request(path="/v1/x", headers=["x-model: big"],
                             body='{"model": "other", "max_tokens": 5}')
    expl = ex.explain(policy, request)
    assert (expl.intake.facts.model, expl.intake.model_from) == ("big", "header x-model")
    assert expl.estimate.costs_from == "estimation.models.big"
    assert expl.classification.ignored == ()  # the model header is read, trusted or not
    assert "model     big from header x-model; costs from estimation.models.big" in ex.render(expl)
    unknown = ex.explain(policy, sample_request(path="/v1/x", body='{"model": "tiny"}'))
    assert unknown.estimate.costs_from == "estimation.default (tiny has no entry in estimation.models)"


# -- bodies, read as the live service reads them ------------------------------------------------------


def test_body_that_is_not_json_falls_back_to_defaults() -> None:
    expl = ex.explain(example("policy.yaml"), sample_request(path="/v1/chat/completions", body="not json {"))
    assert expl.intake.body_read
    assert expl.intake.body.note == "body is not JSON"
    assert expl.estimate.job == Job(None, 2, 256)  # 10 chars / 4 per token; default max_tokens
    assert expl.estimate.output_from == "estimation.default_max_tokens"
    assert "body      10 bytes, read (body is not JSON): no model, no max_tokens, 10 prompt chars" \
        in ex.render(expl)


def test_a_body_that_cannot_be_read_is_explained_as_the_largest_job() -> None:
    request = sample_request(path="/v1/chat/completions", headers=["content-encoding: x-foo"], body=CHAT_BODY)
    expl = ex.explain(example("policy.yaml"), request)
    assert expl.intake.body.unreadable
    est = expl.estimate
    assert est.job == Job(None, (len(CHAT_BODY) - 64) // 4, 32768, unread=True)
    assert est.output_from.startswith("estimation.max_output_tokens: the body cannot be read")
    assert est.costs_from.startswith("estimation.models.llama-3.1-70b, the costliest")
    assert est.decode_ms_per_token == 30.0
    text = ex.render(expl)
    assert ("cannot be read (content-encoding 'x-foo' is not one extproc decodes): "
            "estimation.unreadable_body is estimate, so it is sized as the largest job") in text
    assert expl.scenarios[0].outcome is Outcome.ADMITTED
    assert ex.as_json(expl)["body"]["unreadable"] is True


def test_a_body_that_cannot_be_read_is_explained_as_refused_when_the_policy_says_so() -> None:
    policy = small_policy([{"name": "a", "max_inflight": 1, "deadline": "1s"}],
                          estimation={"default": COST, "read_body": "always", "unreadable_body": "refuse"})
    request = sample_request(path="/v1/chat/completions", headers=["content-encoding: gzip, gzip"],
                             body=CHAT_BODY)
    expl = ex.explain(policy, request)
    # Once the edge let it through (it sheds on a full queue first, as live: it never sees a body).
    assert {(s.outcome, s.reason, s.status, s.retry_after) for s in expl.scenarios if s.at == "ext_proc"} == {
        (Outcome.REJECTED, Reason.UNSUPPORTED_ENCODING, 415, None)}
    text = ex.render(expl)
    assert ("→ REJECTED 415 unsupported_encoding before it is classified: Content-encoding 'gzip, gzip' "
            "is not one extproc decodes.") in text
    assert "Retry-After None" not in text


def test_a_token_limit_the_model_servers_refuse_is_explained_as_a_400() -> None:
    expl = ex.explain(example("policy.yaml"), sample_request(path="/v1/completions",
                                                             body='{"max_tokens": -3, "prompt": "hi"}'))
    assert {(s.reason, s.status) for s in expl.scenarios} == {(Reason.BAD_REQUEST, 400)}
    assert "the model servers refuse it (max_tokens -3: must not be negative)" in ex.render(expl)
    assert ex.as_json(expl)["body"]["invalid"] == "max_tokens -3: must not be negative"


def test_body_of_any_bytes_from_a_file(tmp_path: Path) -> None:
    raw = tmp_path / "body.bin"
    raw.write_bytes(b"\xff\xfe\x00 binary")
    expl = ex.explain(example("policy.yaml"), sample_request(path="/v1/chat/completions", body=f"@{raw}"))
    assert expl.request.body == b"\xff\xfe\x00 binary"
    assert expl.intake.body.note == "body is not JSON"


def test_body_over_max_body_bytes_is_read_in_part() -> None:
    policy = small_policy([{"name": "a", "max_inflight": 1, "deadline": "1s"}],
                          estimation={"default": COST, "read_body": "always", "max_body_bytes": 1024})
    body = json.dumps({"model": "m", "max_tokens": 7, "prompt": "p" * 5000})
    expl = ex.explain(policy, sample_request(path="/v1/completions", body=body))
    facts = expl.intake.body
    assert (facts.model, facts.max_tokens, facts.note) == ("m", 7, "body read in part")
    assert facts.prompt_chars == len(body) - 64  # from the content length, less the JSON envelope


def test_prompt_given_as_token_ids() -> None:
    expl = ex.explain(example("policy.yaml"), sample_request(
        path="/v1/completions", body='{"prompt": [1, 2, 3, 4, 5], "max_tokens": 3}'))
    assert expl.estimate.job == Job(None, 5, 3)
    assert expl.estimate.prompt_from == "token ids in the body"


def test_occupancy_slows_decoding() -> None:
    policy = example("policy.yaml")
    request = sample_request(path="/v1/completions", body='{"max_tokens": 100}')
    est = ex.explain(policy, request, occupancy=0.5).estimate
    assert est.slowdown == pytest.approx(1.75)  # 1 + occupancy_slowdown 1.5 × 0.5
    assert est.predicted_s == pytest.approx((15 + 100 * 8 * 1.75) / 1000)
    parts = est.overhead_ms + est.job.prompt_tokens * est.prefill_ms_per_token \
        + est.job.output_tokens * est.decode_ms_per_token * est.slowdown
    assert parts == pytest.approx(est.predicted_s * 1000)


def _live(policy: Policy, request: ex.SampleRequest) -> tuple[Classification, Job]:
    """The live ext_proc handler's classification and job for the same request (no sockets)."""
    processor = ExternalProcessor(Controller(policy, Metrics(CollectorRegistry())))
    live = _Request(processor)
    pairs = [(":method", request.method), (":path", request.path), *request.headers.items()]
    if request.body:
        pairs.append(("content-length", str(len(request.body))))
    headers = HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])
    if live.on_headers(pb.HttpHeaders(headers=headers, end_of_stream=not request.body), None) is not None:
        assert live.on_body(pb.HttpBody(body=request.body or b"", end_of_stream=True)) is None
    decision = live.decide()
    assert live.cls is not None
    return live.cls, decision.ticket.job


@pytest.mark.parametrize(("policy_file", "argv"), [
    ("policy.yaml", {"path": "/v1/chat/completions", "headers": ["x-extproc-client: acme"],
                     "body": CHAT_BODY}),
    ("policy.yaml", {"path": "/v1/chat/completions", "headers": ["x-tenant-id: acme"], "body": CHAT_BODY}),
    ("policy.yaml", {"path": "/v1/batches/x", "headers": ["x-extproc-foo: 1"], "body": "not json"}),
    ("policy.yaml", {"path": "/v1/x", "headers": ["x-extproc-lane: interactive"], "method": "GET"}),
    ("policy.yaml", {"path": "/v1/completions", "body": '{"prompt": [1, 2, 3], "max_tokens": 9}'}),
    ("demo-policy.yaml", {"path": "/v1/chat/completions", "headers": ["x-extproc-client: free"]}),
    ("demo-policy.yaml", {"path": "/v1/completions", "headers": ["x-extproc-client: globex"],
                          "body": '{"model": "m", "max_tokens": 40, "prompt": "hello there"}'}),
    ("single-lane.yaml", {"path": "/v1/chat/completions", "body": CHAT_BODY}),
    ("policy.yaml", {"path": "/v1/chat/completions", "headers": ["content-encoding: x-foo"],
                     "body": CHAT_BODY}),
    ("policy.yaml", {"path": "/v1/chat/completions", "headers": ["content-encoding: gzip"],
                     "body": CHAT_BODY}),
    ("policy.yaml", {"path": "/v1/completions", "body": '{"max_tokens": "2000", "prompt": "hello"}'}),
])
def test_explanation_agrees_with_the_live_handler(policy_file: str, argv: dict[str, Any]) -> None:
    policy = example(policy_file)
    request = sample_request(**argv)
    expl = ex.explain(policy, request)
    cls, job = _live(policy, request)
    view = expl.classification
    assert (view.lane, view.tenant, view.rule) == (cls.lane, cls.tenant, cls.rule)
    assert expl.estimate.job == job


# -- queue states -------------------------------------------------------------------------------------


def test_parse_state() -> None:
    policy = example("policy.yaml")
    state = parse_state(["interactive=inflight:8,queued:3", "batch = queued:2", "best-effort=inflight:1"],
                        policy)
    assert state == {"interactive": LaneLoad(8, 3), "batch": LaneLoad(0, 2), "best-effort": LaneLoad(1, 0)}


@pytest.mark.parametrize(("texts", "message"), [
    (["interactive"], "expected LANE=inflight:N,queued:M"),
    (["gold=inflight:1"], "unknown lane 'gold'; lanes: interactive, batch, best-effort"),
    (["batch=inflight:1", "batch=queued:2"], "lane batch given twice"),
    (["batch=running:1"], "expected inflight:N and/or queued:M, got 'running:1'"),
    (["batch=inflight:-1"], "expected inflight:N and/or queued:M"),
])
def test_parse_state_errors(texts: list[str], message: str) -> None:
    with pytest.raises(StateError, match=message):
        parse_state(texts, example("policy.yaml"))


def test_given_state_replaces_the_default_scenarios() -> None:
    policy = example("demo-policy.yaml")
    state = parse_state(["batch=inflight:16,queued:3", "interactive=inflight:48"], policy)
    expl = ex.explain(policy, sample_request(path="/v1/completions"), state=state)
    (given,) = expl.scenarios
    assert given.name == "given state"
    assert given.reached == {"batch": LaneLoad(16, 3), "interactive": LaneLoad(48)}
    assert given.notes == ()
    assert given.outcome is Outcome.QUEUED
    assert "given state: interactive 48/50, batch 16/10 +3 queued" in ex.render(expl)


def test_unreachable_states_say_why() -> None:
    policy = example("policy.yaml")
    state = parse_state(["best-effort=inflight:5", "batch=inflight:2,queued:4", "interactive=inflight:20"],
                        policy)
    (given,) = ex.explain(policy, sample_request(path="/v1/x"), state=state).scenarios
    assert given.notes == (
        "best-effort: only 2 of 5 can be in flight: its limit is 2 and it may not borrow",
        "interactive: only 10 of 20 can be in flight: all 14 slots are taken",
    )
    # batch is under its limit, but interactive holds the rest of the capacity: batch can queue.
    assert given.reached == {"best-effort": LaneLoad(2), "batch": LaneLoad(2, 4), "interactive": LaneLoad(10)}


def test_queued_request_whose_deadline_passes_while_higher_lanes_take_the_slots() -> None:
    policy = small_policy(
        [{"name": "a", "priority": 100, "max_inflight": 2, "max_queued": 10, "deadline": "60s"},
         {"name": "b", "priority": 0, "max_inflight": 2, "max_queued": 10, "deadline": "2s"}],
        capacity={"max_inflight": 2},
        classification={"default_lane": "a",
                        "rules": [{"name": "slow", "match": {"path": "/b"}, "lane": "b"}]},
    )
    expl = ex.explain(policy, sample_request(path="/b"), state=parse_state(["a=inflight:2,queued:5"], policy))
    (given,) = expl.scenarios
    # Its own estimate (a slot of the shared capacity frees after 1 s) lets it queue; then lane a's
    # backlog, higher in priority, takes every slot that frees until its 2 s deadline has passed.
    assert given.outcome is Outcome.QUEUED
    assert (given.then, given.then_reason) == (Outcome.REJECTED, Reason.DEADLINE_EXPIRED)
    assert given.then_after_s == 2.0
    assert "QUEUED, then REJECTED deadline_expired after 2.00 s" in ex.render(expl)


def test_request_that_evicts_a_lower_lane() -> None:
    policy = small_policy(
        [{"name": "hi", "priority": 100, "max_inflight": 1, "max_queued": 5, "deadline": "60s"},
         {"name": "lo", "max_inflight": 1, "max_queued": 5, "deadline": "60s", "evictable": True}],
        capacity={"max_queued": 3},
    )
    state = parse_state(["hi=inflight:1", "lo=inflight:1,queued:3"], policy)
    expl = ex.explain(policy, sample_request(path="/"), state=state)
    (given,) = expl.scenarios
    assert given.outcome is Outcome.QUEUED
    assert given.evicted == ("a queued lo request (evicted)",)
    assert (given.then, given.then_after_s) == (Outcome.ADMITTED, 1.0)
    assert "evicts a queued lo request (evicted)" in ex.render(expl)


def test_busy_state_when_borrowing_cannot_use_the_whole_capacity() -> None:
    policy = small_policy([
        {"name": "a", "priority": 10, "max_inflight": 2, "deadline": "10s", "borrow": True, "max_borrow": 1},
        {"name": "b", "max_inflight": 2, "max_queued": 2, "deadline": "10s"},
        {"name": "c", "max_inflight": 1, "deadline": "10s", "closed": True},
    ], capacity={"max_inflight": 6})
    assert busy(policy) == {"a": LaneLoad(3), "b": LaneLoad(2)}
    expl = ex.explain(policy, sample_request(path="/"), state={})
    assert [s.name for s in expl.scenarios] == [
        "idle", "a at its in-flight limit", "5 of 6 slots busy (all lanes may use)"]
    assert [s.reached for s in expl.scenarios][-1] == {"a": LaneLoad(3), "b": LaneLoad(2)}
    # a has no queue: with its borrowing spent, a request of a is turned away at once.
    assert (expl.scenarios[-1].outcome, expl.scenarios[-1].reason) == (Outcome.REJECTED, Reason.QUEUE_FULL)


def test_closed_lane_rejects_in_every_state() -> None:
    policy = small_policy([{"name": "a", "max_inflight": 2, "deadline": "1s", "closed": True},
                           {"name": "b", "max_inflight": 2, "deadline": "1s"}])
    expl = ex.explain(policy, sample_request(path="/"))
    (idle,) = expl.scenarios
    assert (idle.outcome, idle.reason) == (Outcome.REJECTED, Reason.LANE_CLOSED)
    assert "CLOSED" in ex.render(expl)


def test_shadow_mode_shows_what_enforcing_would_do() -> None:
    policy = small_policy([{"name": "a", "max_inflight": 1, "max_queued": 4, "deadline": "10s"}], shadow=True)
    expl = ex.explain(policy, sample_request(path="/"))
    assert expl.shadow == "policy.shadow is true"
    at_limit = expl.scenarios[1]
    assert (at_limit.reached, at_limit.outcome) == ({"a": LaneLoad(1)}, Outcome.QUEUED)
    assert "SHADOW MODE (policy.shadow is true)" in ex.render(expl)
    lane_only = small_policy([{"name": "a", "max_inflight": 1, "deadline": "10s", "shadow": True}])
    assert ex.explain(lane_only, sample_request(path="/")).shadow == "lane a has shadow: true"


# -- the sample request -------------------------------------------------------------------------------


def test_request_document_and_flags_combine(tmp_path: Path) -> None:
    doc = tmp_path / "req.json"
    doc.write_text(json.dumps({"method": "put", "path": "/a", "headers": {"X-A": "1", "x-b": ["2", 3]},
                               "body": {"max_tokens": 4}}))
    request = sample_request(f"@{doc}", path="/b", headers=["x-a: 9", "x-c: 1", "x-c: 2"])
    assert request == ex.SampleRequest("PUT", "/b", {"x-a": "9", "x-b": "2,3", "x-c": "1,2"},
                                       b'{"max_tokens": 4}')
    assert sample_request('{"path": "/x", "body": "raw {"}').body == b"raw {"
    assert sample_request('{"path": "/x"}').method == "POST"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"document": "{nope"}, "--request: not JSON"),
    ({"document": "[1]"}, "expected a JSON object"),
    ({"document": '{"path": "/x", "query": 1}'}, r"unknown key\(s\) \['query'\]"),
    ({"document": '{"path": 3}'}, "method and path must be strings"),
    ({"document": '{"path": "/x", "headers": [1]}'}, "headers must be an object"),
    ({"document": '{"path": "/x", "headers": {"a": {"b": 1}}}'}, "headers.a: expected a string"),
    ({"document": "@/nonexistent/req.json"}, "--request: cannot read /nonexistent/req.json"),
    ({"path": "/x", "body": "@/nonexistent/body"}, "--body: cannot read /nonexistent/body"),
    ({"path": "/x", "headers": ["no colon"]}, "expected 'name: value'"),
    ({}, "give the request's path"),
    ({"path": "v1/x"}, "must start with /"),
])
def test_request_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ExplainError, match=message):
        sample_request(**kwargs)


# -- the command --------------------------------------------------------------------------------------


def test_command_prints_the_explanation(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run([str(EXAMPLES / "policy.yaml"), "--path", "/v1/chat/completions", "-H",
                          "x-tenant-id: acme", "--body", CHAT_BODY], capsys)
    assert (code, err) == (0, "")
    assert "rule 1 chat (→ interactive; path /v1/chat/completions, method POST): MATCH" in out
    assert "all 14 slots busy: interactive 8/8, batch 4/4, best-effort 2/2" in out


def test_command_json(capsys: pytest.CaptureFixture[str]) -> None:
    request = json.dumps({"path": "/v1/batches/1", "headers": {"x-tenant-id": "globex"}})
    code, out, _ = run([str(EXAMPLES / "policy.yaml"), "--request", request, "--json",
                        "--state", "batch=inflight:4,queued:2"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["classification"]["lane"] == "batch"
    assert doc["classification"]["rule"] == "batch-api"
    assert doc["classification"]["tenant_weight"] == 1
    assert doc["estimate"]["output_tokens"] == 256
    (scenario,) = doc["scenarios"]
    # batch borrows: with other lanes idle its two queued requests could not wait, so they started.
    assert scenario["reached"] == {"batch": {"inflight": 4, "queued": 0}}
    assert scenario["notes"] == [
        "batch: cannot hold queued requests while a slot is free for it (queued 0 of 2)"]
    assert scenario["outcome"] == "admitted"
    assert scenario["borrowed"] is True


def test_command_bad_policy_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("lanes: []\nclassification: {default_lane: x}\n")
    code, out, err = run([str(bad), "--path", "/"], capsys)
    assert (code, out) == (2, "")
    assert err.startswith(f"{bad}: ")
    assert "problem(s)" in err
    assert "lanes" in err


def test_command_bad_request_or_state_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run([str(EXAMPLES / "policy.yaml")], capsys)
    assert code == 2
    assert err == ("extproc policy explain: give the request's path (--path /v1/chat/completions, "
                   "or in --request)\n")
    code, _, err = run([str(EXAMPLES / "policy.yaml"), "--path", "/", "--state", "gold=inflight:1"], capsys)
    assert code == 2
    assert "unknown lane 'gold'" in err


@pytest.mark.parametrize("argv", [["--occupancy", "1.5"], ["--occupancy", "x"], ["--fill-tokens", "0"],
                                  ["--fill-tokens", "x"]])
def test_command_rejects_bad_numbers(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run([str(EXAMPLES / "policy.yaml"), "--path", "/", *argv], capsys)
    assert exc.value.code == 2
    assert "expected" in capsys.readouterr().err


def test_the_words_for_an_unmet_rule_agree_with_the_classifier() -> None:
    """``_unmet`` (explain's words for why a rule does not match) finds nothing exactly when the
    classifier itself matches the rule, over random rules and requests."""
    rng = random.Random(11)
    matched = unmet = 0
    for _ in range(2000):
        match: dict[str, Any] = {}
        if rng.random() < 0.4:
            match[rng.choice(["path", "path_prefix", "path_regex"])] = rng.choice(
                ["/v1/chat/completions", "/v1/", "/v1/(chat/)?completions"])
        if rng.random() < 0.4:
            match["methods"] = rng.sample(["POST", "GET", "PUT"], rng.randint(1, 2))
        if rng.random() < 0.4:
            match["headers"] = {"x-team": rng.sample(["a", "b", "c"], rng.randint(1, 2))}
        if rng.random() < 0.3:
            match["models"] = rng.sample(["m1", "m2"], 1)
        if rng.random() < 0.3:
            match["tenants"] = rng.sample(["acme", "anon"], 1)
        policy = small_policy([{"name": "a", "max_inflight": 1, "deadline": "1s"},
                               {"name": "b", "max_inflight": 1, "deadline": "1s"}],
                              classification={"default_lane": "b", "rules": [{"match": match, "lane": "a"}]},
                              trusted_headers=["x-team", "x-tenant"], tenants={"header": "x-tenant"})
        headers = {k: v for k, v in (("x-team", rng.choice(["a", "b", "z", None])),
                                     ("x-tenant", rng.choice(["acme", None]))) if v is not None}
        facts = RequestFacts(method=rng.choice(["POST", "GET", "post"]),
                             path=rng.choice(["/v1/chat/completions", "/v1/completions", "/v2/x",
                                              "/v1/chat/completions/"]),
                             headers=headers, model=rng.choice(["m1", "m2", None]))
        classified = Classifier(policy).classify(facts)
        words = ex._unmet(policy.classification.rules[0].match, facts, classified.tenant)
        assert (words == []) is (classified.lane == "a"), (match, facts, words)
        matched += classified.lane == "a"
        unmet += classified.lane != "a"
    assert matched > 200
    assert unmet > 200

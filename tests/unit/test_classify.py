"""Classifier: request facts → lane and tenant; only trusted headers ever count."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.core.classify import Classifier, RequestFacts
from extproc.policy import Policy
from extproc.policy.schema import ClassificationPolicy, Match, Rule, Tenants

LANES = [
    {"name": "interactive", "priority": 100, "max_inflight": 4, "deadline": "10s"},
    {"name": "batch", "priority": 50, "max_inflight": 2, "deadline": "30s"},
    {"name": "best-effort", "max_inflight": 1, "deadline": "5s"},
]


def make_policy(rules: list[dict[str, Any]] | None = None, **extra: Any) -> Policy:
    classification = {"default_lane": "best-effort", "rules": rules or []}
    classification.update(extra.pop("classification", {}))
    return Policy.model_validate({"lanes": LANES, "classification": classification, **extra})


def facts(path: str = "/", method: str = "POST", headers: dict[str, str] | None = None,
          model: str | None = None) -> RequestFacts:
    return RequestFacts(method=method, path=path, headers=headers or {}, model=model)


def lane_of(classifier: Classifier, **kwargs: Any) -> str:
    return classifier.classify(facts(**kwargs)).lane


def test_no_rules_gives_default_lane() -> None:
    result = Classifier(make_policy()).classify(facts("/v1/chat/completions"))
    assert (result.lane, result.rule, result.tenant) == ("best-effort", "default", "default")


def test_first_matching_rule_wins() -> None:
    classifier = Classifier(make_policy([
        {"name": "first", "match": {"path_prefix": "/v1/"}, "lane": "batch"},
        {"name": "second", "match": {"path": "/v1/chat/completions"}, "lane": "interactive"},
    ]))
    result = classifier.classify(facts("/v1/chat/completions"))
    assert (result.lane, result.rule) == ("batch", "first")
    assert lane_of(classifier, path="/v2/x") == "best-effort"


def test_later_rule_applies_when_earlier_does_not_match_and_unnamed_rules_get_an_index() -> None:
    classifier = Classifier(make_policy([
        {"match": {"path": "/a"}, "lane": "batch"},
        {"match": {"path": "/b"}, "lane": "interactive"},
    ]))
    result = classifier.classify(facts("/b"))
    assert (result.lane, result.rule) == ("interactive", "rules[1]")


def test_empty_match_always_holds() -> None:
    classifier = Classifier(make_policy([{"lane": "batch"}]))
    assert lane_of(classifier, path="/anything", method="DELETE") == "batch"


def test_exact_path_ignores_query_string() -> None:
    classifier = Classifier(make_policy([{"match": {"path": "/v1/chat/completions"}, "lane": "interactive"}]))
    assert lane_of(classifier, path="/v1/chat/completions") == "interactive"
    assert lane_of(classifier, path="/v1/chat/completions?stream=true&x=/y") == "interactive"
    assert lane_of(classifier, path="/v1/chat/completions/") == "best-effort"
    assert lane_of(classifier, path="/v1/chat/completionsX") == "best-effort"
    assert lane_of(classifier, path="/v1/chat") == "best-effort"


def test_path_prefix() -> None:
    classifier = Classifier(make_policy([{"match": {"path_prefix": "/v1/batches"}, "lane": "batch"}]))
    assert lane_of(classifier, path="/v1/batches") == "batch"
    assert lane_of(classifier, path="/v1/batches/123/cancel") == "batch"
    assert lane_of(classifier, path="/v1/batch") == "best-effort"
    # The query string is not part of the path: a prefix cannot be smuggled in after '?'.
    assert lane_of(classifier, path="/other?/v1/batches") == "best-effort"


def test_path_regex_must_match_the_whole_path() -> None:
    classifier = Classifier(make_policy([{"match": {"path_regex": "/v1/models/[^/]+"}, "lane": "batch"}]))
    assert lane_of(classifier, path="/v1/models/llama") == "batch"
    assert lane_of(classifier, path="/v1/models/llama?x=1") == "batch"
    assert lane_of(classifier, path="/v1/models/llama/extra") == "best-effort"
    assert lane_of(classifier, path="/prefix/v1/models/llama") == "best-effort"


def test_methods() -> None:
    classifier = Classifier(make_policy([{"match": {"methods": ["post", "PUT"]}, "lane": "batch"}]))
    assert lane_of(classifier, method="POST") == "batch"
    assert lane_of(classifier, method="post") == "batch"
    assert lane_of(classifier, method="PUT") == "batch"
    assert lane_of(classifier, method="GET") == "best-effort"


def test_all_conditions_must_hold() -> None:
    classifier = Classifier(make_policy([
        {"match": {"path": "/v1/completions", "methods": ["POST"]}, "lane": "batch"},
    ]))
    assert lane_of(classifier, path="/v1/completions", method="POST") == "batch"
    assert lane_of(classifier, path="/v1/completions", method="GET") == "best-effort"
    assert lane_of(classifier, path="/v1/other", method="POST") == "best-effort"


def test_models() -> None:
    classifier = Classifier(make_policy([{"match": {"models": ["llama-70b", "mixtral"]}, "lane": "batch"}]))
    assert lane_of(classifier, model="mixtral") == "batch"
    assert lane_of(classifier, model="llama-7b") == "best-effort"
    assert lane_of(classifier, model=None) == "best-effort"


def test_tenants_condition_uses_the_tenant_from_the_trusted_header() -> None:
    classifier = Classifier(make_policy(
        [{"match": {"tenants": ["acme"]}, "lane": "interactive"}],
        trusted_headers=["x-tenant-id"],
        tenants={"header": "x-tenant-id"},
    ))
    assert lane_of(classifier, headers={"x-tenant-id": "acme"}) == "interactive"
    assert lane_of(classifier, headers={"x-tenant-id": "globex"}) == "best-effort"
    assert lane_of(classifier) == "best-effort"


def test_tenants_condition_can_match_the_default_tenant() -> None:
    classifier = Classifier(make_policy(
        [{"match": {"tenants": ["anonymous"]}, "lane": "batch"}],
        tenants={"default": "anonymous"},
    ))
    assert lane_of(classifier) == "batch"


def test_header_condition_on_a_trusted_header() -> None:
    classifier = Classifier(make_policy(
        [{"match": {"headers": {"X-Priority": ["high", "urgent"]}}, "lane": "interactive"},
         {"match": {"headers": {"x-priority": "low"}}, "lane": "batch"}],
        trusted_headers=["x-priority"],
    ))
    assert lane_of(classifier, headers={"x-priority": "urgent"}) == "interactive"
    assert lane_of(classifier, headers={"x-priority": "high"}) == "interactive"
    assert lane_of(classifier, headers={"x-priority": "low"}) == "batch"
    # Values are compared exactly.
    assert lane_of(classifier, headers={"x-priority": "HIGH"}) == "best-effort"
    assert lane_of(classifier, headers={}) == "best-effort"


def test_lane_header_names_the_lane_before_rules() -> None:
    classifier = Classifier(make_policy(
        [{"name": "everything", "lane": "batch"}],
        trusted_headers=["x-extproc-lane"],
        classification={"lane_header": "x-extproc-lane"},
    ))
    result = classifier.classify(facts(headers={"x-extproc-lane": "interactive"}))
    assert (result.lane, result.rule) == ("interactive", "lane_header")
    assert lane_of(classifier, headers={"x-extproc-lane": " Interactive "}) == "interactive"


@pytest.mark.parametrize("value", ["gold", "", "  ", "interactive,batch", "../batch"])
def test_lane_header_naming_no_known_lane_falls_through_to_rules(value: str) -> None:
    classifier = Classifier(make_policy(
        [{"name": "everything", "lane": "batch"}],
        trusted_headers=["x-extproc-lane"],
        classification={"lane_header": "x-extproc-lane"},
    ))
    result = classifier.classify(facts(headers={"x-extproc-lane": value}))
    assert (result.lane, result.rule) == ("batch", "everything")


def test_untrusted_lane_header_cannot_select_a_lane() -> None:
    classifier = Classifier(make_policy())
    assert not classifier.trusted("x-extproc-lane")
    result = classifier.classify(facts(headers={"x-extproc-lane": "interactive", "x-tenant-id": "acme"}))
    assert (result.lane, result.tenant) == ("best-effort", "default")


def test_classifier_never_reads_untrusted_headers_even_from_an_unvalidated_policy() -> None:
    """The schema refuses these policies; the classifier must still be safe on its own."""
    policy = make_policy()
    unchecked = policy.model_copy(update={
        "classification": ClassificationPolicy.model_construct(
            default_lane="best-effort",
            lane_header="x-extproc-lane",
            rules=(Rule.model_construct(
                name="sneaky",
                match=Match.model_construct(
                    path=None, path_prefix=None, path_regex=None, methods=(), models=(), tenants=(),
                    headers={"x-lane": ("interactive",)},
                ),
                lane="interactive",
            ),),
        ),
        "tenants": Tenants.model_construct(header="x-tenant-id", default="default", weights={},
                                           default_weight=1.0, max_tenant_length=128),
    })
    assert unchecked.trusted_headers == ()
    classifier = Classifier(unchecked)
    result = classifier.classify(facts(headers={
        "x-extproc-lane": "interactive", "x-lane": "interactive", "x-tenant-id": "acme",
    }))
    assert (result.lane, result.tenant, result.rule) == ("best-effort", "default", "default")


def test_tenant_from_header_is_stripped_and_truncated() -> None:
    classifier = Classifier(make_policy(
        trusted_headers=["x-tenant-id"], tenants={"header": "X-Tenant-ID", "max_tenant_length": 8},
    ))
    assert classifier.tenant(facts(headers={"x-tenant-id": "acme"})) == "acme"
    assert classifier.tenant(facts(headers={"x-tenant-id": "  acme \t"})) == "acme"
    assert classifier.tenant(facts(headers={"x-tenant-id": "a" * 1000})) == "a" * 8
    assert classifier.classify(facts(headers={"x-tenant-id": "abcdefghijkl"})).tenant == "abcdefgh"


@pytest.mark.parametrize("headers", [{}, {"x-tenant-id": ""}, {"x-tenant-id": "   "}, {"x-other": "acme"}])
def test_default_tenant_when_header_is_absent_or_blank(headers: dict[str, str]) -> None:
    classifier = Classifier(make_policy(
        trusted_headers=["x-tenant-id"], tenants={"header": "x-tenant-id", "default": "anonymous"},
    ))
    assert classifier.tenant(facts(headers=headers)) == "anonymous"


def test_tenant_header_is_not_read_when_the_policy_names_none() -> None:
    classifier = Classifier(make_policy(trusted_headers=["x-tenant-id"]))
    assert classifier.tenant(facts(headers={"x-tenant-id": "acme"})) == "default"


def test_example_policy_classification() -> None:
    from pathlib import Path

    from extproc.policy import load_policy

    policy = load_policy(Path(__file__).resolve().parents[2] / "examples" / "policy.yaml")
    classifier = Classifier(policy)
    chat = classifier.classify(facts("/v1/chat/completions", headers={"x-extproc-client": "acme"}))
    assert (chat.lane, chat.tenant, chat.rule) == ("interactive", "acme", "chat")
    assert lane_of(classifier, path="/v1/chat/completions", method="GET") == "best-effort"
    assert lane_of(classifier, path="/v1/batches/abc") == "batch"
    assert lane_of(classifier, path="/v1/completions") == "batch"
    # Safe by default: a client's own lane or tenant header is read by nothing.
    assert lane_of(classifier, path="/v1/completions", headers={"x-extproc-lane": "interactive"}) == "batch"
    assert classifier.classify(facts(headers={"x-tenant-id": "acme"})).tenant == "anonymous"
    assert classifier.classify(facts()).tenant == "anonymous"


@pytest.mark.parametrize(("raw", "normal"), [
    ("/v1/chat/completions", "/v1/chat/completions"),
    ("/v1/chat/%63ompletions", "/v1/chat/completions"),
    ("//v1/chat/completions", "/v1/chat/completions"),
    ("/v1/./chat/completions", "/v1/chat/completions"),
    ("/v1/chat/../chat/completions", "/v1/chat/completions"),
    ("/v1/%2e%2e/v1/chat/completions", "/v1/chat/completions"),
    ("/v1%2Fchat%2Fcompletions", "/v1/chat/completions"),
    ("/v1/chat/completions?stream=1#x", "/v1/chat/completions"),
    ("/v1/batches/", "/v1/batches/"),
    ("/../../etc", "/etc"),
    ("", "/"),
    # Decoded once, as a backend decodes it: %252F stays an escaped slash.
    ("/a%252Fb", "/a%2Fb"),
])
def test_paths_are_classified_as_a_backend_routes_them(raw: str, normal: str) -> None:
    from extproc.core.classify import normalize_path

    assert normalize_path(raw) == normal


@pytest.mark.parametrize("path", ["/v1/chat/%63ompletions", "//v1/chat/completions", "/v1/./chat/completions",
                                  "/v1/x/../chat/completions", "/v1%2Fchat/completions"])
def test_an_encoded_path_cannot_dodge_a_rule(path: str) -> None:
    from pathlib import Path

    from extproc.policy import load_policy

    classifier = Classifier(load_policy(Path(__file__).resolve().parents[2] / "examples" / "policy.yaml"))
    assert lane_of(classifier, path=path) == "interactive"


def test_remembered_classifications_are_the_classifications_and_the_memory_is_bounded() -> None:
    from extproc.core import classify

    def policy() -> Policy:
        return make_policy([{"match": {"path_prefix": "/v1/batches"}, "lane": "batch"},
                            {"match": {"models": ["big"]}, "lane": "batch"},
                            {"match": {"headers": {"x-priority": ["high"]}}, "lane": "interactive"}],
                           trusted_headers=["x-priority", "x-tenant-id"],
                           tenants={"header": "x-tenant-id"})

    remembering, fresh = Classifier(policy()), Classifier(policy())
    cases = [facts("/v1/batches?page=2"), facts("/v1/batches"), facts("/v1/chat", model="big"),
             facts("/v1/chat", model="small"), facts("/v1/chat", headers={"x-priority": "high"}),
             facts("/v1/chat", headers={"x-priority": "high", "x-untrusted": "x", "x-tenant-id": "acme"}),
             facts("/v1/chat", headers={"x-priority": "low", "x-tenant-id": "globex"}),
             facts("/v1/b%61tches")]
    for _ in range(2):  # the second time from memory
        for case in cases:
            assert remembering.classify(case) == fresh._classify(case)
    # Client-chosen paths and values: never more than _KEPT remembered, no long key.
    for i in range(classify._KEPT + 10):
        remembering.classify(facts(f"/v1/chat/{i}"))
    remembering.classify(facts("/" + "a" * classify._KEY_CHARS))
    assert 0 < len(remembering._known) <= classify._KEPT
    assert all(len(key[1] or "") <= classify._KEY_CHARS for key in remembering._known)

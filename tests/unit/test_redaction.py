"""Trusted header values in logs: names as they are, credentials as keyed hashes."""

from __future__ import annotations

import pytest

from extproc.core.redaction import HASHED, Redactor, looks_secret
from extproc.policy import Policy

POLICY = Policy.model_validate({
    "lanes": [{"name": "gold", "max_inflight": 1, "deadline": "1s"},
              {"name": "free", "max_inflight": 1, "deadline": "1s"}],
    "trusted_headers": ["x-extproc-client", "x-extproc-lane", "x-team"],
    "classification": {"default_lane": "free", "lane_header": "x-extproc-lane",
                       "rules": [{"match": {"headers": {"x-team": ["sk-looks-like-a-key-0000000000000"]}},
                                  "lane": "gold"}]},
    "tenants": {"header": "x-extproc-client", "weights": {"acme": 3}},
})


@pytest.mark.parametrize("value", ["Bearer abc", "basic eDp5", "sk-demo-acme", "sk_live_51H8", "ghp_abcdef",
                                   "AIzaSyD-1234", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIi.sig",
                                   "3f2a9c0b1d4e5f60718293a4b5c6d7e8"])
def test_credentials_look_secret(value: str) -> None:
    assert looks_secret(value)


@pytest.mark.parametrize("value", ["acme", "globex-research", "team_alpha", "interactive", "Acme Corp",
                                   "a-very-long-but-plain-tenant-name", "12345"])
def test_names_do_not(value: str) -> None:
    assert not looks_secret(value)


def test_values_the_policy_names_stay_readable_and_the_rest_are_keyed_hashes() -> None:
    redactor = Redactor(POLICY, key=b"k")
    headers = {"x-extproc-client": "sk-live-0123456789abcdef", "x-extproc-lane": "gold",
               "x-team": "sk-looks-like-a-key-0000000000000", "x-other": "sk-x"}
    shown = redactor.headers(headers, POLICY.trusted_headers)
    assert set(shown) == {"x-extproc-client", "x-extproc-lane", "x-team"}
    assert shown["x-extproc-lane"] == "gold"
    # In the policy file already: a rule matches on it, so a replay must see it as it is.
    assert shown["x-team"] == "sk-looks-like-a-key-0000000000000"
    assert shown["x-extproc-client"].startswith(HASHED)
    assert len(shown["x-extproc-client"]) == len(HASHED) + 16
    assert "0123456789abcdef" not in shown["x-extproc-client"]
    assert redactor.tenant("acme") == "acme"
    assert redactor.tenant("sk-live-0123456789abcdef") == shown["x-extproc-client"]


def test_the_same_key_hashes_alike_and_another_does_not() -> None:
    a, b, c = Redactor(POLICY, key=b"one"), Redactor(POLICY, key=b"one"), Redactor(POLICY, key=b"two")
    assert a.tenant("sk-abc") == b.tenant("sk-abc") != c.tenant("sk-abc")
    # Without a key, each start draws its own: hashes never join across processes.
    assert Redactor(POLICY).tenant("sk-abc") != Redactor(POLICY).tenant("sk-abc")


def test_remembered_answers_are_the_answers_and_the_memory_is_bounded() -> None:
    from extproc.core import redaction

    redactor, fresh = Redactor(POLICY, key=b"k"), Redactor(POLICY, key=b"k")
    values = ["acme", "sk-live-0123456789abcdef", "gold", "x" * (redaction.MAX_SHOWN + 1)]
    for _ in range(2):  # the second time from memory, where kept
        for value in values:
            assert redactor.value("x-extproc-client", value) == fresh.value("x-extproc-client", value)
            assert redactor.tenant(value) == fresh.tenant(value)
    # The same value under another header may be shown otherwise (the policy names it there only).
    named = "sk-looks-like-a-key-0000000000000"
    assert redactor.value("x-team", named) == named
    assert redactor.value("x-extproc-client", named).startswith(HASHED)
    # Client-chosen values: never more than _KEPT remembered, none of the long ones.
    for i in range(redaction._KEPT + 10):
        redactor.tenant(f"tenant-{i}")
    assert 0 < len(redactor._shown) <= redaction._KEPT
    assert all(len(value) <= redaction.MAX_SHOWN for _, value in redactor._shown)

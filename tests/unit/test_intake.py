"""The intake's bodies: one extproc cannot read is never a cheap request, and a token limit the model
servers refuse is refused, through the machine's face as every driver meets it."""

from __future__ import annotations

import gzip
import json
from typing import Any

import pytest

from extproc.core.decision import Outcome, Reason, reject
from extproc.core.machine import Machine
from extproc.policy import Policy

#: The issue's case: a 70B model that costs 30 ms a token, a rule that sends it to its own lane.
POLICY: dict[str, Any] = {
    "lanes": [{"name": "chat", "max_inflight": 4, "max_queued": 8, "deadline": "30s"},
              {"name": "big", "max_inflight": 2, "max_queued": 8, "deadline": "30s"}],
    "classification": {"default_lane": "chat",
                       "rules": [{"match": {"models": ["llama-3.1-70b"]}, "lane": "big"}]},
    "estimation": {"default": {"prefill_ms_per_token": 0.033, "decode_ms_per_token": 8, "overhead_ms": 15},
                   "models": {"llama-3.1-70b": {"prefill_ms_per_token": 0.08, "decode_ms_per_token": 30,
                                                "overhead_ms": 30}},
                   "occupancy_slowdown": 1.5, "max_output_tokens": 8192},
    "ratelimit": {"mode": "off"},
}
CHAT = "/v1/chat/completions"
#: A 2,000-token request: about 8,000 characters of prompt and 2,000 tokens of output.
BODY = json.dumps({"model": "llama-3.1-70b", "max_tokens": 2000,
                   "messages": [{"role": "user", "content": "w" * 8000}]}).encode()
#: Content-Encodings extproc does not decode (the last: plain JSON that says it is gzip), and what the
#: refusal tells the client.
UNDECODED = {"identity, identity": "Content-encoding 'identity, identity' is not one extproc decodes.",
             "x-foo": "Content-encoding 'x-foo' is not one extproc decodes.",
             "GZIP2": "Content-encoding 'gzip2' is not one extproc decodes.",
             "identity;q=1": "Content-encoding 'identity;q=1' is not one extproc decodes.",
             "gzip": "Body is not valid gzip."}


def machine(**estimation: object) -> Machine:
    doc = json.loads(json.dumps(POLICY))
    doc["estimation"].update(estimation)
    return Machine(Policy.model_validate(doc))


def headers(encoding: str | None = None) -> dict[str, str]:
    out = {"content-type": "application/json", "content-length": str(len(BODY))}
    if encoding is not None:
        out["content-encoding"] = encoding
    return out


@pytest.mark.parametrize("encoding", UNDECODED)
def test_a_body_extproc_cannot_read_is_not_cheaper(encoding: str) -> None:
    m = machine()
    read = m.intake.request("POST", CHAT, headers(), BODY)
    unread = m.intake.request("POST", CHAT, headers(encoding), BODY)
    no_model = m.intake.request("POST", CHAT, headers(), b'{"messages": []}')
    assert unread.body.unreadable
    assert m.body_verdict(unread.body) is None  # the default: estimated, not refused
    # The largest job the policy expects, in the lane of a request that names no model.
    assert (unread.job.output_tokens, unread.job.unread) == (8192, True)
    assert unread.lane == no_model.lane == "chat" != read.lane
    estimator = m.intake.estimator
    assert estimator.predict(read.job, 1.0) == pytest.approx(150.19, abs=0.01)
    assert estimator.predict(unread.job, 1.0) > estimator.predict(read.job, 1.0)
    # Decided on that size: it is admitted like any other, and its slot comes back.
    decision = m.submit(unread.lane, unread.tenant, unread.job, 0.0).decision
    assert decision.outcome is Outcome.ADMITTED
    assert decision.ticket.predicted == estimator.predict(unread.job, 0.0)
    m.release(decision.ticket, 1.0)
    assert m.snapshot(1.0)["chat"].inflight == 0


@pytest.mark.parametrize(("encoding", "detail"), UNDECODED.items())
def test_a_body_extproc_cannot_read_is_refused_when_the_policy_says_so(encoding: str, detail: str) -> None:
    m = machine(unreadable_body="refuse")
    arrival = m.intake.request("POST", CHAT, headers(encoding), BODY)
    refusal = m.body_verdict(arrival.body)
    assert refusal is not None
    assert (refusal.reason, refusal.detail) == (Reason.UNSUPPORTED_ENCODING, detail)
    rejection = reject(refusal.reason, None, None, detail=refusal.detail)
    assert rejection.status == 415
    assert ("x-should-retry", "false") in rejection.headers
    error = json.loads(rejection.body)["error"]
    assert error["code"] == "unsupported_encoding"
    assert error["message"].endswith(detail)
    # Nothing was taken for it.
    assert all(lane.inflight == 0 and lane.queued == 0 for lane in m.snapshot(0.0).values())


def test_a_readable_body_is_never_refused_for_its_encoding() -> None:
    m = machine(unreadable_body="refuse")
    for encoding, data in (("gzip", gzip.compress(BODY)), ("identity", BODY), (None, BODY)):
        arrival = m.intake.request("POST", CHAT, {"content-type": "application/json", **(
            {"content-encoding": encoding} if encoding else {})}, data)
        assert m.body_verdict(arrival.body) is None
        assert (arrival.lane, arrival.job.output_tokens) == ("big", 2000)


@pytest.mark.parametrize("choice", ["estimate", "refuse"])
@pytest.mark.parametrize("limit", ['"abc"', "-5", "12.5", "NaN", "1e300", "[1]"])
def test_a_token_limit_the_model_servers_refuse_is_a_400(choice: str, limit: str) -> None:
    m = machine(unreadable_body=choice)
    body = b'{"model": "m", "max_tokens": ' + limit.encode() + b', "messages": []}'
    refusal = m.body_verdict(m.intake.request("POST", CHAT, {}, body).body)
    assert refusal is not None
    assert refusal.reason is Reason.BAD_REQUEST
    assert refusal.detail.startswith("max_tokens ")
    assert reject(refusal.reason, None, None, detail=refusal.detail).status == 400


@pytest.mark.parametrize(("limit", "tokens"), [('"2000"', 2000), ("2000.0", 2000), ("true", 1),
                                               ("99999999999", 8192)])
def test_a_token_limit_read_as_the_servers_read_it_sizes_the_job(limit: str, tokens: int) -> None:
    m = machine()
    body = b'{"model": "llama-3.1-70b", "max_tokens": ' + limit.encode() + b"}"
    arrival = m.intake.request("POST", CHAT, {}, body)
    assert m.body_verdict(arrival.body) is None
    assert arrival.job.output_tokens == tokens


def test_a_cut_body_is_never_refused_for_its_token_limit() -> None:
    m = machine(max_body_bytes=1024)
    body = b'{"max_tokens": "abc", "messages": [{"role": "user", "content": "' + b"w" * 4000 + b'"}]}'
    arrival = m.intake.request("POST", CHAT, {}, body)
    assert arrival.body.note == "body read in part"
    assert m.body_verdict(arrival.body) is None
    assert arrival.job.output_tokens == 256

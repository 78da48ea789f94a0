"""One rendering of a refusal, whichever part refuses: ext_proc, the edge, the simulator."""

from __future__ import annotations

import json
import random

import pytest

from extproc.core.admission import Scheduler
from extproc.core.decision import Outcome, Reason, reject
from extproc.core.estimate import Job
from extproc.policy import Policy


def test_a_rejection_carries_reason_lane_retry_after_and_the_error_document() -> None:
    r = reject(Reason.QUEUE_FULL, "batch", 7)
    assert r.status == 429
    assert dict(r.headers) == {"content-type": "application/json", "x-extproc-reason": "queue_full",
                               "x-extproc-lane": "batch", "retry-after": "7"}
    error = json.loads(r.body)["error"]
    assert (error["code"], error["lane"], error["type"]) == ("queue_full", "batch", "rate_limit_exceeded")
    assert error["message"].endswith("Retry after 7 s.")


@pytest.mark.parametrize("reason", [Reason.LANE_CLOSED, Reason.SATURATED, Reason.RETRY_BUDGET])
def test_where_retrying_cannot_help_the_answer_says_so(reason: Reason) -> None:
    assert ("x-should-retry", "false") in reject(reason, "a", 30).headers


def test_a_spent_retry_budget_says_so_on_any_reason() -> None:
    assert ("x-should-retry", "false") in reject(Reason.QUEUE_FULL, "a", 3, retry_allowed=False).headers
    assert ("x-should-retry", "false") not in reject(Reason.QUEUE_FULL, "a", 3).headers


def test_a_shed_names_its_rule_and_signal() -> None:
    r = dict(reject(Reason.SATURATED, "be", 10, signal="kv_cache", rule="kv-full").headers)
    assert (r["x-extproc-signal"], r["x-extproc-rule"]) == ("kv_cache", "kv-full")


POLICY = Policy.model_validate({
    "lanes": [{"name": "open", "max_inflight": 1, "max_queued": 0, "deadline": "5s"},
              {"name": "shut", "max_inflight": 1, "deadline": "5s", "closed": True}],
    "classification": {"default_lane": "open"},
    "retry_after": {"min": "1s", "max": "20s", "jitter": 0, "share": 1},
    "estimation": {"default": {"decode_ms_per_token": 1, "overhead_ms": 0}},
})


def test_retry_after_for_a_closed_lane_is_the_longest_and_for_a_full_one_its_drain() -> None:
    scheduler = Scheduler(POLICY, random.Random(1))
    job = Job(None, 0, 2000)  # 2 s
    closed = scheduler.submit("shut", "t", job, 0.0)[0]
    assert (closed.outcome, closed.reason, closed.retry_after) == (Outcome.REJECTED, Reason.LANE_CLOSED, 20)
    assert scheduler.submit("open", "t", job, 0.0)[0].outcome is Outcome.ADMITTED
    full = scheduler.submit("open", "t", job, 0.0)[0]
    assert (full.reason, full.retry_after) == (Reason.QUEUE_FULL, 2)


def test_a_drain_never_says_do_not_retry() -> None:
    # Another replica takes the request: whatever the retry budget says, the client may retry.
    r = reject(Reason.DRAINING, "a", 3, retry_allowed=False)
    assert r.status == 503
    assert "x-should-retry" not in dict(r.headers)
    assert dict(r.headers)["retry-after"] == "3"

"""One tenant budget for the fleet, through real Envoys (API keys → x-extproc-client), two replicas
and one real Redis: shared while Redis answers, each replica's part (1/fleet size) while it is
down, shared again once it is back; and the fleet's retry budget lets no more retries through
across replicas than one replica would."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

from tests.integration.conftest import as_tenant
from tests.integration.test_replicas import Cluster, cluster, until  # noqa: F401

pytestmark = pytest.mark.envoy

POLICY = """
lanes:
  - {name: a, max_inflight: 8, max_queued: 10, deadline: 10s}
capacity: {max_hold: 30s}
trusted_headers: [x-extproc-client]
classification: {default_lane: a}
tenants: {header: x-extproc-client, default: anonymous}
ratelimit:
  budgets:
    tenants:
      acme: {requests: 4, per: hour, burst: 1}
"""


def _post(url: str, tenant: str = "acme") -> int:
    response = httpx.post(url + "/v1/x", json={"max_tokens": 5}, headers=as_tenant(tenant), timeout=30)
    return response.status_code


def test_a_tenant_budget_is_one_for_the_fleet_through_an_outage(cluster: Callable[..., Cluster]) -> None:  # noqa: F811
    c = cluster(2, POLICY, "--store-fleet-size", "2")
    a, b = c.replicas
    # Shared: 4 an hour for the whole fleet, wherever the requests land.
    codes = [_post(c.replicas[i % 2].url) for i in range(8)]
    assert codes.count(200) == 4, codes
    assert _post(a.url, "globex") == 200  # no budget of its own
    c.redis.kill()
    # Each replica alone: its part, 2 of the 4 (its bucket starts full), never the whole budget.
    codes = [_post(a.url) for _ in range(4)]
    assert codes == [200, 200, 429, 429], codes
    until("both replicas to notice", lambda: a.metric("extproc_store_degraded") == 1
          and b.metric("extproc_store_degraded") == 1)
    codes = [_post(b.url) for _ in range(4)]
    assert codes.count(200) <= 2, codes
    assert a.metric("extproc_ratelimit_budget_alone_total") >= 4
    c.redis.start()
    until("both replicas to reconnect", lambda: a.metric("extproc_store_degraded") == 0
          and b.metric("extproc_store_degraded") == 0)
    # Shared again (Redis came back empty: the fleet's bucket is full again, and one for both).
    codes = [_post(c.replicas[i % 2].url) for i in range(8)]
    assert codes.count(200) == 4, codes


RETRY_POLICY = """
lanes:
  - {name: a, max_inflight: 8, max_queued: 10, deadline: 10s}
capacity: {max_hold: 30s}
classification: {default_lane: a}
ratelimit: {mode: "off"}
retry_budget: {ratio: 0, min_per_second: 0.2, window: 10s}
"""


def _retry(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/x", json={"max_tokens": 5}, headers={"x-stainless-retry-count": "1"},
                      timeout=30)


@pytest.mark.parametrize(("share", "allowed"), [("fleet", 2), ("replica", 4)])
def test_the_retry_budget_is_one_for_the_fleet(cluster: Callable[..., Cluster], share: str,  # noqa: F811
                                               allowed: int) -> None:
    """A floor of 2 retries per 10 s: 2 for the whole fleet, not 2 per replica (as with
    --store-share replica, the baseline)."""
    c = cluster(2, RETRY_POLICY, "--store-share", share)
    answers = []
    for i in range(6):
        answers.append(_retry(c.replicas[i % 2].url))
        time.sleep(0.4)  # the others' withdrawals are read every sync (~0.2 s)
    codes = [r.status_code for r in answers]
    assert codes.count(200) == allowed, codes
    refused = [r for r in answers if r.status_code == 429]
    assert {r.headers["x-extproc-reason"] for r in refused} == {"retry_budget"}

"""Booked returns through real Envoy: a retry that comes back on its booking passes the edge and
queues ahead of fresh arrivals; a retry header without a booking gains nothing; Redis dying while
bookings exist leaks neither a booking nor a slot."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.conftest import Env, as_tenant
from tests.integration.test_replicas import Cluster, cluster, until  # noqa: F401 (a fixture)

pytestmark = pytest.mark.envoy

POLICY = """
lanes:
  - {name: a, max_inflight: 1, max_queued: 2, deadline: 30s}
capacity: {max_hold: 60s}
classification: {default_lane: a}
trusted_headers: [x-extproc-client]
tenants: {header: x-extproc-client}
estimation:
  default: {prefill_ms_per_token: 0, decode_ms_per_token: 1, overhead_ms: 990}
  default_max_tokens: 10
  learning_rate: 0
queueing: {sjf_weight: 0}
ratelimit: {queue_share: 0.5}     # the edge sheds once one request is queued and no slot is free
retry_after: {min: 3s, max: 20s, jitter: 0, share: 1}
retry_budget: {ratio: 1, min_per_second: 50}
"""


def post(url: str, tenant: str, *, retry: int = 0, delay_ms: int = 0) -> httpx.Response:
    headers = {**as_tenant(tenant), "x-test-delay-ms": str(delay_ms), "x-stainless-retry-count": str(retry)}
    return httpx.post(url + "/v1/x", json={"max_tokens": 10}, headers=headers, timeout=60)


def booked_rejection(url: str, metric: Callable[..., float]) -> tuple[float, httpx.Response]:
    """One request running (6 s), one queued, then acme's next one shed at the edge with a booking:
    when it is due (monotonic), and the answer."""
    sent = time.monotonic()
    shed = post(url, "acme")
    assert shed.status_code == 429
    assert "x-envoy-ratelimited" in shed.headers  # the edge answered, from the scheduler's schedule
    assert shed.headers["x-extproc-reason"] == "queue_full"
    assert "x-should-retry" not in shed.headers
    wait_ms = int(shed.headers["retry-after-ms"])
    assert 3000 <= wait_ms <= 20_000
    assert int(shed.headers["retry-after"]) == -(-wait_ms // 1000)
    assert metric("extproc_retry_bookings") >= 1
    return sent + wait_ms / 1000, shed


def fill(pool: ThreadPoolExecutor, url: str, metric: Callable[..., float]) -> list[object]:
    running = pool.submit(post, url, "acme", delay_ms=6000)
    until("one running", lambda: metric("inference_inflight_requests", lane="a") == 1)
    queued = pool.submit(post, url, "acme")
    until("one queued", lambda: metric("inference_pending_requests", lane="a") == 1)
    return [running, queued]


def test_a_booked_retry_passes_the_edge_and_a_forged_one_gains_nothing(make_env: Callable[..., Env]) -> None:
    env = make_env(POLICY)
    with ThreadPoolExecutor(4) as pool:
        first = fill(pool, env.url, env.metric)
        due, _ = booked_rejection(env.url, env.metric)
        # Saying "retry" early, or as another tenant at the due time, claims nothing: shed as any.
        early = post(env.url, "acme", retry=1)
        assert early.status_code == 429
        time.sleep(max(0.0, due - time.monotonic()) + 0.1)
        forged = post(env.url, "globex", retry=1)
        assert forged.status_code == 429
        assert "x-envoy-ratelimited" in forged.headers
        fresh = post(env.url, "acme")  # a fresh request at the same moment: shed
        assert fresh.status_code == 429
        # The booked client, on time: through the edge, queued ahead of every fresh arrival, served.
        back = pool.submit(post, env.url, "acme", retry=1)
        until("the returning retry to queue", lambda: env.metric("inference_pending_requests", lane="a") == 2)
        assert post(env.url, "acme").status_code == 429  # fresh arrivals still shed behind it
        assert back.result().status_code == 200
        assert [f.result().status_code for f in first] == [200, 200]  # type: ignore[attr-defined]
    env.wait_idle()


def test_redis_dying_while_bookings_exist_leaks_neither_a_booking_nor_a_slot(
        cluster: Callable[..., Cluster]) -> None:  # noqa: F811
    c = cluster(1, POLICY)
    (r,) = c.replicas
    with ThreadPoolExecutor(4) as pool:
        first = fill(pool, r.url, r.metric)
        due, _ = booked_rejection(r.url, r.metric)
        c.redis.kill()
        until("the replica to notice", lambda: r.metric("extproc_store_degraded") == 1)
        time.sleep(max(0.0, due - time.monotonic()) + 0.1)
        # The booking lives in the replica, not in Redis: the retry still claims it, and its slot is
        # this replica's to give (its share of the limit while it decides alone).
        back = post(r.url, "acme", retry=1)
        assert back.status_code == 200
        assert [f.result().status_code for f in first] == [200, 200]  # type: ignore[attr-defined]
    # Nothing lingers: bookings are claimed or lapse, every slot is released.
    until("bookings to lapse", lambda: r.metric("extproc_retry_bookings") == 0, within=10)
    until("slots to free", lambda: r.metric("inference_inflight_requests", lane="a") == 0
          and r.metric("inference_pending_requests", lane="a") == 0)
    c.redis.start()
    until("the store to return", lambda: r.metric("extproc_store_degraded") == 0)
    until("the fleet's counts to reconcile",
          lambda: r.metric("extproc_cluster_inflight_requests", lane="a") == 0)

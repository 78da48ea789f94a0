"""Several extproc replicas, one real Redis, one set of limits: counted at a real upstream.

Each replica is a real ``extproc serve --store redis://…`` with its own real Envoy in
front (so a test knows which replica a request reaches); all Envoys send to one upstream
echo server, which reports the highest concurrency it saw. Waits are bounded; nothing
asserts speed beyond the lease TTL the issue names.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from extproc.localstack import Process, Stack, envoy_config, free_port
from tests.integration.conftest import metric, ready
from tests.integration.test_state_redis import RedisServer

pytestmark = pytest.mark.envoy

UPSTREAM = Path(__file__).with_name("upstream.py")
TTL = 3.0

POLICY = """
lanes:
  - {name: a, max_inflight: 3, max_queued: 100, deadline: 30s}
capacity: {max_hold: 60s}
classification: {default_lane: a}
queueing: {sjf_weight: 0}
ratelimit: {mode: "off"}
"""


@dataclass
class Replica:
    name: str
    process: Process
    url: str
    metrics_url: str

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.metrics_url, name, **labels)


@dataclass
class Cluster:
    stack: Stack
    redis: RedisServer
    upstream: str
    replicas: list[Replica]

    def peak(self) -> int:
        value: int = httpx.get(self.upstream + "/stats", timeout=5).json()["peak"]
        return value


def until(what: str, check: Callable[[], bool], within: float = 15.0) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > within:
            raise AssertionError(f"not within {within:g}s: {what}")
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    stack = Stack(tmp_path)
    servers: list[RedisServer] = []

    def make(replicas: int = 2, policy: str = POLICY, *extra: str) -> Cluster:
        redis_dir = tmp_path / "redis"
        redis_dir.mkdir()
        redis = RedisServer(redis_dir)
        redis.start()
        servers.append(redis)
        upstream = free_port()
        echo = stack.start("upstream", [sys.executable, str(UPSTREAM), str(upstream)])
        path = tmp_path / "policy.yaml"
        path.write_text(policy)
        out = []
        # Every process starts side by side, then each is waited for (as start_env does).
        for i in range(replicas):
            grpc, http = free_port(), free_port()
            process = stack.extproc(path, grpc, http, "--store", redis.url, "--store-ttl", str(TTL),
                                    # Exact while the store answers in time: a loaded machine (a parallel
                                    # test run) must not make a reply late (the outage tests cut it).
                                    "--store-timeout", "1",
                                    "--log-format", "json", *extra, name=f"extproc{i}", wait=False)
            listen, admin = free_port(), free_port()
            stack.envoy(envoy_config(listen, admin, upstream, grpc), name=f"envoy{i}")
            out.append(Replica(f"extproc{i}", process, f"http://127.0.0.1:{listen}",
                               f"http://127.0.0.1:{http}/metrics"))
        ready(echo, f"http://127.0.0.1:{upstream}/stats")
        for replica in out:
            ready(replica.process, replica.metrics_url.replace("/metrics", "/readyz"))
        return Cluster(stack, redis, f"http://127.0.0.1:{upstream}", out)

    try:
        yield make
    finally:
        stack.stop()
        for server in servers:
            server.kill()


def post(url: str, delay_ms: int = 0, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + "/v1/x", json={"max_tokens": 5}, headers={"x-test-delay-ms": str(delay_ms)},
                      timeout=timeout)


def test_replicas_share_one_lane_limit_exactly(cluster: Callable[..., Cluster]) -> None:
    c = cluster(replicas=3)
    c.peak()
    with ThreadPoolExecutor(36) as pool:
        futures = [pool.submit(post, c.replicas[i % 3].url, 200) for i in range(36)]
        responses = [f.result() for f in futures]
    assert [r.status_code for r in responses] == [200] * 36
    # Never more than the lane's 3 at once, over all replicas together (each alone would allow 3).
    assert c.peak() <= 3
    for replica in c.replicas:
        assert replica.metric("inference_admission_decisions_total", lane="a", outcome="admitted") > 0
    # Idle: every lease was given back; nothing is left counted.
    until("every slot to be free", lambda: all(
        r.metric("extproc_cluster_inflight_requests", lane="a") == 0 for r in c.replicas))
    assert c.replicas[0].metric("extproc_cluster_replicas") == 3


def test_a_killed_replicas_slots_free_within_the_lease_ttl(cluster: Callable[..., Cluster]) -> None:
    c = cluster(replicas=2)
    a, b = c.replicas
    c.peak()
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(post, a.url, int((TTL + 4) * 1000), 40) for _ in range(3)]
        until("A to hold all three slots", lambda: a.metric("inference_inflight_requests", lane="a") == 3)
        waiting = pool.submit(post, b.url, 0)
        until("B's request to queue behind them",
              lambda: b.metric("inference_pending_requests", lane="a") == 1)
        time.sleep(0.5)
        assert not waiting.done()
        os.kill(a.process.popen.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        response = waiting.result()
        freed_after = time.monotonic() - killed_at
        # Admitted while A's requests still ran (they last the TTL and 4 s more): their leases
        # lapsed, their ends did not free the slot.
        assert not any(f.done() for f in running)
        # Running requests never depend on extproc: A's death cuts none of them.
        assert [f.result().status_code for f in running] == [200] * 3
    assert response.status_code == 200
    # The price, documented: once A's leases lapse, B counts A's still-running requests no more,
    # so the upstream sees one request over the limit until they end.
    assert c.peak() == 4
    # A's leases lapse after the TTL (plus a renewal period and B's wake-up): a margin that scales
    # with the TTL, not a fixed second or two a busy machine can use up.
    assert freed_after < 2 * TTL
    assert int(response.json()["headers"]["x-extproc-queue-ms"]) >= 500


def test_a_client_leaving_while_queued_on_one_replica_frees_its_place_everywhere(
        cluster: Callable[..., Cluster]) -> None:
    c = cluster(replicas=2)
    a, b = c.replicas
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(post, b.url, 3000) for _ in range(3)]
        until("B to hold every slot", lambda: b.metric("inference_inflight_requests", lane="a") == 3)
        with pytest.raises(httpx.TimeoutException):
            post(a.url, 0, timeout=1.0)  # queued on A, then the client gives up
        until("A's queue to empty", lambda: a.metric("inference_pending_requests", lane="a") == 0)
        until("B to see no queue anywhere",
              lambda: b.metric("extproc_cluster_pending_requests", lane="a") == 0)
        assert [f.result().status_code for f in running] == [200] * 3


def test_redis_stopped_and_restarted_under_load(cluster: Callable[..., Cluster]) -> None:
    c = cluster(replicas=2)
    a, b = c.replicas
    with ThreadPoolExecutor(16) as pool:
        first = [pool.submit(post, c.replicas[i % 2].url, 300) for i in range(16)]
        assert [f.result().status_code for f in first] == [200] * 16
        c.peak()
        # Redis goes away between bursts. From here each replica admits within its allotment of the
        # lane's 3 (what it held, plus its part of the room left, as last seen).
        c.redis.kill()
        until("both replicas to notice", lambda: a.metric("extproc_store_degraded") == 1
              and b.metric("extproc_store_degraded") == 1)
        ready = httpx.get(a.metrics_url.replace("/metrics", "/readyz"), timeout=5)
        assert ready.status_code == 200
        assert "shared store unreachable" in ready.json()["detail"]
        during = [pool.submit(post, c.replicas[i % 2].url, 300) for i in range(16)]
        assert [f.result().status_code for f in during] == [200] * 16
        assert c.peak() <= 3
        # Redis comes back while requests run: held leases are put back before new grants count
        # on Redis alone, so the limit holds through the switch.
        after = [pool.submit(post, c.replicas[i % 2].url, 300) for i in range(24)]
        time.sleep(0.4)
        c.redis.start()
        until("both replicas to reconnect", lambda: a.metric("extproc_store_degraded") == 0
              and b.metric("extproc_store_degraded") == 0)
        assert [f.result().status_code for f in after] == [200] * 24
    # Through the switch back too: until every replica has put its leases back, new grants also
    # keep within the outage's allotment.
    assert c.peak() <= 3
    # Reconciled: idle means nothing counted, on either replica.
    until("the counts to reconcile", lambda: all(
        r.metric("extproc_cluster_inflight_requests", lane="a") == 0
        and r.metric("inference_inflight_requests", lane="a") == 0 for r in c.replicas))


def test_an_outage_respects_what_each_replica_held_and_does_not_spin(cluster: Callable[..., Cluster]) -> None:
    """A holds 3 of the lane's 4 when Redis dies. B gets the 4th, not an even 2: together never
    more than 4. B's waiting requests are refused by its ledger without a retry loop."""
    policy = POLICY.replace("max_inflight: 3", "max_inflight: 4")
    c = cluster(2, policy)
    a, b = c.replicas
    c.peak()
    with ThreadPoolExecutor(16) as pool:
        long = [pool.submit(post, a.url, 4000) for _ in range(3)]
        until("A to hold three slots", lambda: a.metric("inference_inflight_requests", lane="a") == 3)
        until("B to see them", lambda: b.metric("extproc_cluster_inflight_requests", lane="a") == 3)
        c.redis.kill()
        until("both replicas to notice", lambda: a.metric("extproc_store_degraded") == 1
              and b.metric("extproc_store_degraded") == 1)
        pid = next(p.popen.pid for p in c.stack.processes if p.name == "extproc1")
        cpu_before = _cpu(pid)
        refusals_before = _refusals(b)
        started = time.monotonic()
        short = [pool.submit(post, r.url, 300) for r in (a, b) * 4]
        time.sleep(2.0)
        cpu = (_cpu(pid) - cpu_before) / (time.monotonic() - started)
        # Waiting requests sit in B's queue; nothing spins on its refusals.
        refused = _refusals(b) - refusals_before
        assert cpu < 0.5, f"B used {cpu:.0%} of a core while its requests waited"
        assert refused < 50, f"{refused} refusals in 2 s"
        assert [f.result().status_code for f in long + short] == [200] * 11
    assert c.peak() <= 4


def _refusals(replica: Replica) -> float:
    return sum(replica.metric("extproc_ledger_refusals_total", lane="a", verdict=verdict)
               for verdict in ("lane_full", "capacity", "borrow_limit", "owed", "outranked", "unavailable"))


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

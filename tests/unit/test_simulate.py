"""The offline simulator: queueing theory, determinism, and the shared core."""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from extproc import controller
from extproc.core import admission
from extproc.policy import Policy, load_policy
from extproc.sim import simulate
from extproc.sim.profiles import LLAMA_70B_2XH100, Profile
from extproc.sim.simulate import Simulator, capacity_rps, fifo_policy
from extproc.sim.traces import Trace
from extproc.sim.workload import Arrivals, Client, Lengths, TrafficClass, WorkloadSpec, generate, load_spec

ROOT = Path(__file__).resolve().parents[2]

#: One sequence at a time, 10 ms per token, free prefill: an M/G/1 server.
ONE_AT_A_TIME = Profile(
    name="mg1",
    model="m",
    decode_ms=((1, 10.0),),
    prefill_tokens_per_s=1e9,
    kv_cache_tokens=100_000,
    max_running=1,
    max_batched_tokens=4096,
    max_model_len=4096,
)


@pytest.mark.parametrize(("rho", "count"), [(0.7, 30_000), (0.9, 60_000), (0.95, 120_000)])
def test_mean_wait_matches_pollaczek_khinchine(rho: float, count: int) -> None:
    lengths = Lengths(kind="chatbot", short_output=30, long_output=70, long_share=0.3, prompt_mean=1)
    mean_service = (0.7 * 30 + 0.3 * 70) * 0.010
    rate = rho / mean_service
    requests = generate(WorkloadSpec(arrivals=Arrivals(rate=rate), lengths=lengths), count / rate, seed=3)
    run = Simulator(ONE_AT_A_TIME, client=Client(kind="none", timeout=1e9)).run(requests, None)
    waits = [r.queue_wait for r in run.results]
    services = [r.e2e - r.queue_wait for r in run.results if r.e2e is not None and r.queue_wait is not None]
    assert len(services) == len(requests)
    # Pollaczek–Khinchine with the moments the server actually had: W = λ E[S²] / (2 (1 − ρ)).
    observed_rate = len(requests) / requests[-1].at
    utilisation = observed_rate * statistics.fmean(services)
    predicted = observed_rate * statistics.fmean(s * s for s in services) / (2 * (1 - utilisation))
    assert utilisation == pytest.approx(rho, abs=0.01)
    assert statistics.fmean(w for w in waits if w is not None) == pytest.approx(predicted, rel=0.10)


def chatbot(load: float, duration: float, seed: int = 1) -> tuple[WorkloadSpec, list[simulate.Request]]:
    spec = load_spec(ROOT / "examples" / "workloads" / "chatbot.yaml")
    rate = capacity_rps(LLAMA_70B_2XH100, 0.1, spec) * load
    spec = spec.model_copy(update={"arrivals": spec.arrivals.model_copy(update={"rate": rate})})
    return spec, generate(spec, duration, seed)


@pytest.fixture(scope="module")
def demo_policy() -> Policy:
    return load_policy(ROOT / "examples" / "demo-policy.yaml")


def test_same_seed_same_results(demo_policy: Policy) -> None:
    spec, requests = chatbot(1.5, 30)
    runs = [
        Simulator(LLAMA_70B_2XH100, time_scale=0.1, client=spec.client, seed=5).run(requests, demo_policy)
        for _ in range(2)
    ]
    assert runs[0].results == runs[1].results
    assert runs[0].served_work == runs[1].served_work
    # Another seed changes Retry-After jitter and client backoff, hence some outcomes (booked
    # returns are told to the millisecond, unjittered: without the return schedule).
    jittered = _with(demo_policy, retry_after={**demo_policy.retry_after.model_dump(), "share": 0})
    one, other = (Simulator(LLAMA_70B_2XH100, time_scale=0.1, client=spec.client, seed=seed)
                  .run(requests, jittered) for seed in (5, 6))
    assert other.results != one.results


def test_the_simulator_and_the_live_service_share_one_core() -> None:
    from extproc.core.machine import Machine
    from extproc.servers import ratelimit

    assert simulate.Machine is controller.Machine is ratelimit.Machine is Machine
    machine = Machine(Policy.model_validate({"lanes": [{"name": "a", "max_inflight": 1, "deadline": "1s"}],
                                             "classification": {"default_lane": "a"}}))
    assert machine._scheduler.__class__ is admission.Scheduler


def test_policy_limits_hold_in_simulation(demo_policy: Policy) -> None:
    spec, requests = chatbot(2.0, 30)
    sim = Simulator(LLAMA_70B_2XH100, time_scale=0.1, client=spec.client)
    assert sim.run(requests, None).peak_running == LLAMA_70B_2XH100.max_running
    assert (
        0.8 * demo_policy.total_capacity
        <= sim.run(requests, demo_policy).peak_running
        <= demo_policy.total_capacity
    )


def test_policy_beats_no_admission_control_for_interactive_under_overload(demo_policy: Policy) -> None:
    spec, requests = chatbot(1.5, 120)
    sim = Simulator(LLAMA_70B_2XH100, time_scale=0.1, client=spec.client)

    def interactive_p99(policy: Policy | None) -> float:
        ttfts = sorted(
            r.ttft
            for r in sim.run(requests, policy).results
            if r.cls == "interactive" and r.ok and r.ttft is not None
        )
        return ttfts[int(len(ttfts) * 0.99)]

    baseline, fifo, policy = (
        interactive_p99(None),
        interactive_p99(fifo_policy(demo_policy)),
        interactive_p99(demo_policy),
    )
    assert policy < 1.0
    assert baseline > 10 * policy
    assert fifo > policy


def test_the_engines_own_time_to_a_first_token_is_told_apart(demo_policy: Policy) -> None:
    spec, requests = chatbot(1.5, 60)
    sim = Simulator(LLAMA_70B_2XH100, time_scale=0.1, client=spec.client)
    for policy in (None, demo_policy):
        served = [r for r in sim.run(requests, policy).results if r.ok]
        assert served
        assert all(r.engine_ttft is not None and r.ttft is not None for r in served)
        if policy is None:
            # Without admission control the engine's own queue is the whole wait.
            assert all(r.engine_ttft == pytest.approx(r.ttft) for r in served)
        else:
            # With it the engine's part is what is left after the wait for admission (and retries).
            assert all(r.engine_ttft <= r.ttft - r.queue_wait + 1e-9 for r in served)
            assert max(r.engine_ttft for r in served) < 1.0 < max(r.ttft for r in served)


def test_tenant_shares_follow_weights_when_contended() -> None:
    policy = Policy.model_validate(
        {
            "lanes": [{"name": "a", "max_inflight": 4, "max_queued": 1000, "deadline": "200s"}],
            "classification": {"default_lane": "a"},
            "trusted_headers": ["x-extproc-client"],
            "tenants": {"header": "x-extproc-client", "weights": {"big": 3, "small": 1}},
            "estimation": {"default": {"decode_ms_per_token": 1, "overhead_ms": 0}, "learning_rate": 0},
            "queueing": {"sjf_weight": 0},
        }
    )
    spec = WorkloadSpec(
        arrivals=Arrivals(rate=40),
        lengths=Lengths(kind="fixed", output=100, prompt_mean=10),
        classes=(TrafficClass(name="a", tenants={"big": 1, "small": 1}),),
        client=Client(kind="none", timeout=1e9),
    )
    run = Simulator(LLAMA_70B_2XH100, time_scale=0.1, client=spec.client).run(generate(spec, 120, 2), policy)
    shares = simulate.tenant_shares(run, policy)["a"]
    assert shares["big"][0] == pytest.approx(0.75, abs=0.05)
    assert shares["big"][1] == pytest.approx(0.75)


def test_decision_log_becomes_a_trace(tmp_path: Path) -> None:
    lines = [
        '{"event": "serving", "grpc": "127.0.0.1:50051"}',
        json.dumps(
            {
                "event": "decision",
                "arrival": 1000.5,
                "lane": "batch",
                "tenant": "acme",
                "path": "/v1/x",
                "headers": {"x-tenant-id": "acme"},
                "model": "m",
                "prompt_tokens": 30,
                "output_tokens": 7,
            }
        ),
        "not json",
        json.dumps(
            {
                "event": "decision",
                "arrival": 1000.0,
                "lane": "interactive",
                "tenant": "t",
                "path": "/v1/chat/completions",
                "headers": {},
                "model": None,
                "prompt_tokens": 0,
                "output_tokens": 50,
            }
        ),
    ]
    log = tmp_path / "extproc.log"
    log.write_text("\n".join(lines) + "\n")
    assert Trace(log).format == "decision-log"
    trace = list(Trace(log))
    assert [r.at for r in trace] == [0.0, 0.5]
    assert [r.cls for r in trace] == ["interactive", "batch"]
    assert trace[1].headers == {"x-tenant-id": "acme"}
    assert trace[1].prompt_tokens == 30
    assert trace[0].prompt_tokens == 1  # an empty prompt still costs the engine a token


def test_simulate_cli_compares_two_policies(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "extproc",
            "simulate",
            "compare",
            str(ROOT / "examples" / "demo-policy.yaml"),
            str(ROOT / "examples" / "single-lane.yaml"),
            "--workload",
            str(ROOT / "examples" / "workloads" / "chatbot.yaml"),
            "--load",
            "1.5",
            "--duration",
            "20",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "demo-policy.yaml" in result.stdout
    assert "single-lane.yaml" in result.stdout
    doc = json.loads(out.read_text())
    assert set(doc["runs"]) == {
        str(ROOT / "examples" / "demo-policy.yaml"),
        str(ROOT / "examples" / "single-lane.yaml"),
    }


# -- the simulator runs what the live service runs ---------------------------------------------------


def _with(policy: Policy, **changes: object) -> Policy:
    return Policy.model_validate({**policy.model_dump(), **changes})


def test_the_retry_budget_applies_in_simulation(demo_policy: Policy) -> None:
    spec, requests = chatbot(2.0, 40)
    sim = Simulator(LLAMA_70B_2XH100, time_scale=0.1, client=spec.client)
    # The return schedule (retry_after.share) also limits who is told to retry: off here, so only
    # the budget does.
    unscheduled = {**demo_policy.retry_after.model_dump(), "share": 0}
    without = sim.run(requests, _with(demo_policy, retry_budget={"enabled": False}, retry_after=unscheduled))
    budgeted = sim.run(requests, _with(demo_policy, retry_after=unscheduled))
    attempts = lambda run: sum(r.attempts for r in run.results) / len(run.results)  # noqa: E731
    # Clients told x-should-retry: false once the budget has no room stop retrying, as live
    # (bench/retry_storm.py measured 1.27 attempts per request without the budget, 1.08 with).
    assert attempts(without) > 1.2
    assert attempts(budgeted) < 1.12


def test_saturation_signals_read_from_the_engine_shed_lanes(demo_policy: Policy) -> None:
    policy = _with(demo_policy, signals={
        "sources": {"engines": {"scrape": {"targets": ["http://127.0.0.1:8000/metrics"], "interval": "1s"}}},
        "read": {"kv": {"source": "engines", "preset": "kv_cache_usage", "stale_after": "5s"},
                 "kueue": {"source": "engines", "metric": "kueue_pending_workloads", "stale_after": "5s",
                           "on_stale": "ignore"}},
        "saturation": [{"name": "kv-busy", "signal": "kv", "above": 0.05, "below": 0.01,
                        "shed": ["best-effort"]}],
    })
    spec, requests = chatbot(1.5, 40)
    run = Simulator(LLAMA_70B_2XH100, time_scale=0.1, client=spec.client).run(requests, policy)
    assert run.signals == ["kv"]  # the engine answers KV-cache usage; Kueue's backlog never arrives
    shed = [r for r in run.results if r.reason == "saturated"]
    assert shed
    assert {r.cls for r in shed} == {"best-effort"}


def test_the_edge_and_tenant_budgets_apply_in_simulation(demo_policy: Policy) -> None:
    budgets = {"tenants": {"acme": {"requests": 60, "per": "minute"}}}
    policy = _with(demo_policy, ratelimit={"budgets": budgets})
    spec, requests = chatbot(0.7, 40)
    run = Simulator(LLAMA_70B_2XH100, time_scale=0.1, client=spec.client).run(requests, policy)
    refused = [r for r in run.results if r.reason == "tenant_request_budget"]
    assert refused
    assert {r.tenant for r in refused} == {"acme"}


def test_streamed_answers_spend_token_budgets_in_simulation(demo_policy: Policy) -> None:
    # The chatbot's answers are streamed: charged from the usage the backend reports, as live.
    budgets = {"tenants": {"acme": {"tokens": 20_000, "per": "minute"}}}
    policy = _with(demo_policy, ratelimit={"budgets": budgets})
    spec, requests = chatbot(0.7, 40)
    assert all(r.stream for r in requests)
    run = Simulator(LLAMA_70B_2XH100, time_scale=0.1, client=spec.client).run(requests, policy)
    refused = [r for r in run.results if r.reason == "tenant_token_budget"]
    assert refused
    assert {r.tenant for r in refused} == {"acme"}


def test_auto_capacity_runs_in_the_simulator_and_follows_a_capacity_step() -> None:
    # The same limit controller as live: sized from the engine model's own signals (waiting requests,
    # TTFT and inter-token latency percentiles), within the policy's bounds, through a lost half.
    policy = load_policy(ROOT / "examples" / "auto-policy.yaml")
    assert policy.capacity.auto is not None
    spec, requests = chatbot(1.5, 90)
    sim = Simulator(LLAMA_70B_2XH100, time_scale=0.1, client=spec.client,
                    capacity_schedule=((30.0, 0.5), (60.0, 1.0)))
    run = sim.run(requests, policy)
    assert set(run.signals) == {"engine_waiting", "engine_running", "engine_ttft_p95", "engine_tpot_p95",
                                "engine_kv_cache"}
    limits = {t: limit for t, limit, _, _ in run.timeline}
    assert all(policy.capacity.auto.min <= limit <= policy.capacity.auto.max for limit in limits.values())
    full = max(limit for t, limit in limits.items() if 20 <= t < 30)
    half = [limit for t, limit in limits.items() if 45 <= t < 60]
    assert max(half) < full  # it fell with the engine's capacity
    assert run.peak_running <= LLAMA_70B_2XH100.max_running
    waiting = [w for t, _, w, _ in run.timeline if 50 <= t < 60]
    assert max(waiting) <= 20  # and kept the engine's own queue short


def test_the_simulator_reads_a_scrape_source_soon_while_a_start_holds_work_back_as_the_hub_does() -> None:
    """Machine.reading_wanted, as live: at a few slots per lane a start reads its scrape source again a
    quarter interval after the last while requests are held back (the first second at 4 slots refused
    the 70B's interactive requests at twice its capacity); from there on, once per interval. Signals
    read through Prometheus are not read sooner (Prometheus' own scrapes set what they answer)."""
    policy = load_policy(ROOT / "examples" / "auto-policy.yaml")
    spec, requests = chatbot(2.0, 10)
    sim = Simulator(LLAMA_70B_2XH100, time_scale=0.1, client=spec.client)
    run = sim.run(requests, policy)
    times = [t for t, _, _, _ in run.timeline]
    early = [(t, limit) for t, limit, _, _ in run.timeline if t < 1.0]
    assert len(early) >= 3, early  # t=0, then hurried readings within the first interval
    assert max(limit for _, limit in early) >= 16
    assert min(b - a for a, b in itertools.pairwise(times)) >= 0.25 - 1e-9
    later = [b - a for a, b in itertools.pairwise(times) if a >= 3.0]
    assert later
    assert all(gap == pytest.approx(1.0) for gap in later)
    # The same engines read through Prometheus: once per interval from the start.
    data = policy.model_dump(mode="json", exclude_none=True)
    data["signals"]["sources"]["engines"] = {"prometheus": {"url": "http://127.0.0.1:9090", "interval": "1s",
                                                                "timeout": "500ms"}}
    data["signals"]["read"] = {
        name: {"source": "engines", "query": f"sum(vllm:{metric})", "stale_after": "5s"}
        for name, metric in (("engine_waiting", "num_requests_waiting"),
                             ("engine_running", "num_requests_running"),
                             ("engine_kv_cache", "kv_cache_usage_perc"))}
    data["capacity"]["auto"]["signals"] = {"waiting": "engine_waiting", "running": "engine_running",
                                           "kv_cache": "engine_kv_cache"}
    data["capacity"]["auto"]["target"] = {"queue": 0}
    prometheus = Policy.model_validate(data)
    run = sim.run(requests, prometheus)
    assert set(run.signals) == {"engine_waiting", "engine_running", "engine_kv_cache"}
    times = [t for t, _, _, _ in run.timeline]
    assert all(b - a == pytest.approx(1.0) for a, b in itertools.pairwise(times))

"""The workload generator: rates, burstiness, length mixes, shares, retries, traces."""

from __future__ import annotations

import itertools
import random
import statistics
from pathlib import Path

import pytest

from extproc.sim.traces import Trace, TraceError
from extproc.sim.workload import (
    Arrivals,
    Burst,
    Client,
    Lengths,
    TrafficClass,
    WorkloadSpec,
    generate,
    retry_delay,
    write_trace,
)


def spec(**arrivals: object) -> WorkloadSpec:
    return WorkloadSpec(arrivals=Arrivals(**{"rate": 10.0, **arrivals}))  # type: ignore[arg-type]


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def test_poisson_rate_and_cv() -> None:
    requests = generate(spec(), duration=1000, seed=1)
    assert len(requests) == pytest.approx(10_000, rel=0.03)
    g = gaps([r.at for r in requests])
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_arrivals_have_the_chosen_cv(cv: float) -> None:
    requests = generate(spec(process="gamma", cv=cv), duration=2000, seed=2)
    g = gaps([r.at for r in requests])
    assert statistics.mean(g) == pytest.approx(0.1, rel=0.06)
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(cv, rel=0.12)


def test_step_burst_multiplies_the_rate() -> None:
    requests = generate(spec(bursts=(Burst(at=100, duration=50, multiplier=4),)), duration=300, seed=3)
    inside = sum(1 for r in requests if 100 <= r.at < 150)
    outside = sum(1 for r in requests if r.at < 100)
    assert inside / 50 == pytest.approx(40, rel=0.1)
    assert outside / 100 == pytest.approx(10, rel=0.1)


def test_chatbot_mix_long_share() -> None:
    s = WorkloadSpec(arrivals=Arrivals(rate=50), lengths=Lengths(kind="chatbot", long_share=0.3))
    requests = generate(s, duration=200, seed=4)
    outputs = {r.output_tokens for r in requests}
    assert outputs == {50, 2000}
    share = sum(r.output_tokens == 2000 for r in requests) / len(requests)
    assert share == pytest.approx(0.3, abs=0.02)
    prompts = [r.prompt_tokens for r in requests]
    assert statistics.mean(prompts) == pytest.approx(200, rel=0.1)


def test_sharegpt_lengths_are_heavy_tailed_and_capped() -> None:
    lengths = Lengths(kind="sharegpt", output=200, max_output=3000)
    s = WorkloadSpec(arrivals=Arrivals(rate=50), lengths=lengths)
    outputs = [r.output_tokens for r in generate(s, duration=200, seed=5)]
    assert statistics.median(outputs) == pytest.approx(200, rel=0.1)
    assert max(outputs) <= 3000
    assert statistics.mean(outputs) > statistics.median(outputs)


def test_class_and_tenant_shares() -> None:
    s = WorkloadSpec(arrivals=Arrivals(rate=100), classes=(
        TrafficClass(name="interactive", share=3, tenants={"acme": 9, "globex": 1}),
        TrafficClass(name="batch", share=1, path="/v1/completions"),
    ))
    requests = generate(s, duration=100, seed=6)
    interactive = [r for r in requests if r.cls == "interactive"]
    assert len(interactive) / len(requests) == pytest.approx(0.75, abs=0.02)
    acme = sum(r.tenant == "acme" for r in interactive) / len(interactive)
    assert acme == pytest.approx(0.9, abs=0.02)
    assert interactive[0].headers["x-extproc-client"] in ("acme", "globex")
    assert interactive[0].key is None
    assert interactive[0].gateway == {}
    batch = next(r for r in requests if r.cls == "batch")
    assert "prompt" in batch.body()
    assert "messages" not in batch.body()
    assert batch.body()["max_tokens"] == batch.output_tokens


def test_same_seed_same_workload_and_trace_round_trip(tmp_path: Path) -> None:
    a = generate(spec(process="gamma", cv=2), duration=50, seed=7)
    assert a == generate(spec(process="gamma", cv=2), duration=50, seed=7)
    assert a != generate(spec(process="gamma", cv=2), duration=50, seed=8)
    path = tmp_path / "trace.jsonl"
    write_trace(a, path)
    assert list(Trace(path)) == a  # detected as extproc's JSONL


def test_bad_trace_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"index": 0}\nnot json\n')
    with pytest.raises(TraceError, match=r"trace.jsonl:1: not an extproc trace record"):
        list(Trace(path, "jsonl"))
    with pytest.raises(TraceError, match=r"trace.jsonl:1: a JSON record with keys \['index'\]"):
        Trace(path)


def test_retry_delay_mimics_the_openai_sdk() -> None:
    client, rng = Client(), random.Random(0)
    assert retry_delay(client, 1, 429, {"retry-after": "7"}, rng) == 7
    assert retry_delay(client, 1, 429, {"retry-after-ms": "1500"}, rng) == 1.5
    # Longer than 60 s is ignored: the SDK falls back to its own backoff.
    assert 0.375 <= retry_delay(client, 1, 429, {"retry-after": "120"}, rng) <= 0.5  # type: ignore[operator]
    assert 0.75 <= retry_delay(client, 2, 503, {}, rng) <= 1.0  # type: ignore[operator]
    assert retry_delay(client, 3, 429, {"retry-after": "1"}, rng) is None
    assert retry_delay(client, 1, 400, {}, rng) is None
    assert retry_delay(client, 1, 429, {"x-should-retry": "false"}, rng) is None
    assert retry_delay(client, 1, None, {}, rng) is not None
    assert retry_delay(Client(kind="none"), 1, 429, {}, rng) is None


def test_tenants_with_keys_present_them_and_the_gateway_names_the_tenant() -> None:
    s = WorkloadSpec(arrivals=Arrivals(rate=50), classes=(
        TrafficClass(name="interactive", tenants={"acme": 1, "globex": 1},
                     keys={"acme": "sk-a", "globex": "sk-g"}),
        TrafficClass(name="free", tenants={"free": 1}, keys={"free": "sk-f"}),
    ))
    requests = generate(s, duration=20, seed=1)
    for r in requests:
        assert r.key == {"acme": "sk-a", "globex": "sk-g", "free": "sk-f"}[r.tenant]
        # The client sends only its key; the gateway derives the tenant header from it.
        assert "x-extproc-client" not in r.headers
        assert r.gateway == {"x-extproc-client": r.tenant}

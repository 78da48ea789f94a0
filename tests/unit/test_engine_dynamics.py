"""Engine models unlike vLLM's (``Dynamics``), on a virtual clock: no sockets, no sleeping.

Prefill-only steps that stall the decode, a batch that takes requests every N steps, gauges
published per step, percentiles read through histogram buckets, a cache that bounds the batch
and preempts; each against numbers worked out by hand from the profile, and the fast-forward
against a plain step-by-step model.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from extproc.signals.scrape import histogram_quantile
from extproc.sim.backend import stream_pieces
from extproc.sim.dynamics import PROMETHEUS_DEFAULT, VLLM, Dynamics, Histograms
from extproc.sim.engine import Engine, Event, FirstToken
from extproc.sim.latencies import bucket_quantile
from extproc.sim.profiles import (
    LLAMA_8B_L40S_TGI,
    LLAMA_13B_A100_V0,
    PROFILES,
    TEST,
    Profile,
    get_profile,
    linear_steps,
)
from extproc.sim.simulate import Simulator, capacity_for_mix, capacity_rps
from extproc.sim.workload import generate, load_spec
from tests.unit.test_sim_engine import Arrival, drive, finished

#: A step of 10 ms + 1 ms per sequence; 0.1 ms per prefill token.
LINEAR = Profile(name="linear-test", model="sim-linear", decode_ms=linear_steps(10.0, 1.0, 8),
                 prefill_tokens_per_s=10_000.0, kv_cache_tokens=4096, max_running=8, max_batched_tokens=1024,
                 max_model_len=1024)
STALL = dataclasses.replace(LINEAR, name="stall-test", dynamics=Dynamics(chunked_prefill=False))
PC = 1 / 10_000.0


def step(n: int) -> float:
    return (10.0 + n) / 1000


class Intervals:
    """What the engine tells a live histogram: every inter-token interval, one by one."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def __call__(self, seconds: float, count: int) -> None:
        self.seen += [seconds] * count


# -- the profiles ----------------------------------------------------------------------------------


def test_linear_steps_are_a_plus_b_times_running_at_any_batch() -> None:
    for n in (1, 2, 8, 9, 48, 300):
        assert LINEAR.step_seconds(n) == pytest.approx(step(n), rel=1e-12)
    for n in (1, 24, 48, 64):
        assert LLAMA_8B_L40S_TGI.step_seconds(n) == pytest.approx((22.0 + 0.3 * n) / 1000, rel=1e-12)
    with pytest.raises(ValueError, match="up_to ≥ 2"):
        linear_steps(10.0, 1.0, 1)


def test_the_new_engine_models_are_registered_with_their_dynamics() -> None:
    assert get_profile("llama-8b-l40s-tgi") is LLAMA_8B_L40S_TGI
    assert get_profile("llama-13b-a100-v0") is LLAMA_13B_A100_V0
    tgi, v0 = LLAMA_8B_L40S_TGI.dynamics, LLAMA_13B_A100_V0.dynamics
    assert (tgi.chunked_prefill, tgi.admit_every_steps, tgi.gauges_at_steps, tgi.stream_every_tokens,
            tgi.histograms, tgi.percentiles) == (False, 20, True, 8, PROMETHEUS_DEFAULT, "histogram")
    assert (v0.chunked_prefill, v0.admit_every_steps, v0.gauges_at_steps, v0.histograms, v0.percentiles) \
        == (False, 1, False, VLLM, "histogram")
    # Every other profile is vLLM as it was.
    others = [p for name, p in PROFILES.items() if name not in ("llama-8b-l40s-tgi", "llama-13b-a100-v0")]
    assert others
    assert all(p.dynamics == Dynamics() for p in others)


@pytest.mark.parametrize(("options", "message"), [
    ({"admit_every_steps": 0}, "admit_every_steps must be an integer ≥ 1, got 0"),
    ({"admit_every_steps": 2.5}, "admit_every_steps must be an integer"),
    ({"admit_waiting_ratio": -1.0}, "admit_waiting_ratio must be a positive number or None, got -1.0"),
    ({"admit_waiting_ratio": math.nan}, "admit_waiting_ratio must be a positive number"),
    ({"stream_every_tokens": 0}, "stream_every_tokens must be an integer ≥ 1 or None, got 0"),
    ({"percentiles": "median"}, "percentiles must be 'exact' or 'histogram', got 'median'"),
    ({"histograms": (0.1, 1.0)}, "histograms must be a Histograms, got tuple"),
])
def test_bad_dynamics_are_refused_with_what_is_wrong(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=f"^engine dynamics: {message}"):
        Dynamics(**options)  # type: ignore[arg-type]


def test_bad_histograms_and_profiles_are_refused() -> None:
    with pytest.raises(ValueError, match="histograms 'odd': itl bounds must be finite, positive and "):
        Histograms("odd", ttft=(1.0,), itl=(0.5, 0.5), request=(1.0,))
    with pytest.raises(ValueError, match="profile 'stall-test': without chunked prefill max_batched_tokens "
                                         "must be ≥ max_model_len"):
        dataclasses.replace(STALL, max_batched_tokens=512)
    with pytest.raises(ValueError, match="profile 'linear-test': dynamics must be a Dynamics, got dict"):
        dataclasses.replace(LINEAR, dynamics={"chunked_prefill": False})  # type: ignore[arg-type]


# -- prefill-only steps: the decode stalls ----------------------------------------------------------


def test_without_chunked_prefill_a_prefill_stalls_every_decoding_sequence() -> None:
    intervals = Intervals()
    engine = Engine(STALL, on_interval=intervals)
    t0 = step(1) + 10 * PC  # a's own prefill step
    arrive_b = t0 + 2.5 * step(1)
    events = drive(engine, [(0.0, "a", 10, 20), (arrive_b, "b", 100, 5)])
    stall = step(1) + 100 * PC  # b's prefill step, decoding nothing
    b_first = t0 + 3 * step(1) + stall
    done = finished(events)
    assert done["b"].ttft == pytest.approx(b_first - arrive_b, rel=1e-9)
    # a: 3 tokens before the stall, one interval across it, 4 beside b, 12 alone.
    assert done["a"].e2e == pytest.approx(b_first + 4 * step(2) + 12 * step(1), rel=1e-9)
    assert sorted(intervals.seen) == pytest.approx(sorted([step(1)] * 15 + [step(2)] * 7 + [stall + step(2)]))


def test_during_a_prefill_only_step_nobody_makes_a_token() -> None:
    engine = Engine(STALL)
    t0 = step(1) + 10 * PC
    drive_to(engine, [(0.0, "a", 10, 20), (t0 + 2.5 * step(1), "b", 100, 5)], t0 + 3 * step(1))
    assert engine.progress("a") == 4
    engine.advance(t0 + 3 * step(1) + (step(1) + 100 * PC) * 0.9)
    assert engine.progress("a") == 4
    assert engine.progress("b") == 0
    engine.advance(t0 + 3 * step(1) + step(1) + 100 * PC + 1.5 * step(2))  # mid the next decode step
    assert (engine.progress("a"), engine.progress("b")) == (5, 2)


def test_chunked_prefill_shares_the_step_instead() -> None:
    # The same arrivals on the same numbers with vLLM's dynamics: a's interval across b's prefill is
    # the shared step, shorter than the stall plus the next step.
    intervals = Intervals()
    t0 = step(1) + 10 * PC
    drive(Engine(LINEAR, on_interval=intervals), [(0.0, "a", 10, 20), (t0 + 2.5 * step(1), "b", 100, 5)])
    assert max(intervals.seen) == pytest.approx(step(2) + 100 * PC)
    assert max(intervals.seen) < step(1) + 100 * PC + step(2)


def drive_to(engine: Engine, arrivals: list[Arrival], until: float) -> list[Event]:
    """Feed arrivals and advance event by event up to ``until`` (not beyond)."""
    events: list[Event] = []
    pending = sorted(arrivals)
    while True:
        nxt = engine.next_event_time()
        if pending and pending[0][0] <= until and (nxt is None or pending[0][0] <= nxt):
            at, rid, prompt, output = pending.pop(0)
            engine.add(rid, prompt, output, at)
        elif nxt is not None and nxt <= until:
            events += engine.advance(nxt)
        else:
            events += engine.advance(until)
            return events


# -- a cache that bounds the batch, and preempts ---------------------------------------------------

#: 160 tokens of KV: two 50-token prompts fit, their answers outgrow it.
KV_BOUND = dataclasses.replace(STALL, name="kv-test", kv_cache_tokens=160, max_running=64,
                               max_batched_tokens=100, max_model_len=100)


def test_a_kv_bound_engine_preempts_the_newest_and_recomputes_it_in_a_stall() -> None:
    intervals = Intervals()
    engine = Engine(KV_BOUND, on_interval=intervals)
    done = finished(drive(engine, [(0.0, "a", 50, 50), (0.0, "b", 50, 50)]))
    assert engine.preemptions == 1
    assert (done["a"].preemptions, done["b"].preemptions) == (0, 1)
    assert (done["a"].output_tokens, done["b"].output_tokens) == (50, 50)
    # Both prefilled together, then 29 steps side by side fill the cache (102 + 2 × 29 = 160); at the
    # 30th b goes, a runs its last 20 tokens alone, then b's 80 tokens are prefilled again.
    preempted = step(2) + 100 * PC + 29 * step(2)
    a_done = preempted + 20 * step(1)
    assert done["a"].e2e == pytest.approx(a_done, rel=1e-9)
    recompute = step(1) + 80 * PC
    assert max(intervals.seen) == pytest.approx(a_done + recompute - preempted, rel=1e-9)
    assert done["b"].e2e == pytest.approx(a_done + recompute + 19 * step(1), rel=1e-9)


def test_the_v0_profile_runs_as_many_as_its_cache_holds_not_its_slots() -> None:
    rng = random.Random(3)
    engine = Engine(LLAMA_13B_A100_V0)
    arrivals = sorted((rng.uniform(0, 20), str(i), rng.randint(100, 1500), rng.choice((50, 2000)))
                      for i in range(400))
    peak, events = 0, []
    for at, rid, prompt, output in arrivals:
        events += drain_until(engine, at)
        engine.add(rid, prompt, output, at)
        peak = max(peak, engine.running)
        assert engine.kv_tokens <= LLAMA_13B_A100_V0.kv_cache_tokens
    events += drain_until(engine, math.inf)
    done = finished(events)
    assert {rid: f.output_tokens for rid, f in done.items()} == {rid: out for _, rid, _, out in arrivals}
    assert engine.preemptions > 50
    assert sum(f.preemptions for f in done.values()) == engine.preemptions
    assert 20 < peak < LLAMA_13B_A100_V0.max_running // 2


def drain_until(engine: Engine, until: float) -> list[Event]:
    events: list[Event] = []
    while (nxt := engine.next_event_time()) is not None and nxt <= until:
        events += engine.advance(nxt)
        assert engine.kv_tokens <= engine.kv_capacity_tokens
    return events


# -- a batch that takes requests every N steps -----------------------------------------------------


def gated(every: int, ratio: float | None = None) -> Profile:
    return dataclasses.replace(STALL, name="gated-test",
                               dynamics=Dynamics(chunked_prefill=False, admit_every_steps=every,
                                                 admit_waiting_ratio=ratio))


@pytest.mark.parametrize(("profile", "steps_waited"), [
    (STALL, 0.5),  # taken at the next step
    (gated(5), 3.5),  # after 4 decode steps since a was taken, though 7 slots are free
    (gated(5, ratio=1.0), 0.5),  # one waits for one running: enough at once
    (gated(5, ratio=2.0), 3.5),  # two would have to wait
])
def test_a_gated_batch_takes_requests_every_n_steps(profile: Profile, steps_waited: float) -> None:
    t0 = step(1) + 10 * PC
    engine = Engine(profile)
    done = finished(drive(engine, [(0.0, "a", 10, 40), (t0 + 0.5 * step(1), "b", 10, 5)]))
    assert done["a"].queue_time == 0  # an empty batch takes a request at once
    assert done["b"].queue_time == pytest.approx(steps_waited * step(1), rel=1e-9)


def test_a_gated_batch_shows_requests_waiting_beside_free_slots() -> None:
    t0 = step(1) + 10 * PC
    engine = Engine(gated(5))
    drive_to(engine, [(0.0, "a", 10, 40), (t0 + 0.5 * step(1), "b", 10, 5)], t0 + 3.5 * step(1))
    assert (engine.running, engine.waiting) == (1, 1)
    engine.advance(t0 + 4 * step(1) + 0.5 * (step(1) + 10 * PC))
    assert (engine.running, engine.waiting) == (2, 0)


# -- the fast-forward against a plain step-by-step model --------------------------------------------


@dataclass
class _Seq:
    rid: str
    prompt: int
    output: int
    arrival: float
    generated: int = 0
    prefill_left: int = 0
    first: float | None = None
    last: float | None = None


@dataclass
class _Reference:
    """One step at a time, every sequence touched every step: the dynamics spelled out plainly."""

    p: Profile
    waiting: deque[_Seq] = field(default_factory=deque)
    running: list[_Seq] = field(default_factory=list)
    events: list[tuple[str, str, float]] = field(default_factory=list)
    intervals: list[float] = field(default_factory=list)
    steps: int = 0  # steps that decoded (every step, with chunked prefill)
    admitted_at: int = 0

    def kv(self) -> int:
        return sum(s.prompt + s.generated for s in self.running)

    def gate_open(self) -> bool:
        d, n = self.p.dynamics, len(self.running)
        ratio = d.admit_waiting_ratio is not None and math.floor(n * d.admit_waiting_ratio) <= min(
            len(self.waiting), self.p.max_running - n)
        return d.admit_every_steps == 1 or not self.running or ratio \
            or self.steps - self.admitted_at >= d.admit_every_steps - 1

    def admit(self, t: float, budget: int, growth: int, whole: bool) -> list[tuple[_Seq, int]]:
        chunks: list[tuple[_Seq, int]] = []
        if not self.gate_open():
            return chunks
        while self.waiting and budget > 0 and len(self.running) < self.p.max_running:
            s = self.waiting[0]
            ctx = s.prompt + s.generated
            if self.kv() + growth + ctx + self.p.block_size > self.p.kv_cache_tokens:
                break
            if whole and ctx > budget:
                break
            self.waiting.popleft()
            self.running.append(s)
            self.admitted_at = self.steps
            s.prefill_left = ctx
            chunks.append((s, min(ctx, budget)))
            budget -= chunks[-1][1]
            growth += chunks[-1][1] == ctx
        return chunks

    def preempt(self, growth_of: int) -> list[_Seq]:
        """Preempt the newest until the decoding sequences' growth (and ``growth_of`` more) fits."""
        while self.running and self.kv() + growth_of + sum(s.prefill_left == 0 for s in self.running) \
                > self.p.kv_cache_tokens:
            victim = self.running.pop()
            victim.prefill_left = 0
            self.waiting.appendleft(victim)
        return [s for s in self.running if s.prefill_left == 0]

    def step(self, t: float) -> float | None:
        p = self.p
        if p.dynamics.chunked_prefill:  # as vLLM, with a gate on admission (no long prompts here)
            decoding = self.preempt(0)
            chunks = self.admit(t, p.max_batched_tokens - len(decoding), len(decoding), whole=False)
        else:  # prefill first and whole, the decode waiting
            chunks = self.admit(t, p.max_batched_tokens, 0, whole=True) if self.waiting else []
            decoding = [] if chunks else self.preempt(0)
        if not decoding and not chunks:
            return None
        prefill = sum(n for _, n in chunks) / p.prefill_tokens_per_s
        end = t + p.step_seconds(len(decoding) + len(chunks)) + prefill
        for s in decoding + [s for s, n in chunks if n == s.prefill_left]:
            s.prefill_left = 0
            s.generated += 1
            if s.first is None:
                s.first = end
                self.events.append(("first", s.rid, end))
            else:
                assert s.last is not None
                self.intervals.append(end - s.last)
            s.last = end
        self.steps += bool(decoding) or p.dynamics.chunked_prefill
        for s in [s for s in self.running if s.prefill_left == 0 and s.generated >= s.output]:
            self.running.remove(s)
            self.events.append(("done", s.rid, end))
        return end

    def run(self, arrivals: list[Arrival]) -> list[tuple[str, str, float]]:
        t: float | None = None
        for at, rid, prompt, output in sorted(arrivals):
            while t is not None and t <= at:
                t = self.step(t)
            self.waiting.append(_Seq(rid, prompt, output, at))
            if t is None:
                t = self.step(at)
        while t is not None:
            t = self.step(t)
        return self.events


def _arrivals(seed: int, n: int = 150) -> list[Arrival]:
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(25)
        arrivals.append((t, f"r{i}", rng.randint(1, 800), rng.randint(1, 220)))
    return arrivals


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("dynamics", [
    Dynamics(chunked_prefill=False),
    Dynamics(chunked_prefill=False, admit_every_steps=6, admit_waiting_ratio=1.5),
    Dynamics(admit_every_steps=4),
], ids=["stall", "stall-gated", "chunked-gated"])
def test_fast_forward_agrees_with_a_step_by_step_model(seed: int, dynamics: Dynamics) -> None:
    profile = dataclasses.replace(TEST, name="ref-test", dynamics=dynamics)
    arrivals = _arrivals(seed)
    reference = _Reference(profile)
    expected = reference.run(arrivals)
    intervals = Intervals()
    engine = Engine(profile, on_interval=intervals)
    got = [("first" if isinstance(e, FirstToken) else "done", e.req_id, e.time)
           for e in drive(engine, arrivals)]
    assert engine.preemptions > 0  # a preempted sequence's recompute is a prefill too
    assert sorted((k, r) for k, r, _ in got) == sorted((k, r) for k, r, _ in expected)
    want = {(k, r): at for k, r, at in expected}
    for kind, rid, at in got:
        assert at == pytest.approx(want[kind, rid], rel=1e-9), (kind, rid)
    # Every token after a first has one interval, from that sequence's own previous token.
    assert sorted(intervals.seen) == pytest.approx(sorted(reference.intervals), rel=1e-9)


@pytest.mark.parametrize("profile", [LLAMA_8B_L40S_TGI, LLAMA_13B_A100_V0], ids=lambda p: p.name)
def test_each_sequences_intervals_add_up_to_its_decode_time(profile: Profile) -> None:
    """Whatever stalls and preemptions: the intervals add up to last token minus first, per request."""
    rng = random.Random(5)
    intervals = Intervals()
    arrivals = sorted((rng.uniform(0, 30), str(i), rng.randint(50, 1500), rng.choice((50, 2000)))
                      for i in range(300))
    done = finished(drive(Engine(profile, on_interval=intervals), arrivals))
    assert len(done) == 300
    assert len(intervals.seen) == sum(f.output_tokens - 1 for f in done.values())
    assert sum(intervals.seen) == pytest.approx(sum(f.e2e - f.ttft for f in done.values()), rel=1e-9)


# -- gauges published per step ---------------------------------------------------------------------

#: One slot, vLLM otherwise, gauges published when a step starts.
PUBLISHED = dataclasses.replace(LINEAR, name="published-test", max_running=1,
                                dynamics=Dynamics(gauges_at_steps=True))


def test_published_gauges_show_an_arrival_from_the_next_step() -> None:
    t0 = step(1) + 10 * PC
    engine = Engine(PUBLISHED)
    drive_to(engine, [(0.0, "a", 10, 40)], t0 + 2.5 * step(1))
    engine.add("b", 10, 5, t0 + 2.5 * step(1))
    assert engine.waiting == 1  # the queue itself has it at once
    assert engine.gauges(t0 + 2.5 * step(1)) == (1, 0, 13 / 4096)  # as step 3 began: a's 13 tokens
    assert engine.gauges(t0 + 3.01 * step(1)) == (1, 1, 14 / 4096)


def test_published_gauges_show_a_cancelled_request_until_the_next_step() -> None:
    t0 = step(1) + 10 * PC
    engine = Engine(PUBLISHED)
    drive_to(engine, [(0.0, "a", 10, 40)], t0 + 2.5 * step(1))
    assert engine.cancel("a", t0 + 2.5 * step(1))
    assert (engine.running, engine.kv_tokens) == (0, 0)
    assert engine.gauges(t0 + 2.6 * step(1)) == (1, 0, 13 / 4096)
    engine.advance(t0 + 3 * step(1))
    assert engine.gauges(t0 + 3.5 * step(1)) == (0, 0, 0.0)


def test_published_waiting_counts_what_waited_at_each_step_start_inside_a_run() -> None:
    # a holds the only slot for 40 steps (one run); arrivals pile up and show a step later each.
    t0 = step(1) + 10 * PC
    engine = Engine(PUBLISHED)
    drive_to(engine, [(0.0, "a", 10, 40)], t0)
    for k in range(5):
        engine.add(f"w{k}", 10, 5, t0 + (k + 0.5) * step(1))
        assert engine.gauges(t0 + (k + 0.6) * step(1)).waiting == k
    assert engine.gauges(t0 + 5.1 * step(1)).waiting == 5
    assert engine.cancel("w0", t0 + 5.2 * step(1))
    assert engine.gauges(t0 + 5.9 * step(1)).waiting == 5
    assert engine.gauges(t0 + 6.1 * step(1)) == (1, 4, (11 + 6) / 4096)


def test_instant_gauges_are_the_engine_as_it_is() -> None:
    engine = Engine(LINEAR)
    engine.add("a", 10, 40, 0.0)
    engine.add("b", 10, 40, 0.0)
    assert engine.gauges() == (engine.running, engine.waiting, engine.kv_usage) == (0, 2, 0.0)
    engine.advance(0.0)
    assert engine.gauges() == (2, 0, 20 / 4096)


# -- percentiles through buckets -------------------------------------------------------------------


@pytest.mark.parametrize("bounds", [VLLM.ttft, VLLM.itl, PROMETHEUS_DEFAULT.ttft, (0.5,)])
def test_bucket_quantiles_are_prometheus_histogram_quantile(bounds: tuple[float, ...]) -> None:
    rng = random.Random(len(bounds))
    for _ in range(50):
        samples = [(rng.lognormvariate(-2, 1.5), rng.randint(1, 5)) for _ in range(rng.randint(1, 40))]
        cumulative = {b: float(sum(w for v, w in samples if v <= b)) for b in bounds}
        cumulative[math.inf] = float(sum(w for _, w in samples))
        for q in (0.5, 0.95, 0.99):
            assert bucket_quantile(samples, q, bounds) == histogram_quantile(q, cumulative)
    assert bucket_quantile([], 0.95, bounds) is None


def test_an_engine_read_through_buckets_answers_what_a_scrape_would() -> None:
    exact = Engine(LINEAR, keep_latencies=True)
    coarse = Engine(dataclasses.replace(LINEAR, dynamics=Dynamics(histograms=PROMETHEUS_DEFAULT,
                                                                  percentiles="histogram")),
                    keep_latencies=True)
    for engine in (exact, coarse):
        drive(engine, [(0.0, "a", 10, 3)])
    ttft = step(1) + 10 * PC  # 11.2 ms: in Prometheus' (10 ms, 25 ms] bucket
    assert exact.recent_ttft_p95(1.0) == pytest.approx(ttft)
    assert coarse.recent_ttft_p95(1.0) == pytest.approx(0.01 + 0.015 * 0.95)
    assert exact.recent_itl_p95(1.0) == pytest.approx(step(1))
    assert coarse.recent_itl_p95(1.0) == pytest.approx(0.01 + 0.015 * 0.95)


# -- streams every K tokens ------------------------------------------------------------------------


@pytest.mark.parametrize(("sent", "upto", "final", "every", "pieces"), [
    (0, 5, False, None, [(0, 5, False)]),
    (5, 5, False, None, []),
    (5, 5, True, None, [(5, 5, True)]),
    (0, 1, False, 8, [(0, 1, False)]),
    (0, 12, False, 8, [(0, 1, False), (1, 9, False)]),
    (9, 16, False, 8, []),
    (9, 25, False, 8, [(9, 17, False), (17, 25, False)]),
    (9, 30, True, 8, [(9, 17, False), (17, 25, False), (25, 30, True)]),
    (9, 17, True, 8, [(9, 17, True)]),
    (17, 17, True, 8, [(17, 17, True)]),
    (0, 1, True, 8, [(0, 1, True)]),
])
def test_stream_pieces(sent: int, upto: int, final: bool, every: int | None,
                       pieces: list[tuple[int, int, bool]]) -> None:
    assert stream_pieces(sent, upto, final, every) == pieces


# -- capacity --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama-8b-l40s-tgi", "llama-13b-a100-v0"])
def test_capacity_is_what_the_engine_completes_when_overloaded(name: str) -> None:
    profile = get_profile(name)
    base = load_spec("examples/workloads/chatbot.yaml")
    capacity = capacity_rps(profile, 0.5, base)
    # Twice that, every request kept (no admission control, patient clients): the engine's own rate.
    patient = base.client.model_copy(update={"timeout": 1e6, "max_retries": 0})
    spec = base.model_copy(update={"arrivals": base.arrivals.model_copy(update={"rate": 2 * capacity}),
                                   "client": patient})
    run = Simulator(profile, time_scale=0.5, client=spec.client, seed=1).run(generate(spec, 1200.0, 1), None)
    ends = sorted(r.at + r.e2e for r in run.results if r.e2e is not None)
    completed = sum(1 for end in ends if 200 <= end <= 1200) / 1000
    assert completed == pytest.approx(capacity, rel=0.08)
    assert capacity_rps(profile, 1.0, base) == pytest.approx(capacity / 2)


def test_capacity_without_a_sample_spreads_outputs_and_refuses_a_batch_size() -> None:
    rate = capacity_for_mix(LLAMA_13B_A100_V0, 1.0, 300, 440)
    assert 0 < rate < capacity_for_mix(LLAMA_13B_A100_V0, 1.0, 300, 50)
    with pytest.raises(ValueError, match="a batch size applies to vLLM-like dynamics only"):
        capacity_for_mix(LLAMA_13B_A100_V0, 1.0, 300, 440, batch=32)

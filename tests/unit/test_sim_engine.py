"""The simulated engine's timing model, on a virtual clock: no sockets, no sleeping."""

from __future__ import annotations

import dataclasses
import math
import random
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from types import FrameType
from typing import Any

import pytest

from extproc.sim import batch as batch_module
from extproc.sim import engine as engine_module
from extproc.sim import latencies as latencies_module
from extproc.sim.engine import Engine, Event, Finished, FirstToken, RequestRejected
from extproc.sim.profiles import (
    LLAMA_8B_H100,
    LLAMA_8B_L4,
    LLAMA_70B_2XH100,
    PROFILES,
    TEST,
    Profile,
    get_profile,
)

Arrival = tuple[float, str, int, int]  # (time, id, prompt tokens, output tokens)


def drive(engine: Engine, arrivals: list[Arrival], cancels: list[tuple[float, str]] | None = None,
          capacity: list[tuple[float, float]] | None = None) -> list[Event]:
    """Feed arrivals, cancels and capacity changes at their times; run until the engine is idle.

    Inputs due no later than the engine's next event go in first (``add`` keeps the events it
    passes for the next ``advance``), so a burst at one instant is scheduled together.
    """
    inputs: list[tuple[float, Callable[[], object]]] = [
        (at, partial(engine.add, rid, prompt, output, at)) for at, rid, prompt, output in arrivals
    ]
    inputs += [(at, partial(engine.cancel, rid, at)) for at, rid in cancels or []]
    inputs += [(at, partial(engine.set_capacity, f, at)) for at, f in capacity or []]
    inputs.sort(key=lambda x: x[0])
    events: list[Event] = []
    i = 0
    while True:
        nxt = engine.next_event_time()
        if i < len(inputs) and (nxt is None or inputs[i][0] <= nxt):
            inputs[i][1]()
            i += 1
        elif nxt is not None:
            events += engine.advance(nxt)
        else:
            return events


def finished(events: list[Event]) -> dict[str, Finished]:
    return {e.req_id: e for e in events if isinstance(e, Finished)}


def per_token(f: Finished) -> float:
    return (f.e2e - f.ttft) / (f.output_tokens - 1)


# -- the profiles --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("profile", "batch", "ms"), [
    (LLAMA_8B_H100, 1, 4.6), (LLAMA_8B_H100, 250, 16.0),
    (LLAMA_70B_2XH100, 1, 19.0), (LLAMA_70B_2XH100, 100, 93.0),
    (LLAMA_8B_L4, 1, 18.0), (LLAMA_8B_L4, 64, 60.0),
])
def test_profile_step_times_match_the_published_numbers(profile: Profile, batch: int, ms: float) -> None:
    assert profile.step_seconds(batch) * 1000 == pytest.approx(ms, rel=0.02)


def test_step_time_interpolates_and_extrapolates_monotonically() -> None:
    times = [LLAMA_8B_H100.step_seconds(b) for b in range(1, LLAMA_8B_H100.max_running + 1)]
    assert times == sorted(times)
    assert LLAMA_8B_H100.step_seconds(256) > LLAMA_8B_H100.step_seconds(250)
    assert TEST.step_seconds(2) == pytest.approx(0.012)


def test_profiles_are_registered_and_validated() -> None:
    assert {"llama-8b-h100", "llama-70b-2xh100", "llama-8b-l4", "test"} <= set(PROFILES)
    assert get_profile("test") is TEST
    assert get_profile("llama-8b-l4") is LLAMA_8B_L4
    with pytest.raises(ValueError, match="unknown profile 'nope'; known: "):
        get_profile("nope")
    with pytest.raises(ValueError, match="strictly increasing"):
        dataclasses.replace(TEST, decode_ms=((4, 10.0), (1, 12.0)))
    with pytest.raises(ValueError, match="leave a block free"):
        dataclasses.replace(TEST, max_model_len=TEST.kv_cache_tokens)
    with pytest.raises(ValueError, match="max_batched_tokens"):
        dataclasses.replace(TEST, max_batched_tokens=TEST.max_running)
    with pytest.raises(dataclasses.FrozenInstanceError):
        TEST.max_running = 9  # type: ignore[misc]


# -- timing against the profile numbers ------------------------------------------------------------


@pytest.mark.parametrize("profile", [LLAMA_8B_H100, LLAMA_70B_2XH100])
def test_alone_a_request_sees_the_batch_one_latency_and_the_prefill_rate(profile: Profile) -> None:
    events = drive(Engine(profile), [(0.0, "a", 3000, 201)])
    f = finished(events)["a"]
    step1 = profile.step_seconds(1)
    assert f.queue_time == 0
    assert f.ttft == pytest.approx(3000 / profile.prefill_tokens_per_s + step1, rel=1e-9)
    assert per_token(f) == pytest.approx(step1, rel=1e-9)
    assert f.e2e == pytest.approx(f.ttft + 200 * step1, rel=1e-9)


@pytest.mark.parametrize(("profile", "batch", "ms"),
                         [(LLAMA_8B_H100, 250, 16.0), (LLAMA_70B_2XH100, 100, 93.0)])
def test_per_token_latency_near_the_maximum_batch_matches_the_profile(profile: Profile, batch: int,
                                                                      ms: float) -> None:
    # Prompts of 10 tokens fit one step's budget, so the batch decodes together from the start.
    events = drive(Engine(profile), [(0.0, str(i), 10, 400) for i in range(batch)])
    done = finished(events)
    assert len(done) == batch
    for f in done.values():
        assert per_token(f) * 1000 == pytest.approx(ms, rel=0.02)


def test_the_l4_cache_fills_with_a_few_dozen_long_requests() -> None:
    # 40k KV tokens: at most twenty 2000-token contexts run at once, though there are 64 slots.
    engine = Engine(LLAMA_8B_L4)
    for i in range(40):
        engine.add(str(i), 2000, 300, 0.0)
    events: list[Event] = []
    peak, blocked_by_kv = 0, False
    while (nxt := engine.next_event_time()) is not None:
        events += engine.advance(nxt)
        peak = max(peak, engine.running)
        blocked_by_kv |= engine.waiting > 0 and engine.running < LLAMA_8B_L4.max_running
        assert engine.kv_tokens <= LLAMA_8B_L4.kv_cache_tokens
    assert 10 < peak <= LLAMA_8B_L4.kv_cache_tokens // 2000
    assert blocked_by_kv
    assert len(finished(events)) == 40


def test_per_token_latency_grows_with_the_batch() -> None:
    latencies = []
    for batch in (1, 16, 64, 200):
        done = finished(drive(Engine(LLAMA_8B_H100), [(0.0, str(i), 10, 100) for i in range(batch)]))
        latencies.append(max(per_token(f) for f in done.values()))
    assert latencies == sorted(latencies)
    assert latencies[-1] > 2.5 * latencies[0]


def test_ttft_grows_with_prefill_length() -> None:
    ttfts = [finished(drive(Engine(TEST), [(0.0, "a", prompt, 5)]))["a"].ttft for prompt in (10, 200, 900)]
    assert ttfts == sorted(ttfts)
    assert ttfts[2] - ttfts[0] == pytest.approx(890 / TEST.prefill_tokens_per_s, rel=1e-9)


def test_ttft_grows_with_the_queue_ahead() -> None:
    # Eight equal requests at once, four slots: the second four wait for the first four to finish.
    events = drive(Engine(TEST), [(0.0, str(i), 100, 50) for i in range(8)])
    done = finished(events)
    first, second = [done[str(i)] for i in range(4)], [done[str(i)] for i in range(4, 8)]
    assert all(f.queue_time == 0 for f in first)
    assert all(f.queue_time > 0 for f in second)
    assert min(f.ttft for f in second) >= max(f.e2e for f in first)
    assert min(f.ttft for f in second) > 10 * max(f.ttft for f in first)


def test_long_prompts_are_prefilled_in_chunks_and_stall_decoding() -> None:
    p = LLAMA_8B_H100
    alone = finished(drive(Engine(p), [(0.0, "long", 20_000, 2)]))["long"]
    chunks = 3  # 20k tokens through an 8192-token step budget
    assert alone.ttft == pytest.approx(20_000 / p.prefill_tokens_per_s + chunks * p.step_seconds(1), rel=1e-9)
    # A short request decoding meanwhile waits for each prefill chunk: its per-token latency jumps.
    mixed = finished(drive(Engine(p), [(0.0, "short", 10, 50), (0.001, "long", 20_000, 2)]))
    assert per_token(mixed["short"]) > 3 * p.step_seconds(2)


# -- capacity ---------------------------------------------------------------------------------------


def test_kv_capacity_limits_the_running_batch() -> None:
    engine = Engine(TEST)
    for i in range(4):  # four slots, but only three 600-token prompts fit 2048 KV tokens
        engine.add(str(i), 600, 10, 0.0)
    assert engine.next_event_time() == 0.0
    assert engine.advance(0.0) == []
    assert engine.running == 3
    assert engine.waiting == 1
    assert 0.85 < engine.kv_usage <= 1.0
    events = drive(engine, [])
    assert finished(events)["3"].queue_time > 0


def test_max_running_limits_the_batch_when_kv_has_room() -> None:
    engine = Engine(TEST)
    for i in range(6):
        engine.add(str(i), 10, 10, 0.0)
    engine.advance(0.0)
    assert (engine.running, engine.waiting) == (4, 2)


def test_kv_overflow_preempts_the_newest_sequence_and_it_still_completes() -> None:
    engine = Engine(TEST)
    events = drive(engine, [(0.0, str(i), 600, 200) for i in range(3)])
    done = finished(events)
    assert engine.preemptions >= 1
    assert done["2"].preemptions >= 1
    assert done["0"].preemptions == 0
    assert all(f.output_tokens == 200 for f in done.values())
    assert sum(isinstance(e, FirstToken) for e in events) == 3  # a preemption emits no second first token


def test_kv_usage_never_exceeds_capacity() -> None:
    rng = random.Random(3)
    engine = Engine(TEST)
    t = 0.0
    for i in range(300):
        t += rng.expovariate(40)
        engine.advance(t)
        engine.add(str(i), rng.randint(1, 700), rng.randint(1, 300), t)
        assert engine.kv_tokens <= TEST.kv_cache_tokens
        assert engine.running <= TEST.max_running
    while (nxt := engine.next_event_time()) is not None:
        engine.advance(nxt)
        assert engine.kv_tokens <= TEST.kv_cache_tokens
    assert (engine.running, engine.waiting, engine.kv_tokens) == (0, 0, 0)


def test_requests_that_can_never_run_are_rejected() -> None:
    engine = Engine(TEST)
    with pytest.raises(RequestRejected, match="maximum context length is 1024 tokens"):
        engine.add("a", 1000, 100, 0.0)
    with pytest.raises(RequestRejected):
        engine.add("b", 10, 0, 0.0)
    engine.add("c", 10, 10, 0.0)
    with pytest.raises(ValueError, match="already"):
        engine.add("c", 10, 10, 0.0)
    with pytest.raises(ValueError, match="backwards"):
        engine.advance(-1.0)


# -- cancel, time scale, determinism -----------------------------------------------------------------


def test_cancel_frees_capacity_for_the_waiting_queue() -> None:
    arrivals = [(0.0, str(i), 10, 100) for i in range(5)]  # four slots: "4" waits
    baseline = finished(drive(Engine(TEST), arrivals))
    cancelled = drive(Engine(TEST), arrivals, cancels=[(0.05, "0")])
    done = finished(cancelled)
    assert "0" not in done
    assert all(e.req_id != "0" for e in cancelled if isinstance(e, FirstToken) and e.time > 0.05)
    assert done["4"].ttft < baseline["4"].ttft / 3
    # It joins at the end of the step in progress and gets its first token one step later.
    assert done["4"].ttft <= 0.05 + 2 * TEST.step_seconds(4) + 10 / TEST.prefill_tokens_per_s


def test_cancel_of_a_waiting_or_unknown_request() -> None:
    engine = Engine(TEST)
    for i in range(5):
        engine.add(str(i), 10, 10, 0.0)
    assert engine.cancel("4", 0.001)
    assert not engine.cancel("4", 0.001)
    assert not engine.cancel("nope", 0.001)
    assert "4" not in finished(drive(engine, []))


def test_time_scale_scales_every_duration() -> None:
    rng = random.Random(5)
    arrivals, t = [], 0.0
    for i in range(200):
        t += rng.expovariate(30)
        arrivals.append((t, str(i), rng.randint(5, 500), rng.randint(1, 200)))
    slow = finished(drive(Engine(TEST), arrivals))
    fast = finished(drive(Engine(TEST, time_scale=0.1), [(a * 0.1, i, p, o) for a, i, p, o in arrivals]))
    assert slow.keys() == fast.keys()
    for key, f in slow.items():
        assert fast[key].ttft == pytest.approx(f.ttft * 0.1, rel=1e-6, abs=1e-12)
        assert fast[key].e2e == pytest.approx(f.e2e * 0.1, rel=1e-6)
    with pytest.raises(ValueError, match="time_scale"):
        Engine(TEST, time_scale=0)


def test_same_inputs_give_the_same_events() -> None:
    def once() -> list[Event]:
        rng = random.Random(11)
        arrivals, t = [], 0.0
        for i in range(500):
            t += rng.expovariate(50)
            arrivals.append((t, str(i), rng.randint(5, 700), rng.randint(1, 300)))
        return drive(Engine(TEST), arrivals, cancels=[(1.0, "10"), (2.0, "200")])

    assert once() == once()


def test_progress_counts_tokens_between_events() -> None:
    engine = Engine(TEST)
    engine.add("a", 10, 100, 0.0)
    ttft = 10 / TEST.prefill_tokens_per_s + TEST.step_seconds(1)
    engine.advance(ttft + 10.5 * TEST.step_seconds(1))
    assert engine.progress("a") == 11
    assert engine.next_event_time() == pytest.approx(ttft + 99 * TEST.step_seconds(1))


# -- the fast-forward against a plain step-by-step model ------------------------------------------


@dataclass
class _RefSeq:
    rid: str
    prompt: int
    output: int
    arrival: float
    generated: int = 0
    prefill_left: int = 0
    scheduled: float | None = None
    first: float | None = None
    last: float | None = None
    pre: int = 0


@dataclass
class _Reference:
    """One step at a time, every sequence touched every step, capacity applied between steps."""

    p: Profile
    fraction: float = 1.0
    waiting: deque[_RefSeq] = field(default_factory=deque)
    running: list[_RefSeq] = field(default_factory=list)
    events: list[tuple[str, str, float]] = field(default_factory=list)
    itls: list[tuple[float, float]] = field(default_factory=list)  # (time, interval)
    ttfts: list[tuple[float, float]] = field(default_factory=list)  # (time, ttft)

    @property
    def kv_cap(self) -> int:
        return max(math.floor(self.fraction * self.p.kv_cache_tokens + 1e-9),
                   self.p.max_model_len + self.p.block_size)

    @property
    def max_run(self) -> int:
        return max(1, math.floor(self.fraction * self.p.max_running + 1e-9))

    def kv(self) -> int:
        return sum(s.prompt + s.generated for s in self.running)

    def step(self, t: float) -> float | None:
        p, decoding = self.p, [s for s in self.running if s.prefill_left == 0]
        while True:
            budget, chunks = p.max_batched_tokens - len(decoding), []
            for s in self.running:
                if s.prefill_left and budget > 0:
                    chunks.append((s, min(s.prefill_left, budget)))
                    budget -= chunks[-1][1]
            growth = len(decoding) + sum(n == s.prefill_left for s, n in chunks)
            fits = self.kv() + growth <= self.kv_cap and len(self.running) <= self.max_run
            if fits or not self.running:
                break
            victim = self.running.pop()
            if victim.prefill_left == 0:
                victim.last = t
            victim.prefill_left, victim.pre = 0, victim.pre + 1
            self.waiting.appendleft(victim)
            decoding = [s for s in self.running if s.prefill_left == 0]
        while self.waiting and budget > 0 and len(self.running) < self.max_run:
            s = self.waiting[0]
            ctx = s.prompt + s.generated
            if self.kv() + growth + ctx + p.block_size > self.kv_cap:
                break
            self.waiting.popleft()
            self.running.append(s)
            s.prefill_left = ctx
            s.scheduled = t if s.scheduled is None else s.scheduled
            chunks.append((s, min(ctx, budget)))
            budget -= chunks[-1][1]
            growth += chunks[-1][1] == ctx
        if not decoding and not chunks:
            return None
        prefill = sum(n for _, n in chunks) / p.prefill_tokens_per_s
        end = t + (p.step_seconds(len(decoding) + len(chunks)) + prefill) / self.fraction
        for s in decoding:
            s.generated += 1
            self.itls.append((end, end - t))
            s.last = end
        for s, n in chunks:
            s.prefill_left -= n
            if s.prefill_left == 0:
                s.generated += 1
                if s.first is None:
                    s.first = end
                    self.events.append(("first", s.rid, end))
                    self.ttfts.append((end, end - s.arrival))
                else:
                    assert s.last is not None
                    self.itls.append((end, end - s.last))
                s.last = end
        for s in [s for s in self.running if s.prefill_left == 0 and s.generated >= s.output]:
            self.running.remove(s)
            self.events.append(("done", s.rid, end))
        return end

    def cancel(self, rid: str) -> None:
        for group in (self.waiting, self.running):
            for s in [s for s in group if s.rid == rid]:
                group.remove(s)

    def set_fraction(self, fraction: float) -> None:
        self.fraction = fraction

    def run(self, arrivals: list[Arrival], cancels: list[tuple[float, str]],
            capacity: list[tuple[float, float]]) -> list[tuple[str, str, float]]:
        inputs: list[tuple[float, Callable[[], None]]] = [
            (at, partial(self.waiting.append, _RefSeq(rid, prompt, output, at)))
            for at, rid, prompt, output in arrivals
        ]
        inputs += [(at, partial(self.cancel, rid)) for at, rid in cancels]
        inputs += [(at, partial(self.set_fraction, f)) for at, f in capacity]
        inputs.sort(key=lambda x: x[0])
        t: float | None = None
        for at, apply in inputs:
            while t is not None and t <= at:
                t = self.step(t)
            apply()
            if t is None:
                t = self.step(at)
        while t is not None:
            t = self.step(t)
        return self.events


Workload = tuple[list[Arrival], list[tuple[float, str]], list[tuple[float, float]]]


def _workload(seed: int, n: int = 150) -> Workload:
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(25)
        arrivals.append((t, f"r{i}", rng.randint(1, 800), rng.randint(1, 220)))
    cancels = [(rng.uniform(0, t), f"r{rng.randrange(n)}") for _ in range(10)]
    changes = sorted(rng.uniform(0, t) for _ in range(6))
    capacity = [(at, rng.choice((0.25, 0.5, 0.75, 1.0))) for at in changes]
    return arrivals, cancels, capacity


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fast_forward_agrees_with_a_step_by_step_model(seed: int) -> None:
    profile = dataclasses.replace(TEST, max_batched_tokens=512)  # force chunked prefills too
    arrivals, cancels, _ = _workload(seed)
    expected = _Reference(profile).run(arrivals, cancels, [])
    engine = Engine(profile)
    got = [("first" if isinstance(e, FirstToken) else "done", e.req_id, e.time)
           for e in drive(engine, arrivals, cancels)]
    assert engine.preemptions > 0  # the workload reaches every path: chunks, preemption, cancel
    # Times agree to float rounding (the engine multiplies where the reference adds step by step).
    assert sorted((k, r) for k, r, _ in got) == sorted((k, r) for k, r, _ in expected)
    want = {(k, r): at for k, r, at in expected}
    for kind, rid, at in got:
        assert at == pytest.approx(want[kind, rid], rel=1e-9), (kind, rid)
    assert any(kind == "done" for kind, _, _ in got)


def engine_lines(arrivals: list[Arrival]) -> int:
    """Lines of the engine's code (its modules: the step loop, the batch, the latency record) run
    to simulate ``arrivals`` to the end: its work, counted the same on any machine (a timing would
    measure the machine too)."""
    files = {module.__file__ for module in (engine_module, batch_module, latencies_module)}
    lines = 0

    def line(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal lines
        lines += event == "line"
        return line

    def call(frame: FrameType, event: str, arg: Any) -> Any:
        return line if frame.f_code.co_filename in files else None

    previous = sys.gettrace()
    sys.settrace(call)
    try:
        done = finished(drive(Engine(LLAMA_8B_H100), arrivals))
    finally:
        sys.settrace(previous)
    assert len(done) == len(arrivals)
    return lines


def test_simulation_cost_is_per_request_not_per_token() -> None:
    rng = random.Random(7)
    arrivals, t = [], 0.0
    for i in range(3_000):
        t += rng.expovariate(25)
        arrivals.append((t, str(i), rng.randint(50, 1000), 2000 if rng.random() < 0.1 else 50))
    longer = [(at, rid, prompt, 10 * output) for at, rid, prompt, output in arrivals]
    # Ten times the tokens (7.3M instead of 0.73M), and the batches' steps go up 19-fold: the
    # engine's work not even twice (here 1.3M lines of its code against 0.72M). Work per token, or
    # per step, would grow ten- or twenty-fold.
    assert engine_lines(longer) < 3 * engine_lines(arrivals)

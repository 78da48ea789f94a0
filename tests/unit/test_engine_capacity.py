"""The engine at a fraction of its capacity, its capacity schedules, and its recent-latency record."""

from __future__ import annotations

import dataclasses
import math

import pytest

from extproc.sim.engine import (
    LATENCY_HISTORY_S,
    Engine,
    FirstToken,
    parse_capacity_schedule,
)
from extproc.sim.profiles import TEST
from tests.unit.test_sim_engine import _Reference, _workload, drive, finished, per_token

#: TEST with room to halve: at F=0.5 it has 4 slots and 2048 KV tokens, above the one-request floor.
ROOMY = dataclasses.replace(TEST, kv_cache_tokens=4096, max_running=8)


def nearest_rank(values: list[float], q: float = 0.95) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


# -- schedules ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("0:1,60:0.5,120:1", ((0.0, 1.0), (60.0, 0.5), (120.0, 1.0))),
    ("30:0.25", ((30.0, 0.25),)),
    (" 0:1 , 1.5:0.5 ", ((0.0, 1.0), (1.5, 0.5))),
    ("0:1e-3", ((0.0, 0.001),)),
])
def test_schedules_parse(text: str, expected: tuple[tuple[float, float], ...]) -> None:
    assert parse_capacity_schedule(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("", "capacity schedule is empty"),
    ("  ", "capacity schedule is empty"),
    ("0:1,", "entry 2 '': expected T:F"),
    ("60-0.5", "entry 1 '60-0.5': expected T:F"),
    ("60:", "expected T:F"),
    (":0.5", "expected T:F"),
    ("a:1", "entry 1 'a:1': T and F must be numbers"),
    ("0:1,60:half", "entry 2 '60:half': T and F must be numbers"),
    ("0:1:2", "T and F must be numbers"),
    ("0:0", "fraction must be in (0, 1]"),
    ("0:1.5", "fraction must be in (0, 1]"),
    ("0:-0.5", "fraction must be in (0, 1]"),
    ("0:nan", "fraction must be in (0, 1]"),
    ("-1:0.5", "time must be a finite number of seconds ≥ 0"),
    ("inf:0.5", "time must be a finite number"),
    ("nan:0.5", "time must be a finite number"),
    ("0:1,0:0.5", "entry 2 '0:0.5': times must be strictly increasing (the entry before is at 0s)"),
    ("10:1,60:0.5,30:1", "entry 3 '30:1': times must be strictly increasing (the entry before is at 60s)"),
])
def test_bad_schedules_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"^capacity schedule") as info:
        parse_capacity_schedule(text)
    assert message in str(info.value)


def test_half_capacity_halves_slots_and_kv_and_doubles_step_times() -> None:
    engine = Engine(ROOMY)
    assert (engine.capacity, engine.max_running, engine.kv_capacity_tokens) == (1, 8, 4096)
    engine.set_capacity(0.5, 0.0)
    assert (engine.capacity, engine.max_running, engine.kv_capacity_tokens) == (0.5, 4, 2048)
    for i in range(8):
        engine.add(str(i), 10, 10, 0.0)
    engine.advance(0.0)
    assert (engine.running, engine.waiting) == (4, 4)

    alone = finished(drive(Engine(ROOMY), [(0.0, "a", 300, 51)]))["a"]
    slow_engine = Engine(ROOMY)
    slow_engine.set_capacity(0.5, 0.0)
    slow = finished(drive(slow_engine, [(0.0, "a", 300, 51)]))["a"]
    assert slow.ttft == pytest.approx(2 * alone.ttft, rel=1e-9)
    assert per_token(slow) == pytest.approx(2 * ROOMY.step_seconds(1), rel=1e-9)
    assert per_token(alone) == pytest.approx(ROOMY.step_seconds(1), rel=1e-9)


def test_half_kv_limits_the_batch_by_memory() -> None:
    engine = Engine(ROOMY)
    engine.set_capacity(0.5, 0.0)
    for i in range(4):  # four slots at F=0.5, but only three 600-token prompts fit 2048 KV tokens
        engine.add(str(i), 600, 10, 0.0)
    engine.advance(0.0)
    assert (engine.running, engine.waiting) == (3, 1)


def test_capacity_never_shrinks_below_one_longest_request_or_one_slot() -> None:
    engine = Engine(TEST)
    engine.set_capacity(0.1, 0.0)
    assert engine.kv_capacity_tokens == TEST.max_model_len + TEST.block_size  # not 204
    assert engine.max_running == 1
    engine.add("longest", 24, TEST.max_model_len - 24, 0.0)
    done = finished(drive(engine, []))
    assert done["longest"].output_tokens == TEST.max_model_len - 24
    # Floors are taken after a tolerance: 0.29 × 100 slots is 29, not 28.999… → 28.
    wide = Engine(dataclasses.replace(TEST, max_running=100, max_batched_tokens=4096))
    wide.set_capacity(0.29, 0.0)
    assert wide.max_running == 29


def test_bad_fractions_are_refused() -> None:
    engine = Engine(TEST)
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"capacity fraction must be in \(0, 1\]"):
            engine.set_capacity(bad, 0.0)
    engine.advance(1.0)
    with pytest.raises(ValueError, match="backwards"):
        engine.set_capacity(0.5, 0.5)


def test_shrinking_preempts_the_newest_and_every_request_still_finishes_once() -> None:
    engine = Engine(ROOMY)
    arrivals = [(0.0, str(i), 200, 300) for i in range(8)]
    for _, rid, prompt, output in arrivals:
        engine.add(rid, prompt, output, 0.0)
    events = engine.advance(0.0)
    t = 0.0
    while len(events) < 8:  # run until all eight decode
        nxt = engine.next_event_time()
        assert nxt is not None
        t = nxt
        events += engine.advance(t)
    assert engine.running == 8
    mid = t + 20.5 * ROOMY.step_seconds(8)
    engine.set_capacity(0.5, mid)
    # The step in progress ends as planned; the next boundary preempts the four newest.
    assert engine.running == 8
    boundary = engine.next_event_time()
    assert boundary is not None
    assert mid < boundary <= mid + ROOMY.step_seconds(8) + 1e-12
    assert engine.advance(boundary) == []
    assert (engine.running, engine.waiting, engine.preemptions) == (4, 4, 4)
    assert engine.kv_tokens <= engine.kv_capacity_tokens
    assert engine.kv_usage <= 1
    events += drive(engine, [])
    done = finished(events)
    assert sorted(done) == sorted(rid for _, rid, _, _ in arrivals)
    assert all(f.output_tokens == 300 for f in done.values())
    assert sum(isinstance(e, FirstToken) for e in events) == 8  # a preemption emits no second first token
    assert {rid for rid, f in done.items() if f.preemptions} == {"4", "5", "6", "7"}
    assert sum(f.preemptions for f in done.values()) == engine.preemptions == 4
    assert (engine.running, engine.waiting, engine.kv_tokens) == (0, 0, 0)


def test_a_shrink_while_kv_is_full_preempts_by_memory_too() -> None:
    engine = Engine(ROOMY)
    for i in range(4):
        engine.add(str(i), 900, 100, 0.0)  # 3600 KV tokens of 4096
    engine.advance(0.0)
    engine.advance(0.5)
    assert engine.running == 4
    engine.set_capacity(0.5, 0.5)  # four slots still, but 2048 KV tokens hold two of them
    boundary = engine.next_event_time()
    assert boundary is not None
    engine.advance(boundary)
    assert engine.running == 2
    assert engine.kv_tokens <= 2048
    done = finished(drive(engine, []))
    assert sorted(done) == ["0", "1", "2", "3"]


def test_back_to_full_capacity_restores_everything() -> None:
    engine = Engine(ROOMY)
    engine.set_capacity(0.5, 0.0)
    engine.set_capacity(0.25, 1.0)
    engine.set_capacity(1.0, 2.0)
    assert (engine.capacity, engine.max_running, engine.kv_capacity_tokens) == (1, 8, 4096)
    restored = finished(drive(engine, [(3.0, "a", 300, 51)]))["a"]
    fresh = finished(drive(Engine(ROOMY), [(0.0, "a", 300, 51)]))["a"]
    assert restored.ttft == pytest.approx(fresh.ttft, rel=1e-9)
    assert per_token(restored) == pytest.approx(per_token(fresh), rel=1e-9)
    # Growing back while requests wait admits them at the next step boundary.
    engine = Engine(ROOMY)
    engine.set_capacity(0.5, 0.0)
    for i in range(8):
        engine.add(str(i), 10, 400, 0.0)
    engine.advance(0.0)
    assert (engine.running, engine.waiting) == (4, 4)
    engine.set_capacity(1.0, 0.1)
    boundary = engine.next_event_time()
    assert boundary is not None
    assert boundary <= 0.1 + 2 * ROOMY.step_seconds(4)
    engine.advance(boundary)
    assert (engine.running, engine.waiting) == (8, 0)


def test_the_same_fraction_again_changes_nothing() -> None:
    arrivals = [(0.0, str(i), 50, 200) for i in range(6)]
    plain = drive(Engine(ROOMY), arrivals)
    again = drive(Engine(ROOMY), arrivals, capacity=[(0.3, 1.0), (0.7, 1.0)])
    assert plain == again


# -- the capacity changes against a plain step-by-step model -------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_capacity_changes_agree_with_a_step_by_step_model(seed: int) -> None:
    profile = dataclasses.replace(ROOMY, max_batched_tokens=512)  # chunked prefills too
    arrivals, cancels, capacity = _workload(seed)
    reference = _Reference(profile)
    expected = reference.run(arrivals, cancels, capacity)
    engine = Engine(profile, keep_latencies=True)
    got = [("first" if isinstance(e, FirstToken) else "done", e.req_id, e.time)
           for e in drive(engine, arrivals, cancels, capacity)]
    assert engine.preemptions > 0
    assert sorted((k, r) for k, r, _ in got) == sorted((k, r) for k, r, _ in expected)
    want = {(k, r): at for k, r, at in expected}
    for kind, rid, at in got:
        assert at == pytest.approx(want[kind, rid], rel=1e-9), (kind, rid)
    # The recent percentiles match the reference's own samples over a few windows.
    end = max(at for _, _, at in got)  # the engine's clock (the reference's may differ by a rounding)
    for now, window in ((end, 1.0), (end, 3.0), (end, LATENCY_HISTORY_S), (end + 0.5, 2.0)):
        lo = now - window
        itl = nearest_rank([v for at, v in reference.itls if lo < at <= now])
        ttft = nearest_rank([v for at, v in reference.ttfts if lo < at <= now])
        got_itl, got_ttft = engine.recent_itl_p95(now, window), engine.recent_ttft_p95(now, window)
        assert (got_itl is None) == (itl is None)
        assert (got_ttft is None) == (ttft is None)
        if itl is not None:
            assert got_itl == pytest.approx(itl, rel=1e-6)
        if ttft is not None:
            assert got_ttft == pytest.approx(ttft, rel=1e-6)


def test_every_token_after_the_first_is_one_interval_through_preemptions() -> None:
    arrivals, _, capacity = _workload(7, n=200)
    seen: list[tuple[float, int]] = []
    engine = Engine(ROOMY, on_interval=lambda seconds, count: seen.append((seconds, count)))
    done = finished(drive(engine, arrivals, capacity=capacity))
    assert engine.preemptions > 0
    assert len(done) == len(arrivals)
    assert sum(count for _, count in seen) == sum(f.output_tokens - 1 for f in done.values())
    # A request's intervals add up to the time from its first token to its last.
    assert sum(s * c for s, c in seen) == pytest.approx(sum(f.e2e - f.ttft for f in done.values()), rel=1e-9)
    assert all(s > 0 and c > 0 for s, c in seen)


# -- recent latencies -------------------------------------------------------------------------------------


def test_recent_percentiles_are_none_without_data_in_the_window() -> None:
    engine = Engine(TEST, keep_latencies=True)
    assert engine.recent_ttft_p95(0.0) is None
    assert engine.recent_itl_p95(0.0) is None
    drive(engine, [(0.0, "a", 10, 20)])
    assert engine.recent_ttft_p95(1.0, window=5) == pytest.approx(10 / TEST.prefill_tokens_per_s
                                                                  + TEST.step_seconds(1))
    assert engine.recent_itl_p95(1.0, window=5) == pytest.approx(TEST.step_seconds(1))
    assert engine.recent_ttft_p95(100.0, window=5) is None
    assert engine.recent_itl_p95(100.0, window=5) is None
    for bad in (0.0, -1.0, LATENCY_HISTORY_S + 1):
        with pytest.raises(ValueError, match="window must be in"):
            engine.recent_itl_p95(100.0, window=bad)


def test_recent_itl_sees_a_long_decode_while_it_runs() -> None:
    engine = Engine(TEST, keep_latencies=True)
    engine.add("long", 10, 1000 - 10, 0.0)
    engine.advance(0.0)
    step = TEST.step_seconds(1)
    ttft = 10 / TEST.prefill_tokens_per_s + step
    # No event between the first token and the last: the record still sees the steps so far.
    now = ttft + 100.5 * step
    assert engine.recent_itl_p95(now, window=10) == pytest.approx(step)
    # Only steps inside the window count: a window of 3.5 steps holds 3 step ends, all the same.
    assert engine.recent_itl_p95(now, window=3.5 * step) == pytest.approx(step)
    assert engine.progress("long") == 101


def test_recent_itl_weighs_by_tokens_and_sees_a_slowdown() -> None:
    engine = Engine(ROOMY, keep_latencies=True)
    engine.add("a", 10, 900, 0.0)
    engine.advance(0.0)
    step = ROOMY.step_seconds(1)
    engine.advance(2.0)
    assert engine.recent_itl_p95(2.0, window=1.0) == pytest.approx(step)
    engine.set_capacity(0.5, 2.0)
    # About 200 intervals of one step, then a handful of two: under 5 % slow, p95 is still fast …
    assert engine.recent_itl_p95(2.1, window=5.0) == pytest.approx(step)
    # … about 20 of two steps out of 220 is over 5 %: p95 is the slow step.
    assert engine.recent_itl_p95(2.4, window=5.0) == pytest.approx(2 * step)
    assert engine.recent_itl_p95(2.4, window=0.3) == pytest.approx(2 * step)


def test_recent_ttft_p95_is_the_nearest_rank_over_the_window() -> None:
    engine = Engine(TEST, keep_latencies=True)
    # One at a time, each alone: the TTFT is its prefill plus one step, and grows with the prompt.
    arrivals = [(float(i), str(i), 10 * (i + 1), 2) for i in range(40)]
    events = drive(engine, arrivals)
    firsts = [e for e in events if isinstance(e, FirstToken)]
    now = 40.0
    for window in (5.0, 20.0, 100.0):
        expected = nearest_rank([e.ttft for e in firsts if e.time > now - window])
        assert engine.recent_ttft_p95(now, window) == pytest.approx(expected)


def test_an_engine_made_without_a_latency_record_says_so() -> None:
    # The live backend exports histograms through on_interval and keeps no record (nobody reads it).
    engine = Engine(TEST)
    drive(engine, [(0.0, "a", 10, 5)])
    with pytest.raises(RuntimeError, match="keep_latencies=True"):
        engine.recent_itl_p95(1.0)

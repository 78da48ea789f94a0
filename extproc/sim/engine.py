"""A continuous-batching inference engine (like vLLM's) as a pure discrete-event model.

How this works: the engine runs in *steps*. At the start of a step the scheduler
(1) makes sure the KV cache can take one more token for every decoding sequence,
preempting the newest sequences if not (vLLM's recompute preemption: they lose
their cache and go back to the head of the waiting queue); (2) gives the step's
token budget to sequences still prefilling, then admits waiting requests in FIFO
order while there is a free sequence slot, budget, and KV room for the whole
prompt plus one block. A step lasts ``step_seconds(batch) + prefilled_tokens ×
prefill cost`` (times the time scale); at its end every decoding sequence has one
more token, and a sequence whose prefill completed has its first token.

Between two interesting steps — a prefill, a finish, a KV overflow — the batch
does not change, so those steps are identical. The engine plans such a *run* of
steps at once and applies any number of them in O(1): the cost of a simulation
is per request, not per token, which lets the offline simulator replay 100k
requests in seconds. Every call takes an explicit ``now``; nothing here reads a
clock or does I/O, so the same model runs behind the live HTTP backend (asyncio,
wall clock) and in the what-if simulator (virtual clock).

KV usage is counted in tokens, a running sequence holding its prompt plus the
tokens generated so far, by the batch (:mod:`extproc.sim.batch`) in O(1) per change.

Capacity (``set_capacity(F, now)``, 0 < F ≤ 1) models losing part of the hardware — a GPU
gone from a tensor-parallel group — or a noisy neighbour. At fraction F the KV cache and the
running-sequence cap are ``floor(F × the profile's)`` (never below one ``max_model_len``
request plus a block of KV, nor below one sequence), and every step takes 1/F as long
(prefill included; the per-step token budget is unchanged). The change takes effect at the
first step boundary at or after ``now``: a step the GPU is already running finishes as
planned. At that boundary the scheduler preempts the newest sequences until the batch fits
the new caps, by the same recompute preemption as a KV overflow (back to the head of the
waiting queue, counted in ``preemptions``); nothing is lost or emitted twice. ``F = 1``
restores the profile exactly. :func:`parse_capacity_schedule` reads ``T:F,…`` schedules.

How the server behaves is its profile's :class:`~extproc.sim.dynamics.Dynamics` (vLLM's V1 engine,
as above, unless it says otherwise). Without chunked prefill a step either prefills or decodes:
waiting requests that fit are prefilled whole in a *prefill-only* step (every decoding sequence
waits through it, makes no token and grows no KV), before any decode step; only a decode step
preempts. The batch counts decode steps only, so a stall costs nothing per sequence; the first
decode step after one records each sequence's inter-token latency from its own latest token (before
the stall, or made in it), in O(running) once per stall. With ``admit_every_steps`` N > 1 a running
batch takes waiting requests only once N − 1 decode steps have passed since it last did (or once
``admit_waiting_ratio`` × running wait): a run of identical steps ends there, as at a finish. Gauges
published per step are kept by :class:`~extproc.sim.gauges.StepGauges` (``gauges``).

Recent latencies (``recent_ttft_p95``, ``recent_itl_p95``; kept only for an engine made with
``keep_latencies=True``, as the offline simulator does) are the p95 over a window of what the steps
made, TTFT per request and inter-token latency per token, as vLLM's histograms would give them: the
record and what counts as a sample are in :mod:`extproc.sim.latencies` (read through the engine's
histogram buckets when its ``Dynamics.percentiles`` says so).
"""

from __future__ import annotations

import argparse
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from extproc.sim.batch import Batch, Seq
from extproc.sim.dynamics import Dynamics
from extproc.sim.gauges import Gauges, StepGauges
from extproc.sim.latencies import LATENCY_HISTORY_S, LatencyRecord
from extproc.sim.profiles import Profile


@dataclass(frozen=True, slots=True)
class FirstToken:
    req_id: str
    time: float
    ttft: float
    queue_time: float


@dataclass(frozen=True, slots=True)
class Finished:
    req_id: str
    time: float
    ttft: float
    e2e: float
    queue_time: float
    prompt_tokens: int
    output_tokens: int
    preemptions: int


Event = FirstToken | Finished


class RequestRejected(ValueError):
    """The engine can never run this request (too long for the model, bad lengths)."""


#: Rounding tolerance: a capacity fraction is floored after it (0.29 × 100 slots is 29, not 28).
_EPS = 1e-9

#: Called with (seconds, count): ``count`` inter-token intervals of ``seconds`` each were made.
IntervalObserver = Callable[[float, int], None]


def parse_capacity_schedule(text: str) -> tuple[tuple[float, float], ...]:
    """Parse ``T:F[,T:F…]`` (seconds ≥ 0 strictly increasing, fractions in (0, 1]) into ((T, F), …).

    Before the first entry the fraction is 1. Raises ValueError saying which entry is wrong and why.
    """
    if not text.strip():
        raise ValueError("capacity schedule is empty: expected T:F[,T:F...], e.g. 0:1,60:0.5,120:1")
    schedule: list[tuple[float, float]] = []
    for i, entry in enumerate(text.split(","), 1):
        where = f"capacity schedule entry {i} {entry.strip()!r}"
        t_text, colon, f_text = entry.partition(":")
        if not colon or not t_text.strip() or not f_text.strip():
            raise ValueError(f"{where}: expected T:F (seconds:fraction), e.g. 60:0.5")
        try:
            at, fraction = float(t_text), float(f_text)
        except ValueError:
            raise ValueError(f"{where}: T and F must be numbers") from None
        if not math.isfinite(at) or at < 0:
            raise ValueError(f"{where}: time must be a finite number of seconds ≥ 0")
        if not 0 < fraction <= 1:  # NaN fails this too
            raise ValueError(f"{where}: fraction must be in (0, 1]")
        if schedule and at <= schedule[-1][0]:
            raise ValueError(f"{where}: times must be strictly increasing (the entry before is at "
                             f"{schedule[-1][0]:g}s)")
        schedule.append((at, fraction))
    return tuple(schedule)


def capacity_schedule_arg(text: str) -> tuple[tuple[float, float], ...]:
    """:func:`parse_capacity_schedule` as an argparse ``type`` (a bad schedule is a usage error)."""
    try:
        return parse_capacity_schedule(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _Capacity:
    """What the engine runs on at capacity fraction F: its KV cache, its running-sequence cap and
    the cost of a step (see the module doc)."""

    __slots__ = ("_profile", "_scale", "_step_cache", "fraction", "kv_tokens", "max_running", "prefill_cost")

    def __init__(self, profile: Profile, time_scale: float, fraction: float = 1.0) -> None:
        self._profile = profile
        self.fraction = fraction
        self.kv_tokens = max(math.floor(fraction * profile.kv_cache_tokens + _EPS),
                             min(profile.max_model_len + profile.block_size, profile.kv_cache_tokens))
        self.max_running = max(1, math.floor(fraction * profile.max_running + _EPS))
        #: Seconds of engine time per second of profile time: the time scale, slowed by 1/F.
        self._scale = time_scale / fraction
        self.prefill_cost = profile.prefill_s_per_token * self._scale
        self._step_cache: dict[int, float] = {}

    def step_seconds(self, batch: int) -> float:
        cost = self._step_cache.get(batch)
        if cost is None:
            # Losing part of the GPU slows every step by 1/F (in _scale).
            cost = self._profile.step_seconds(batch) * self._scale
            self._step_cache[batch] = cost
        return cost


def _check_lengths(profile: Profile, prompt_tokens: int, output_tokens: int) -> None:
    """Raise :class:`RequestRejected` for a request the engine can never run."""
    if prompt_tokens < 1 or output_tokens < 1:
        raise RequestRejected("prompt and output must each be at least one token")
    if prompt_tokens + output_tokens > profile.max_model_len:
        raise RequestRejected(
            f"This model's maximum context length is {profile.max_model_len} tokens. However, you "
            f"requested {prompt_tokens + output_tokens} tokens ({prompt_tokens} in the messages, "
            f"{output_tokens} in the completion). Please reduce the length of the messages or completion."
        )


class _Gate:
    """When a running batch takes waiting requests: at every step (vLLM), or once N − 1 decode steps
    passed since it last did unless enough wait (``Dynamics.admit_every_steps``, ``admit_waiting_ratio``)."""

    __slots__ = ("_every", "_ratio", "admitted_at")

    def __init__(self, dynamics: Dynamics) -> None:
        self._every = dynamics.admit_every_steps
        self._ratio = dynamics.admit_waiting_ratio
        self.admitted_at = 0  # decode steps (``Batch.steps``) when the batch last took waiting requests

    def ratio_met(self, running: int, waiting: int, slots: int) -> bool:
        """Enough requests wait, with free slots for them, for the batch to take them at once."""
        return self._ratio is not None and math.floor(running * self._ratio) <= min(waiting, slots - running)

    def steps_left(self, steps: int, running: int, waiting: int, slots: int) -> int:
        """Decode steps until the batch takes waiting requests (0: it takes them now)."""
        if self._every == 1 or not running or self.ratio_met(running, waiting, slots):
            return 0
        return max(0, self.admitted_at + self._every - 1 - steps)


def _latest_token(seq: Seq, decode_end: float) -> float:
    """When decoding ``seq`` made its latest token, the last step that decoded having ended at
    ``decode_end`` (its first token, or a recompute's, may have come in a prefill-only step since)."""
    assert seq.last_token_at is not None
    return max(seq.last_token_at, decode_end)


def _intervals_after_stall(batch: Batch, decode_end: float, end: float) -> list[tuple[float, int]]:
    """(interval, sequences) of the first decode step after prefill-only ones, ended at ``end``: each
    sequence's runs from its own latest token."""
    intervals: dict[float, int] = {}
    for seq in batch.running.values():
        if seq.decoding:
            interval = end - _latest_token(seq, decode_end)
            intervals[interval] = intervals.get(interval, 0) + 1
    return sorted(intervals.items())


class Engine:
    """One model server: ``add`` and ``cancel`` requests, ``advance`` the clock, read the events.

    Drive it with any clock: call ``advance(t)`` at ``t = next_event_time()`` (or any later
    time) and whenever inputs arrive. ``time_scale`` multiplies every cost in the profile.
    """

    def __init__(self, profile: Profile, time_scale: float = 1.0, *,
                 on_interval: IntervalObserver | None = None, keep_latencies: bool = False) -> None:
        """``keep_latencies``: keep the record ``recent_ttft_p95``/``recent_itl_p95`` read (the live
        backend exports histograms through ``on_interval`` instead and need not pay for it)."""
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.profile = profile
        self.time_scale = time_scale
        #: Told of every inter-token interval as the engine's clock passes it (a live histogram).
        self.on_interval = on_interval
        self._capacity = _Capacity(profile, time_scale)
        self._waiting: deque[Seq] = deque()
        self._batch = Batch()
        self._by_id: dict[str, Seq] = {}
        self._uids = 0
        self._clock = float("-inf")
        self._busy = False
        #: A step boundary whose scheduling decision is still open: requests added at exactly
        #: this time join the step that starts then (a burst at one instant is admitted together).
        self._decide_at: float | None = None
        #: The run in progress started at ``_run_start``; ``_run_done`` of its steps are over. Step
        #: ends are always ``_run_start + k × _step_len``: looking at the engine mid-run (which skips
        #: the steps done so far) cannot move a later event, not even by a rounding.
        self._run_start = 0.0
        self._run_done = 0
        self._step_len = 0.0
        self._run_left = 0  # steps left in the current run, the one in progress included
        self._chunks: list[tuple[Seq, int]] = []  # prefill work of the step in progress
        self._pending: list[Event] = []
        self.preemptions = 0
        dynamics = profile.dynamics
        buckets = dynamics.histograms if dynamics.percentiles == "histogram" else None
        self._latencies = LatencyRecord(buckets) if keep_latencies else None
        self._stall_step = False  # the step in progress prefills only: decoding sequences wait
        self._stalled = False  # decoding sequences waited through a prefill-only step since the last decode
        self._decode_end = float("-inf")  # end of the last step that decoded
        self._gate = _Gate(dynamics)
        self._published = StepGauges() if dynamics.gauges_at_steps else None

    # -- state for metrics -------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._batch.running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_tokens(self) -> int:
        return self._batch.kv_tokens

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV cache in use (0..1), as of the last call that took ``now``.

        Measured against the cache the engine has now: just after ``set_capacity`` shrank it the
        batch may hold more until the next step boundary preempts; that reads as 1 (full).
        """
        return min(1.0, self.kv_tokens / self._capacity.kv_tokens)

    def gauges(self, now: float | None = None) -> Gauges:
        """Running, waiting and KV usage as ``/metrics`` shows them: by default the properties, as of
        the last call that took ``now``; published per step (``Dynamics.gauges_at_steps``), as the
        latest step began, the engine brought up to ``now`` first if given (as ``add`` does)."""
        if self._published is None:
            return Gauges(self.running, self.waiting, self.kv_usage)
        if now is not None:
            self._catch_up(now, inclusive=False)
        return self._published.read(self._capacity.kv_tokens)

    @property
    def capacity(self) -> float:
        """The capacity fraction F set last (1 unless ``set_capacity`` said otherwise)."""
        return self._capacity.fraction

    @property
    def kv_capacity_tokens(self) -> int:
        """The KV cache in tokens at the current capacity fraction."""
        return self._capacity.kv_tokens

    @property
    def max_running(self) -> int:
        """The running-sequence cap at the current capacity fraction."""
        return self._capacity.max_running

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._by_id

    def progress(self, req_id: str) -> int:
        """Tokens generated so far for an active request (as of the last ``now``)."""
        seq = self._by_id[req_id]
        return self._batch.generated(seq)

    def next_event_time(self) -> float | None:
        """When the engine next needs ``advance``: a step boundary where something may change.

        None when idle. Between now and then nothing is emitted, though ``progress`` and
        ``kv_usage`` move with every step (``advance`` to any time to read them).
        """
        if self._decide_at is not None:
            return self._decide_at
        if not self._busy:
            return None
        return self._run_end()

    # -- inputs ------------------------------------------------------------------------------------

    def add(self, req_id: str, prompt_tokens: int, output_tokens: int, now: float) -> None:
        """A request arrives; it joins the waiting queue and is scheduled at the next step boundary.

        Events up to ``now`` are kept for the next ``advance``; a step starting at exactly
        ``now`` is decided by that ``advance``, so add every arrival of an instant first.
        """
        if req_id in self._by_id:
            raise ValueError(f"request {req_id!r} is already in the engine")
        _check_lengths(self.profile, prompt_tokens, output_tokens)
        self._catch_up(now, inclusive=False)
        self._uids += 1
        seq = Seq(self._uids, req_id, prompt_tokens, output_tokens, now)
        self._by_id[req_id] = seq
        was_empty = not self._waiting
        self._waiting.append(seq)
        if self._published is not None:
            self._published.waiting_changed(now, 1)
        if not self._busy:
            if self._decide_at is None:
                self._decide_at = now
        elif len(self._batch.running) < self._capacity.max_running and (was_empty or self._gate.ratio_met(
                len(self._batch.running), len(self._waiting), self._capacity.max_running)):
            # The batch may have room for it: stop the run after the step in progress (or where the batch
            # next takes requests). With a queue already waiting, the head is blocked or the run ends there.
            self._run_left = min(self._run_left, max(1, self._gate_steps()))

    def cancel(self, req_id: str, now: float) -> bool:
        """Abort a request (client gone); its slot and KV are free from the next step. False if unknown."""
        self._catch_up(now, inclusive=False)
        seq = self._by_id.pop(req_id, None)
        if seq is None:
            return False
        if seq.uid in self._batch.running:
            self._batch.release(seq)
            if self._busy:
                self._run_left = 1
        else:
            self._waiting.remove(seq)
            if self._published is not None:
                self._published.waiting_changed(now, -1)
        return True

    def advance(self, now: float) -> list[Event]:
        """Apply every step that ended by ``now``; return the events since the last call, in order."""
        self._catch_up(now, inclusive=True)
        events, self._pending = self._pending, []
        return events

    def set_capacity(self, fraction: float, now: float) -> None:
        """Run at ``fraction`` (0 < F ≤ 1) of the profile's capacity from ``now`` (see the module doc).

        Like ``add``, events up to ``now`` are kept for the next ``advance``, and the step starting
        at exactly ``now`` (if its decision is still open) already runs at the new capacity.
        """
        if not 0 < fraction <= 1:
            raise ValueError(f"capacity fraction must be in (0, 1], got {fraction!r}")
        self._catch_up(now, inclusive=False)
        if fraction == self._capacity.fraction:
            return
        self._capacity = _Capacity(self.profile, self.time_scale, fraction)
        if self._busy:
            # The step in progress ends as planned; the next one is planned at the new capacity
            # (and preempts what no longer fits, or admits what now does).
            self._run_left = 1

    # -- recent latencies --------------------------------------------------------------------------

    def recent_ttft_p95(self, now: float, window: float = 60.0) -> float | None:
        """p95 of the TTFTs of requests whose first token came in ``(now - window, now]``; None if none.

        Brings the engine up to ``now`` first, as ``add`` does.
        """
        return self._latencies_to(now, window).ttft_p95(now - window)

    def recent_itl_p95(self, now: float, window: float = 60.0) -> float | None:
        """p95 of the inter-token latencies that ended in ``(now - window, now]``; None if none.

        One sample per generated token after a request's first (see :mod:`extproc.sim.latencies`),
        so a long request weighs by its tokens, as in vLLM's ``inter_token_latency_seconds`` histogram.
        """
        return self._latencies_to(now, window).itl_p95(now - window)

    def _latencies_to(self, now: float, window: float) -> LatencyRecord:
        """The latency record, brought up to ``now``, once ``window`` is known to be one it covers."""
        if self._latencies is None:
            raise RuntimeError("this engine keeps no latency record: make it with keep_latencies=True")
        if not 0 < window <= LATENCY_HISTORY_S:
            raise ValueError(f"window must be in (0, {LATENCY_HISTORY_S:g}] seconds, got {window!r}")
        self._catch_up(now, inclusive=False)
        return self._latencies

    def _record_itl(self, first: float, interval: float, steps: int, sequences: int) -> None:
        """``sequences`` tokens after a first were made at each of ``steps`` step ends from ``first``."""
        if steps <= 0 or sequences <= 0:
            return
        if self._latencies is not None:
            self._latencies.add_itl(first, interval, steps, sequences)
        if self.on_interval is not None:
            self.on_interval(interval, steps * sequences)

    # -- the step loop -----------------------------------------------------------------------------

    def _catch_up(self, now: float, inclusive: bool) -> None:
        if now < self._clock:
            raise ValueError(f"time went backwards: {now} < {self._clock}")
        self._clock = now
        while True:
            if self._decide_at is not None:
                if now < self._decide_at or (now == self._decide_at and not inclusive):
                    return
                at, self._decide_at = self._decide_at, None
                self._schedule(at)
            if not self._busy:
                return
            run_end = self._run_end()
            step_start = self._run_start + self._run_done * self._step_len
            if now >= run_end:
                self._steps_ended(step_start + self._step_len, self._run_left)
                self._end_run(run_end)
                self._busy = False
                self._decide_at = run_end
                continue
            done = int((now - step_start) // self._step_len)
            if done > 0:  # identical decode steps inside the run: skip them all at once
                done = min(done, self._run_left - 1)
                self._steps_ended(step_start + self._step_len, done)
                self._run_done += done
                self._run_left -= done
                if self._published is not None:
                    self._published.stepped(self._run_start + self._run_done * self._step_len, self._run_done)
            return

    def _steps_ended(self, first_end: float, steps: int) -> None:
        """``steps`` steps ended, the first at ``first_end``; decoding sequences made a token at each
        unless the step prefilled only (they waited through it)."""
        batch = self._batch
        if steps <= 0:
            return
        if self._stall_step:
            self._stalled = self._stalled or batch.decoding > 0
            return
        batch.steps += steps
        if self._stalled:  # the first step's intervals run from each sequence's own latest token
            self._stalled = False
            for interval, count in _intervals_after_stall(batch, self._decode_end, first_end):
                self._record_itl(first_end, interval, 1, count)
            first_end, steps = first_end + self._step_len, steps - 1
        self._record_itl(first_end, self._step_len, steps, batch.decoding)
        self._decode_end = first_end + (steps - 1) * self._step_len

    def _run_end(self) -> float:
        return self._run_start + (self._run_done + self._run_left) * self._step_len

    def _finish(self, seq: Seq, now: float) -> None:
        self._batch.release(seq)
        del self._by_id[seq.req_id]
        assert seq.first_token_at is not None
        assert seq.scheduled_at is not None
        self._pending.append(Finished(
            seq.req_id, now, seq.first_token_at - seq.arrival, now - seq.arrival,
            seq.scheduled_at - seq.arrival, seq.prompt, seq.output, seq.preemptions,
        ))

    def _end_run(self, now: float) -> None:
        """The last step of the run ended at ``now``: prefills that completed emit a token; finishes."""
        batch = self._batch
        chunks, self._chunks = self._chunks, []
        for seq, n in chunks:
            if seq.uid not in batch.running:  # cancelled during the step
                continue
            seq.prefill_left -= n
            if seq.prefill_left > 0:
                continue
            batch.complete_prefill(seq)
            if seq.first_token_at is None:
                seq.first_token_at = now
                assert seq.scheduled_at is not None
                self._pending.append(
                    FirstToken(seq.req_id, now, now - seq.arrival, seq.scheduled_at - seq.arrival)
                )
                if self._latencies is not None:
                    self._latencies.add_ttft(now, now - seq.arrival)
            elif seq.last_token_at is not None:  # recomputed after a preemption: one long interval
                self._record_itl(now, now - seq.last_token_at, 1, 1)
            seq.last_token_at = now
            if seq.generated >= seq.output:
                self._finish(seq, now)
            else:
                batch.reserve(seq, decoding=True)
        for live in batch.due():
            self._finish(live, now)

    def _schedule(self, now: float) -> None:
        """Plan the next step (or run of identical steps) starting at ``now``."""
        batch = self._batch
        chunks = self._plan_prefill(now)
        self._stall_step = bool(chunks) and not self.profile.dynamics.chunked_prefill
        size = len(chunks) if self._stall_step else batch.decoding + len(chunks)
        self._busy = size > 0
        if self._busy:
            self._plan_run(now, chunks, size)
        if self._published is not None:
            self._published.decided(len(batch.running), len(self._waiting), batch.kv_tokens,
                                    0 if self._stall_step else batch.decoding)

    def _plan_run(self, now: float, chunks: list[tuple[Seq, int]], size: int) -> None:
        """A step of ``size`` sequences (and these prefill ``chunks``), or a run of identical ones."""
        batch = self._batch
        prefilled = sum(n for _, n in chunks)
        self._chunks = chunks
        self._run_start = now
        self._run_done = 0
        self._step_len = self._capacity.step_seconds(size) + prefilled * self._capacity.prefill_cost
        if chunks:
            self._run_left = 1
            return
        to_finish = batch.steps_to_next_finish()
        room = (self._capacity.kv_tokens - batch.kv_tokens) // batch.decoding
        gate = (self._gate_steps() if self._waiting else 0) or to_finish  # the batch takes requests then
        self._run_left = max(1, min(to_finish, room, gate))

    def _plan_prefill(self, now: float) -> list[tuple[Seq, int]]:
        """The step's prefill work: beside the decode (chunked), or alone if a waiting request fits."""
        if self.profile.dynamics.chunked_prefill:
            chunks, budget, growth = self._preempt_to_fit(now)
            if not self._gate_steps():
                self._admit_waiting(now, chunks, budget, growth)
            return chunks
        chunks = []
        if self._waiting and not self._gate_steps():
            self._admit_waiting(now, chunks, self.profile.max_batched_tokens, 0)
        if not chunks:
            self._preempt_to_fit(now)
        return chunks

    def _gate_steps(self) -> int:  # decode steps until a running batch takes waiting requests (0: now)
        return self._gate.steps_left(self._batch.steps, len(self._batch.running), len(self._waiting),
                                     self._capacity.max_running)

    def _preempt_to_fit(self, now: float) -> tuple[list[tuple[Seq, int]], int, int]:
        """Preempt the newest sequences until the step's growth fits the KV cache and the slot cap.

        Returns the step's prefill chunks so far, the token budget left and the tokens the step adds.
        """
        batch, capacity = self._batch, self._capacity
        while True:
            chunks, budget, completing = batch.plan_prefill(self.profile.max_batched_tokens)
            growth = batch.decoding + completing  # tokens this step adds to the cache
            fits = (batch.kv_tokens + growth <= capacity.kv_tokens
                    and len(batch.running) <= capacity.max_running)
            if fits or not batch.running:
                return chunks, budget, growth
            victim = batch.newest()
            if victim.decoding:  # its latest token was made at the end of the step that just ended
                victim.last_token_at = _latest_token(victim, self._decode_end) if self._stalled else now
            batch.release(victim)
            victim.preemptions += 1
            self.preemptions += 1
            self._waiting.appendleft(victim)

    def _admit_waiting(self, now: float, chunks: list[tuple[Seq, int]], budget: int, growth: int) -> None:
        """Admit waiting requests in FIFO order while a slot, budget and KV room last (onto ``chunks``)."""
        batch, capacity = self._batch, self._capacity
        whole = not self.profile.dynamics.chunked_prefill  # a context is prefilled whole, in one step
        while self._waiting and budget > 0 and len(batch.running) < capacity.max_running:
            seq = self._waiting[0]
            context = seq.prompt + seq.generated
            if batch.kv_tokens + growth + context + self.profile.block_size > capacity.kv_tokens:
                break  # FIFO: the head waits for room, and everyone behind it waits too
            if whole and context > budget:
                break
            self._waiting.popleft()
            self._gate.admitted_at = batch.steps
            batch.admit(seq, context)
            if seq.scheduled_at is None:
                seq.scheduled_at = now
            n = min(context, budget)
            chunks.append((seq, n))
            budget -= n
            growth += n == context

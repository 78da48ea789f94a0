"""Offline what-if simulator: the live decision core on a virtual clock.

How this works: a discrete-event loop takes, in time order, the next of four
kinds of events — a request arriving (or a client retrying or giving up), the
engine's next step boundary, the machine's next deadline, and the next poll of
the policy's cluster signals. Every decision is the live service's own: the one
intake (``core.intake``) classifies and sizes each attempt from what the live
service would see of it (its headers, the gateway's, its retry count, its body's
sizes); the edge (``core.edge``) sheds it or not, with the same tenant budgets;
the machine (``core.machine``: scheduler, retry budget, saturation rules)
admits, queues or rejects it; every refusal is rendered as live
(``core.decision.reject``), and simulated clients read ``retry-after`` and
``x-should-retry`` from it like the OpenAI SDKs. Signals the engine model can
answer (KV-cache usage, waiting and running requests, by scrape preset, vLLM
metric name or a Prometheus query on them) are read from it on each source's
interval; others never arrive and go stale, as an unreachable source would. The
backend is ``extproc.sim.engine.Engine``, the same timing model the simulated
backend serves over HTTP. Only time and the backend are simulated, so a policy
edit can be tried on yesterday's traffic in seconds, and the results can be
checked against queueing theory.

Three ways to run the same requests: no admission control (everything goes
straight to the engine, whose own queue is FIFO and unbounded), FIFO with a
queue cap (one lane, the policy's capacity, first come first served), and the
policy itself.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import heapq
import json
import math
import random
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from extproc.core.body import BodyFacts
from extproc.core.capacity import READ_SOON
from extproc.core.decision import Decision, Reason, Ticket, reject
from extproc.core.machine import Machine
from extproc.core.saturation import Reading
from extproc.core.usage import FILTER_HEADER, USAGE, admission_metadata, charged, plan
from extproc.policy.schema import Policy
from extproc.sim import traces
from extproc.sim.driver import Driver, Offer
from extproc.sim.dynamics import VLLM_V1
from extproc.sim.engine import Engine, Finished, FirstToken, RequestRejected, capacity_schedule_arg
from extproc.sim.profiles import Profile, get_profile
from extproc.sim.report import Result, Slo, Summary, grouped, side_by_side, summarise
from extproc.sim.traces import Trace
from extproc.sim.workload import Arrivals, Client, Request, WorkloadSpec, generate, load_spec, retry_delay


class Mode(StrEnum):
    NONE = "no admission control"
    FIFO = "fifo, capped queue"
    POLICY = "policy"


_ARRIVE, _TIMEOUT = 0, 1
#: Sequence numbers of events pushed while the simulation runs (retries) start here: a request's own
#: arrival and timeout (numbered in arrival order below it) go first at the same instant.
_LATER = 1 << 62


@dataclass(slots=True)
class _State:
    request: Request
    lane: str = ""
    tenant: str = ""
    attempts: int = 0
    ticket: Ticket | None = None
    first_token: float | None = None
    queue_wait: float | None = None
    engine_ttft: float | None = None
    in_engine: bool = False
    result: Result | None = None


@dataclass
class Run:
    """One simulated run: per-request results and what the scheduler served per tenant."""

    mode: str
    results: list[Result]
    served_work: dict[str, dict[str, float]] = field(default_factory=dict)
    """lane → tenant → predicted seconds of work admitted."""
    events: int = 0
    peak_running: int = 0
    """Most sequences the engine ran at once (the policy's capacity must bound it)."""
    signals: list[str] = field(default_factory=list)
    """The policy's signals the engine model answered (the others went stale)."""
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)
    """At every signal poll: (time, the fleet limit in force, engine waiting, engine running)."""


def capacity_rps(profile: Profile, time_scale: float, spec: WorkloadSpec, batch: int | None = None
                 ) -> float:
    """Requests per second the engine completes with a full batch of this workload's mix.

    Throughput of a continuous-batching engine is batch / (time per request), and a
    request takes its output length in decode steps plus its prompt's prefill.
    """
    sample = generate(spec.model_copy(update={"arrivals": spec.arrivals.model_copy(update={"rate": 100.0})}),
                      200.0, seed=12345)
    mean_out = sum(r.output_tokens for r in sample) / len(sample)
    mean_prompt = sum(r.prompt_tokens for r in sample) / len(sample)
    lengths = tuple((r.prompt_tokens, r.output_tokens) for r in sample)
    return capacity_for_mix(profile, time_scale, mean_prompt, mean_out, batch, lengths=lengths)


def capacity_for_mix(profile: Profile, time_scale: float, mean_prompt: float, mean_output: float,
                     batch: int | None = None, *, lengths: Sequence[tuple[int, int]] = ()) -> float:
    """Requests per second the engine completes with a full batch of requests this long on average.

    For vLLM's dynamics (the default), the full batch is ``max_running`` (or ``batch``) and each
    request costs its output in steps of that batch plus its prompt's prefill: the estimate every
    recorded run of those profiles was loaded by. An engine of other dynamics (prefill stalls, a
    batch that takes requests every N steps, a cache that bounds the batch and preempts) is measured
    instead: the engine model itself, saturated with ``lengths`` (prompt, output) — or, without them,
    prompts of the mean and outputs spread as an exponential of the mean (long answers fill a cache)
    — as :func:`saturated_rate` finds it.
    """
    if profile.dynamics == VLLM_V1:
        b = batch or profile.max_running
        per_request = mean_output * profile.step_seconds(b) + mean_prompt * profile.prefill_s_per_token
        return b / (per_request * time_scale)
    if batch is not None:
        raise ValueError(f"profile {profile.name!r}: a batch size applies to vLLM-like dynamics only")
    if not lengths:
        n = _SATURATED_REQUESTS
        lengths = [(max(1, round(mean_prompt)), max(1, round(-mean_output * math.log(1 - (i + 0.5) / n))))
                   for i in range(n)]
    return saturated_rate(profile, tuple(lengths)) / time_scale


#: Requests of the mix spread from means alone (spread evenly: no sampling noise to average out).
_SATURATED_REQUESTS = 3000


@functools.lru_cache(maxsize=32)
def saturated_rate(profile: Profile, lengths: tuple[tuple[int, int], ...]) -> float:
    """Requests per second (at time scale 1) the engine completes when it never runs out of work.

    Every request (prompt, output) waits at time 0, in this order; the rate is that of the middle
    half of the completions, after the batch filled and before it drains. Requests the engine can
    never run (too long) are left out. With answers of very different lengths it takes thousands of
    requests for the rate to settle (``capacity_rps`` runs its whole sample, about a second).
    """
    engine = Engine(profile)
    for i, (prompt, output) in enumerate(lengths):
        with contextlib.suppress(RequestRejected):
            engine.add(str(i), prompt, output, 0.0)
    done: list[float] = []
    while (at := engine.next_event_time()) is not None:
        done += (event.time for event in engine.advance(at) if isinstance(event, Finished))
    if len(done) < 8:
        raise ValueError(f"profile {profile.name!r}: too few requests of this mix run to measure a rate")
    first, last = len(done) // 4, 3 * len(done) // 4
    return (last - first) / (done[last] - done[first])


def fifo_policy(policy: Policy, max_queued: int | None = None) -> Policy:
    """One first-come-first-served lane with the policy's capacity and a queue cap."""
    cap = max_queued if max_queued is not None else sum(lane.max_queued for lane in policy.lanes)
    return Policy.model_validate({
        "lanes": [{"name": "fifo", "max_inflight": policy.total_capacity, "max_queued": cap,
                   # A queue cap, not a deadline: waits are limited only by the hold bound.
                   "deadline": policy.capacity.max_hold * 0.99}],
        "classification": {"default_lane": "fifo"},
        "queueing": {"sjf_weight": 0},
        "estimation": policy.estimation.model_dump(),
        "capacity": {"max_hold": policy.capacity.max_hold},
        "retry_after": policy.retry_after.model_dump(),
        # A plain capped queue: no edge shed, no retry budget.
        "ratelimit": {"mode": "off"},
        "retry_budget": {"enabled": False},
    })


#: Engine quantities a signal may name, by what names them.
_ENGINE_PRESETS = {"kv_cache_usage": "kv", "waiting_requests": "waiting", "running_requests": "running",
                   "ttft_seconds": "ttft", "inter_token_latency_seconds": "itl"}
_ENGINE_METRICS = {"kv_cache_usage_perc": "kv", "gpu_cache_usage_perc": "kv",
                   "num_requests_waiting": "waiting", "num_requests_running": "running",
                   "time_to_first_token_seconds": "ttft", "inter_token_latency_seconds": "itl",
                   "time_per_output_token_seconds": "itl"}
#: The window of a latency percentile read from a PromQL query (``[30s]``), when it says none.
_DEFAULT_WINDOW = 30.0


def engine_signals(policy: Policy) -> dict[str, str]:
    """The policy's signals the engine model answers: signal name → kv, waiting, running, ttft, itl.

    Latency signals (``ttft``, ``itl``) are the engine's p95 over the signal's window, as
    Prometheus' ``histogram_quantile(0.95, rate(…[window]))`` or a scrape signal's ``quantile`` gives.
    """
    out: dict[str, str] = {}
    for name, signal in policy.signals.read.items():
        if signal.preset is not None:
            if signal.preset in _ENGINE_PRESETS:
                out[name] = _ENGINE_PRESETS[signal.preset]
            continue
        text = signal.metric or signal.query or ""
        found = {quantity for metric, quantity in _ENGINE_METRICS.items() if metric in text}
        if len(found) == 1 and "kueue" not in text:
            out[name] = found.pop()
    return out


def _window(policy: Policy, name: str) -> float:
    lookback = policy.signals.read[name].lookback
    return _DEFAULT_WINDOW if lookback is None else lookback


class Simulator:
    def __init__(self, profile: Profile, *, time_scale: float = 1.0, client: Client | None = None,
                 seed: int = 0, capacity_schedule: Sequence[tuple[float, float]] = ()) -> None:
        """``capacity_schedule``: (simulated seconds, fraction) — from then on the engine runs at that
        fraction of its capacity (see ``Engine.set_capacity``)."""
        self.profile = profile
        self.time_scale = time_scale
        self.client = client or Client()
        self.seed = seed
        self.capacity_schedule = tuple(capacity_schedule)

    def run(self, requests: Iterable[Request], policy: Policy | None, mode: str = Mode.POLICY) -> Run:
        """Simulate ``requests`` through ``policy`` (None: no admission control).

        ``requests`` is read as the simulation reaches each arrival (a trace streams; nothing is
        loaded whole): they must come in arrival order, with increasing indices. A request's state is
        dropped once it has its result.
        """
        return _Run(self, requests, policy, mode).run()


def _soonest(*times: float | None) -> float:
    return min((t for t in times if t is not None), default=math.inf)


class _Run:
    """One simulated run: the event loop's state, and what each kind of event does.

    The decisions are the machine's, driven by the shared virtual-clock driver (``sim/driver.py``:
    the edge, the intake, the machine, its timers); this class is the listener that turns them into
    what simulated clients and the engine do.
    """

    def __init__(self, sim: Simulator, requests: Iterable[Request], policy: Policy | None, mode: str) -> None:
        self.sim = sim
        self.policy = policy
        self.mode = mode
        self.rng = random.Random(sim.seed)
        self.engine = Engine(sim.profile, sim.time_scale, keep_latencies=True)
        self.clock = 0.0
        self.driver = Driver(Machine(policy, random.Random(sim.seed), edge_rng=random.Random(sim.seed + 1)),
                             self) if policy is not None else None
        self.signals = engine_signals(policy) if policy is not None else {}
        self.poll = min((s.interval for s in policy.signals.sources.values()), default=math.inf) \
            if policy is not None and policy.signals.read else math.inf
        self.next_poll = 0.0 if math.isfinite(self.poll) else math.inf
        self.last_poll = -math.inf
        # The self-sized limit's start reads a scrape source again soon (SignalHub.hurry).
        self.hurried = policy is not None and bool(policy.signals.hurriable(policy.capacity_sources))
        self.windows = {name: _window(policy, name) for name in self.signals} if policy is not None else {}
        self.changes = list(sim.capacity_schedule)
        self.timeline: list[tuple[float, int, int, int]] = []
        self.source = iter(requests)
        self.upcoming = next(self.source, None)
        self.arrived = 0
        self.last = (-math.inf, -1)
        self.states: dict[int, _State] = {}
        self.results: list[Result] = []
        self.by_ticket: dict[int, _State] = {}
        self.served: dict[str, dict[str, float]] = {}
        self.heap: list[tuple[float, int, int, int]] = []
        # A request's own arrival and timeout order before anything pushed later at the same time.
        self.seq = _LATER
        self.events = 0
        self.peak = 0

    # -- the machine's decisions (the driver's listener) ------------------------------------------

    def admitted(self, d: Decision, now: float) -> None:
        st = self.by_ticket.get(d.ticket.id)
        if st is None or st.result is not None:
            return
        st.queue_wait = d.ticket.queue_wait
        lane = self.served.setdefault(d.ticket.lane, {})
        lane[d.ticket.tenant] = lane.get(d.ticket.tenant, 0.0) + d.ticket.predicted
        self.to_engine(st, now)

    def rejected(self, d: Decision, now: float) -> None:
        st = self.by_ticket.get(d.ticket.id)
        if st is None or st.result is not None:
            return
        self.by_ticket.pop(d.ticket.id, None)
        st.ticket = None
        reason = d.reason or Reason.QUEUE_FULL
        rejection = reject(reason, d.ticket.lane, d.retry_after, retry_allowed=d.retry_allowed,
                           retry_after_ms=d.retry_after_ms)
        self.refused(st, rejection.status, dict(rejection.headers), reason.value, now)

    # -- a request's life ---------------------------------------------------------------------

    def finish(self, st: _State, status: int, now: float | None, reason: str = "") -> None:
        r = st.request
        ok = 200 <= status < 300 and now is not None
        st.result = Result(
            r.index, r.cls, st.tenant or r.tenant, r.at, status,
            (st.first_token - r.at) if ok and st.first_token is not None else None,
            (now - r.at) if ok and now is not None else None,
            st.attempts, r.output_tokens, reason, st.queue_wait if ok else None,
            engine_ttft=st.engine_ttft if ok else None,
        )
        self.results.append(st.result)
        self.states.pop(r.index, None)

    def to_engine(self, st: _State, now: float) -> None:
        try:
            self.engine.add(str(st.request.index), st.request.prompt_tokens, st.request.output_tokens, now)
            st.in_engine = True
        except RequestRejected:
            self.finish(st, 400, None, "too_long")
            if self.driver is not None and st.ticket is not None:
                self.by_ticket.pop(st.ticket.id, None)
                self.driver.release(st.ticket, now, learn=False)

    def refused(self, st: _State, status: int, headers: dict[str, str], reason: str, now: float) -> None:
        """A refusal as the client reads it: retry after a while, or give up."""
        delay = retry_delay(self.sim.client, st.attempts, status, headers, self.rng)
        if delay is None:
            self.finish(st, status, None, reason)
        else:
            heapq.heappush(self.heap, (now + delay, self.seq, _ARRIVE, st.request.index))
            self.seq += 1

    def arrive(self, st: _State, now: float) -> None:
        driver = self.driver
        assert driver is not None
        r = st.request
        headers = {k.lower(): v for k, v in r.headers.items()}
        headers.update((k.lower(), v) for k, v in r.gateway.items())
        headers["x-stainless-retry-count"] = str(st.attempts - 1)
        offer = Offer("POST", r.path, headers, sized=True, model=r.model, prompt_tokens=r.prompt_tokens,
                      output_tokens=r.output_tokens)

        def decided(ticket: Ticket) -> None:
            self.by_ticket[ticket.id] = st
            st.ticket = ticket

        answer = driver.offer(offer, now, decided=decided)
        st.lane, st.tenant = answer.lane, answer.tenant
        if answer.shed is not None and answer.judgement is not None:
            reason = answer.judgement.reason
            rejection = answer.shed.rejection
            self.refused(st, rejection.status, dict(rejection.headers), reason.value if reason else "", now)

    def usage(self, st: _State, now: float, finished: bool) -> None:
        # As live: a finished request is charged the usage the backend reported (the simulated
        # backend reports it like vLLM, in the body, and in a stream that asked for it, as ext_proc
        # makes every stream ask); one cut short, the estimate from its admission (core/usage.py).
        policy, driver = self.policy, self.driver
        assert policy is not None
        assert driver is not None
        config = policy.ratelimit
        ticket = st.ticket
        if ticket is None or ticket.admitted_at is None:
            return
        request = st.request
        # Behind the shipped proxy, which says it strips the event ext_proc asks for.
        facts = BodyFacts(stream=request.stream, usage_asked=request.include_usage)
        how = plan(config, ticket.tenant, request.path, {FILTER_HEADER: "1"}, facts)
        if not how.record:
            return
        headers = {**request.headers, **request.gateway}
        entries = {"generic_key": config.usage_descriptor,
                   **{k.lower(): v for k, v in headers.items() if k.lower() in policy.trusted_headers}}
        if finished and (not request.stream or request.include_usage or how.ask):
            said = {USAGE: str(request.prompt_tokens + request.output_tokens)}
        else:
            job = ticket.job
            said = admission_metadata(job.prompt_tokens, job.output_tokens, request.output_tokens,
                                      ticket.predicted, ticket.admitted_at, strip=False)
        charge = charged(said, now)
        if charge.tokens > 0:
            driver.machine.charge(config, entries, charge.tokens, now)

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> Run:
        engine, driver = self.engine, self.driver
        while True:
            if self.hurried and driver is not None and driver.machine.reading_wanted(self.clock):
                self.next_poll = min(self.next_poll, max(self.clock, self.last_poll + self.poll * READ_SOON))
            upcoming = self.upcoming
            t_sched = driver.machine.next_timer() if driver is not None else None
            now = _soonest(self.heap[0][0] if self.heap else None,
                           upcoming.at if upcoming is not None else None, engine.next_event_time(), t_sched)
            if now == math.inf:
                break
            if self.changes and self.changes[0][0] <= now:
                at, fraction = self.changes.pop(0)
                now = max(at, self.clock)
                engine.set_capacity(fraction, now)
                self.clock = now
                continue
            if self.next_poll <= now:
                # Signals are read on their sources' interval, while anything is still going on.
                now = self.last_poll = self.next_poll
                self.next_poll = now + self.poll
                self.read_signals(now)
            self.clock = now
            self.take_arrivals(now)
            self.client_events(now)
            if driver is not None and t_sched is not None and t_sched <= now:
                self.events += 1
                driver.expire(now)
            self.engine_events(now)
        self.results.extend(Result(st.request.index, st.request.cls, st.request.tenant, st.request.at, -1,
                                   None, None, st.attempts, st.request.output_tokens, "unfinished")
                            for st in self.states.values())
        self.results.sort(key=lambda result: result.index)
        return Run(self.mode, self.results, self.served, self.events, self.peak, sorted(self.signals),
                   self.timeline)

    def read_signals(self, now: float) -> None:
        driver, engine = self.driver, self.engine
        assert driver is not None
        gauges = engine.gauges(now)  # as the engine's /metrics would show them
        values: dict[str, float | None] = {"kv": gauges.kv_usage, "waiting": float(gauges.waiting),
                                           "running": float(gauges.running)}
        readings = {}
        for name, quantity in self.signals.items():
            value = values.get(quantity)
            if quantity == "ttft":
                value = engine.recent_ttft_p95(now, self.windows[name])
            elif quantity == "itl":
                value = engine.recent_itl_p95(now, self.windows[name])
            if value is not None:  # no observation in the window: nothing read
                readings[name] = Reading(value, now)
        decisions = driver.machine.on_signals(readings, now).decisions
        self.timeline.append((now, driver.machine.policy.total_capacity, engine.waiting, engine.running))
        self.clock = now
        driver.settle(decisions, now)

    def take_arrivals(self, now: float) -> None:
        """Requests due by ``now`` join the event heap (with their client's timeout)."""
        timeout = self.sim.client.timeout
        while self.upcoming is not None and self.upcoming.at <= now:
            r = self.upcoming
            last_at, last_index = self.last
            if r.at < last_at or r.index <= last_index:
                raise ValueError(f"requests must come in arrival order with increasing indices: request "
                                 f"{r.index} at {r.at:g}s after {last_index} at {last_at:g}s")
            self.last = (r.at, r.index)
            self.states[r.index] = _State(r)
            heapq.heappush(self.heap, (r.at, 2 * self.arrived, _ARRIVE, r.index))
            heapq.heappush(self.heap, (r.at + timeout, 2 * self.arrived + 1, _TIMEOUT, r.index))
            self.arrived += 1
            self.upcoming = next(self.source, None)

    def client_events(self, now: float) -> None:
        """Attempts (first ones and retries) and clients giving up, due by ``now``."""
        heap, driver = self.heap, self.driver
        while heap and heap[0][0] <= now:
            _, _, kind, index = heapq.heappop(heap)
            found = self.states.get(index)
            if found is None or found.result is not None:
                continue
            st = found
            self.events += 1
            if kind == _TIMEOUT:
                if st.in_engine:
                    self.engine.cancel(str(index), now)
                self.finish(st, -1, None, "timeout")
                if driver is not None and st.ticket is not None:
                    self.by_ticket.pop(st.ticket.id, None)
                    self.usage(st, now, finished=False)
                    driver.release(st.ticket, now, learn=False)
                continue
            st.attempts += 1
            if driver is None:
                self.to_engine(st, now)
                continue
            self.arrive(st, now)

    def engine_events(self, now: float) -> None:
        engine, driver = self.engine, self.driver
        events_now = engine.advance(now)
        self.peak = max(self.peak, engine.running)
        for event in events_now:
            self.events += 1
            st = self.states[int(event.req_id)]  # in the engine: no result yet
            if isinstance(event, FirstToken):
                st.first_token = event.time
                st.engine_ttft = event.ttft
            elif isinstance(event, Finished):
                st.in_engine = False
                if driver is None:
                    # Without admission control the only queue is the engine's own.
                    st.queue_wait = event.queue_time
                if st.first_token is None:
                    st.first_token = event.time - (event.e2e - event.ttft)
                    st.engine_ttft = event.ttft
                self.finish(st, 200, event.time)
                if driver is not None and st.ticket is not None:
                    self.by_ticket.pop(st.ticket.id, None)
                    self.clock = event.time
                    self.usage(st, event.time, finished=True)
                    driver.release(st.ticket, event.time)


def tenant_shares(run: Run, policy: Policy) -> dict[str, dict[str, tuple[float, float]]]:
    """lane → tenant → (share of admitted predicted work, share its weight entitles it to)."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    weights = policy.tenants.weights
    for lane, tenants in run.served_work.items():
        total = sum(tenants.values())
        weight_total = sum(weights.get(t, policy.tenants.default_weight) for t in tenants)
        if total <= 0 or len(tenants) < 2:
            continue
        out[lane] = {t: (work / total, weights.get(t, policy.tenants.default_weight) / weight_total)
                     for t, work in sorted(tenants.items())}
    return out


# -- command line: extproc simulate [compare A B] ---------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("compare", nargs="*", metavar="compare A.yaml B.yaml",
                        help="compare two policies on the same requests instead of the baselines")
    parser.add_argument("--policy", action="append", metavar="FILE",
                        help="the policy to simulate (with the two baselines); with --verify, each policy "
                        "the log names (repeat it: a record names the sha256 of its policy file's bytes)")
    parser.add_argument("--workload", help="workload spec (YAML); with --trace, only its SLOs are used")
    parser.add_argument("--trace", help="replay a trace: Azure 2023, Mooncake or BurstGPT, extproc's JSONL "
                        "or decision log (see --trace-format); with --rate or --load, sped up to that rate")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals (workload)")
    rate = parser.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, help="mean arrivals per second")
    rate.add_argument("--load", type=float, help="arrival rate as a multiple of the backend's capacity")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", default="llama-70b-2xh100")
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument("--capacity-schedule", type=capacity_schedule_arg, default=(), metavar="T:F,...",
                        help="from T simulated seconds on, the engine runs at fraction F of its capacity "
                        "(slots, KV cache and step speed), e.g. 0:1,60:0.5,120:1")
    parser.add_argument("--fifo-cap", type=int, default=None,
                        help="queue cap of the FIFO baseline (default: the policy's lanes' queues summed)")
    parser.add_argument("--verify", action="store_true",
                        help="with --trace DECISION_LOG and --policy (one per policy the log names): replay "
                        "every logged attempt through the core, each under the policy that decided it and "
                        "with the logged drains, pauses and reloads, and report how often it decides as the "
                        "live service did (lane, tenant, outcome); --json writes {\"verify\": {...}}")
    parser.add_argument("--json", dest="json_out", help="write the summaries here")
    parser.add_argument("--plot", help="write a PNG here")
    traces.add_arguments(parser)


def _requests(args: argparse.Namespace, profile: Profile
              ) -> tuple[Iterable[Request], float | None, WorkloadSpec, Trace | None]:
    """The requests to simulate, their span in seconds (None: known once a run has read them), the
    workload (its SLOs and client; with a public trace, the classes its records become)."""
    spec = load_spec(args.workload) if args.workload else WorkloadSpec(arrivals=Arrivals(rate=1.0))
    if args.trace:
        trace = traces.from_args(args, spec)
        if args.rate or args.load:
            n, span, prompt, output = trace.mix()
            if span <= 0:
                raise traces.TraceError(f"{args.trace}: every request arrives at once: no rate to scale")
            target = args.rate or args.load * capacity_for_mix(profile, args.time_scale, prompt, output)
            speedup = target / (n * trace.replay.rate_scale / span)
            print(f"{args.trace}: {n} requests over {span:.0f}s (mean prompt {prompt:.0f}, output "
                  f"{output:.0f} tokens): --speedup {speedup:.3g} for {target:.2f} requests/s",
                  file=sys.stderr)
            trace = traces.with_speedup(trace, speedup)
        return trace, None, spec, trace
    if not args.workload:
        raise SystemExit("extproc simulate: give --workload SPEC or --trace FILE")
    rate = args.rate or (capacity_rps(profile, args.time_scale, spec) * args.load if args.load else None)
    if rate is not None:
        spec = spec.model_copy(update={"arrivals": spec.arrivals.model_copy(update={"rate": rate})})
    return generate(spec, args.duration, args.seed), args.duration, spec, None


def command(args: argparse.Namespace) -> int:
    from extproc.policy import PolicyError, load_policy

    if args.compare and (args.compare[0] != "compare" or len(args.compare) != 3):
        raise SystemExit("extproc simulate: expected `compare A.yaml B.yaml` or no positional arguments")
    if not args.compare and not args.policy:
        raise SystemExit("extproc simulate: give --policy FILE (or `compare A.yaml B.yaml`)")
    if args.verify:
        return _verify(args)
    if args.policy and len(args.policy) > 1:
        raise SystemExit("extproc simulate: give one --policy (several only with --verify)")
    profile = get_profile(args.profile)
    try:
        if args.compare:
            policies: dict[str, Policy | None] = {p: load_policy(p) for p in args.compare[1:]}
        else:
            policy = load_policy(args.policy[0])
            policies = {Mode.NONE.value: None, Mode.FIFO.value: fifo_policy(policy, args.fifo_cap),
                        f"policy ({Path(args.policy[0]).name})": policy}
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        requests, duration, spec, trace = _requests(args, profile)
    except (OSError, ValueError) as exc:
        print(f"extproc simulate: {exc}", file=sys.stderr)
        return 2
    simulator = Simulator(profile, time_scale=args.time_scale, client=spec.client, seed=args.seed,
                          capacity_schedule=args.capacity_schedule)
    default_slo = Slo(ttft=2.0, e2e=120.0)
    slos = {c.name: Slo(c.slo.ttft, c.slo.e2e) for c in spec.classes}
    columns: dict[str, tuple[dict[str, Summary], Summary]] = {}
    doc: dict[str, Any] = {"profile": profile.name, "time_scale": args.time_scale, "seed": args.seed,
                           "load": args.load, "rate": args.rate, "requests": 0, "duration_s": duration,
                           "runs": {}}
    if trace is not None:
        doc["trace"] = _trace_doc(trace, scaled=bool(args.rate or args.load))
    started = time.perf_counter()
    for name, policy_or_none in policies.items():
        t0 = time.perf_counter()
        try:
            run = simulator.run(requests, policy_or_none, name)
        except (OSError, ValueError) as exc:
            print(f"extproc simulate: {exc}", file=sys.stderr)
            return 2
        if not run.results:
            print("extproc simulate: no requests to simulate", file=sys.stderr)
            return 2
        doc["requests"] = len(run.results)
        if duration is None:  # a trace: its span as played
            duration = max(max(r.at for r in run.results), 1e-9)
            doc["duration_s"] = round(duration, 3)
        for r in run.results:
            slos.setdefault(r.cls, default_slo)
        per_lane = grouped(run.results, slos, duration)
        overall = summarise(run.results, slos, duration)
        columns[name] = (per_lane, overall)
        shares = tenant_shares(run, policy_or_none) if policy_or_none is not None else {}
        doc["runs"][name] = {
            "overall": overall.as_dict(), "lanes": {k: v.as_dict() for k, v in per_lane.items()},
            "tenant_shares": shares, "simulated_s": round(time.perf_counter() - t0, 2),
        }
    if trace is not None and trace.bad:
        print(f"{trace.path}: skipped {trace.bad} malformed lines", file=sys.stderr)
        doc["trace"]["skipped_bad_lines"] = trace.bad
    doc["simulated_s"] = round(time.perf_counter() - started, 2)
    print(f"{doc['requests']} requests over {duration:.0f}s on {profile.name} "
          f"(time scale {args.time_scale}), simulated in {doc['simulated_s']:.1f}s")
    print(side_by_side(columns))
    for name, run_doc in doc["runs"].items():
        for lane, shares in run_doc["tenant_shares"].items():
            text = ", ".join(f"{t} {got:.0%} (weight {want:.0%})" for t, (got, want) in shares.items())
            print(f"tenant shares, {name}, {lane}: {text}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=1))
    if args.plot:
        _plot(columns, Path(args.plot))
    return 0


def _trace_doc(trace: Trace, scaled: bool) -> dict[str, Any]:
    """What a replay played; ``scaled`` (sped up to a rate or load): with the mix the speedup came from."""
    out: dict[str, Any] = {"path": str(trace.path), "format": trace.format, "speedup": trace.replay.speedup,
                           "rate_scale": trace.replay.rate_scale, "window": list(trace.replay.window)}
    if scaled:
        n, span, prompt, output = trace.mix()
        out.update(requests=n, span_s=round(span, 3), mean_prompt_tokens=round(prompt, 1),
                   mean_output_tokens=round(output, 1))
    return out


def _verify(args: argparse.Namespace) -> int:
    from extproc.policy import PolicyError, load_policy
    from extproc.sim.verify import LogError, PolicyMissing, policies_by_hash, read_log_file, replay, resolve

    if not args.trace or args.compare:
        raise SystemExit("extproc simulate: --verify needs --trace DECISION_LOG and --policy FILE")
    try:
        files = policies_by_hash(args.policy, load_policy)
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"extproc simulate: {exc}", file=sys.stderr)
        return 2
    try:
        log = read_log_file(args.trace)
        policies = resolve(log, {sha: policy for sha, (_, policy) in files.items()})
    except (OSError, LogError, PolicyMissing) as exc:
        print(f"extproc simulate: {args.trace}: {exc}", file=sys.stderr)
        return 2
    if not log.attempts:
        print(f"extproc simulate: {args.trace}: no decision records to replay", file=sys.stderr)
        return 2
    started = time.perf_counter()
    summary = replay(log, policies, seed=args.seed).summary()
    print(f"{summary['requests']} logged attempts replayed in {time.perf_counter() - started:.1f}s: "
          f"lane {summary['lane_agreement']:.1%}, tenant {summary['tenant_agreement']:.1%}, "
          f"outcome {summary['outcome_agreement']:.1%} as the live service decided")
    names = {sha: path for sha, (path, _) in files.items()}
    for span in summary["spans"]:
        name = names.get(span["policy"]) or next(iter(names.values()))
        print(f"  {span['attempts']:6d}  under {Path(name).name} ({span['policy'][:12] or 'no hash'})")
    if summary["actions"]:
        print("  applied: " + ", ".join(f"{n} {action}" for action, n in summary["actions"].items()))
    for kind, count in list(summary["disagreements"].items())[:8]:
        print(f"  {count:6d}  live {kind}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"verify": summary}, indent=1))
    return 0


def _plot(columns: dict[str, tuple[dict[str, Summary], Summary]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    lanes = sorted({lane for per_lane, _ in columns.values() for lane in per_lane})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(columns), 1)
    for i, (name, (per_lane, _)) in enumerate(columns.items()):
        xs = [j + i * width for j in range(len(lanes))]
        ax1.bar(xs, [per_lane[lane].ttft.get("p99") or 0 if lane in per_lane else 0 for lane in lanes],
                width, label=name)
        ax2.bar(xs, [per_lane[lane].goodput_rps if lane in per_lane else 0 for lane in lanes], width,
                label=name)
    for ax, title in ((ax1, "TTFT p99 (s, log)"), (ax2, "goodput (requests/s meeting their SLO)")):
        ax.set_xticks([j + width * (len(columns) - 1) / 2 for j in range(len(lanes))], lanes)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
    ax1.set_yscale("log")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

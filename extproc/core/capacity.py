"""Self-sizing capacity: the fleet's in-flight limit, found and followed from the engines' own signals.

How this works: :class:`AutoLimit` holds one number, the fleet in-flight limit, inside the
policy's ``[min, max]``, and moves it at most once per ``interval`` from engine signals (each
optional): the requests waiting in the engines' own queues, TTFT p95, time per output token (TPOT)
p95, the requests the engines run, and their KV-cache usage.

* **Fall fast.** An engine queue above ``target.queue`` (seen on two ticks running, or four times
  over at once) means the limit lets more requests in than the engines run at once: the limit drops
  to what the engines run (in flight − (waiting − queue)), at most halving in one move; a limit
  already there holds while the requests admitted before it drain, and a limit well above what runs
  sheds only a few waiting requests (ones caught between two engine steps look the same), not itself
  down to what runs; and a few waiting while TTFT p95 is under half its target are no queue at all
  (they cost no first token: an engine that takes new requests into its batch every few steps shows
  some at most samples with slots free), unless that TTFT has tripled since the last reading with no
  queue (and is past a tenth of its target): then their first tokens wait, and they are a queue. A
  larger queue with TTFT p95 still under half its target (an engine that prefills waiting requests
  first, or preempts and resumes) is cheap, with the same exception: the limit keeps a quarter over
  what runs, once per ``cooldown``, rather than falling to what runs (that threw away the buffer a
  static limit keeps, and left lower lanes holding slots from the higher limit while the interactive
  lane waited out its deadline); in the start, at idle engines (a KV cache under half full, TTFT p95
  under a quarter of its target) it is a doubling's prefills, and the start goes on from the trim. A
  latency percentile above its target cuts the limit in proportion (target / observed, between ×0.5
  and ×0.95; a TPOT, which a smaller batch shortens only a little, by ×0.9 at most, and so a TTFT
  while the engines queue no more than the target though they did within its window and the TTFT
  seen: it holds the first tokens of a queue already gone). A percentile looks back over its window
  (the signal's ``window``, or a query's ``[range]``), so after a fall it may cut again only once
  that window and ``cooldown`` have passed (for TTFT, the window plus the TTFT seen: a first token
  seen now is of a request admitted that long ago); the queue always may (it is a gauge). Each fall
  remembers where the engines had too many: what ran then (not a limit far above it; a cheap queue's
  trim leaves it).
* **Grow carefully.** Only while every fresh signal has headroom (no engine queue beyond the target,
  latencies below 90 % of their targets, a KV cache under 90 % full) *and* the limit is what holds
  traffic back (in flight ≥ 90 % of the limit, or ≥ 75 % while requests wait in extproc's queues for
  want of a slot (or were refused for want of one since it last moved, within the interval), or
  within one slot per lane of it: at a limit of a few slots per lane, every lane sized at least one,
  a lane at its share holds work back long before 75 % are in flight; or, in the start, while the
  work held back would fill the limit with what is in flight and the engines are idle: a KV cache
  under half full, TTFT p95 under a quarter of its target): a limit far above what runs is not grown
  further (it would only let a burst flood the engines). Until the engines first queue
  it doubles (a slow start, as TCP's: from ``min`` to hundreds in seconds), on every fresh reading
  while requests are held back rather than once per interval (under four slots per lane it wants
  that reading a quarter of the signals' interval after the last: ``reading_soon``, which a scrape
  source answers by reading its targets again then); a few requests waiting while what the
  engines run still rises (a burst's prefills) do not stop it, nor does a larger queue at a TTFT p95
  under half its target while what runs rises by at least half of what waited at the last reading
  (an engine that takes new requests in only at join points, every so many steps, holds a doubling's
  burst until the next; a queue that stays while what runs creeps up is the start's overshoot
  building up, and ends it); a few that stay are trimmed without ending it, and a latency percentile
  over target only pauses it for the percentile's window (it is mostly the burst of held requests
  the last doubling let in). With the engines' KV-cache usage (the ``kv_cache`` role) a growth goes
  no further than where the cache would be 90 % full at what the running requests use of it now
  (+5 % once there), and the start ends there: an engine bound by its cache shows no queue and a
  low TTFT right up to the moment its sequences outgrow it, so a doubling past that point (128 → 256
  live on the 70B profile, whose best static limit is 96) showed only later, as a queue the admitted
  excess waited in; and a start that went on from there crept up the cache's room on the demand of
  lanes held at their shares, to twice what the engines ran. A
  queue the engines cannot clear (four times the target) ends it (unless, as above, they are taking
  it in), and where they had too many is then what they ran, not the doubling's overshoot. After
  that, as TCP CUBIC: quickly (+5 %, doubling per growth up to +25 %) back up to 95 % of where the
  last fall began, then +1 % (at least one slot) per interval through ±5 % of it, and past that,
  where nothing said "too many" yet, quickly again. A limit that nothing presses against never
  drifts up; the saw-tooth of a plain additive increase is damped where it used to break.
* **Stale or missing signals.** With no fresh signal the last limit holds for ``stale_hold``,
  then decays by 10 % per interval to ``min``; the state says so.
* **Unreachable targets** (a TPOT of 1 ms): the limit stops at ``min`` and the state says the
  target is unreachable there; it never reaches 0.

:func:`size` turns a policy with ``max_inflight: auto`` into one with concrete numbers at a
given limit (lanes' max_inflight are shares of it), which is what the scheduler and the shared
store enforce. The live controller, the simulator and ``policy explain`` all run this code;
nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from extproc.core.saturation import Reading, is_stale
from extproc.policy.schema import AutoCapacity, Policy
from extproc.policy.signals import Signals

#: Most of the excess one fall may take off; the largest and smallest proportional cuts.
_MAX_CUT, _CUT_FLOOR, _CUT_CEILING = 0.5, 0.5, 0.95
#: A TPOT over target cuts at most this much at once: a step takes a fixed time plus a little per
#: sequence, so TPOT is far from proportional to concurrency, and a cut in proportion (as for TTFT,
#: which is queueing) took a third of the slots off for a TPOT that fewer would not have fixed.
_TPOT_CUT_FLOOR = 0.9
#: A TTFT over target while the engines queue nothing, though they did within the percentile's window,
#: cuts at most this much at once: the percentile still holds the first tokens of that queue, which is
#: gone (the limit's fall, or the engines, took it off). A cut in proportion halved the V0-like
#: engine's limit (38 to 19, bench/adaptive.py's second simulator seed) for a TTFT p95 of 2.9 s ten
#: seconds after its queue was last seen: that seed's goodput was 0.982 of the best static limit's,
#: and is 0.998 with this (38 to 34).
_TTFT_DRAINED_CUT_FLOOR = 0.9
#: Growth per interval: first step, largest step (consecutive growths double it up to this).
_GROW_FIRST, _GROW_MAX = 0.05, 0.25
#: Near the last fall's starting point (within this share of it) growth creeps by _CREEP (at
#: least one slot) per interval: that is where the engines said "too many" last time.
_NEAR, _CREEP = 0.05, 0.01
#: Headroom: latencies below this share of their target. Pressure: in flight at _PRESSED of the
#: limit, or at _PRESSED_HELD of it while requests wait in extproc's queues for want of a slot (a
#: lane at its share), or were refused for want of one since the limit last moved and within the
#: interval (Scheduler.turned_away_at). Not less: a limit far above what runs would only let a
#: burst flood the engines.
_HEADROOM, _PRESSED, _PRESSED_HELD = 0.9, 0.9, 0.75
#: In the start, requests held back that would fill the limit with those in flight are pressure
#: enough while the engines are idle: their KV cache under _IDLE_KV full and TTFT p95 under _IDLE_TTFT
#: of its target. At 16 slots the lanes below the highest held at their shares (two and one) while
#: the highest had few requests: in flight stayed at half the limit for seconds, and the V0-like
#: engine's start took 16 s to reach 64 (its best static limit is 48).
_IDLE_KV, _IDLE_TTFT = 0.5, 0.25
#: An engine queue this many times the target (+1) is acted on at once; a smaller one only when
#: the previous tick saw one too (a request that arrived just before the sample waits one step).
_CLEAR_QUEUE = 4
#: A queue that costs no first token yet (TTFT p95 under _QUEUE_TTFT of its target) keeps this share
#: over what the engines run: the engines' own queue is what feeds their next step.
_CHEAP_BUFFER = 0.25
#: A start grows no further than where the engines' KV cache would be this full at the share of it
#: each running request uses now (the kv_cache role; +5 % once there, while it is not yet), and ends
#: there: a cache-bound engine shows no queue until its sequences outgrow the cache, a reading after the
#: doubling that overfilled it. A cache this full is a signal without headroom: no limit grows (an
#: engine that preempts past it recomputes; growing there took the V0-like engine 56 → 70 at 99 %
#: while a few waited, and the fall that followed held its interactive lane past its deadline).
_KV_FULL = 0.9
#: A KV-cache usage below this says nothing of what a request uses (an idle engine's few sequences).
_KV_MEASURABLE = 0.05
#: Decay per interval once stale signals outlast stale_hold.
_DECAY = 0.9
#: A few requests waiting at the engines while TTFT p95 is under this share of its target cost no
#: first token anything: not a queue to fall for (an engine that batches new requests in every few
#: steps shows a few waiting at most samples with free slots).
_QUEUE_TTFT = 0.5
#: Nor is a queue cheap once TTFT p95 has risen to this many times what it was at the last reading
#: with none (and past _QUEUE_RISE_FLOOR of its target: an idle engine's few milliseconds say little):
#: the first tokens then wait in it, even while the percentile is still under half its target (the
#: 70B's start at twice its capacity, its KV cache roomy: 66 ms with no queue, then 283, 423 and 498 ms
#: with 5 to 14 waiting at a quarter over the 128 it runs, first tokens up to 0.6 s). An engine that
#: queues a few between its join points (TGI-like, V0-like) shows them at about the TTFT it has with
#: none, so its queue stays cheap.
_QUEUE_RISE, _QUEUE_RISE_FLOOR = 3.0, 0.1
#: A start goes on through a queue over _CLEAR_QUEUE times the target only while what the engines run
#: rose, since the last reading, by at least this share of what waited then (and it costs no first
#: token): the engines are taking the queue in, at a join point, not out of room.
_QUEUE_TAKEN = 0.5
#: A start under this many slots per lane wants its next reading after this share of the signals'
#: interval, not the whole of it, while requests are held back (reading_soon): at a few slots per
#: lane the interactive lane refuses requests (its queue past its deadline) within a fraction of a
#: second, before a reading every second could double the limit (70B, twice its capacity: nine
#: refused in the first second, at 4). Only there: a start's doublings further up overshot when
#: read that often (what the engines run has not yet taken in the last doubling's burst).
_SOON_SLOTS, READ_SOON = 4, 0.25

Reason = Literal["start", "running", "engine_queue", "ttft", "tpot", "headroom", "stale", "reload"]
Role = Literal["waiting", "running", "ttft_p95", "tpot_p95", "kv_cache"]
ROLES: tuple[Role, ...] = ("waiting", "running", "ttft_p95", "tpot_p95", "kv_cache")


@dataclass(frozen=True, slots=True)
class Move:
    """The limit moved (or a notable state began): what it is now and why."""

    limit: int
    previous: int
    at: float
    reason: Reason
    why: str


@dataclass(frozen=True, slots=True)
class AutoState:
    """What the admin API, metrics and logs say about the limit."""

    limit: int
    min: int
    max: int
    shadow: bool
    reason: Reason
    why: str
    since: float
    """When the limit last moved (or the state began)."""
    stale: bool
    """No fresh signal: holding, then decaying to min."""
    unreachable: str | None
    """A target not met even at min, e.g. ``tpot_p95 80ms > 1ms at min 4``."""
    signals: Mapping[str, float | None]
    """Each configured role's fresh value (None: stale or missing)."""


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}ms" if seconds < 10 else f"{seconds:.1f}s"


class AutoLimit:
    """The self-sizing limit of one policy's ``capacity.auto`` (pure: explicit ``now``)."""

    def __init__(self, auto: AutoCapacity, signals: Signals, now: float = 0.0, *, lanes: int = 1) -> None:
        self.auto = auto
        #: The policy's lanes: each is sized at least one slot of the limit (see :func:`size`).
        self.lanes = lanes
        self._signals = signals
        self._value = float(auto.first)
        self._last_tick: float | None = None
        self._seen: float | None = None
        self._last_cut: float = -math.inf
        self._growth = _GROW_FIRST
        self._slow_start = True
        #: The last tick saw a latency percentile over its target (a start waits out its window).
        self._over = False
        self._ceiling: float | None = None
        self._lookback = _lookbacks(auto, signals)
        self._queueing = False
        self._running: float | None = None
        self._waiting: float | None = None
        #: TTFT p95 at the last reading with no engine queue (beyond the target): what a queue adds to.
        self._calm_ttft: float | None = None
        #: When a reading last showed an engine queue beyond the target.
        self._queued_at: float | None = None
        self._stale_since: float | None = None
        self._values: dict[str, float | None] = {}
        self._unreachable: str | None = None
        self._reason: Reason = "start"
        self._why = f"starts at {auto.first} (min {auto.min}, max {auto.max})"
        self._since = now
        #: Still at its starting value: it has neither moved nor adopted a fleet's limit (a shared store
        #: then gives it the fleet's stored limit rather than taking this one).
        self.starting = True

    @property
    def limit(self) -> int:
        return int(self._value)

    @property
    def since(self) -> float:
        """When the limit last moved (or, before it has, when it was made; or when it went stale)."""
        return self._since

    def reconfigure(self, auto: AutoCapacity, signals: Signals, now: float, *, lanes: int | None = None
                    ) -> Move | None:
        """A new policy: keep the limit learned so far, clamped into the new bounds (``lanes``: the new
        policy's count, if it changed)."""
        if auto.signals != self.auto.signals:
            self._running = self._waiting = None  # other signals: their last readings say nothing now
        if auto.signals != self.auto.signals or auto.target != self.auto.target:
            self._calm_ttft = self._queued_at = None  # (a queue, and its absence, against other targets)
        self.auto, self._signals = auto, signals
        if lanes is not None:
            self.lanes = lanes
        self._lookback = _lookbacks(auto, signals)
        clamped = min(max(self._value, auto.min), auto.max)
        if int(clamped) != self.limit:
            before = self.limit
            self._value = clamped
            return self._moved(before, now, "reload", f"clamped into the new bounds [{auto.min}, {auto.max}]")
        return None

    def adopt(self, limit: int) -> None:
        """Follow the fleet's limit (another replica sets it): continue from there if this one takes over."""
        value = float(min(max(limit, self.auto.min), self.auto.max))
        if int(value) != self.limit:
            self.starting = False  # (the store answering with this replica's own proposal is no news)
        self._value = value

    @property
    def reading_soon(self) -> bool:
        """Whether the next reading is wanted after ``READ_SOON`` of the signals' interval while
        requests are held back: a start still under ``_SOON_SLOTS`` slots per lane (and under
        ``max``), not waiting out a latency percentile's window (a reading soon changes nothing then)."""
        return self._slow_start and not self._over and self._value < min(_SOON_SLOTS * self.lanes,
                                                                          self.auto.max)

    def state(self) -> AutoState:
        return AutoState(self.limit, self.auto.min, self.auto.max, self.auto.shadow, self._reason, self._why,
                         self._since, self._stale_since is not None, self._unreachable, dict(self._values))

    def update(self, readings: Mapping[str, Reading], inflight: int, held: bool, now: float, *,
               queued: int = 0) -> Move | None:
        """Look at the latest readings; move the limit if an interval has passed and they say so.

        ``inflight``: requests running under this limit (fleet-wide with a shared store);
        ``queued``: requests waiting in extproc's queues only for want of a slot (fleet-wide with a
        shared store, as last synced: ``admission.held_queued``);
        ``held``: requests wait in extproc's queues only for want of a slot (a lane at its share of
        the limit, or the fleet at the limit: ``Scheduler.held_back``), or one was refused for want of
        a slot since the limit last moved, within the interval (``Scheduler.turned_away_at``: a queue
        full, or a deadline out of reach behind the slots; at a small limit the interactive lane's
        requests are refused so). ``Machine.on_signals`` works that out.
        """
        # A start moves on every fresh reading while requests are held back, not once per interval:
        # each second at a small limit refuses what a static limit would run.
        newest = self._newest(readings)
        news = newest is not None and (self._seen is None or newest > self._seen)
        quick = self._slow_start and held and news
        if self._last_tick is not None and now - self._last_tick < self.auto.interval and not quick:
            return None
        self._last_tick, self._seen, self._over = now, newest, False
        fresh = self._fresh(readings, now)
        configured = {role for role in ROLES if getattr(self.auto.signals, role) is not None}
        self._values = {role: fresh.get(role) for role in sorted(configured)}
        if not fresh:
            return self._stale(now)
        self._stale_since = None
        waiting = fresh.get("waiting")
        if waiting is not None and waiting > self.auto.target.queue:
            self._queued_at = now
        elif waiting is not None and "ttft_p95" in fresh:
            self._calm_ttft = fresh["ttft_p95"]
        if self.starting and fresh.get("running") is not None:
            seeded = self._seed(fresh, now)
            if seeded is not None:
                return seeded  # (else what runs says nothing new: the usual rules, this same tick)
        queueing, act = self._queue_seen(fresh)
        if act:
            if self._queue_is_cheap(fresh):
                return self._cheap_queue(fresh["waiting"], inflight, now, self._idle(fresh))
            return self._queue_fall(fresh["waiting"], inflight, now)
        over, cut = self._latency_cut(fresh, inflight, now)
        self._over = over
        if over:
            return cut
        self._unreachable = None
        if queueing:
            return None  # one sample of a queue: neither grow nor fall until the next tick says
        return self._grow(fresh, inflight, held, now, queued)

    def _queue_seen(self, fresh: Mapping[Role, float]) -> tuple[bool, bool]:
        """Whether the engines queue beyond the target now, and whether to act on it (seen on two
        ticks running, or four times over at once)."""
        target = self.auto.target
        waiting, running = fresh.get("waiting"), fresh.get("running")
        queueing = waiting is not None and waiting > target.queue
        large = waiting is not None and waiting > _CLEAR_QUEUE * (target.queue + 1)
        rise = running - self._running if running is not None and self._running is not None else None
        waited = self._waiting or 0.0
        self._running, self._waiting = running, waiting
        if self._slow_start and queueing and rise is not None and rise > 0 and (
                not large or (rise >= _QUEUE_TAKEN * waited and self._queue_is_cheap(fresh))):
            # A few waiting while the engines still take more in are requests caught between two
            # steps (a burst's prefills), not engines out of room: a start does not stop for them.
            # Nor for a larger queue that costs no first token while what runs still rises by at
            # least half of what waited at the last reading: an engine that takes new requests in
            # only at join points (every so many steps) holds a doubling's burst in its queue until
            # the next one, then runs it. A queue that stays while what runs creeps up (by one or
            # two) is the engines out of room, the start's overshoot building up: it ends the start.
            queueing = False
        if queueing and not large and self._queue_is_cheap(fresh):
            queueing = False  # a few waiting that cost no first token anything
        seen_before, self._queueing = self._queueing, queueing
        return queueing, queueing and (seen_before or large)

    def _queue_is_cheap(self, fresh: Mapping[Role, float]) -> bool:
        """TTFT p95 under half its target, and not risen to three times what it was at the last reading
        with no engine queue: requests waiting at the engines cost no first token yet."""
        ttft, goal, calm = fresh.get("ttft_p95"), self.auto.target.ttft_p95, self._calm_ttft
        return ttft is not None and goal is not None and ttft < _QUEUE_TTFT * goal and (
            calm is None or ttft < max(_QUEUE_RISE * calm, _QUEUE_RISE_FLOOR * goal))

    def _queue_fall(self, waiting: float, inflight: int, now: float) -> Move | None:
        # What the engines run is what is in flight less what waits in their queues. A limit
        # already at or below that has taken the excess off: requests admitted before it still
        # wait there until running ones finish, and cutting again for them would overshoot.
        # A few requests waiting while the limit is well above what runs may be ones caught
        # between two engine steps: shed that excess, not the limit down to what runs. A larger
        # queue is the engines out of room (their KV cache): down to what they run at once.
        auto, before, was = self.auto, self.limit, self._value
        target = auto.target
        excess = waiting - target.queue
        full = inflight >= _PRESSED * self._value or waiting > _CLEAR_QUEUE * (target.queue + 1)
        base = float(inflight) if full else self._value
        fall_to = max(float(auto.min), base - excess, self._value * (1 - _MAX_CUT))
        if fall_to >= self._value:
            return None
        self._value = fall_to
        if self._slow_start and waiting <= _CLEAR_QUEUE * (target.queue + 1):
            # A few waiting twice running while the start is on: trim them, but only a queue the
            # engines cannot clear (four times over) ends the start; a few are as often requests
            # caught between steps at a high arrival rate, and the next doubling tells which.
            self._last_cut = now
        else:
            # A trim of a loose limit says nothing of where the engines have too many: keep that.
            # Out of a start's doubling, where they had too many is what they ran, not the overshoot.
            trouble = base - excess if self._slow_start else float(inflight)
            self._cut(now, min(was, max(trouble, self._value)) if full else None)
        return self._moved(before, now, "engine_queue",
                           f"the engines queue {waiting:g} requests (target {target.queue})")

    def _cheap_queue(self, waiting: float, inflight: int, now: float, idle: bool) -> Move | None:
        """A queue at the engines (four times the target, or seen twice) while TTFT p95 is under half
        its target: it costs no first token yet (an engine that prefills waiting requests first, or
        one that preempts and resumes). Its own queue is what feeds the engines' next step: keep a
        quarter over what they run (at most halving), once per cooldown, and leave where the engines
        had too many as it was. Falling to what runs, as for a costly queue, took the buffer a static
        limit keeps, and left the lanes below the highest holding slots admitted at the higher limit:
        the interactive lane waited past its deadline while they drained. A queue that does cost
        meets the full fall once TTFT shows it, on a later tick: the queue of engines that just lost
        capacity looks cheap until its requests' first tokens come late (a few seconds at a quarter
        over what runs; bench/adaptive.py's step measures it). In the start, a queue at ``idle``
        engines (``_idle``) is a doubling's prefills, not engines out of room: the trim leaves the
        start on (ending it there left the 8B at 33 slots, a third of what it runs, regrowing by 5 %
        per interval while the interactive lane waited)."""
        auto, before = self.auto, self.limit
        if not (self._slow_start and idle):
            # The engines are full: the start is over (where they had too many: unknown).
            self._slow_start = False
        if now - self._last_cut < auto.cooldown:
            return None
        runs = inflight - (waiting - auto.target.queue)
        fall_to = max(float(auto.min), self._value * (1 - _MAX_CUT), runs * (1 + _CHEAP_BUFFER))
        if fall_to >= self._value:
            return None
        self._value = fall_to
        self._last_cut = now
        self._growth = _GROW_FIRST
        return self._moved(before, now, "engine_queue",
                           f"the engines queue {waiting:g} requests (target {auto.target.queue}) at a TTFT "
                           f"p95 under half its target: a quarter over the {max(runs, 0):g} they run")

    def _latency_cut(self, fresh: Mapping[Role, float], inflight: int, now: float
                     ) -> tuple[bool, Move | None]:
        """Whether a percentile is over its target, and the cut it makes (None: not yet, or at min)."""
        auto, before, was = self.auto, self.limit, self._value
        over: list[tuple[float, Reason, str]] = []
        wait = auto.cooldown
        checks: tuple[tuple[Role, Reason], ...] = (("ttft_p95", "ttft"), ("tpot_p95", "tpot"))
        for role, reason in checks:
            value, goal = fresh.get(role), getattr(auto.target, role)
            if value is not None and goal is not None and value > goal:
                over.append((goal / value, reason, f"{role} {_ms(value)} > target {_ms(goal)}"))
                # A percentile still holds what it saw before the last fall until its window has
                # passed; a TTFT is observed when the first token comes, that long after its request
                # was admitted: one seen now may be of a request let in before the fall.
                wait = max(wait, self._lookback.get(role, 0.0) + (value if role == "ttft_p95" else 0.0))
        if not over:
            return False, None
        ratio, reason, text = min(over)
        at_min = self._value <= auto.min
        self._unreachable = f"{text} at min {auto.min}" if at_min else None
        if at_min or now - self._last_cut < wait:
            return True, None
        floor = _TPOT_CUT_FLOOR if reason == "tpot" else _CUT_FLOOR
        seen = self._lookback.get("ttft_p95", 0.0) + fresh.get("ttft_p95", 0.0)  # what a TTFT p95 holds
        if reason == "ttft" and _drained(fresh, auto.target.queue, self._queued_at, now, seen):
            floor = _TTFT_DRAINED_CUT_FLOOR
        self._value = max(float(auto.min), self._value * min(max(ratio, floor), _CUT_CEILING))
        if self._slow_start:
            # Before the engines first queue, a percentile over target is mostly the burst of
            # held requests the last doubling let in, prefilled at once: wait out its window,
            # then go on doubling (ending the start here left limits at a fraction of what the
            # engines run, crept up one slot per interval).
            self._last_cut = now
        else:
            self._cut(now, min(was, max(float(inflight), self._value)))
        return True, self._moved(before, now, reason, text)

    def _grow(self, fresh: Mapping[Role, float], inflight: int, held: bool, now: float, queued: int
              ) -> Move | None:
        auto, before, target = self.auto, self.limit, self.auto.target
        headroom = all(
            (value := fresh.get(role)) is None or (goal := getattr(target, role)) is None
            or value < goal * _HEADROOM
            for role in ("ttft_p95", "tpot_p95")
        # A cache 90 % full has no room to give. Past 1 is no usage (a percentage where a fraction
        # belongs): as in _kv_room, it may slow a start, never stop the limit for good.
        ) and not _KV_FULL <= fresh.get("kv_cache", 0.0) <= 1.0
        # Held back, and in flight within one slot per lane of the limit: at a few slots per lane (a
        # start from min) the lanes' rounded shares, each at least one slot, leave a lane at its share
        # with the slots that are left another lane's; 75 % is out of reach while work waits there.
        pressed = inflight >= _PRESSED * self._value or (held and inflight >= min(
            _PRESSED_HELD * self._value, self._value - self.lanes)) or (
            # In the start, work held back that would fill the limit, at engines that are idle: lanes
            # below the highest held at their shares (two slots of 16) while its own slots sit idle.
            self._slow_start and held and inflight + queued >= self._value and self._idle(fresh))
        if not headroom or not pressed or self._value >= auto.max:
            return None
        room = _kv_room(fresh) if self._slow_start else None
        doubled = self._grown()
        self._value = min(float(auto.max), doubled if room is None else max(
            min(doubled, room), self._value * (1 + _GROW_FIRST), self._value + 1))
        seen = ", ".join(f"{role} {_fmt(role, fresh[role])}" for role in sorted(fresh))
        why = f"headroom: {seen}"
        if room is not None and room < min(doubled, auto.max):
            why += f"; not doubled: at that usage the KV cache holds about {room / _KV_FULL:.0f}"
            if fresh["kv_cache"] <= 1.0:
                # The cache says where the engines fill: the start has found their scale, and goes no
                # further by doubling or by demand (going on crept the 70B's limit from 128 up the
                # cache's room, 145, 160, 189, at twice what ran, while the lanes below held work at
                # their shares). What is left is the careful growth, while in flight presses the limit.
                # (A usage past full is no usage: it slows a start, and must not end it for good.)
                why += "; the start ends"
                self._slow_start = False
                self._growth = _GROW_FIRST
        return self._moved(before, now, "headroom", why)

    def _idle(self, fresh: Mapping[Role, float]) -> bool:
        """The engines have room to spare: their KV cache under half full and TTFT p95 under a quarter
        of its target, as far as they are read (at least one of the two)."""
        kv, ttft, goal = fresh.get("kv_cache"), fresh.get("ttft_p95"), self.auto.target.ttft_p95
        if goal is None:
            ttft = None  # (no target to measure it by)
        return (kv is not None or ttft is not None) and (kv is None or kv < _IDLE_KV) \
            and (ttft is None or (goal is not None and ttft < _IDLE_TTFT * goal))

    # -- internals ------------------------------------------------------------------------------

    def _seed(self, fresh: Mapping[Role, float], now: float) -> Move | None:
        """The first fresh reading of what the engines run (the ``running`` role), while the limit is
        still its starting value: start from it. Engines that queue beyond the target (more than a few,
        or at a TTFT that shows it) run all they can at once: the limit is what runs (and the engines
        said "too many" there). Engines with room run at least that: the limit is at least what runs,
        and grows from there."""
        auto, before = self.auto, self.limit
        running, waiting = fresh["running"], fresh.get("waiting")
        # A few waiting at a TTFT p95 under half its target are no queue (as in _queue_seen): an
        # engine that takes new requests in every few steps shows some with slots free, and taking
        # them for a full engine made what ran then (two sequences) the limit's ceiling for good.
        queueing = waiting is not None and waiting > auto.target.queue and not (
            waiting <= _CLEAR_QUEUE * (auto.target.queue + 1) and self._queue_is_cheap(fresh))
        value = min(max(running if queueing else max(running, self._value), float(auto.min)), float(auto.max))
        self._value = value
        if queueing:
            self._cut(now, value)
        said = f"{running:g} running" + (f", {waiting:g} waiting" if waiting is not None else "")
        return self._moved(before, now, "running", f"starts from what the engines run: {said}")

    def _newest(self, readings: Mapping[str, Reading]) -> float | None:
        """When the newest good reading of this limit's own signals was taken."""
        times = [reading.updated_at for role in ROLES
                 if (name := getattr(self.auto.signals, role)) is not None
                 and (reading := readings.get(name)) is not None and reading.good
                 and reading.updated_at is not None]
        return max(times, default=None)

    def _fresh(self, readings: Mapping[str, Reading], now: float) -> dict[Role, float]:
        out: dict[Role, float] = {}
        for role in ROLES:
            name = getattr(self.auto.signals, role)
            if name is None:
                continue
            signal, reading = self._signals.read.get(name), readings.get(name)
            # The saturation rules' staleness test; a signal not read yet is missing here (no grace
            # for a first reading: stale_hold gives that).
            if signal is None or reading is None or reading.value is None or not reading.good \
                    or is_stale(reading, signal.stale_after, now, now):
                continue
            out[role] = reading.value
        return out

    def _stale(self, now: float) -> Move | None:
        if self._stale_since is None:
            self._stale_since = now
            self._reason, self._why, self._since = "stale", "no fresh signal: holding the last limit", now
        if now - self._stale_since < self.auto.stale_hold or self._value <= self.auto.min:
            return None
        before = self.limit
        self._value = max(float(self.auto.min), math.floor(self._value * _DECAY))
        quiet = now - self._stale_since
        why = f"no fresh signal for {quiet:.0f}s: decaying to min {self.auto.min}"
        return self._moved(before, now, "stale", why)

    def _grown(self) -> float:
        value, ceiling = self._value, self._ceiling
        if self._slow_start:
            return value * 2
        if ceiling is not None and ceiling * (1 - _NEAR) <= value < ceiling * (1 + _NEAR):
            self._growth = _GROW_FIRST  # past the old fall point without trouble: probe anew
            return max(value * (1 + _CREEP), value + 1)
        grown = max(value * (1 + self._growth), value + 1)
        self._growth = min(self._growth * 2, _GROW_MAX)
        if ceiling is not None and value < ceiling * (1 - _NEAR):
            return min(grown, max(ceiling * (1 - _NEAR), value + 1))
        return grown

    def _cut(self, now: float, trouble: float | None) -> None:
        """``trouble``: the concurrency the engines could not take (what ran, not a limit above it);
        None: not known from this fall (the last one's stays)."""
        if trouble is not None:
            self._ceiling = trouble
        self._slow_start = False
        self._last_cut = now
        self._growth = _GROW_FIRST

    def _moved(self, before: int, now: float, reason: Reason, why: str) -> Move | None:
        self._reason, self._why = reason, why
        if self.limit == before:
            return None
        self._since = now
        self.starting = False
        return Move(self.limit, before, now, reason, why)


def _kv_room(fresh: Mapping[Role, float]) -> float | None:
    """What the engines could run with their KV cache 90 % full, at the share of it each running
    request uses now (None: unknown, or too little in use to tell)."""
    kv, running = fresh.get("kv_cache"), fresh.get("running")
    if kv is None or running is None or not (math.isfinite(kv) and math.isfinite(running)) \
            or running < 1 or kv < _KV_MEASURABLE:
        return None
    return running / kv * _KV_FULL


def _drained(fresh: Mapping[Role, float], queue: int, queued_at: float | None, now: float, window: float
             ) -> bool:
    """The engines queue no more than ``queue`` now, but did (last at ``queued_at``) within ``window``
    (what a TTFT p95 seen now looks back over): the percentile holds that queue's first tokens."""
    waiting = fresh.get("waiting")
    return waiting is not None and waiting <= queue and queued_at is not None and now - queued_at <= window


def _lookbacks(auto: AutoCapacity, signals: Signals) -> dict[Role, float]:
    """How far back each of the limit's percentile signals looks (its window, or a query's range)."""
    out: dict[Role, float] = {}
    for role in ROLES:
        name = getattr(auto.signals, role)
        signal = signals.read.get(name) if name is not None else None
        if signal is not None and signal.lookback is not None:
            out[role] = signal.lookback
    return out


def _fmt(role: str, value: float) -> str:
    if role == "kv_cache":
        return f"{value:.0%}"
    return f"{value:g}" if role in ("waiting", "running") else _ms(value)


def size(policy: Policy, limit: int) -> Policy:
    """``policy`` with ``max_inflight: auto`` made concrete at ``limit`` (other policies unchanged).

    Each lane's max_inflight (and max_borrow) is its share of the limit: ``limit × its
    max_inflight / the lanes' max_inflight summed``, rounded, at least 1 slot (0 borrowed).
    """
    if not policy.auto_capacity:
        return policy
    total = sum(lane.max_inflight for lane in policy.lanes)
    lanes = tuple(
        lane.model_copy(update={
            "max_inflight": max(1, round(limit * lane.max_inflight / total)),
            "max_borrow": None if lane.max_borrow is None else max(0, round(limit * lane.max_borrow / total)),
        })
        for lane in policy.lanes
    )
    capacity = policy.capacity.model_copy(update={"max_inflight": limit})
    return policy.model_copy(update={"lanes": lanes, "capacity": capacity})

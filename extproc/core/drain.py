"""How fast each lane drains, and when a rejected request should come back (pure: explicit time, no I/O).

How this works: Retry-After should say when a request rejected now would get a slot if it came
back: the requests ahead of it in its lane (over every replica) divided by how fast the lane
completes requests (over every replica). :class:`CompletionRate` is an exponentially weighted
event rate: each completion adds ``1/tau`` and the estimate decays by ``e^(-dt/tau)``, so it
follows a change in throughput within a few ``tau`` and needs no timer. :class:`FleetRate` turns
the fleet's completion counters (one per lane in the shared store, read on each sync) into the
same kind of estimate. :class:`ReturnSchedule` books rejected clients' returns at a share of that
rate, and lets a retry that comes back on time claim its place. :class:`Returns` puts them
together for the scheduler: it measures each lane's completions, reads the rest of what it needs
of the lanes through :class:`LaneState`, and answers what a rejection tells its client.
"""

from __future__ import annotations

import math
import random
import sys
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

from extproc.core.decision import Reason, Ticket
from extproc.core.queue import LaneQueue
from extproc.core.retry import bounds, retry_after
from extproc.policy.schema import Lane, Policy

#: Time constant of the completion-rate estimates (seconds).
TAU = 10.0
#: A lane completing fewer requests per second than this drains slower than a Retry-After can say
#: (a minute at most): its measured rate is not used.
_SLOWEST_RATE = 1e-3


class CompletionRate:
    """Events per second, exponentially weighted over ``tau``; it does not decay while paused (a
    lane with nothing to do completes nothing, and that says nothing of how fast it drains)."""

    __slots__ = ("_at", "_paused", "_rate", "_since", "tau")

    def __init__(self, tau: float = TAU) -> None:
        self.tau = tau
        self._rate = 0.0
        self._at: float | None = None
        self._since: float | None = None
        self._paused: float | None = None

    def add(self, now: float, events: float = 1.0) -> None:
        self.resume(now)
        self._rate = self.value(now) + events / self.tau
        self._at = now
        self.watch(now)

    def value(self, now: float) -> float:
        if self._at is None:
            return 0.0
        until = self._paused if self._paused is not None else now
        return self._rate * math.exp(-max(0.0, until - self._at) / self.tau)

    def pause(self, now: float) -> None:
        """Nothing to do from ``now`` on: hold the estimate until :meth:`resume`."""
        if self._paused is None:
            self._paused = now

    def resume(self, now: float) -> None:
        if self._paused is not None:
            idle = max(0.0, now - self._paused)
            if self._at is not None:
                self._at += idle
            if self._since is not None:
                self._since += idle
            self._paused = None

    def watch(self, now: float) -> None:
        """Start watching at ``now`` even before the first event (a lane that completes nothing
        for a ``tau`` drains at 0 per second, known)."""
        if self._since is None:
            self._since = now

    def known(self, now: float) -> bool:
        """Whether it has watched long enough to mean something (one ``tau`` since the first event)."""
        until = self._paused if self._paused is not None else now
        return self._since is not None and until - self._since >= self.tau


class FleetRate:
    """Per lane, completions per second over the whole fleet, from monotonic counters."""

    def __init__(self, tau: float = TAU) -> None:
        self.tau = tau
        self._last: dict[str, tuple[int, float]] = {}
        self._rates: dict[str, CompletionRate] = {}

    def update(self, counters: Mapping[str, int], now: float) -> None:
        for lane, count in counters.items():
            before = self._last.get(lane)
            self._last[lane] = (count, now)
            if before is None or count < before[0] or now - before[1] > self.tau:
                # A first reading, the store restarted empty, or readings missed for a while (what
                # completed meanwhile would count as a burst now): a new baseline.
                continue
            rate = self._rates.setdefault(lane, CompletionRate(self.tau))
            rate.watch(before[1])
            if count > before[0]:
                rate.add(now, count - before[0])
        for lane in [lane for lane in self._rates if lane not in counters]:
            del self._rates[lane], self._last[lane]

    def rates(self, now: float) -> dict[str, float]:
        """Lanes watched for at least ``tau``: their fleet completion rates."""
        return {lane: rate.value(now) for lane, rate in self._rates.items() if rate.known(now)}


@dataclass(frozen=True, slots=True)
class Told:
    """What a rejection tells its client about coming back."""

    seconds: int
    """``Retry-After`` (whole seconds, at least 1)."""
    ms: int | None = None
    """The exact wait when a place on the return schedule was booked (``retry-after-ms``)."""
    allowed: bool = True
    """False: retrying soon cannot be promised (the schedule is full, or the retry budget has no
    room): ``x-should-retry: false``."""
    booked: bool = False


class ReturnSchedule:
    """Per lane, when rejected clients were told to come back, and whose return each place is.

    How this works: a lane keeps ``share`` of its completion rate for returning retries. Each
    rejection that may retry takes the next place of the lane's schedule, one per
    ``1 / (share * rate)`` seconds from when the drain says a slot frees (``earliest``): a burst
    of rejections comes back spread at that pace, not as one wave that all heard the same number.
    A place is booked for the rejected request's (lane, tenant) and told to the client to the
    millisecond (``Retry-After`` in whole seconds, rounded up, and ``retry-after-ms``).

    Returns take at most ``share`` of the lane's slot time too: each booking also spends its
    predicted service time from an allowance that refills at ``share`` of the lane's slots
    (``supply`` slot-seconds per second, holding at most the longest wait's worth). A long job
    that finds too little there is not booked (one long return costs the service of dozens of
    short ones, which the lane's shortest-job-first order would have served instead).

    A request marked as a retry that arrives around a due time (from ``EARLY`` s before it to
    ``LATE`` s after) *claims* one booking of its own tenant and lane, the earliest, and keeps the
    place its first attempt had (the scheduler ranks it as if it had arrived then). A claim
    consumes a booking, so a tenant's claims never outnumber the rejections it was told to come
    back from, and a retry header alone (no booking) gains nothing. Unclaimed bookings lapse
    ``LATE`` s after their due time. When the schedule is booked beyond the longest Retry-After
    allowed it is *full*: nothing is booked (the rejection says retrying soon cannot help).

    The schedule is this replica's (its part of the fleet's pace): a retry that lands on another
    replica finds no booking there and is an ordinary request.
    """

    #: How early before its due time a retry may claim its booking (a client's clock, the network).
    EARLY = 1.0
    #: How late after its due time it still may (whole-second Retry-After rounds the wait up).
    LATE = 2.0
    #: Bookings held at most (over every lane and tenant): beyond it the schedule is full.
    LIMIT = 100_000
    #: How long the edge's pass for a booking holds (ext_proc claims it within milliseconds): one
    #: booking lets one retry past the edge, not every request that says it retries.
    PASS_HOLD = 1.0

    def __init__(self, weight: Callable[[str], float] | None = None) -> None:
        self._weight: Callable[[str], float] = weight or (lambda _: 1.0)
        # lane -> tenant -> bookings held, and the sum of those tenants' weights: a tenant's cap
        # needs the weight of every tenant holding bookings, at each rejection, in O(1).
        self._held: dict[str, dict[str, int]] = {}
        self._held_weight: dict[str, float] = {}
        self._next: dict[str, float] = {}
        # (lane, tenant) -> [(due, first attempt's arrival)], due times increasing: a lane's
        # places only move forward.
        self._booked: dict[tuple[str, str], deque[tuple[float, float]]] = {}
        self._size = 0
        self._sweep_at = -math.inf
        # lane -> (slot-seconds left for returns, as of when)
        self._work: dict[str, tuple[float, float]] = {}
        # (lane, tenant) -> {a booking's due time: when the edge let a retry through for it}
        self._passes: dict[tuple[str, str], dict[float, float]] = {}

    def __len__(self) -> int:
        return self._size

    def place(self, lane: str, now: float, earliest: float, latest: float, pace: float, *,
              work: float = 0.0, supply: float = math.inf) -> float | None:
        """The due time the next booking of ``lane`` would get: at least ``earliest`` s from now, no
        sooner than one ``1 / pace`` after the last place; None when that is beyond ``latest`` s
        (or the drain, or the pace, is no number), or when the lane's allowance (refilled at
        ``supply``) holds less than ``work`` slot-seconds: the schedule is full."""
        if not (math.isfinite(earliest) and pace > 0 and math.isfinite(pace)) or earliest > latest:
            return None
        if work > self._allowance(lane, now, latest, supply):
            return None
        if self._size >= self.LIMIT:
            self._sweep(now)
            if self._size >= self.LIMIT:
                return None
        due = max(self._next.get(lane, -math.inf), now + earliest)
        return due if due - now <= latest + 1e-9 else None

    def book(self, lane: str, tenant: str, due: float, pace: float, first: float, *, now: float,
             latest: float = math.inf, work: float = 0.0, supply: float = math.inf) -> None:
        """Book ``due`` (from :meth:`place`, same arguments) for ``tenant``'s return; ``first``: when
        the request first arrived (a retry's booking keeps its first attempt's)."""
        self._next[lane] = due + 1.0 / pace
        if work > 0 and math.isfinite(supply):
            self._work[lane] = (self._allowance(lane, now, latest, supply) - work, now)
        self._booked.setdefault((lane, tenant), deque()).append((due, first))
        self._size += 1
        self._count(lane, tenant, +1)

    def _count(self, lane: str, tenant: str, delta: int) -> None:
        held = self._held.setdefault(lane, {})
        before = held.get(tenant, 0)
        after = before + delta
        if after > 0:
            held[tenant] = after
        else:
            held.pop(tenant, None)
        if not held:
            del self._held[lane]
            self._held_weight.pop(lane, None)
        elif (before == 0) != (after <= 0):
            # The holders changed (a first or a last booking): summed anew, never drifting.
            self._held_weight[lane] = sum(self._weight(name) for name in held)

    def reweigh(self, weight: Callable[[str], float]) -> None:
        """Tenants' weights changed (a policy reload): the held weights are summed anew."""
        self._weight = weight
        self._held_weight = {lane: sum(weight(t) for t in held) for lane, held in self._held.items()}

    def held_weight(self, lane: str) -> float:
        """The summed weights of the tenants holding bookings on ``lane``."""
        return self._held_weight.get(lane, 0.0)
    def _allowance(self, lane: str, now: float, latest: float, supply: float) -> float:
        if not math.isfinite(supply):
            return math.inf
        cap = supply * latest
        level, at = self._work.get(lane, (cap, now))
        return min(cap, level + max(0.0, now - at) * supply)

    def claim(self, lane: str, tenant: str, now: float) -> float | None:
        """A retry of ``tenant`` to ``lane`` arrives: consume its earliest booking due around now;
        returns that booking's first arrival, or None (no booking: an ordinary request)."""
        booked = self._live(lane, tenant, now)
        if booked is None or booked[0][0] - self.EARLY > now:
            return None
        due, first = booked.popleft()
        self._size -= 1
        self._count(lane, tenant, -1)
        if not booked:
            del self._booked[(lane, tenant)]
        self._unpass(lane, tenant, due)  # its pass, if the edge gave one, is spent with it
        return first

    def _unpass(self, lane: str, tenant: str, due: float) -> None:
        passes = self._passes.get((lane, tenant))
        if passes is not None:
            passes.pop(due, None)
            if not passes:
                del self._passes[(lane, tenant)]

    def claimable(self, lane: str, tenant: str, now: float) -> bool:
        """Whether :meth:`claim` would find a booking now that the edge has not let a retry through
        for in the last ``PASS_HOLD`` s (the edge asks; when true, that booking's pass is taken)."""
        booked = self._live(lane, tenant, now)
        if booked is None:
            return False
        passes = self._passes.setdefault((lane, tenant), {})
        for due, _ in booked:
            if due - self.EARLY > now:
                break
            passed = passes.get(due)
            if passed is None or passed + self.PASS_HOLD < now:
                passes[due] = now
                return True
        if not passes:
            del self._passes[(lane, tenant)]
        return False

    def holds(self, lane: str, tenant: str, now: float) -> bool:
        """Whether :meth:`claim` would find a booking now (nothing is taken)."""
        booked = self._live(lane, tenant, now)
        return booked is not None and booked[0][0] - self.EARLY <= now

    def booked(self, lane: str, tenant: str) -> int:
        """Bookings ``tenant`` holds on ``lane``'s schedule (lapsed ones until swept)."""
        return self._held.get(lane, {}).get(tenant, 0)

    def holders(self, lane: str) -> Mapping[str, int]:
        """The tenants holding bookings on ``lane``'s schedule, with how many."""
        return self._held.get(lane, {})

    def _live(self, lane: str, tenant: str, now: float) -> deque[tuple[float, float]] | None:
        booked = self._booked.get((lane, tenant))
        if booked is None:
            return None
        while booked and booked[0][0] + self.LATE < now:
            due, _ = booked.popleft()
            self._size -= 1
            self._count(lane, tenant, -1)
            self._unpass(lane, tenant, due)
        if not booked:
            del self._booked[(lane, tenant)]
            return None
        return booked

    def _sweep(self, now: float) -> None:
        for lane, tenant in list(self._booked):
            self._live(lane, tenant, now)
        for key in [key for key in self._passes if key not in self._booked]:
            del self._passes[key]
        self._sweep_at = now + self.LATE

    def expire(self, now: float) -> None:
        """Drop lapsed bookings (at most once per ``LATE`` s: bookings lapse that slowly)."""
        if now >= self._sweep_at:
            self._sweep(now)

    def forget(self, lanes: set[str]) -> None:
        """Only ``lanes`` are kept (after a reload)."""
        for lane in [lane for lane in self._next if lane not in lanes]:
            del self._next[lane]
            self._work.pop(lane, None)
        for key in [key for key in self._booked if key[0] not in lanes]:
            self._size -= len(self._booked.pop(key))
        for lane in [lane for lane in self._held if lane not in lanes]:
            del self._held[lane]
            self._held_weight.pop(lane, None)
        for key in [key for key in self._passes if key[0] not in lanes]:
            del self._passes[key]


class LaneState(Protocol):
    """What :class:`Returns` reads of the lanes (the scheduler's lanes implement it)."""

    @property
    def policy(self) -> Policy: ...

    @property
    def configs(self) -> Mapping[str, Lane]:
        """Every lane the scheduler has (retired ones too), by name."""
        ...

    def queue(self, lane: str) -> LaneQueue | None: ...

    def running(self, lane: str) -> Collection[Ticket]:
        """``lane``'s in-flight tickets on this replica."""
        ...

    def limit(self, lane: str) -> int:
        """``lane``'s in-flight limit in force (0 for a lane it does not have)."""
        ...

    def others_queued(self, lane: str) -> int:
        """What the other replicas queue in ``lane``, as last seen."""
        ...

    def admissible(self, lane: str) -> bool:
        """Whether one more request of ``lane`` could start now."""
        ...

    def tenant_weight(self, tenant: str) -> float: ...

    def estimated_wait(self, lane: Lane, rank: float, now: float) -> float:
        """When a request of ``rank`` would start, by list scheduling on the lane's slots."""
        ...


class Returns:
    """Each lane's drain and its return schedule: what a rejection tells its client.

    Owns this replica's completion rates per lane, the fleet's (when a shared store says), the
    return schedule, and the retry budget's say (``permit``); reads the lanes through
    :class:`LaneState`.
    """

    def __init__(self, lanes: LaneState, rng: random.Random,
                 permit: Callable[[float], bool] | None = None) -> None:
        self._lanes = lanes
        self._rng = rng
        # How fast each lane frees slots: this replica's own completions, and the fleet's (from the
        # shared store's counters) when a store says.
        self._completions: dict[str, CompletionRate] = {}
        self._fleet_rates: dict[str, float] = {}
        self._replicas = 1
        self._schedule = ReturnSchedule(lanes.tenant_weight)
        #: Reserves a retry in the retry budget for a rejection that lets its client retry; False:
        #: no room (None: no budget).
        self.permit = permit

    # -- what the lanes do ----------------------------------------------------------

    def completed(self, lane: str, now: float, idle: bool) -> None:
        """A request of ``lane`` ended in its slot; ``idle``: the lane has nothing more to do."""
        rate = self._completions.get(lane)
        if rate is None:
            rate = self._completions[lane] = CompletionRate()
        rate.add(now)
        if idle:
            rate.pause(now)  # idle: completing nothing says nothing of its pace

    def started(self, lane: str, now: float) -> None:
        """A request of ``lane`` took a slot: the lane is not idle."""
        rate = self._completions.get(lane)
        if rate is not None:
            rate.resume(now)

    def forget(self, lanes: Collection[str]) -> None:
        """Only ``lanes`` are kept (after a reload, or once retired lanes are gone)."""
        for name in [name for name in self._completions if name not in lanes]:
            del self._completions[name]
        self._schedule.forget(set(lanes))

    def reweigh(self) -> None:
        """Tenants' weights may have changed (a policy reload)."""
        self._schedule.reweigh(self._lanes.tenant_weight)

    # -- what a rejection tells -----------------------------------------------------

    def retry_after(self, reason: Reason, lane: str, now: float, drain: float | None = None, *,
                    tenant: str | None = None, first: float | None = None,
                    predicted: float | None = None, rank: float | None = None) -> Told:
        """What a rejection tells its client: when to come back, and whether retrying can help.

        Where retrying soon cannot help (a closed or shed lane): the longest allowed, jittered.
        Otherwise from when the request would start from its place (``drain_wait`` at ``rank``; a
        booked return keeps that place): once the lane's
        completion rate is known, the next place of the lane's return schedule from then on (one
        client per ``1 / (retry_after.share * rate)`` s; this replica's part of the fleet's rate),
        booked for ``tenant``'s return (``first``: when the request first arrived) if the retry
        budget has room. Returns also spend their service time (``predicted``) from ``share`` of
        the lane's slots: a long job that finds too little there is not booked. With the schedule
        full (to the longest wait allowed, or of slot time), retrying is not allowed.
        Before a rate is measured the schedule paces at the rate the running requests imply
        (``_running_rate``). With nothing running, with ``retry_after.share`` 0, or for a replica
        shutting down: the drain itself, jittered (a replica shutting down always allows the retry,
        which another replica takes, and leaves the retry budget alone). ``drain``: ``drain_wait``
        if the caller already has it (the edge's lane check computed it). The retry budget is asked
        once, here (``permit``).
        """
        config = self._lanes.policy.retry_after
        if not reason.retry_helps:
            return Told(retry_after(config.max, config, self._rng))
        if drain is None:
            drain = self.drain_wait(lane, now, rank)
        if reason.retry_elsewhere:
            # A replica shutting down: the retry goes to another one. Nothing is booked here, and
            # the retry budget is not asked (a reservation is spent only by a retry arriving here,
            # and a tight budget must not tell the client to give up): retrying is always allowed.
            return Told(retry_after(drain, config, self._rng))
        measured = self._rate(lane, now) or self._running_rate(lane)
        if measured is not None and tenant is not None and config.share > 0:
            low, high = bounds(config)
            rate, share = measured
            pace = config.share * rate / share
            self._schedule.expire(now)
            # From the drain on (a return before a slot frees would find none), but at most the
            # longest allowed: a booked return keeps its first attempt's place, so it does not
            # wait behind all of a long queue.
            earliest = min(max(drain, low), high)
            # This replica's part of share of the lane's slots, as slot-seconds per second.
            supply = config.share * self._lanes.limit(lane) / share
            work = predicted or 0.0
            cap = self._booking_cap(lane, tenant, pace, high, work, supply)
            if self._schedule.booked(lane, tenant) >= cap:
                # Its tenant holds its share of the returns: no place can be promised to this one.
                return Told(retry_after(drain, config, self._rng), allowed=False)
            due = self._schedule.place(lane, now, earliest, high, pace, work=work, supply=supply)
            if due is None:
                # Booked to the longest wait allowed: no return within it can be promised.
                return Told(retry_after(config.max, config, self._rng), allowed=False)
            if not self._permitted(now):
                return Told(retry_after(drain, config, self._rng), allowed=False)
            self._schedule.book(lane, tenant, due, pace, now if first is None else first, now=now,
                                latest=high, work=work, supply=supply)
            wait = due - now
            return Told(max(1, math.ceil(wait - 1e-9)), ms=max(1, round(wait * 1000)), booked=True)
        return Told(retry_after(drain, config, self._rng), allowed=self._permitted(now))

    def _running_rate(self, lane: str) -> tuple[float, int] | None:
        """Before a completion rate is measured: the rate the lane's running requests imply (each
        slot completes one request per predicted service time of what runs in it: the sum of
        1 / predicted; not the count over the mean, which long jobs, running longest, dominate),
        so the first rejections are spread too."""
        tickets = self._lanes.running(lane)
        if not tickets:
            return None
        rate = sum(1.0 / max(t.predicted, 1e-3) for t in tickets)
        return (rate, 1) if _SLOWEST_RATE <= rate < math.inf else None

    def _permitted(self, now: float) -> bool:
        return self.permit is None or self.permit(now)

    # -- bookings -------------------------------------------------------------------

    def claim(self, lane: str, tenant: str, now: float) -> float | None:
        """A retry of ``tenant`` to ``lane`` arrives: its booking's first arrival, consumed, if it
        holds one (only a tenant the gateway vouches for may claim); None: an ordinary request."""
        return self._schedule.claim(lane, tenant, now) if self._vouched(tenant) else None

    def claimable(self, lane: str, tenant: str, now: float) -> bool:
        """Whether a retry of ``tenant`` to ``lane`` arriving now would claim a booking (the edge
        lets one retry per booking through to ext_proc, which claims it)."""
        return self._vouched(tenant) and self._schedule.claimable(lane, tenant, now)

    def holds_booking(self, lane: str, tenant: str, now: float) -> bool:
        """Whether a retry of ``tenant`` to ``lane`` arriving now would claim a booking (nothing is
        taken: ext_proc's own check before it submits)."""
        return self._vouched(tenant) and self._schedule.holds(lane, tenant, now)

    def _vouched(self, tenant: str) -> bool:
        """Whether ``tenant`` came from a header the gateway vouches for (not the default)."""
        policy = self._lanes.policy
        tenants = policy.tenants
        return (tenants.header is not None and tenants.header in policy.trusted_headers
                and tenant != tenants.default)

    def _booking_cap(self, lane: str, tenant: str, pace: float, high: float, work: float,
                     supply: float) -> int:
        """How many bookings ``tenant`` may hold on ``lane``'s schedule: its weight's share of the
        returns the longest wait holds (places at ``pace``, and the slot time allowed for returns,
        ``supply``, in jobs of this one's ``work``), among the tenants queued or booked there: one
        tenant's flood of rejections cannot take every return."""
        weight = self._lanes.tenant_weight
        held = self._schedule.holders(lane)
        total = self._schedule.held_weight(lane)  # kept as bookings come and go: O(1)
        queue = self._lanes.queue(lane)
        queued = queue.tenants() if queue is not None else {}
        for name in queued:  # at most max_queued of them
            if name not in held:
                total += weight(name)
        mine = weight(tenant)
        if tenant not in held and tenant not in queued:
            total += mine
        share = mine / total if total > 0 else 1.0
        if share >= 1 - 1e-12:
            return sys.maxsize  # alone: the schedule's own limits are all there is
        returns = pace * high
        if work > 0 and math.isfinite(supply):
            returns = min(returns, supply * high / work)
        return max(1, math.ceil(share * returns))

    @property
    def bookings(self) -> int:
        """Returns booked on the lanes' schedules and not yet claimed (lapsed ones until swept)."""
        return len(self._schedule)

    def expire_bookings(self, now: float) -> None:
        """Sweep lapsed bookings (at most once per ``ReturnSchedule.LATE`` s)."""
        self._schedule.expire(now)

    # -- drain rates ----------------------------------------------------------------

    def set_drain_rates(self, rates: Mapping[str, float], replicas: int = 1) -> None:
        """The fleet's completions per second per lane (from the shared store; lanes absent are
        measured here) and how many replicas share them (each books its part of the schedule)."""
        self._fleet_rates = dict(rates)
        self._replicas = max(1, replicas)

    def drain_rate(self, lane: str, now: float) -> float | None:
        """Completions per second in ``lane``: the fleet's if known, else this replica's once it
        has watched for a while; None before that (or while slower than Retry-After can say)."""
        measured = self._rate(lane, now)
        return measured[0] if measured is not None else None

    def _rate(self, lane: str, now: float) -> tuple[float, int] | None:
        """(completions per second, how many replicas share them) for ``lane``, if known."""
        fleet = self._fleet_rates.get(lane)
        if fleet is not None:
            rate, share = fleet, self._replicas
        else:
            local = self._completions.get(lane)
            if local is None or not local.known(now):
                return None
            rate, share = local.value(now), 1
        if not (rate >= _SLOWEST_RATE and math.isfinite(rate)):
            return None
        return rate, share

    def drain_rates(self, now: float) -> dict[str, float | None]:
        """Every lane's ``drain_rate``."""
        return {name: self.drain_rate(name, now) for name in self._lanes.configs}

    def drain_wait(self, lane: str, now: float, rank: float | None = None) -> float:
        """Seconds until a request joining ``lane``'s queue now would get a slot: the requests
        ahead of it over every replica (this one's queue and the others' as last seen), plus
        itself, over the lane's measured completion rate. ``rank``: its place in the lane's order
        (None: behind the whole queue, as the edge, which knows no job size, asks); the other
        replicas' queues count in the share this one's has ahead of it. Until a rate is known,
        list scheduling on this replica's own predicted service times. 0 with a slot free now."""
        lanes = self._lanes
        config = lanes.configs.get(lane)
        if config is None:
            return 0.0
        queue = lanes.queue(lane)
        here = len(queue) if queue is not None else 0
        if here + lanes.others_queued(lane) == 0 and lanes.admissible(lane):
            return 0.0
        measured = self._rate(lane, now)
        if measured is None:
            return lanes.estimated_wait(config, math.inf if rank is None else rank, now)
        rate, _ = measured
        ahead: float = here
        others: float = lanes.others_queued(lane)
        if rank is not None and queue is not None and here:
            ahead = sum(1 for e in queue.entries() if e.rank <= rank)
            others = others * ahead / here
        # The fleet's rate drains every replica's queue; this replica's own rate only its own.
        if lane in self._fleet_rates:
            ahead += others
        return (ahead + 1) / rate

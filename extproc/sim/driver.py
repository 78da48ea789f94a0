"""One virtual-clock driver of the decision machine: what ``simulate``, ``simulate --verify`` and
``policy explain`` share.

How this works: the live service drives the machine (``core/machine.py``) with the wall clock; the
offline tools drive it with this. A request is offered as the live path meets it: the edge (when the
policy has one) judges its arrival descriptor first — the very entries the proxy's ratelimit filter
would send (``Intake.descriptor``) — and, unless it sheds the request, the one intake classifies and
sizes it (from its body, or from the sizes a trace or a log recorded) — or refuses it for its body,
as the live path does (``Machine.body_verdict``) — and the machine decides.
Decisions come out of every event, for the request offered and for others (a queued request
admitted because a slot freed, one evicted, one past its deadline); each goes to the listener, which
says when an admitted request ends (:meth:`Driver.finish_at`). Time moves only forward: :meth:`run`
takes, in time order, the next scheduled event (an arrival, a request's end) or the machine's next
timer, on one clock. ``simulate`` runs its own loop (an engine, signals, clients) and uses
:meth:`offer`, :meth:`release` and :meth:`expire` on the same driver.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from extproc.core.decision import Decision, Outcome, Ticket
from extproc.core.estimate import Job
from extproc.core.intake import Arrival
from extproc.core.machine import Judgement, Machine, Refusal, Shed, Submitted


class Listener(Protocol):
    def admitted(self, decision: Decision, now: float) -> None:
        """A request is admitted (at once, or from its queue): say when it ends (``finish_at``)."""

    def rejected(self, decision: Decision, now: float) -> None:
        """A request is refused by ext_proc's decision (at once, or from its queue)."""


@dataclass(frozen=True, slots=True)
class Offer:
    """A request as it arrives: its head, and its body or the sizes it recorded."""

    method: str
    path: str
    headers: Mapping[str, str]
    """Lower-case names."""
    body: bytes | None = None
    """The raw body (``policy explain``); None with ``sized``."""
    sized: bool = False
    """The body is known only by its sizes (a trace, a decision log): ``model`` and the token counts."""
    model: str | None = None
    prompt_tokens: int = 0
    output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Answer:
    """What an offered request got at once."""

    lane: str
    tenant: str
    judgement: Judgement | None = None
    """The edge's judgement (None: the policy has no edge)."""
    shed: Shed | None = None
    """The edge's refusal, as the client sees it (None: it let the request through)."""
    arrival: Arrival | None = None
    """The request as the intake saw it (None: shed at the edge)."""
    decision: Decision | None = None
    """ext_proc's decision (None: shed at the edge, or refused at its intake)."""
    evicted: tuple[Decision, ...] = ()
    """Queued requests it pushed out."""
    refusal: Refusal | None = None
    """ext_proc refused it for its body before deciding (no ticket; the listener hears nothing)."""


class Driver:
    def __init__(self, machine: Machine, listener: Listener, now: float = 0.0) -> None:
        self.machine = machine
        self.listener = listener
        self.now = now
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = 0

    # -- requests -------------------------------------------------------------------------------

    def offer(self, offer: Offer, now: float, *, decided: Callable[[Ticket], None] | None = None) -> Answer:
        """Decide an arriving request as the live path does: the edge, the intake, the machine.

        ``decided``: told the request's ticket before any decision is handed to the listener."""
        self.now = now
        machine = self.machine
        judgement = None
        config = machine.policy.ratelimit
        if config.mode != "off":
            entries = {"generic_key": config.request_descriptor,
                       **machine.intake.descriptor(offer.method, offer.path, offer.headers)}
            judgement = machine.judge(config, entries, 1, now)
            if judgement.over and not judgement.shadow:
                return Answer(judgement.lane, judgement.tenant, judgement, machine.shed([judgement], now))
        intake = machine.intake
        if offer.sized:
            head = intake.head(offer.method, offer.path, offer.headers)
            arrival = intake.sized(head, model=offer.model, prompt_tokens=offer.prompt_tokens,
                                   output_tokens=offer.output_tokens)
        else:
            arrival = intake.request(offer.method, offer.path, offer.headers, offer.body)
            refusal = machine.body_verdict(arrival.body) if arrival.body_read else None
            if refusal is not None:
                return Answer(arrival.lane, arrival.tenant, judgement, arrival=arrival, refusal=refusal)
        submitted = machine.submit(arrival.lane, arrival.tenant, arrival.job, now, retry=arrival.retry)
        decision = submitted.decision
        if decided is not None:
            decided(decision.ticket)
        self.settle([decision, *submitted.evicted], now)
        return Answer(arrival.lane, arrival.tenant, judgement, None, arrival, decision, submitted.evicted)

    def submit(self, lane: str, tenant: str, job: Job, now: float, *, retry: bool = False) -> Submitted:
        """A request already classified and sized (a synthetic one) goes straight to the machine."""
        self.now = now
        submitted = self.machine.submit(lane, tenant, job, now, retry=retry)
        self.settle([submitted.decision, *submitted.evicted], now)
        return submitted

    def settle(self, decisions: Iterable[Decision], now: float) -> None:
        """Hand decisions to the listener (an admission is final here: no store to confirm it)."""
        listener = self.listener
        for decision in decisions:
            if decision.outcome is Outcome.ADMITTED:
                self.machine.admitted(decision)
                listener.admitted(decision, now)
            elif decision.outcome is Outcome.REJECTED:
                listener.rejected(decision, now)

    def release(self, ticket: Ticket, now: float, *, learn: bool = True) -> None:
        """A request ended now."""
        self.now = now
        self.settle(self.machine.release(ticket, now, learn), now)

    def expire(self, now: float) -> None:
        """The machine's timers due by ``now`` (deadlines, leases)."""
        self.now = now
        self.settle(self.machine.expire(now), now)

    # -- the clock ------------------------------------------------------------------------------

    def at(self, when: float, event: Callable[[float], None]) -> None:
        """Run ``event(when)`` at ``when`` (events at one instant run in the order they were given)."""
        heapq.heappush(self._heap, (when, self._seq, event))
        self._seq += 1

    def finish_at(self, ticket: Ticket, when: float, *, learn: bool = True) -> None:
        """An admitted request ends at ``when``."""
        self.at(when, lambda now: self.release(ticket, now, learn=learn))

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Take events and timers in time order until none is left (or ``until()`` holds)."""
        machine = self.machine
        heap = self._heap
        while until is None or not until():
            timer = machine.next_timer()
            now = min(heap[0][0] if heap else math.inf, math.inf if timer is None else timer)
            if now == math.inf:
                return
            self.now = now
            if timer is not None and timer <= now:
                self.expire(now)
            while heap and heap[0][0] <= now:
                _, _, event = heapq.heappop(heap)
                event(now)

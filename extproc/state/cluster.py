"""What one replica makes of the shared store's answers: pure, no I/O, explicit ``now``.

The controller publishes its queues, reads the cluster (:class:`~extproc.state.GlobalView`),
and tells the scheduler what the *other* replicas hold and queue (:func:`others`). When the
store refuses a slot, the lane backs off before it asks again (:class:`RefusalBackoff`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from extproc.state import GlobalView, Limits

#: Backoff of a lane the shared ledger refused: from this, doubling while refusals repeat, up to the max.
RETRY_MIN_S = 0.05
RETRY_MAX_S = 2.0


@dataclass(frozen=True, slots=True)
class Others:
    """What the other replicas hold and queue, as the scheduler takes it (``Scheduler.set_others``)."""

    inflight: Mapping[str, int]
    queued: Mapping[str, int]
    total: int | None = None
    """Slots of the whole capacity they hold, when not the sum over lanes."""


def others(view: GlobalView, mine: Mapping[str, int], queued_here: Mapping[str, int], limits: Limits,
           alone: Limits | None) -> Others:
    """The other replicas' part of ``view``, given what this replica holds (``mine``: leases per
    lane) and queues (``queued_here``, published before the view was read).

    While the store is unreachable (``view.degraded``) and this replica goes on within ``alone``
    (its allotment of the limits), the others are taken to hold every slot beyond it: the
    scheduler then decides as the ledger will, instead of admitting on the full limits what the
    ledger refuses, again and again. Degraded with no allotment (failing closed): nothing of the
    others is known, and the ledger grants nothing anyway.
    """
    if view.degraded:
        if alone is None:
            return Others({}, {})
        return Others({lane.name: max(0, lane.max_inflight - alone.lane(lane.name).max_inflight)
                       for lane in limits.lanes}, {}, max(0, limits.capacity - alone.capacity))
    return Others({lane: n - mine.get(lane, 0) for lane, n in view.inflight.items()},
                  {lane: n - queued_here.get(lane, 0) for lane, n in view.queued.items()})


class RefusalBackoff:
    """When a lane the ledger refused may ask again: a refusal must never turn into a loop of
    grants and refusals. The wait doubles while refusals repeat (from ``RETRY_MIN_S`` up to
    ``RETRY_MAX_S``) and is jittered, so replicas refused together do not come back together;
    a grant resets it. A freed slot anywhere lets every refused lane ask at once (the caller's
    wake-up), whatever its backoff.
    """

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._streak: dict[str, int] = {}
        self._at: dict[str, float] = {}

    def refused(self, lane: str, now: float) -> float:
        """Count a refusal of ``lane``; when it may ask again."""
        streak = self._streak.get(lane, 0)
        self._streak[lane] = streak + 1
        wait = min(RETRY_MIN_S * 2 ** min(streak, 8), RETRY_MAX_S)
        self._at[lane] = now + wait * self._rng.uniform(0.5, 1.5)
        return self._at[lane]

    def granted(self, lane: str) -> None:
        self._streak.pop(lane, None)
        self._at.pop(lane, None)

    def due(self, lanes: Iterable[str], now: float) -> set[str]:
        """Of the refused ``lanes``, those whose backoff is over."""
        return {lane for lane in lanes if self._at.get(lane, 0.0) <= now}

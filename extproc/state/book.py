"""One replica's own side of the shared ledger: the leases it holds, those to remove, its queue summary.

How this works: no I/O, so the outage fallback can go on granting and releasing here while the
store is away. A lease this replica holds is *held*; one released, or acquired with its answer
lost (the script may have run), is *pending* until the store has removed it. The heartbeat puts
every held lease back into the store and removes every pending one; ``version`` counts the
changes, so a caller can tell whether a grant or release slipped in while it talked to the
store. The queue summary (queued count and best rank per lane, per-tenant counts) is kept both
as numbers and as the JSON the scripts store; ``take_summary`` hands over what changed since the
last send, with the lanes whose waiters the other replicas should re-check (``wake``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from extproc.state import summary_changes


class LocalBook:
    """This replica's leases and queue summary, as it knows them itself."""

    def __init__(self) -> None:
        self._held: dict[str, set[str]] = {}
        self._pending: dict[str, set[str]] = {}
        """Leases to remove from Redis when it answers again (released, or acquired in doubt)."""
        self.version = 0
        self._known: set[str] = set()
        self._queued: dict[str, int] = {}
        self._heads: dict[str, float] = {}
        self.summary = ""
        """The queue summary as the scripts store it ("" while nothing is queued)."""
        self.tenants = ""
        """The per-tenant queued counts as the scripts store them ("" while there are none)."""
        self._tenant_counts: dict[str, dict[str, int]] = {}
        self._dirty = False
        self._wake: set[str] = set()

    # -- leases ---------------------------------------------------------------------------

    def hold(self, lane: str, lease: str) -> None:
        """Record a lease granted without Redis; the next heartbeat registers it."""
        self._held.setdefault(lane, set()).add(lease)
        pending = self._pending.get(lane)
        if pending is not None:
            pending.discard(lease)
        self.version += 1

    def drop(self, lane: str, lease: str) -> None:
        """Forget a lease without telling Redis yet; the next heartbeat removes it there."""
        leases = self._held.get(lane)
        if leases is None or lease not in leases:
            return
        leases.discard(lease)
        if not leases:
            del self._held[lane]
        self._pending.setdefault(lane, set()).add(lease)
        self.version += 1

    def forget(self, lane: str, lease: str) -> None:
        """No longer hold a lease that is being released in Redis right now."""
        leases = self._held.get(lane)
        if leases is not None:
            leases.discard(lease)
            if not leases:
                del self._held[lane]
        self.version += 1

    def doubt(self, lane: str, lease: str) -> None:
        """Remove a lease from Redis when it answers again (a call about it may or may not have run)."""
        self._pending.setdefault(lane, set()).add(lease)

    def drop_all(self) -> None:
        """Hold nothing any more: every held lease is to be removed from Redis."""
        for lane, leases in self._held.items():
            self._pending.setdefault(lane, set()).update(leases)
        self._held.clear()

    @property
    def held(self) -> dict[str, int]:
        """Leases this replica holds, per lane."""
        return {lane: len(leases) for lane, leases in self._held.items() if leases}

    def holds(self, lane: str, lease: str) -> bool:
        return lease in self._held.get(lane, ())

    def leases(self, lane: str) -> Iterable[str]:
        """The leases held in ``lane``."""
        return self._held.get(lane, ())

    def pending(self, lane: str) -> set[str]:
        """A copy of the leases of ``lane`` still to remove from Redis."""
        return set(self._pending.get(lane, ()))

    def removed(self, dropped: Mapping[str, set[str]]) -> None:
        """Redis has removed these pending leases."""
        for lane, gone in dropped.items():
            pending = self._pending.get(lane)
            if pending is not None:
                pending -= gone
                if not pending:
                    del self._pending[lane]

    # -- lanes ----------------------------------------------------------------------------

    def learn(self, lanes: Iterable[str]) -> None:
        """Lanes of the limits in use (their waiters are woken for ``*``, the heartbeat covers them)."""
        self._known.update(lanes)

    def lanes(self) -> set[str]:
        """Every lane known here or holding a lease."""
        return self._known | set(self._held)

    def every_lane(self) -> list[str]:
        """Every lane known, holding a lease or with leases to remove, sorted (the heartbeat's)."""
        return sorted(self._known | set(self._held) | set(self._pending))

    # -- queue summary --------------------------------------------------------------------

    @property
    def queue(self) -> tuple[dict[str, int], dict[str, float], dict[str, dict[str, int]]]:
        """This replica's own queue summary as last set: queued, heads, tenants per lane."""
        tenants = {lane: dict(per) for lane, per in self._tenant_counts.items()}
        return dict(self._queued), dict(self._heads), tenants

    def set_queue(self, queued: Mapping[str, int], heads: Mapping[str, float | None],
                  tenants: Mapping[str, Mapping[str, int]] | None = None) -> None:
        """Record this replica's queue summary; the next publish or heartbeat sends it."""
        new_queued = {lane: n for lane, n in queued.items() if n}
        new_heads = {lane: h for lane, h in heads.items() if h is not None}
        self._wake.update(summary_changes((self._queued, self._heads), (new_queued, new_heads)))
        self._queued, self._heads = new_queued, new_heads
        self._known.update(queued)
        # No summary while nothing is queued: then releases need not wake anyone (release.lua).
        summary = {"q": new_queued, "h": new_heads}
        self.summary = json.dumps(summary, separators=(",", ":")) if new_queued else ""
        counts = {lane: {t: n for t, n in per.items() if n} for lane, per in (tenants or {}).items()}
        counts = {lane: per for lane, per in counts.items() if per}
        self._tenant_counts = counts
        self.tenants = json.dumps(counts, separators=(",", ":")) if counts else ""
        self._dirty = True

    def take_summary(self) -> tuple[list[str], dict[str, int]] | None:
        """What to send since the last time (None: nothing changed): the lanes to wake, sorted, and
        the queued counts. :meth:`unsend` if the send fails."""
        if not self._dirty:
            return None
        wake, self._wake, self._dirty = sorted(self._wake), set(), False
        return wake, dict(self._queued)

    def unsend(self, wake: Iterable[str]) -> None:
        """The summary taken did not get through: send it (and wake those lanes) next time."""
        self._wake.update(wake)
        self._dirty = True

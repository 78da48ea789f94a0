"""The fleet-wide budgets in Redis: tenant buckets, the retry budget's window, the work served.

How this works: each call is one Lua script, one atomic round trip on the ledger's connections
(:class:`~extproc.state.redis_link.RedisLink`; tenant buckets share the decision path's
pipelines when every connection is busy). Keys, under the ledger's hash tag ``{prefix}``:

* ``{prefix}:budget:<kind>:<tenant>`` — hash (``level``, ``at``): a tenant's bucket of the fleet
  (``bucket.lua``, the arithmetic of ``core.budget.Budget``); kept only while below full, its TTL
  the time it takes to refill, and at most ``_BUCKET_IDLE_MS`` unused.
* ``{prefix}:retry`` — hash, ``d:<slot>:<replica>`` / ``w:<slot>:<replica>`` → the retry budget's
  deposits and withdrawals per slot of the window (``retry.lua``); fields leave with the window.
* ``{prefix}:served`` — hash, ``<lane>|<tenant>`` → predicted seconds served fleet-wide
  (``served.lua``): what the fair queues share. This replica adds what it served and reads the
  totals of the pairs it has queued; what changed since its last read, less its own part, is the
  others'. A pair read for the first time is a baseline, and so is every pair after a call whose
  answer was lost (the script may have run and added this replica's work).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence

from extproc.state import BucketOp, LedgerUnavailable, Level
from extproc.state.redis_link import RedisLink

#: The longest a tenant bucket below full lives unused (ms): bounds what a debt-ridden tenant that
#: never comes back costs (its bucket then comes back full). Seven days.
_BUCKET_IDLE_MS = str(7 * 86_400_000)
#: The fleet's served-work totals live this long after the last replica's call (ms), and hold at
#: most this many lane/tenant fields.
_SERVED_TTL_MS = str(3_600_000)
_SERVED_MAX_FIELDS = 100_000


class RedisBudgets:
    """This replica's calls on the fleet's budgets (the ``BudgetStore`` calls, without the outage rule)."""

    def __init__(self, link: RedisLink, tag: str, replica: str) -> None:
        self._link = link
        self._tag = tag
        self.replica = replica
        self.retry_key = f"{tag}:retry"
        self.served_key = f"{tag}:served"
        #: The fleet's served totals as last read (field -> seconds), to tell the others' part.
        self._served_seen: dict[str, float] = {}

    def budget_key(self, name: str) -> str:
        """The Redis key of the bucket named ``name`` (``<kind>:<tenant>``)."""
        return f"{self._tag}:budget:{name}"

    async def buckets(self, ops: Sequence[BucketOp], now: float | None = None) -> list[Level]:
        """``bucket.lua``: the operations in order, in one atomic script (one round trip, shared
        with other decisions when every connection is busy)."""
        if not ops:
            return []
        args: list[str | bytes] = ["" if now is None else repr(now)]
        for item in ops:
            args += [item.op, repr(item.per_second), repr(item.burst), repr(item.amount), _BUCKET_IDLE_MS]
        answer = await self._link.run("bucket", [self.budget_key(item.key) for item in ops], args)
        try:
            return [Level(bool(int(allowed)), float(level)) for allowed, level in answer]
        except (TypeError, ValueError) as exc:
            where = self._link.target.describe()
            raise LedgerUnavailable(f"redis {where}: bad bucket answer {answer!r}") from exc

    async def retry_counts(self, deposits: int, withdrawals: int, window_s: float, slots: int,
                           now_ms: int | None = None) -> tuple[int, int]:
        width = max(int(window_s * 1000 / slots), 1)
        answer = await self._link.run("retry", [self.retry_key], [
            self.replica, str(width), str(slots), str(deposits), str(withdrawals),
            "" if now_ms is None else str(now_ms)])
        return int(answer[0]), int(answer[1])

    async def served(self, work: Mapping[tuple[str, str], float],
                     queued: Iterable[tuple[str, str]] = ()) -> dict[tuple[str, str], float]:
        fields = {f"{lane}|{tenant}": seconds for (lane, tenant), seconds in work.items()
                  if seconds > 0}
        wanted = sorted({f"{lane}|{tenant}" for lane, tenant in queued})
        args: list[str | bytes] = [_SERVED_TTL_MS, str(_SERVED_MAX_FIELDS), str(len(fields))]
        for field, seconds in fields.items():
            args += [field, repr(seconds)]
        args += wanted
        try:
            values = await self._link.run("served", [self.served_key], args)
            totals: dict[str, float] = {}
            for field, value in zip(wanted, values, strict=True):
                with contextlib.suppress(TypeError, ValueError):
                    totals[field] = float(value)
        except BaseException:
            # The script may have run and added this replica's work before the answer was lost: the
            # totals read next would show that work as the others'. Start from a baseline instead.
            self.forget_served()
            raise
        seen, self._served_seen = self._served_seen, totals
        others: dict[tuple[str, str], float] = {}
        for field, total in totals.items():
            if field not in seen:
                continue  # newly read: a baseline, not work to charge
            delta = total - seen[field] - fields.get(field, 0.0)
            lane, sep, tenant = field.partition("|")
            if delta > 1e-9 and sep:
                others[(lane, tenant)] = delta
        return others

    def forget_served(self) -> None:
        """Read the fleet's served totals afresh next time (a baseline, nothing charged)."""
        self._served_seen = {}

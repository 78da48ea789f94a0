"""The retry budget: retries may be at most a set share of the admitted original requests.

How this works: every admitted original request deposits one unit, every retry
that is let through withdraws one. Over a sliding window, retries may spend
``ratio`` × the deposits, plus a floor of ``min_per_second`` × the window, so
that a quiet service (few deposits) can still retry now and then. When the
budget is spent, further retries are refused until old withdrawals leave the
window or new originals come in. A storm of retries therefore adds at most
``ratio`` (and the floor) to the load, however many clients retry and however often.

The window is a ring of a few slots of equal width: counts move out a slot at a
time, memory is constant, and each call costs at most one pass over the ring.

A request is recognised as a retry by a header its client sets: the OpenAI and
Anthropic SDKs send ``x-stainless-retry-count`` (0 on the first attempt). A
client that leaves the header out escapes the budget (its retries look like
originals) but not admission, which treats every request alike.

Across a fleet (a shared store), every replica counts its own deposits and withdrawals as
they happen and learns the others' (``fleet``, from the store a few times a second): each
decides on the fleet's balance, so the ratio and the floor hold for the fleet as a whole (up to
what the others did since the last reading). While the store is unreachable each decides
alone (``alone``): the ratio holds replica by replica anyway, the floor is split like the slots
(the replicas counted, at least the fleet size), and a store failing closed lets no retry through.

Pure: every call takes ``now``; no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

from extproc.policy.ratelimit import RetryBudgetPolicy

#: Slots in the window's ring: the window slides in steps of window / SLOTS.
SLOTS = 10


def is_retry(headers: Mapping[str, str], header: str) -> bool:
    """Whether a request's headers say it is a retry: a retry count above 0.

    ``headers`` has lower-cased names. Repeated headers arrive joined with commas;
    the first value counts. Anything that is not a whole number is not a retry.
    """
    value = headers.get(header.lower())
    if not value:
        return False
    first = value.split(",", 1)[0].strip()
    return first.isdigit() and int(first) > 0


class RetryBudget:
    def __init__(self, ratio: float, min_per_second: float, window_s: float) -> None:
        if not 0 <= ratio <= 1:
            raise ValueError(f"ratio must be within [0, 1], got {ratio!r}")
        if not (min_per_second >= 0 and math.isfinite(min_per_second)):
            raise ValueError(f"min_per_second must be a non-negative number, got {min_per_second!r}")
        if not (window_s > 0 and math.isfinite(window_s)):
            raise ValueError(f"window_s must be a positive number, got {window_s!r}")
        self.ratio = ratio
        self.min_per_second = min_per_second
        self.window_s = window_s
        self._width = window_s / SLOTS
        self._deposits = [0] * SLOTS
        self._withdrawals = [0] * SLOTS
        #: Index (in slot widths since time 0) of the newest slot in the ring.
        self._head: int | None = None
        #: When each outstanding reservation was made (oldest first).
        self._reserved: deque[float] = deque()
        #: The other replicas' deposits and withdrawals in the window, as last read.
        self._others = (0, 0)
        #: This replica's part of the floor (1: the whole fleet decides on one balance).
        self._floor_part = 1.0
        self._closed = False
        #: Deposits and withdrawals not yet told to the fleet's store.
        self._new = [0, 0]

    @classmethod
    def of(cls, policy: RetryBudgetPolicy) -> RetryBudget:
        return cls(policy.ratio, policy.min_per_second, policy.window)

    def reconfigure(self, policy: RetryBudgetPolicy) -> None:
        """A policy reload: the counts are kept unless the window changed (then they start over)."""
        fresh = RetryBudget.of(policy)
        self.ratio, self.min_per_second = fresh.ratio, fresh.min_per_second
        if fresh.window_s != self.window_s:
            self.window_s, self._width = fresh.window_s, fresh._width
            self._deposits, self._withdrawals, self._head = fresh._deposits, fresh._withdrawals, None

    def deposit(self, now: float) -> None:
        """An original request was admitted."""
        self._deposits[self._advance(now)] += 1
        self._new[0] += 1

    def unsent(self) -> tuple[int, int]:
        """Deposits and withdrawals since the last call (what to add to the fleet's counts)."""
        new, self._new = self._new, [0, 0]
        return new[0], new[1]

    def fleet(self, deposits: int, withdrawals: int) -> None:
        """The other replicas' counts in the window, as the shared store just gave them."""
        self._others = (max(deposits, 0), max(withdrawals, 0))
        self._floor_part, self._closed = 1.0, False

    def alone(self, parts: int, *, closed: bool = False) -> None:
        """The store is unreachable: decide on this replica's counts, with its part of the floor
        (``1 / parts``: the replicas the slot ledger counts); ``closed``: let no retry through."""
        self._others = (0, 0)
        self._floor_part, self._closed = 1.0 / max(parts, 1), closed

    def reserve(self, now: float) -> bool:
        """A rejection is about to tell its client it may retry: set one retry aside, if there is room.

        The retry is counted now (a withdrawal) and, when it arrives, spends the reservation
        instead of the budget, so a client told "retry" is not refused later because other
        retries took the room meanwhile. Reservations lapse with the window. False: no room,
        and the rejection should tell the client not to retry.
        """
        slot = self._advance(now)
        if self._balance() < 1.0:
            return False
        self._withdrawals[slot] += 1
        self._new[1] += 1
        self._reserved.append(now)
        return True

    def try_withdraw(self, now: float) -> bool:
        """A retry asks to go through: True (and counted) if the budget allows one more."""
        reserved = self._reserved
        while reserved and reserved[0] <= now - self.window_s:
            reserved.popleft()
        if reserved:
            reserved.popleft()
            return True
        slot = self._advance(now)
        if self._balance() < 1.0:
            return False
        self._withdrawals[slot] += 1
        self._new[1] += 1
        return True

    def balance(self, now: float) -> float:
        """Retries that would still be allowed now."""
        self._advance(now)
        return self._balance()

    def _balance(self) -> float:
        if self._closed:
            return 0.0
        deposits, withdrawals = self._others
        allowed = (self.ratio * (sum(self._deposits) + deposits)
                   + self._floor_part * self.min_per_second * self.window_s)
        return allowed - sum(self._withdrawals) - withdrawals

    def _advance(self, now: float) -> int:
        """Rotate the ring up to ``now``; returns the slot that ``now`` falls in."""
        index = math.floor(now / self._width) if math.isfinite(now) else 0
        head = self._head
        if head is None or index - head >= SLOTS:
            if head is not None:
                self._deposits = [0] * SLOTS
                self._withdrawals = [0] * SLOTS
            self._head = index
        elif index > head:
            for i in range(head + 1, index + 1):
                self._deposits[i % SLOTS] = 0
                self._withdrawals[i % SLOTS] = 0
            self._head = index
        # A clock that steps back lands in the newest slot rather than erasing anything.
        assert self._head is not None
        return self._head % SLOTS

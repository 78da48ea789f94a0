"""Per-tenant budgets: token buckets keyed by tenant, in bounded memory.

How this works: each key (a tenant) has a bucket that holds up to ``burst``
units and refills at ``per_second``; a key seen for the first time starts full.
Requests are *taken* before they start — all or nothing, so a refused request
costs its tenant nothing. Tokens are only known once a response has finished,
so they are *charged* afterwards, unconditionally: the bucket may go below zero
(a debt), and the tenant is refused until the refill has paid the debt back.

Memory is bounded by ``max_keys``: the least recently used bucket is dropped
first. A dropped bucket comes back full, so eviction forgives a little; the
least recently used tenant is the one most likely to be full already.

Pure: every call takes ``now`` (seconds, any monotonic origin) and does no I/O.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Refill:
    """How fast a bucket refills and how much it can hold."""

    per_second: float
    burst: float

    def __post_init__(self) -> None:
        if not (self.per_second > 0 and math.isfinite(self.per_second)):
            raise ValueError(f"per_second must be a positive number, got {self.per_second!r}")
        if not (self.burst > 0 and math.isfinite(self.burst)):
            raise ValueError(f"burst must be a positive number, got {self.burst!r}")


@dataclass(frozen=True, slots=True)
class BucketVerdict:
    allowed: bool
    remaining: float
    """Units left in the bucket after the call (negative while in debt)."""
    wait_s: float
    """Seconds until the same call would be allowed (0 when it was)."""
    full_s: float
    """Seconds until the bucket is full again, if nothing more is taken."""


class _Bucket:
    __slots__ = ("at", "level")

    def __init__(self, level: float, at: float) -> None:
        self.level = level
        self.at = at

    def refill(self, rate: Refill, now: float) -> None:
        # A clock that steps back must not drain the bucket: elapsed time is never negative.
        elapsed = max(now - self.at, 0.0)
        self.level = min(rate.burst, self.level + elapsed * rate.per_second)
        self.at = max(self.at, now)


def verdict(allowed: bool, level: float, need: float, rate: Refill) -> BucketVerdict:
    """The verdict of a call that left ``level`` in a bucket of ``rate`` (``need``: what it asked
    for; a charge asks for one unit). A shared store answers with levels; this makes them verdicts."""
    wait = 0.0 if allowed else max(need - level, 0.0) / rate.per_second
    return BucketVerdict(allowed, level, wait, max(rate.burst - level, 0.0) / rate.per_second)


def part(rate: Refill, replicas: int) -> Refill:
    """One replica's part of a budget ``replicas`` share without talking (a store outage): the rate
    and the burst divided, the burst never below one unit (a request must fit)."""
    if replicas <= 1:
        return rate
    return Refill(rate.per_second / replicas, max(rate.burst / replicas, 1.0))


class Budget:
    """Token buckets by key, at most ``max_keys`` of them.

    ``bucket.lua`` (the fleet's shared buckets in Redis) does the same arithmetic; a conformance
    test holds the two to the same levels over random operations."""

    def __init__(self, max_keys: int) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {max_keys}")
        self._max_keys = max_keys
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    @property
    def max_keys(self) -> int:
        return self._max_keys

    def resize(self, max_keys: int) -> None:
        """Change the bound (a policy reload); the least recently used buckets go first."""
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {max_keys}")
        self._max_keys = max_keys
        self._evict()

    def check(self, key: str, rate: Refill, need: float, now: float) -> BucketVerdict:
        """Whether ``need`` units are there, without taking them."""
        bucket = self._buckets.get(key)
        if bucket is None:
            # Never seen (or evicted): full. Nothing is stored for a mere look.
            return verdict(need <= rate.burst, rate.burst, need, rate)
        bucket.refill(rate, now)
        self._buckets.move_to_end(key)
        return verdict(bucket.level >= need, bucket.level, need, rate)

    def take(self, key: str, rate: Refill, amount: float, now: float) -> BucketVerdict:
        """Take ``amount`` units if they are all there; otherwise take nothing."""
        bucket = self._bucket(key, rate, now)
        allowed = bucket.level >= amount
        if allowed:
            bucket.level -= amount
        return verdict(allowed, bucket.level, amount, rate)

    def charge(self, key: str, rate: Refill, amount: float, now: float) -> BucketVerdict:
        """Take ``amount`` units whatever the level: what was used is used. ``allowed`` says
        whether at least one unit is left afterwards."""
        bucket = self._bucket(key, rate, now)
        bucket.level -= max(amount, 0.0)
        return verdict(bucket.level >= 1.0, bucket.level, 1.0, rate)

    def apply(self, op: str, key: str, rate: Refill, amount: float, now: float) -> BucketVerdict:
        """``check``, ``take`` or ``charge`` by name (the operations a shared store is sent)."""
        if op == "take":
            return self.take(key, rate, amount, now)
        if op == "charge":
            return self.charge(key, rate, amount, now)
        if op == "check":
            return self.check(key, rate, amount, now)
        raise ValueError(f"unknown budget operation {op!r}")

    def _bucket(self, key: str, rate: Refill, now: float) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(rate.burst, now)
            self._evict()
        else:
            bucket.refill(rate, now)
            self._buckets.move_to_end(key)
        return bucket

    def _evict(self) -> None:
        while len(self._buckets) > self._max_keys:
            self._buckets.popitem(last=False)

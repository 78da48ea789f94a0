"""Saturation: cluster signals → which lanes shed and how far in-flight limits shrink.

How this works: every rule of ``signals.saturation`` is a latch with hysteresis. It is
set when a fresh reading of its signal is above ``above`` and cleared only when a fresh
reading is below ``below`` *and* the latch has been set for at least ``min_active``, so a
value wobbling around one threshold cannot make admission flap.

A signal is stale when it had no good reading for ``stale_after`` (a signal never read
gets ``stale_after`` from the moment its rule was first evaluated, so a replica that has
just started does not act on "no data yet"). What a stale signal does to its rules is
the signal's ``on_stale``:

* ``ignore`` (fail open): the rule is released at once, whatever ``min_active`` says,
  and stays released until a fresh reading sets it again;
* ``saturated`` (fail closed): the rule is set at once and stays set while the signal is
  stale; once fresh, the usual release condition applies;
* ``hold``: the rule keeps the state it had until the signal is fresh again.

After every change the per-lane :class:`Effect` is computed once, so the request path
only does a dict lookup. With several active rules a lane is shed if any of them sheds it
(the first in policy order is named as the cause) and its limit factor is the smallest.

Pure: callers pass readings and ``now``; nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from extproc.policy.signals import SaturationRule, Signal, Signals


@dataclass(frozen=True, slots=True)
class Reading:
    """What is known about one signal: its last good value and when it was read.

    After a failed poll ``value``/``updated_at`` still describe the last good reading and
    ``error`` says what went wrong; a good poll clears ``error``.
    """

    value: float | None
    updated_at: float | None
    error: str | None = None

    @property
    def good(self) -> bool:
        return self.value is not None and self.updated_at is not None and not math.isnan(self.value)


def is_stale(reading: Reading | None, stale_after: float, now: float, watched_since: float) -> bool:
    """No good reading within ``stale_after``; one never read counts from ``watched_since``."""
    if reading is not None and reading.good:
        assert reading.updated_at is not None
        return now - reading.updated_at > stale_after
    return now - watched_since > stale_after


@dataclass(frozen=True, slots=True)
class Effect:
    """What saturation does to one lane right now."""

    shed_by: str | None = None
    """The rule that sheds the lane (None: not shed)."""
    signal: str | None = None
    """The signal behind the effect: the shedding rule's, else the rule with the smallest factor."""
    factor: float = 1.0
    """Multiplier for the lane's in-flight limit."""
    shrunk_by: str | None = None

    @property
    def shed(self) -> bool:
        return self.shed_by is not None

    def limit(self, base: int) -> int:
        """The in-flight limit under this effect: rounded down, but never below one slot."""
        if self.factor >= 1.0:
            return base
        return max(1, math.floor(base * self.factor))


NO_EFFECT = Effect()


@dataclass(frozen=True, slots=True)
class Change:
    """A rule became active or inactive (for logs and events)."""

    rule: str
    signal: str
    active: bool
    at: float
    value: float | None
    stale: bool
    why: str


@dataclass(frozen=True, slots=True)
class RuleState:
    """A rule as reported by the admin API and metrics."""

    name: str
    signal: str
    active: bool
    since: float | None
    """When ``active`` last changed (None: never active)."""
    value: float | None
    stale: bool
    error: str | None
    shed: tuple[str, ...]
    shrink: Mapping[str, float]


@dataclass(slots=True)
class _Latch:
    active: bool = False
    since: float | None = None
    first_seen: float | None = None


class Saturation:
    """The state of every saturation rule, and the effect on each lane that follows from it."""

    def __init__(self, signals: Signals) -> None:
        self._signals = signals
        self._latches: dict[str, _Latch] = {rule.name: _Latch() for rule in signals.saturation}
        self._readings: dict[str, Reading] = {}
        self._effects: dict[str, Effect] = {}

    @property
    def signals(self) -> Signals:
        return self._signals

    def reconfigure(self, signals: Signals) -> None:
        """Adopt a new policy; rules whose name survives keep their state.

        A rule whose signal now means something else (another signal, or the same name with
        another definition) keeps its state but waits ``stale_after`` afresh for a first reading.
        """
        old_rules = {rule.name: rule for rule in self._signals.saturation}
        latches: dict[str, _Latch] = {}
        for rule in signals.saturation:
            latch = self._latches.get(rule.name, _Latch())
            before = old_rules.get(rule.name)
            if before is not None and (
                before.signal != rule.signal
                or self._signals.read.get(before.signal) != signals.read.get(rule.signal)
            ):
                latch.first_seen = None
            latches[rule.name] = latch
        self._readings = {name: r for name, r in self._readings.items()
                          if name in signals.read and signals.read[name] == self._signals.read.get(name)}
        self._signals = signals
        self._latches = latches
        self._recompute()

    def update(self, readings: Mapping[str, Reading], now: float) -> list[Change]:
        """Evaluate every rule against the latest readings; return what changed."""
        self._readings = dict(readings)
        changes: list[Change] = []
        for rule in self._signals.saturation:
            change = self._step(rule, self._latches[rule.name], now)
            if change is not None:
                changes.append(change)
        if changes:
            self._recompute()
        return changes

    def effect(self, lane: str) -> Effect:
        """The effect on ``lane`` as of the last update (cheap: called on every request)."""
        return self._effects.get(lane, NO_EFFECT)

    def lanes(self) -> list[str]:
        """Lanes some rule may shed or shrink."""
        names: set[str] = set()
        for rule in self._signals.saturation:
            names.update(rule.shed)
            names.update(rule.shrink)
        return sorted(names)

    def rules(self, now: float) -> list[RuleState]:
        out = []
        for rule in self._signals.saturation:
            latch = self._latches[rule.name]
            reading = self._readings.get(rule.signal)
            out.append(RuleState(
                name=rule.name, signal=rule.signal, active=latch.active, since=latch.since,
                value=reading.value if reading is not None and reading.good else None,
                stale=self._stale(rule, latch, reading, now),
                error=reading.error if reading is not None else None,
                shed=rule.shed, shrink=dict(rule.shrink),
            ))
        return out

    # -- internals ------------------------------------------------------------------------------

    def _stale(self, rule: SaturationRule, latch: _Latch, reading: Reading | None, now: float) -> bool:
        signal = self._signals.read.get(rule.signal)
        if signal is None:
            return True
        watched_since = latch.first_seen if latch.first_seen is not None else now
        return is_stale(reading, signal.stale_after, now, watched_since)

    def _step(self, rule: SaturationRule, latch: _Latch, now: float) -> Change | None:
        if latch.first_seen is None:
            latch.first_seen = now
        signal: Signal | None = self._signals.read.get(rule.signal)
        reading = self._readings.get(rule.signal)
        value = reading.value if reading is not None and reading.good else None
        if self._stale(rule, latch, reading, now):
            on_stale = signal.on_stale if signal is not None else "ignore"
            if on_stale == "saturated" and not latch.active:
                return self._flip(rule, latch, now, True, value, True,
                                  f"signal {rule.signal} is stale (on_stale: saturated)")
            if on_stale == "ignore" and latch.active:
                return self._flip(rule, latch, now, False, value, True,
                                  f"signal {rule.signal} is stale (on_stale: ignore)")
            return None
        if value is None:  # nothing read yet, but still within the grace for a first reading
            return None
        if not latch.active and value > rule.above:
            return self._flip(rule, latch, now, True, value, False,
                              f"{rule.signal} = {value:g} > above {rule.above:g}")
        if latch.active and value < rule.release:
            held = now - latch.since if latch.since is not None else math.inf
            if held >= rule.min_active:
                return self._flip(rule, latch, now, False, value, False,
                                  f"{rule.signal} = {value:g} < below {rule.release:g}")
        return None

    @staticmethod
    def _flip(rule: SaturationRule, latch: _Latch, now: float, active: bool, value: float | None,
              stale: bool, why: str) -> Change:
        latch.active = active
        latch.since = now
        return Change(rule.name, rule.signal, active, now, value, stale, why)

    def _recompute(self) -> None:
        effects: dict[str, Effect] = {}
        for rule in self._signals.saturation:
            if not self._latches[rule.name].active:
                continue
            for lane in rule.shed:
                current = effects.get(lane, NO_EFFECT)
                if current.shed_by is None:
                    effects[lane] = replace(current, shed_by=rule.name, signal=rule.signal)
            for lane, factor in rule.shrink.items():
                current = effects.get(lane, NO_EFFECT)
                if factor < current.factor:
                    effects[lane] = replace(current, factor=factor, shrunk_by=rule.name,
                                            signal=current.signal if current.shed else rule.signal)
        self._effects = effects

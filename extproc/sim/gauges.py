"""What an engine's ``/metrics`` gauges show: running, waiting and KV usage, now or as of the step.

How this works: an engine with ``Dynamics.gauges_at_steps`` publishes its gauges once per step, as
its scheduler saw them when the step began (after that step's admissions and preemptions). The
engine (:class:`~extproc.sim.engine.Engine`) takes a snapshot at every scheduling decision; inside
a run of identical decode steps, which it skips in O(1), the batch does not change, so the gauges at
the k-th step's start are the snapshot's running, its KV plus one token per decoding sequence per
step, and its waiting plus the requests added (less those cancelled while waiting) by then. Those
changes are logged with their time and folded in once a step starts after them, so a read is O(1).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple


class Gauges(NamedTuple):
    """The engine's gauges as ``/metrics`` shows them."""

    running: int
    waiting: int
    kv_usage: float


class StepGauges:
    """Gauges published at step starts (see the module doc)."""

    __slots__ = ("_decoding", "_kv", "_log", "kv_tokens", "running", "waiting")

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_tokens = 0
        self._kv = 0  # at the decision
        self._decoding = 0
        self._log: deque[tuple[float, int]] = deque()  # (time, change of waiting) not yet published

    def decided(self, running: int, waiting: int, kv_tokens: int, decoding: int) -> None:
        """A scheduling decision: the step starting now shows exactly this."""
        self.running, self.waiting, self._kv, self._decoding = running, waiting, kv_tokens, decoding
        self.kv_tokens = kv_tokens
        self._log.clear()

    def stepped(self, at: float, steps: int) -> None:
        """The step starting at ``at`` is the ``steps``-th after the decision (its decode steps all)."""
        self.kv_tokens = self._kv + self._decoding * steps
        log = self._log
        while log and log[0][0] <= at:
            self.waiting += log.popleft()[1]

    def read(self, kv_capacity: int) -> Gauges:
        """The gauges as published, KV usage against a cache of ``kv_capacity`` tokens."""
        return Gauges(self.running, self.waiting, min(1.0, self.kv_tokens / kv_capacity))

    def waiting_changed(self, at: float, change: int) -> None:
        """A request joined (+1) or left (-1) the waiting queue at ``at``; shown from the next step."""
        self._log.append((at, change))

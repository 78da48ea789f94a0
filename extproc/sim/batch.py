"""The engine's running batch: which sequences hold a slot, the KV cache they fill, when they finish.

How this works: KV usage is counted in tokens: a running sequence holds its prompt plus the tokens
generated so far. A decoding sequence's share grows by one token per step, so the total is kept as
``fixed + decoding × steps`` and never summed; a sequence's generated count is likewise kept as of
the step it started decoding (``since_step``) and read off the step count. Each decoding sequence
has an entry in a heap keyed by the step count it will finish at; an entry whose sequence was
cancelled or preempted since is stale and skipped when it comes up. Every change is O(1) (the heap
O(log n)), whatever the number of steps in between: the engine
(:class:`~extproc.sim.engine.Engine`) decides what runs, this only keeps the count.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator


class Seq:
    """One request in the engine, waiting or running."""

    __slots__ = ("arrival", "decoding", "first_token_at", "generated", "kv_base", "last_token_at", "output",
                 "preemptions", "prefill_left", "prompt", "req_id", "scheduled_at", "since_step", "uid")

    def __init__(self, uid: int, req_id: str, prompt: int, output: int, arrival: float) -> None:
        self.uid = uid
        self.req_id = req_id
        self.prompt = prompt
        self.output = output
        self.arrival = arrival
        #: Tokens generated as of step ``since_step`` (decoding) or frozen (otherwise).
        self.generated = 0
        self.since_step = 0
        self.decoding = False
        self.prefill_left = 0
        #: This sequence's share of the batch's fixed KV term (see the module doc).
        self.kv_base = 0
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        #: When its latest token was made, once it has one (the base of its next inter-token latency).
        self.last_token_at: float | None = None
        self.preemptions = 0


class Batch:
    """The sequences holding a slot, their KV tokens, and the steps completed since the engine started."""

    __slots__ = ("_finishes", "decoding", "kv_fixed", "prefilling", "running", "steps")

    def __init__(self) -> None:
        self.running: dict[int, Seq] = {}  # admission order: the newest is preempted first
        self.prefilling: dict[int, Seq] = {}  # the subset of running still prefilling
        self._finishes: list[tuple[int, int]] = []  # (step count at finish, uid); stale entries skipped
        self.steps = 0  # steps completed since the engine started
        self.kv_fixed = 0
        self.decoding = 0

    @property
    def kv_tokens(self) -> int:
        return self.kv_fixed + self.decoding * self.steps

    def generated(self, seq: Seq) -> int:
        """Tokens ``seq`` has generated as of the current step count."""
        return seq.generated + (self.steps - seq.since_step if seq.decoding else 0)

    def admit(self, seq: Seq, context: int) -> None:
        """``seq`` takes a slot to prefill ``context`` tokens (its prompt and any tokens it had)."""
        self.running[seq.uid] = seq
        self.prefilling[seq.uid] = seq
        seq.prefill_left = context
        self.reserve(seq, decoding=False)

    def reserve(self, seq: Seq, decoding: bool) -> None:
        """Account ``seq`` as running; a decoding sequence's tokens from now on grow with the step count."""
        seq.decoding = decoding
        seq.since_step = self.steps
        seq.kv_base = seq.prompt + seq.generated - (self.steps if decoding else 0)
        self.kv_fixed += seq.kv_base
        if decoding:
            self.decoding += 1
            heapq.heappush(self._finishes, (self.steps + seq.output - seq.generated, seq.uid))

    def complete_prefill(self, seq: Seq) -> None:
        """``seq``'s prefill is done and made a token: trade its prefill reservation for a decoding one."""
        del self.prefilling[seq.uid]
        self.kv_fixed -= seq.kv_base
        seq.kv_base = 0
        seq.generated += 1

    def release(self, seq: Seq) -> None:
        """Take ``seq`` out of the batch, freeing its slot and KV; freezes its token count."""
        seq.generated = self.generated(seq)
        self.kv_fixed -= seq.kv_base
        if seq.decoding:
            self.decoding -= 1
        seq.decoding = False
        del self.running[seq.uid]
        self.prefilling.pop(seq.uid, None)

    def newest(self) -> Seq:
        """The sequence admitted last (the first to preempt)."""
        return self.running[next(reversed(self.running))]

    def due(self) -> Iterator[Seq]:
        """The decoding sequences whose last token is made by the current step count (to finish)."""
        while self._finishes and self._finishes[0][0] <= self.steps:
            at, uid = heapq.heappop(self._finishes)
            live = self._live(at, uid)
            if live is not None:
                yield live

    def steps_to_next_finish(self) -> int:
        """Steps until a decoding sequence (there must be one) makes its last token."""
        while self._live(*self._finishes[0]) is None:  # drop stale heads
            heapq.heappop(self._finishes)
        return self._finishes[0][0] - self.steps

    def _live(self, at: int, uid: int) -> Seq | None:
        """The sequence a finish-heap entry is for, or None if the entry is stale (cancel, preemption)."""
        seq = self.running.get(uid)
        if seq is None or not seq.decoding or seq.since_step + seq.output - seq.generated != at:
            return None
        return seq

    def plan_prefill(self, max_batched_tokens: int) -> tuple[list[tuple[Seq, int]], int, int]:
        """Give a step's token budget to sequences already prefilling, oldest first.

        Returns the chunks (sequence, tokens), the budget left, and how many prefills complete.
        """
        budget = max_batched_tokens - self.decoding
        chunks: list[tuple[Seq, int]] = []
        completing = 0
        for seq in self.prefilling.values():
            if budget <= 0:
                break
            n = min(seq.prefill_left, budget)
            chunks.append((seq, n))
            budget -= n
            completing += n == seq.prefill_left
        return chunks, budget, completing

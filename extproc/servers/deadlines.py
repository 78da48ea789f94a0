"""Reads under a deadline, one timer for them all.

How this works: every request whose body is read waits for it under a deadline (the policy's
``body_timeout``). ``asyncio.timeout`` per read would arm and cancel a timer of the event loop on
every such request (about 4 µs each, and as many cancelled timers left in the loop's heap as reads
in the last timeout). Here a read enters its task and deadline in a table; one timer, armed only
while some read waits, ticks ``TICKS`` times per timeout and cancels every task whose deadline
passed, as ``asyncio.timeout`` does, and the read raises ``TimeoutError`` in that task. A read is
thus at most one tick (a ``TICKS``-th of its timeout) late. A cancellation from anywhere else (the
client went away) propagates untouched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")
#: Ticks per timeout while reads wait: how late a deadline may be noticed, as a share of it.
TICKS = 8


class Deadlines:
    """The reads of one event loop's streams waiting under a deadline."""

    __slots__ = ("_every", "_expired", "_loop", "_timer", "_waiting")

    def __init__(self) -> None:
        self._waiting: dict[asyncio.Task[Any], float] = {}
        self._expired: set[asyncio.Task[Any]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._every = 0.0

    async def within(self, seconds: float, read: Awaitable[T]) -> T:
        """``read``'s result, or ``TimeoutError`` once ``seconds`` passed without one."""
        task = asyncio.current_task()
        assert task is not None
        loop = task.get_loop()
        cancelling = task.cancelling()
        self._waiting[task] = loop.time() + seconds
        every = seconds / TICKS
        if self._timer is None or self._loop is not loop or every < self._every:
            # (None armed; or a shorter timeout than the one the timer ticks for: a policy reload)
            if self._timer is not None:
                self._timer.cancel()
            self._loop, self._every = loop, every
            self._timer = loop.call_later(every, self._tick)
        try:
            return await read
        except asyncio.CancelledError:
            # Ours (the deadline passed), and no one else's meanwhile: a timeout, as asyncio.timeout says.
            if task in self._expired and task.uncancel() <= cancelling:
                raise TimeoutError from None
            raise
        finally:
            del self._waiting[task]
            self._expired.discard(task)

    def _tick(self) -> None:
        loop = self._loop
        assert loop is not None
        now = loop.time()
        for task, deadline in self._waiting.items():
            if deadline <= now and task not in self._expired:
                self._expired.add(task)
                task.cancel()
        self._timer = loop.call_later(self._every, self._tick) if self._waiting else None

    def __len__(self) -> int:
        """Reads waiting now."""
        return len(self._waiting)

"""Reads under a deadline with one timer for them all (servers/deadlines.py): a read in time gives its
result, a late one TimeoutError, anyone else's cancellation stays a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from extproc.servers.deadlines import Deadlines


async def test_a_read_in_time_gives_its_result_and_leaves_nothing_armed() -> None:
    deadlines = Deadlines()
    came: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(came.set_result, "body")
    assert await deadlines.within(0.8, came) == "body"
    assert len(deadlines) == 0
    await asyncio.sleep(0.8 / 8 * 1.5)  # (past the first tick: nothing waits, so nothing is re-armed)
    assert deadlines._timer is None


async def test_late_reads_time_out_and_the_others_are_untouched() -> None:
    deadlines = Deadlines()
    loop = asyncio.get_running_loop()
    never: list[asyncio.Future[str]] = [loop.create_future() for _ in range(3)]
    soon: list[asyncio.Future[str]] = [loop.create_future() for _ in range(3)]

    async def read(future: asyncio.Future[str]) -> str:
        try:
            return await deadlines.within(0.05, future)
        except TimeoutError:
            return "late"

    reads = [asyncio.ensure_future(read(f)) for f in (*never, *soon)]
    for i, future in enumerate(soon):
        future.set_result(f"body {i}")
    assert await asyncio.gather(*reads) == ["late", "late", "late", "body 0", "body 1", "body 2"]
    assert len(deadlines) == 0


async def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    # The client went away while its body was awaited: the handler is cancelled, never told "late".
    deadlines = Deadlines()
    never: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(deadlines.within(60.0, never))
    await asyncio.sleep(0)
    assert len(deadlines) == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert len(deadlines) == 0


async def test_a_shorter_timeout_ticks_sooner() -> None:
    # A reload that shortens body_timeout while reads wait under the old one: the new read is not
    # left to the old, slower ticks.
    deadlines = Deadlines()
    loop = asyncio.get_running_loop()
    old = asyncio.ensure_future(deadlines.within(600.0, loop.create_future()))
    await asyncio.sleep(0)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(deadlines.within(0.05, loop.create_future()), timeout=30)
    old.cancel()
    with pytest.raises(asyncio.CancelledError):
        await old

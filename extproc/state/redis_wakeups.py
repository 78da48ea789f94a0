"""Wake-ups through Redis pub/sub: a slot freed on any replica wakes the waiters of this one.

How this works: one subscription to the ledger's channel ``{prefix}:freed``, on a connection of
its own with no read timeout (it idles between messages; health checks find a dead peer). A
message names a lane whose slot may have freed (``*`` for all); the ``on_freed`` callbacks are
scheduled for it on the event loop (for every lane this replica knows, for ``*``). While the
subscription is down every lane is woken at each retry instead (backing off from 50 ms to 1 s),
and once more when it is back: whatever was published meanwhile is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable

from redis.exceptions import RedisError

from extproc.state import ALL_LANES, FreedCallback, wake
from extproc.state.redis_link import RedisLink


class RedisWakeups:
    """The subscription to the freed channel and the callbacks it wakes."""

    def __init__(self, link: RedisLink, channel: str, lanes: Callable[[], Iterable[str]]) -> None:
        """``lanes``: the lanes to wake for ``*``."""
        self.channel = channel
        self.loop: asyncio.AbstractEventLoop | None = None
        """Where the callbacks run (set when the ledger starts)."""
        self.subscribed = False
        self._link = link
        self._lanes = lanes
        self._callbacks: list[FreedCallback] = []
        self._closing = False

    def on_freed(self, callback: FreedCallback) -> None:
        self._callbacks.append(callback)

    def deliver(self, lane: str) -> None:
        """Schedule the callbacks for ``lane`` (every known lane for ``*``)."""
        wake(self.loop, self._callbacks, lane, self._lanes())

    def stop(self) -> None:
        """End :meth:`listen` at its next turn (the caller cancels it too)."""
        self._closing = True

    async def listen(self) -> None:
        """Keep one subscription open; while it is down, wake every lane at each retry instead."""
        delay = 0.05
        # No read timeout: the subscription idles between messages; health checks find a dead peer.
        client = self._link.connect(None, 2, health_check=5)
        try:
            while not self._closing:
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                try:
                    await pubsub.subscribe(self.channel)
                    if not self.subscribed:
                        self.subscribed = True
                        self.deliver(ALL_LANES)  # whatever was published while we were away is lost
                    delay = 0.05
                    while not self._closing:
                        message = await pubsub.get_message(timeout=1.0)
                        if message is not None and message.get("type") == "message":
                            self.deliver(str(message["data"]))
                except (RedisError, OSError):
                    self.subscribed = False
                    self.deliver(ALL_LANES)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
                finally:
                    with contextlib.suppress(RedisError, OSError):
                        await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
        finally:
            self.subscribed = False
            await client.aclose()

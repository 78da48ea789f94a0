"""extproc overloaded itself: refuse at once what reaches it too late to be worth deciding.

Beyond its decision rate, new ext_proc streams wait in gRPC's transport before extproc's code sees
them (the event loop stays responsive; the backlog is below it). Deciding a request that waited there
most of Envoy's ``message_timeout`` is wasted work: the answer comes too late to help the client, and
the time it costs is taken from the requests behind it. The proxy stamps each request's arrival
(``x-extproc-arrival: %START_TIME(%s.%3f)%``, set after the strip of client ``x-extproc-*`` headers, so no
client can forge it); a request whose headers reach extproc more than ``max_delay`` after that gets a
prebuilt ``503 overloaded`` at once, which costs a part of a decision. Refusing costs extproc too
(about 0.4 of a decision, measured), so under a sustained overload most of the excess must be refused
before it reaches extproc: the proxy's overload shed (Envoy's admission_control filter) refuses new
requests in proportion to these answers, which travel with status ``SHED_STATUS`` until the proxy
turns them into the 503 clients see.

The delay is measured against the proxy's clock, which may differ from this process's (another node).
The offset is learnt, not assumed: the smallest ``now - stamp`` seen over the last ``WINDOWS`` windows
of ``WINDOW`` seconds is taken as "no delay" (the transport's own latency and the clock offset). A
clock that steps or drifts moves that floor within ``WINDOWS * WINDOW`` seconds; a sustained overload
that never lets one request through quickly raises it too, so the guard relaxes rather than refusing
everything for good (Envoy's ``message_timeout`` still bounds what waits).

A moment of lateness is not an overload: a pause of the process (a collection, a slow store call) leaves
the requests that came meanwhile late, all at once, with nothing behind them. So a late request is
refused only once every request for ``persist`` seconds (by default twice ``max_delay``) has come
late: a standing queue, not a burst (the idea of CoDel's interval). Once it refuses, a late request
within ``RECALL`` seconds of the last refusal is refused at once (as CoDel re-enters its dropping
state): an overload that lets one request through on time now and then is still an overload.

It only ever looks at the first message of a stream: never at a request held in a lane's queue, never at
a running generation. Pure logic, no I/O: ``servers/extproc.py`` asks it once per stream.
"""

from __future__ import annotations

from collections import deque

#: The header the proxy stamps (its value: epoch seconds with milliseconds, from %START_TIME%).
ARRIVAL_HEADER = "x-extproc-arrival"
#: The status of extproc's "overloaded" refusal between extproc and the proxy: the proxy's overload shed
#: counts this status (and nothing else: not a drain's 503, not a backend's), then the proxy's
#: extproc.overload_status filter turns it into the 503 clients get.
SHED_STATUS = 529


class OverloadGuard:
    """Says whether a stream's request arrived recently enough to be decided."""

    #: Seconds per window of the floor, and how many windows it spans (a minute).
    WINDOW = 2.0
    WINDOWS = 30

    #: Seconds after a refusal during which a late request is refused without waiting ``persist`` again.
    RECALL = 1.0

    __slots__ = ("_floor", "_last_refusal", "_late_since", "_mins", "_window_end", "_window_min", "max_delay",
                 "persist", "refused")

    def __init__(self, max_delay: float, persist: float | None = None) -> None:
        #: Seconds a request may wait before extproc sees it (0: the guard is off).
        self.max_delay = max_delay
        #: Seconds without a request on time before late ones are refused.
        self.persist = 2 * max_delay if persist is None else persist
        #: When the current run of late requests began (None: the last request came on time).
        self._late_since: float | None = None
        self._last_refusal = float("-inf")
        #: (end, smallest age) of each past window that saw a request, the oldest first.
        self._mins: deque[tuple[float, float]] = deque(maxlen=self.WINDOWS)
        self._window_min = float("inf")
        self._window_end = 0.0
        self._floor = float("inf")
        #: Requests refused since the last ``take_refused`` (for a rate-limited log line).
        self.refused = 0

    def admit(self, stamp: bytes | str | None, now: float) -> bool:
        """False when the request stamped ``stamp`` (epoch seconds, as text) waited more than
        ``max_delay`` before ``now`` (this process's epoch clock). No stamp, an unreadable one, or the
        guard off: True (it cannot tell, so the request is decided)."""
        if stamp is None or self.max_delay <= 0:
            return True
        try:
            age = now - float(stamp)
        except ValueError:
            return True
        if age != age or age in (float("inf"), float("-inf")):  # nan, inf: "nan" and "inf" parse
            return True
        if now >= self._window_end:
            self._roll(now)
        if age < self._window_min:
            self._window_min = age
            if age < self._floor:
                self._floor = age
        if age - self._floor <= self.max_delay:
            self._late_since = None
            return True
        since = self._late_since
        if now - self._last_refusal > self.RECALL:
            if since is None:
                self._late_since = now
                return True  # late, but no standing queue (yet)
            if now - since <= self.persist:
                return True
        self._last_refusal = now
        self.refused += 1
        return False

    def delay(self, stamp: bytes | str, now: float) -> float:
        """How long the request stamped ``stamp`` waited, as the guard reckons it (for tests and logs)."""
        return now - float(stamp) - self._floor

    def take_refused(self) -> int:
        """The refusals counted since the last call (and reset the count)."""
        refused, self.refused = self.refused, 0
        return refused

    def _roll(self, now: float) -> None:
        mins = self._mins
        if self._window_min != float("inf"):
            mins.append((self._window_end, self._window_min))
        # By time as well as by count: after a quiet spell the floor is learnt again.
        horizon = now - self.WINDOW * self.WINDOWS
        while mins and mins[0][0] < horizon:
            mins.popleft()
        self._window_min = float("inf")
        self._window_end = now + self.WINDOW
        self._floor = min((m for _, m in mins), default=float("inf"))

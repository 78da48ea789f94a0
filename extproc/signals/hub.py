"""The signal hub: polls every source on its interval and keeps the latest reading of every signal.

How this works: one asyncio task per source, all sharing one HTTP session. A round of a
prometheus source runs its signals' queries concurrently; a round of a scrape source
fetches each target once and reads every signal of that source from the same pages. A
signal with ``quantile`` also needs the pages of earlier rounds: its
:class:`~extproc.signals.scrape.HistogramWindow` lives here as long as the signal's
definition does. Its first round only sets the baseline and gives no reading (the signal
is then "never read", not failing); a window without observations fails with ``no_data``.
Each signal's reading is replaced by a good one or keeps its last good value with the
error beside it, so staleness is judged by age alone. After every round ``on_change`` is
called with all readings and the time, which is where the caller updates
:class:`~extproc.core.saturation.Saturation`.

Nothing raises out of a task: a source that is down, slow or answering nonsense is an
error kind in a counter and a log line on the transition (not one per poll), never a
crash. Rounds start on a fixed cadence; a round that takes longer delays the next one
instead of overlapping it. ``hurry`` brings a scrape source's next round forward to a quarter of
its interval after the last began (the self-sized limit's start wants readings that often).

Its metrics (``metrics.SignalMetrics``) are computed when scraped, from the readings and the
clock, so an age keeps growing while a source is down and a removed signal disappears at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import aiohttp
import structlog
from prometheus_client import CollectorRegistry

from extproc.core.capacity import READ_SOON
from extproc.core.saturation import Reading, is_stale
from extproc.metrics import SignalMetrics
from extproc.policy.signals import Signal, Signals, Source
from extproc.signals import ErrorKind, SignalError, prometheus, scrape

log = structlog.get_logger("extproc.signals")

#: Called after every poll round with every signal's reading and the clock's time.
OnChange = Callable[[Mapping[str, Reading], float], None]


@dataclass(frozen=True, slots=True)
class SignalStatus:
    """One signal as reported by gauges and the admin API."""

    name: str
    source: str
    kind: str
    value: float | None
    updated_at: float | None
    age: float | None
    stale: bool
    error: str | None


class SignalHub:
    def __init__(self, signals: Signals, registry: CollectorRegistry,
                 clock: Callable[[], float] = time.monotonic, on_change: OnChange | None = None) -> None:
        self._signals = signals
        self._clock = clock
        self.on_change = on_change
        self._readings: dict[str, Reading] = {}
        self._watched_since: dict[str, float] = {}
        self._failing: dict[str, ErrorKind] = {}
        self._target_up: dict[tuple[str, str], bool] = {}
        self._windows: dict[str, scrape.HistogramWindow] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: Per polling source: set to end its wait early (``hurry``).
        self._soon: dict[str, asyncio.Event] = {}
        self._retired: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._errors = SignalMetrics(registry, self.status, self.targets).errors

    @property
    def signals(self) -> Signals:
        return self._signals

    def start(self) -> None:
        """Start polling (call from within the running event loop)."""
        if self._session is not None:
            raise RuntimeError("the signal hub is already started")
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=64, limit_per_host=8),
            headers={"User-Agent": "extproc-signals"},
        )
        now = self._clock()
        for name in self._signals.read:
            self._watched_since.setdefault(name, now)
        for name, source in self._signals.sources.items():
            self._start_source(name, source)

    async def stop(self) -> None:
        tasks = [*self._tasks.values(), *self._retired]
        self._tasks.clear()
        self._soon.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def reconfigure(self, signals: Signals) -> None:
        """Adopt a new policy: restart sources whose settings changed, forget changed signals."""
        old = self._signals
        self._signals = signals
        for name in list(self._tasks):
            if signals.sources.get(name) != old.sources.get(name):
                self._retire(name)
        for key in [key for key in self._target_up if signals.sources.get(key[0]) != old.sources.get(key[0])]:
            del self._target_up[key]
        now = self._clock()
        for name in set(old.read) | set(signals.read):
            if signals.read.get(name) == old.read.get(name):
                continue
            # A changed definition is another signal under the same name: start over.
            self._readings.pop(name, None)
            self._windows.pop(name, None)
            self._failing.pop(name, None)
            self._watched_since.pop(name, None)
            for kind in ErrorKind:
                with contextlib.suppress(KeyError):
                    self._errors.remove(name, kind.value)
            if name in signals.read and self._session is not None:
                self._watched_since[name] = now
        if self._session is not None:
            for name, source in signals.sources.items():
                if name not in self._tasks:
                    self._start_source(name, source)

    def hurry(self, sources: Iterable[str]) -> None:
        """Read these sources' scrape targets again soon: ``READ_SOON`` of their interval after their
        last round began, not a whole interval (the self-sized limit's start at a few slots per lane:
        ``Machine.reading_wanted``). A Prometheus source is not hurried: what it answers changes only
        as often as Prometheus scrapes. Unknown or stopped sources are ignored."""
        for name in self._signals.hurriable(frozenset(sources)):
            soon = self._soon.get(name)
            if soon is not None:
                soon.set()

    def readings(self) -> dict[str, Reading]:
        return dict(self._readings)

    def status(self, now: float | None = None) -> list[SignalStatus]:
        now = self._clock() if now is None else now
        out = []
        for name, signal in self._signals.read.items():
            reading = self._readings.get(name)
            good = reading is not None and reading.good
            updated_at = reading.updated_at if reading is not None and good else None
            out.append(SignalStatus(
                name=name, source=signal.source, kind=signal.exported_kind,
                value=reading.value if reading is not None and good else None,
                updated_at=updated_at,
                age=now - updated_at if updated_at is not None else None,
                stale=is_stale(reading, signal.stale_after, now, self._watched_since.get(name, now)),
                error=reading.error if reading is not None else None,
            ))
        return out

    def targets(self) -> dict[tuple[str, str], bool]:
        """(scrape source, target URL) → whether the last fetch of it succeeded."""
        return dict(self._target_up)

    # -- polling --------------------------------------------------------------------------------

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the signal hub is not started")
        return self._session

    def _start_source(self, name: str, source: Source) -> None:
        self._soon[name] = soon = asyncio.Event()
        self._tasks[name] = asyncio.get_running_loop().create_task(self._run(name, source, soon),
                                                                   name=f"signals:{name}")

    def _retire(self, name: str) -> None:
        task = self._tasks.pop(name)
        self._soon.pop(name, None)
        task.cancel()
        self._retired.add(task)
        task.add_done_callback(self._retired.discard)

    async def _run(self, name: str, source: Source, soon: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            soon.clear()  # (a hurry during this round shortens the wait after it)
            try:
                if source.prometheus is not None:
                    await self._poll_prometheus(name, source)
                else:
                    await self._poll_scrape(name, source)
            except Exception:  # a bug here must not end polling for good
                log.exception("signal poll failed", source=name)
            self._notify()
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that races with
            # the event (a hurry in the same tick as stop() or a reload's retire: the task polls on).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, source.interval - (loop.time() - started))):
                    await soon.wait()
            # Hurried: no sooner than READ_SOON of the interval after this round began.
            await asyncio.sleep(max(0.0, started + source.interval * READ_SOON - loop.time()))

    async def _poll_prometheus(self, name: str, source: Source) -> None:
        config = source.prometheus
        assert config is not None
        session = self._http()

        async def one(signal_name: str, signal: Signal) -> None:
            assert signal.query is not None
            try:
                value = await prometheus.query(session, config.url, signal.query, config.timeout)
            except SignalError as exc:
                self._failed(signal_name, signal, exc)
            else:
                self._succeeded(signal_name, signal, value)

        await asyncio.gather(*(one(n, s) for n, s in self._signals.signals_of(name).items() if s.query))

    async def _poll_scrape(self, name: str, source: Source) -> None:
        config = source.scrape
        assert config is not None
        signals = {n: s for n, s in self._signals.signals_of(name).items() if s.metric or s.preset}
        if not signals:
            return
        names = scrape.names_of(list(signals.values()))
        session = self._http()

        async def page(url: str) -> scrape.Page | SignalError:
            try:
                return await scrape.scrape(session, url, config.timeout, names)
            except SignalError as exc:
                return exc

        results = await asyncio.gather(*(page(url) for url in config.targets))
        now = self._clock()
        pages: dict[str, scrape.Page] = {}
        errors: list[SignalError] = []
        for url, result in zip(config.targets, results, strict=True):
            up = not isinstance(result, SignalError)
            if self._target_up.get((name, url), True) != up:
                if up:
                    log.info("scrape target is back", source=name, target=url)
                else:
                    log.warning("scrape target failed", source=name, target=url, error=str(result))
            self._target_up[(name, url)] = up
            if isinstance(result, SignalError):
                errors.append(result)
            else:
                pages[url] = result
        for signal_name, signal in signals.items():
            if not pages:
                first = errors[0]
                error = first if len(errors) == 1 else SignalError(
                    first.kind, f"all {len(errors)} targets failed; the first: {first.message}")
                self._failed(signal_name, signal, error)
                continue
            try:
                if signal.quantile is not None:
                    if not self._current(signal_name, signal):
                        continue
                    # A changed definition dropped its window (reconfigure): a missing one starts afresh.
                    window = self._windows.get(signal_name)
                    if window is None:
                        window = self._windows[signal_name] = scrape.HistogramWindow(signal)
                    window.observe(now, pages, config.targets)
                    value = window.value()
                    if value is None:  # only the baseline so far
                        continue
                else:
                    value = scrape.read(signal, list(pages.values()))
            except SignalError as exc:
                self._failed(signal_name, signal, exc)
            else:
                self._succeeded(signal_name, signal, value)

    def _current(self, name: str, signal: Signal) -> bool:
        # A reconfigure during a round may have changed what this name means; drop the stale answer.
        return self._signals.read.get(name) == signal

    def _succeeded(self, name: str, signal: Signal, value: float) -> None:
        if not self._current(name, signal):
            return
        self._readings[name] = Reading(value, self._clock())
        if self._failing.pop(name, None) is not None:
            log.info("signal recovered", signal=name, value=value)

    def _failed(self, name: str, signal: Signal, error: SignalError) -> None:
        if not self._current(name, signal):
            return
        previous = self._readings.get(name)
        self._readings[name] = Reading(previous.value if previous else None,
                                       previous.updated_at if previous else None, str(error))
        self._errors.labels(name, error.kind.value).inc()
        if self._failing.get(name) != error.kind:
            log.warning("signal read failed", signal=name, source=signal.source, kind=error.kind.value,
                        error=error.message)
        self._failing[name] = error.kind

    def _notify(self) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(self.readings(), self._clock())
        except Exception:  # the caller's bug must not stop the polling
            log.exception("signal on_change callback failed")

"""The simulated GPU backend: an OpenAI-compatible HTTP server whose timing is the engine's.

How this works: one :class:`~extproc.sim.engine.Engine` holds every request. A
:class:`LiveEngine` drives it on the event loop's clock with a single timer, armed for
the engine's next event time; when it fires, the engine is advanced to "now" and the
first-token and finished events resolve the waiting requests' futures. Handlers never
sleep for a computed duration: a request is slow exactly when the engine says so. A
stream sends its first chunk when the first token exists and its last when the request
finishes; in between it sends the tokens made so far every ``stream_interval`` seconds
(several tokens per chunk keep the CPU low with hundreds of concurrent streams), or, for a
profile that streams every K tokens (``Dynamics.stream_every_tokens``), one event per K
tokens, looked for as often. A client that goes away is cancelled in the engine, freeing
its slot and KV cache.

``/metrics`` carries vLLM's own metric names so dashboards, PromQL signals and
extproc's scraper work the same against this server and a real vLLM. Inter-token latency
(``vllm:inter_token_latency_seconds``, and the same observations under V0's
``vllm:time_per_output_token_seconds``) is observed as vLLM does, once per token after a
request's first, the time since its previous token as the engine makes them (chunks of a
stream may bunch several): the engine reports a run of identical steps as one (interval,
count) pair, so the histogram costs one bucket update per engine catch-up, not one per token.
The buckets are the profile's (``Dynamics.histograms``: vLLM's, or coarser ones), and the
running, waiting and KV gauges move at once or once per step as its dynamics say
(:meth:`~extproc.sim.engine.Engine.gauges`).

``--capacity-schedule T:F,…`` runs the engine at fraction F of its profile from T seconds of
wall-clock time after the server starts (see :mod:`extproc.sim.engine` for what a fraction
means). The engine's clock is the event loop's (the time scale multiplies costs, not the
clock), so T is applied as engine time ``start + T``; ``sim_capacity_fraction`` shows it.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import itertools
import json
import math
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from extproc.settings import Address, positive_float
from extproc.sim.dynamics import VLLM, Histograms
from extproc.sim.engine import Engine, Event, Finished, FirstToken, RequestRejected, capacity_schedule_arg
from extproc.sim.profiles import PROFILES, Profile, get_profile

log = structlog.get_logger("extproc.sim")

EXIT_STARTUP = 3
CHARS_PER_TOKEN = 4
#: When a request sets no max_tokens its length is drawn from a log-normal around this median,
#: roughly the shape of chat answers (most short, a long tail).
OUTPUT_MEDIAN_TOKENS = 150
OUTPUT_SIGMA = 0.8
#: How often a waiting request checks whether its client is still there.
DISCONNECT_POLL_S = 0.25

# vLLM's own bucket boundaries (the vLLM-like profiles'), so histogram_quantile gives the same
# answers against both.
TTFT_BUCKETS = VLLM.ttft
LATENCY_BUCKETS = VLLM.request
ITL_BUCKETS = VLLM.itl

_WORDS = (" The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", " again")


def _text(start: int, end: int) -> str:
    return "".join(_WORDS[i % len(_WORDS)] for i in range(start, end))


# -- driving the engine on the event loop ------------------------------------------------------------


@dataclass(eq=False)
class Handle:
    """One request inside the engine, as the HTTP handler sees it."""

    req_id: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    first_token: asyncio.Future[FirstToken]
    finished: asyncio.Future[Finished]


class LiveEngine:
    """Runs an :class:`Engine` on the event loop's monotonic clock (time-scaled by the engine)."""

    def __init__(self, engine: Engine, observe: Callable[[Event, Handle], None] | None = None) -> None:
        self.engine = engine
        self._observe = observe
        self._handles: dict[str, Handle] = {}
        self._ids = itertools.count(1)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._now = float("-inf")

    def _time(self) -> float:
        # The engine insists on monotonic time; a timer may fire a hair before its deadline.
        self._now = max(self._now, asyncio.get_running_loop().time())
        return self._now

    def submit(self, prompt_tokens: int, output_tokens: int, finish_reason: str = "length") -> Handle:
        """Add a request; raises :class:`RequestRejected` if the engine can never run it."""
        loop = asyncio.get_running_loop()
        req_id = f"req-{next(self._ids)}"
        self.engine.add(req_id, prompt_tokens, output_tokens, self._time())
        handle = Handle(req_id, prompt_tokens, output_tokens, finish_reason,
                        loop.create_future(), loop.create_future())
        self._handles[req_id] = handle
        self.sync()
        return handle

    def cancel(self, handle: Handle) -> None:
        """Abort a request that has not finished (no-op otherwise)."""
        if self._handles.pop(handle.req_id, None) is None:
            return
        self.engine.cancel(handle.req_id, self._time())
        for future in (handle.first_token, handle.finished):
            future.cancel()
        self.sync()

    def progress(self, handle: Handle) -> int:
        """Tokens generated so far for ``handle``."""
        self.sync()
        if handle.req_id in self.engine:
            return self.engine.progress(handle.req_id)
        return handle.output_tokens if handle.finished.done() else 0

    def set_capacity(self, fraction: float, at: float | None = None) -> None:
        """Run the engine at ``fraction`` of its profile from now (or ``at``, a loop time already reached)."""
        if at is not None:
            self._now = max(self._now, at)
        try:
            self.engine.set_capacity(fraction, self._time())
            self.sync()
        except Exception as exc:  # as in _fire: a bug in the model must not leave requests hanging
            log.exception("engine failed")
            self.close(exc)
            return
        log.info("sim capacity changed", fraction=fraction, max_running=self.engine.max_running,
                 kv_cache_tokens=self.engine.kv_capacity_tokens)

    def sync(self) -> None:
        """Advance the engine to now, resolve what happened, re-arm the timer."""
        events = self.engine.advance(self._time())
        for event in events:
            handle = self._handles.get(event.req_id)
            if handle is None:
                continue
            if self._observe is not None:
                self._observe(event, handle)
            if isinstance(event, FirstToken):
                handle.first_token.set_result(event)
            else:
                del self._handles[event.req_id]
                handle.finished.set_result(event)
        at = self.engine.next_event_time()
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = None if at is None else asyncio.get_running_loop().call_at(at, self._fire, at)

    def _fire(self, at: float) -> None:
        self._timer = self._timer_at = None
        self._now = max(self._now, at)
        try:
            self.sync()
        except Exception as exc:  # a bug in the model must not leave requests hanging forever
            log.exception("engine failed")
            self.close(exc)

    def close(self, error: BaseException | None = None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timer_at = None
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            for future in (handle.first_token, handle.finished):
                if future.done():
                    continue
                if error is None:
                    future.cancel()
                else:
                    future.set_exception(RuntimeError(f"simulated engine failed: {error}"))


# -- metrics -----------------------------------------------------------------------------------------


class _EngineCollector(Collector):
    """The engine's current state, read at scrape time so it can never drift from the model."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self._engine = engine
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name"]
        gauges = self._engine.gauges()  # as of the last step, for an engine that publishes per step
        families: list[tuple[GaugeMetricFamily | CounterMetricFamily, float]] = [
            (GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                               labels=labels), gauges.running),
            (GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                               labels=labels), gauges.waiting),
            (GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                               labels=labels), gauges.kv_usage),
            (CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemptions from the engine.",
                                 labels=labels), self._engine.preemptions),
            # Not a vLLM metric: what --capacity-schedule set (1 = the whole profile).
            (GaugeMetricFamily("sim_capacity_fraction",
                               "Fraction of its profile's capacity the simulated engine runs at.",
                               labels=labels), self._engine.capacity),
        ]
        for family, value in families:
            family.add_metric([self._model], value)
            yield family


class _TokenIntervals(Collector):
    """vLLM's inter-token latency histogram, observed in bulk: ``count`` intervals of one length at once."""

    NAMES = (
        ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
        # vLLM V0's name for the same observations; dashboards written for it keep working.
        ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds."),
    )

    def __init__(self, model_name: str, buckets: tuple[float, ...] = ITL_BUCKETS) -> None:
        self._model = model_name
        self._buckets = buckets
        self._counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self._sum = 0.0

    def observe(self, seconds: float, count: int = 1) -> None:
        # Scrapes run on the event loop, as the engine does: no lock needed.
        self._counts[bisect.bisect_left(self._buckets, seconds)] += count  # le: the bound is inclusive
        self._sum += seconds * count

    def collect(self) -> Iterator[Metric]:
        cumulative = list(itertools.accumulate(self._counts))
        total = self._sum
        bounds = [*map(floatToGoString, self._buckets), "+Inf"]
        for name, documentation in self.NAMES:
            family = HistogramMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric([self._model], list(zip(bounds, cumulative, strict=True)), sum_value=total)
            yield family


class BackendMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, engine: Engine) -> None:
        labels = ["model_name"]
        buckets: Histograms = engine.profile.dynamics.histograms
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", labels,
                              buckets=buckets.ttft, registry=registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", labels,
                             buckets=buckets.request, registry=registry).labels(model_name)
        self.queue = Histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.",
                               labels, buckets=buckets.request, registry=registry).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels,
                                     registry=registry).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         labels, registry=registry).labels(model_name)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                ["model_name", "finished_reason"], registry=registry)
        self._model = model_name
        registry.register(_EngineCollector(engine, model_name))
        self.intervals = _TokenIntervals(model_name, buckets.itl)
        registry.register(self.intervals)
        engine.on_interval = self.intervals.observe

    def observe(self, event: Event, handle: Handle) -> None:
        if isinstance(event, FirstToken):
            self.ttft.observe(event.ttft)
            return
        self.e2e.observe(event.e2e)
        self.queue.observe(event.queue_time)
        self.prompt_tokens.inc(event.prompt_tokens)
        self.generation_tokens.inc(event.output_tokens)
        self._success.labels(self._model, handle.finish_reason).inc()


# -- the OpenAI-compatible API ---------------------------------------------------------------------


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class CompletionAsk:
    """What the engine needs to know about a completion request."""

    model: str | None
    prompt_tokens: int
    max_tokens: int | None
    stream: bool
    include_usage: bool


def _tokens(chars: int) -> int:
    return max(1, math.ceil(chars / CHARS_PER_TOKEN))


def _message_chars(messages: object) -> int:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", "messages")
    chars = 0
    for message in messages:
        if not isinstance(message, dict):
            raise BadRequest("each message must be an object", "messages")
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(len(part["text"]) for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
        elif content is not None:
            raise BadRequest("message content must be a string or an array of parts", "messages")
    return chars


def _prompt_tokens(prompt: object) -> int:
    if isinstance(prompt, str):
        return _tokens(len(prompt))
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return _prompt_tokens(prompt[0])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)  # already tokens
    raise BadRequest("'prompt' must be a string or one array of token ids (batches are not supported)",
                     "prompt")


def parse_ask(body: bytes, chat: bool) -> CompletionAsk:
    """Read the few fields that matter from an untrusted request body."""
    try:
        return _parse_ask(body, chat)
    except RecursionError:
        # json and the prompt walk both recurse per nesting level: the client chooses the depth.
        raise BadRequest("the request body is nested too deeply") from None


def _parse_ask(body: bytes, chat: bool) -> CompletionAsk:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    prompt = _tokens(_message_chars(data.get("messages"))) if chat else _prompt_tokens(data.get("prompt"))
    max_tokens = data.get("max_completion_tokens") if chat else None
    param = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, param = data.get("max_tokens"), "max_tokens"
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or max_tokens < 1):
        raise BadRequest(f"'{param}' must be a positive integer", param)
    if data.get("n") not in (None, 1):
        raise BadRequest("only n=1 is supported by the simulated backend", "n")
    stream = data.get("stream", False)
    if not isinstance(stream, bool | None):
        raise BadRequest("'stream' must be a boolean", "stream")
    options = data.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    model = data.get("model")
    return CompletionAsk(model if isinstance(model, str) else None, prompt, max_tokens, bool(stream),
               bool(options.get("include_usage")))


def error_response(status: int, message: str, param: str | None = None,
                   kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}},
                             status=status)


@dataclass
class Backend:
    """Everything the handlers share."""

    profile: Profile
    model_name: str
    live: LiveEngine
    metrics: BackendMetrics
    registry: CollectorRegistry
    rng: random.Random
    stream_interval: float
    created: int

    def output_tokens(self, ask: CompletionAsk) -> tuple[int, str]:
        if ask.max_tokens is not None:
            return ask.max_tokens, "length"
        sampled = round(self.rng.lognormvariate(math.log(OUTPUT_MEDIAN_TOKENS), OUTPUT_SIGMA))
        room = self.profile.max_model_len - ask.prompt_tokens
        return max(1, min(sampled, room)), "stop"


BACKEND = web.AppKey("backend", Backend)


class _Reply:
    """Renders one request's response bodies in the OpenAI wire format."""

    def __init__(self, chat: bool, model: str, ask: CompletionAsk, handle: Handle, created: int) -> None:
        self.chat = chat
        self.model = model
        self.ask = ask
        self.handle = handle
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{handle.req_id}"
        self.created = created

    def usage(self) -> dict[str, int]:
        p, o = self.handle.prompt_tokens, self.handle.output_tokens
        return {"prompt_tokens": p, "completion_tokens": o, "total_tokens": p + o}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def whole(self) -> dict[str, Any]:
        text = _text(0, self.handle.output_tokens)
        reason = self.handle.finish_reason
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
            body = self._envelope("chat.completion", [choice])
        else:
            body = self._envelope("text_completion",
                                  [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}])
        body["usage"] = self.usage()
        return body

    def chunk(self, start: int, end: int, final: bool) -> bytes:
        reason = self.handle.finish_reason if final else None
        if self.chat:
            delta: dict[str, str] = {"content": _text(start, end)}
            if start == 0:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": 0, "text": _text(start, end), "logprobs": None, "finish_reason": reason}
            body = self._envelope("text_completion", [choice])
        if self.ask.include_usage:
            body["usage"] = None
        return _sse(body)

    def usage_chunk(self) -> bytes:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = self.usage()
        return _sse(body)


def _sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _wait(request: web.Request, future: asyncio.Future[Any]) -> bool:
    """Wait for ``future``; False if the client went away first."""
    while not future.done():
        await asyncio.wait((future,), timeout=DISCONNECT_POLL_S)
        if not future.done() and _gone(request):
            return False
    return True


async def _completion(request: web.Request, chat: bool) -> web.StreamResponse:
    backend = request.app[BACKEND]
    try:
        ask = parse_ask(await request.read(), chat)
        output, reason = backend.output_tokens(ask)
        handle = backend.live.submit(ask.prompt_tokens, output, reason)
    except BadRequest as exc:
        return error_response(400, str(exc), exc.param)
    except RequestRejected as exc:
        return error_response(400, str(exc))
    reply = _Reply(chat, ask.model or backend.model_name, ask, handle, int(time.time()))
    try:
        if ask.stream:
            return await _stream(request, backend, reply)
        if not await _wait(request, handle.finished):
            return web.Response(status=499)  # nobody is listening; the status is for the access log
        handle.finished.result()
        # Usage in the body only, as vLLM reports it (no header: Envoy's usage filter reads the body).
        return web.Response(body=json.dumps(reply.whole(), separators=(",", ":")).encode(),
                            content_type="application/json")
    finally:
        # Whatever ended this handler (client gone, handler cancelled, server stopping): free the slot.
        backend.live.cancel(handle)


async def _stream(request: web.Request, backend: Backend, reply: _Reply) -> web.StreamResponse:
    handle = reply.handle
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    # Headers go out at once, as vLLM's do; the body waits for the engine.
    await response.prepare(request)
    try:
        if not await _wait(request, handle.first_token):
            return response
        handle.first_token.result()
        sent = 0
        every = backend.profile.dynamics.stream_every_tokens
        while True:
            final = handle.finished.done()
            if final:
                handle.finished.result()
            upto = handle.output_tokens if final else backend.live.progress(handle)
            for start, end, last in stream_pieces(sent, upto, final, every):
                await response.write(reply.chunk(start, end, last))
                sent = end
            if final:
                break
            await asyncio.wait((handle.finished,), timeout=backend.stream_interval)
            if _gone(request):
                return response
        if reply.ask.include_usage:
            await response.write(reply.usage_chunk())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionError:
        pass  # the client went away mid-stream; the caller cancels the request
    except RuntimeError as exc:  # the engine failed; headers are sent, so say it in the stream
        with contextlib.suppress(ConnectionError):
            await response.write(_sse({"error": {"message": str(exc), "type": "internal_error", "param": None,
                                                 "code": None}}))
    return response


def stream_pieces(sent: int, upto: int, final: bool, every: int | None) -> list[tuple[int, int, bool]]:
    """The stream events (first token, past the last, is it the final one) for tokens ``sent`` to
    ``upto``: one of everything new (and the final one even if nothing is new), or with ``every``,
    the first token alone, then ``every`` tokens each, the final event carrying the rest; tokens
    short of a whole ``every`` wait for more unless it is the end."""
    if every is None:
        return [(sent, upto, final)] if upto > sent or final else []
    pieces = []
    start = sent
    while start < upto:
        end = 1 if start == 0 else start + every
        if end > upto and not final:
            break
        end = min(end, upto)
        pieces.append((start, end, False))
        start = end
    if final:
        if pieces and pieces[-1][1] == upto:
            pieces[-1] = (pieces[-1][0], upto, True)
        else:
            pieces.append((start, upto, True))
    return pieces


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=False)


async def models(request: web.Request) -> web.Response:
    backend = request.app[BACKEND]
    return web.json_response({"object": "list", "data": [{
        "id": backend.model_name, "object": "model", "created": backend.created, "owned_by": "extproc-sim",
        "root": backend.model_name, "max_model_len": backend.profile.max_model_len,
    }]})


async def health(_: web.Request) -> web.Response:
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    backend = request.app[BACKEND]
    backend.live.sync()  # gauges are read from the engine: bring it up to now first
    return web.Response(body=generate_latest(backend.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def _errors(request: web.Request,
                  handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Every error is an OpenAI-style JSON body; nothing a client sends can crash the server."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason, kind="invalid_request_error" if exc.status < 500
                              else "internal_error")
    except Exception:
        log.exception("request failed", path=request.path)
        return error_response(500, "internal error in the simulated backend", kind="internal_error")


def build_app(profile: Profile, *, time_scale: float = 1.0, seed: int = 0, model_name: str | None = None,
              registry: CollectorRegistry | None = None, stream_interval: float = 0.05,
              capacity_schedule: Sequence[tuple[float, float]] = ()) -> web.Application:
    """The backend as an aiohttp application (run it with ``handler_cancellation=True`` ideally).

    ``capacity_schedule`` is ((T, F), …) as :func:`~extproc.sim.engine.parse_capacity_schedule`
    returns it: from T seconds after the application starts, the engine runs at fraction F.
    """
    registry = registry if registry is not None else CollectorRegistry()
    name = model_name or profile.model
    engine = Engine(profile, time_scale)
    backend_metrics = BackendMetrics(registry, name, engine)
    live = LiveEngine(engine, backend_metrics.observe)
    backend = Backend(profile, name, live, backend_metrics, registry, random.Random(seed), stream_interval,
                      int(time.time()))
    app = web.Application(middlewares=[_errors], client_max_size=32 * 1024 * 1024)
    app[BACKEND] = backend
    timers: list[asyncio.TimerHandle] = []

    async def start_schedule(_: web.Application) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        for at, fraction in capacity_schedule:
            if at <= 0:
                live.set_capacity(fraction)
            else:
                timers.append(loop.call_at(start + at, live.set_capacity, fraction, start + at))

    async def close(_: web.Application) -> None:
        for timer in timers:
            timer.cancel()
        live.close()

    app.on_startup.append(start_schedule)
    app.on_cleanup.append(close)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def serve(host: str, port: int, profile_name: str, time_scale: float = 1.0, seed: int = 0,
                model_name: str | None = None, *, stream_interval: float = 0.05,
                stop: asyncio.Event | None = None,
                capacity_schedule: Sequence[tuple[float, float]] = ()) -> None:
    """Run the backend until ``stop`` is set or the process gets SIGTERM/SIGINT.

    Raises ValueError for an unknown profile and OSError if the address cannot be bound.
    """
    app = build_app(get_profile(profile_name), time_scale=time_scale, seed=seed, model_name=model_name,
                    stream_interval=stream_interval, capacity_schedule=capacity_schedule)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    # handler_cancellation: a client that hangs up cancels its handler, which cancels its request.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    try:
        # A burst of new connections (a load test starting) must not overflow the accept queue:
        # dropped SYNs are retried only after a second, which would look like queueing.
        await web.TCPSite(runner, host, port, backlog=2048).start()
        log.info("sim backend listening", addresses=[str(a) for a in runner.addresses], profile=profile_name,
                 model=app[BACKEND].model_name, time_scale=time_scale,
                 capacity_schedule=",".join(f"{t:g}:{f:g}" for t, f in capacity_schedule) or None)
        await stop.wait()
    finally:
        await runner.cleanup()
        log.info("sim backend stopped")


# -- command line (wired into ``extproc sim backend`` by extproc.cli) ---------------------------------


def _address(text: str) -> Address:
    try:
        return Address.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", choices=sorted(PROFILES), default="llama-8b-h100",
                        help="model/hardware timing profile (default %(default)s)")
    parser.add_argument("--listen", type=_address, default=Address("127.0.0.1", 8000), metavar="HOST:PORT",
                        help="listen address (default %(default)s)")
    parser.add_argument("--time-scale", type=positive_float, default=1.0, metavar="X",
                        help="multiply every engine cost by X: 0.1 runs ten times faster (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed for sampled output lengths (default 0)")
    parser.add_argument("--model-name", default=None,
                        help="model id to serve (default: the profile's model)")
    parser.add_argument("--stream-interval", type=positive_float, default=0.05, metavar="SECONDS",
                        help="at most one SSE chunk per stream per interval, between first and last token")
    parser.add_argument("--capacity-schedule", type=capacity_schedule_arg, default=(), metavar="T:F[,T:F...]",
                        help="from T seconds (wall clock) after start, run the engine at fraction F "
                             "(0 < F ≤ 1) of the profile: KV cache and batch slots × F, steps 1/F as long, "
                             "as after losing a GPU of a tensor-parallel group; e.g. 60:0.5,120:1 "
                             "(before the first T: 1)")
    parser.add_argument("--log-format", choices=["json", "console"], default="json")
    parser.add_argument("--log-level", default="info")


def run(args: argparse.Namespace) -> int:
    from extproc import log as logging_setup

    try:
        logging_setup.configure(args.log_format, args.log_level)
    except ValueError as exc:
        print(f"extproc: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(args.listen.host, args.listen.port, args.profile, args.time_scale, args.seed,
                          args.model_name, stream_interval=args.stream_interval,
                          capacity_schedule=args.capacity_schedule))
    except OSError as exc:
        print(f"extproc: cannot listen on {args.listen}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_STARTUP
    return 0


if __name__ == "__main__":  # pragma: no cover - `extproc sim backend` is the supported entry point
    _parser = argparse.ArgumentParser(prog="extproc sim backend")
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))

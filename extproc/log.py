"""structlog set-up: one JSON object per line (or readable console lines), on stderr.

The chain is kept lean: no processor that has nothing to do here (``merge_contextvars``: nothing
binds context variables), and a timestamp and a JSON encoder that do once what the stock ones redo
on every line (formatting the date and time to the second; building a JSON encoder), in exactly the
stock format.

Every request writes one decision line, and even that lean chain (a dict copied and handed from
processor to processor, the stdlib encoder) cost several times what the line itself does. So that
one line has a writer of its own, :class:`Lines`: the same keys in the same order (the fields, then
``event``, ``level`` and ``timestamp``, as the chain appends them), encoded by orjson in one call
(compact separators: the same JSON, not the same bytes), written and flushed to the same stream as
structlog's lines. With the console format, or logging not configured here, its lines go through
structlog like any other.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, Any, TextIO

import orjson
import structlog


def _json_default(obj: Any) -> Any:
    """What structlog's JSONRenderer does with values json cannot encode: ``__structlog__()`` or repr."""
    try:
        return obj.__structlog__()
    except AttributeError:
        return repr(obj)


#: One encoder for every line: ``json.dumps(..., default=...)`` would build a new one each call.
_ENCODER = json.JSONEncoder(default=_json_default)


def _dumps(obj: Any, **_: Any) -> str:
    # JSONRenderer passes its own ``default``; _ENCODER already has the equivalent.
    return _ENCODER.encode(obj)


class UTCTimeStamper:
    """``timestamp`` as ISO 8601 in UTC, identical to ``TimeStamper(fmt="iso", utc=True)``.

    The date and time to the second are formatted once per second, not once per line.
    """

    __slots__ = ("_prefix", "_second")

    def __init__(self) -> None:
        self._second = -1
        self._prefix = ""

    def __call__(self, logger: Any, method_name: str, event_dict: Any) -> Any:
        event_dict["timestamp"] = self.now()
        return event_dict

    def now(self) -> str:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        micros = int((now - second) * 1_000_000)
        # datetime.isoformat() leaves the fraction out when it is zero; so does this.
        return f"{self._prefix}.{micros:06d}Z" if micros else f"{self._prefix}Z"


class _Output:
    """What :func:`configure` set: the format, the level, and the stream lines go to."""

    __slots__ = ("file", "fmt", "level")

    def __init__(self) -> None:
        self.fmt = ""  # (not configured here: structlog's defaults)
        self.level = logging.INFO
        self.file: TextIO = sys.stderr


_OUTPUT = _Output()


class Lines:
    """``info`` lines of one logger written without structlog's chain (see the module docstring).

    Made after :func:`configure` (it reads the format, level and stream then), as a bound logger is;
    its ``info`` takes what a bound logger's does."""

    __slots__ = ("_binary", "_fallback", "_file", "_on", "_stamp")

    def __init__(self, name: str) -> None:
        self._fallback: structlog.typing.FilteringBoundLogger = structlog.get_logger(name).bind()
        out = _OUTPUT
        self._on = out.level <= logging.INFO
        self._file: TextIO | None = out.file if out.fmt == "json" else None
        # Bytes straight to a UTF-8 text stream's buffer: structlog flushes after every line, so nothing
        # of the text layer is ever pending there to be overtaken.
        utf8 = (getattr(self._file, "encoding", None) or "").lower().replace("-", "") == "utf8"
        self._binary: IO[bytes] | None = getattr(self._file, "buffer", None) if utf8 else None
        self._stamp = UTCTimeStamper()

    def info(self, event: str, **fields: Any) -> None:
        file = self._file
        if file is None:
            self._fallback.info(event, **fields)
            return
        if not self._on:
            return
        fields["event"] = event
        fields["level"] = "info"
        fields["timestamp"] = self._stamp.now()
        try:
            line = orjson.dumps(fields, default=_json_default, option=orjson.OPT_APPEND_NEWLINE)
        except orjson.JSONEncodeError:
            # What orjson refuses and the chain's encoder writes: a lone surrogate (a JSON body's
            # "\ud800" read as the model), an integer beyond 64 bits.
            line = (_ENCODER.encode(fields) + "\n").encode("utf-8")
        binary = self._binary
        if binary is not None:
            binary.write(line)
            binary.flush()
        else:
            file.write(line.decode())
            file.flush()


def configure(fmt: str = "json", level: str = "info", file: TextIO | None = None) -> None:
    """Every logger's format, level and stream (``file``, default stderr)."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    stream = file if file is not None else sys.stderr
    _OUTPUT.fmt, _OUTPUT.level, _OUTPUT.file = fmt, numeric, stream
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer(serializer=_dumps) if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            UTCTimeStamper(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # write() + flush() of the finished line: print() costs more for the same bytes.
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=True,
    )

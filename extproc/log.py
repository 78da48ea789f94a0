"""structlog set-up: one JSON object per line (or readable console lines), on stderr.

Every request writes one decision line, so the chain is kept lean: no processor that has
nothing to do here (``merge_contextvars``: nothing binds context variables), and a timestamp
and a JSON encoder that do once what the stock ones redo on every line (formatting the date
and time to the second; building a JSON encoder), in exactly the stock format.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

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
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        micros = int((now - second) * 1_000_000)
        # datetime.isoformat() leaves the fraction out when it is zero; so does this.
        event_dict["timestamp"] = f"{self._prefix}.{micros:06d}Z" if micros else f"{self._prefix}Z"
        return event_dict


def configure(fmt: str = "json", level: str = "info") -> None:
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
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
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )

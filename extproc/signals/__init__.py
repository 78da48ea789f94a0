"""Cluster signals: PromQL queries (prometheus.py), model servers' /metrics (scrape.py), run by hub.py.

This module holds what both sources share: the kinds of failure, which are metric labels
and so a public interface, and the one HTTP GET that maps aiohttp's many exceptions to
them, once, at the boundary.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

import aiohttp

#: Larger answers are refused: a query that matches every series, or a page that is not /metrics.
MAX_BODY_BYTES = 16 * 1024 * 1024


class ErrorKind(StrEnum):
    UNREACHABLE = "unreachable"
    """No connection (refused, DNS, reset)."""
    TIMEOUT = "timeout"
    """No complete answer within the source's timeout (or Prometheus timed the query out)."""
    HTTP_STATUS = "http_status"
    """An HTTP status other than 200 that is not a query error."""
    BAD_RESPONSE = "bad_response"
    """An answer that cannot be parsed (not JSON, not exposition text, truncated, too large)."""
    QUERY_ERROR = "query_error"
    """The query is wrong for a signal: PromQL error, several series, a range vector."""
    NO_DATA = "no_data"
    """A valid answer without a number: no series, no matching metric, NaN."""


class SignalError(Exception):
    """Reading a signal failed; ``kind`` is the metric label, the message is for humans."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


async def fetch(session: aiohttp.ClientSession, url: str, *, time_limit: float, accept: str,
                params: Mapping[str, str] | None = None) -> tuple[int, bytes]:
    """GET ``url``; return status and body, or raise :class:`SignalError` (never anything else)."""
    try:
        timeout = aiohttp.ClientTimeout(total=time_limit)
        async with session.get(url, params=params, headers={"Accept": accept}, timeout=timeout,
                               allow_redirects=False) as response:
            if response.content_length is not None and response.content_length > MAX_BODY_BYTES:
                raise SignalError(ErrorKind.BAD_RESPONSE,
                                  f"answer of {response.content_length} bytes exceeds {MAX_BODY_BYTES}")
            body = bytearray()
            async for chunk in response.content.iter_chunked(64 * 1024):
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise SignalError(ErrorKind.BAD_RESPONSE, f"answer exceeds {MAX_BODY_BYTES} bytes")
            return response.status, bytes(body)
    except TimeoutError:
        raise SignalError(ErrorKind.TIMEOUT, f"no answer from {url} within {time_limit:g}s") from None
    except (aiohttp.ClientPayloadError, aiohttp.ClientResponseError) as exc:
        raise SignalError(ErrorKind.BAD_RESPONSE, f"broken answer from {url}: {exc}") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise SignalError(ErrorKind.UNREACHABLE, f"cannot reach {url}: {exc or type(exc).__name__}") from None

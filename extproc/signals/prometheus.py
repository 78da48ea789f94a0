"""PromQL instant queries against a Prometheus-compatible HTTP API, each turned into one number.

A signal is one number, so a query must answer a scalar or a vector of exactly one series.
Several series are an error that says how to fix the query (aggregate it) rather than a
silent pick of one of them. NaN (``histogram_quantile`` or a ratio over no observations)
counts as no data; ±Inf is a value (a quantile in the +Inf bucket really is "very large").
"""

from __future__ import annotations

import json
import math
from typing import Any

import aiohttp

from extproc.signals import ErrorKind, SignalError, fetch


def query_url(base: str) -> str:
    return base.rstrip("/") + "/api/v1/query"


async def query(session: aiohttp.ClientSession, base: str, promql: str, time_limit: float) -> float:
    """Run an instant query; return its number or raise :class:`SignalError`."""
    # Prometheus stops the evaluation itself a little before we give up waiting for it.
    params = {"query": promql, "timeout": f"{max(time_limit * 0.9, 0.001):.3f}"}
    status, body = await fetch(session, query_url(base), time_limit=time_limit, accept="application/json",
                               params=params)
    return parse_response(status, body)


def _number(raw: object) -> float:
    if not isinstance(raw, list) or len(raw) != 2 or not isinstance(raw[1], str):
        raise SignalError(ErrorKind.BAD_RESPONSE, f"expected a [time, \"value\"] pair, got {raw!r:.80}")
    try:
        value = float(raw[1])
    except ValueError:
        raise SignalError(ErrorKind.BAD_RESPONSE, f"not a number: {raw[1]!r:.40}") from None
    if math.isnan(value):
        raise SignalError(ErrorKind.NO_DATA, "query returned NaN (e.g. histogram_quantile or a ratio "
                                             "over no observations)")
    return value


def _labels(series: Any) -> str:
    metric = series.get("metric") if isinstance(series, dict) else None
    if not isinstance(metric, dict):
        return "{}"
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(metric.items())) + "}"


def parse_response(status: int, body: bytes) -> float:
    """The number in a ``/api/v1/query`` answer, or :class:`SignalError` saying why there is none."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        if status != 200:
            raise SignalError(ErrorKind.HTTP_STATUS, f"HTTP {status}") from None
        raise SignalError(ErrorKind.BAD_RESPONSE, "answer is not JSON") from None
    if not isinstance(data, dict):
        raise SignalError(ErrorKind.BAD_RESPONSE, "answer is not a JSON object")
    if data.get("status") == "error":
        error_type, error = data.get("errorType"), data.get("error")
        if error_type == "timeout":
            raise SignalError(ErrorKind.TIMEOUT, f"Prometheus timed the query out: {error}")
        if error_type in ("bad_data", "execution") or status in (400, 422):
            raise SignalError(ErrorKind.QUERY_ERROR, f"{error_type}: {error}")
        raise SignalError(ErrorKind.HTTP_STATUS, f"HTTP {status}: {error_type}: {error}")
    if status != 200:
        raise SignalError(ErrorKind.HTTP_STATUS, f"HTTP {status}")
    if data.get("status") != "success" or not isinstance(data.get("data"), dict):
        raise SignalError(ErrorKind.BAD_RESPONSE, "answer has no status \"success\" and data object")
    result_type, result = data["data"].get("resultType"), data["data"].get("result")
    if result_type == "scalar":
        return _number(result)
    if result_type == "vector":
        if not isinstance(result, list):
            raise SignalError(ErrorKind.BAD_RESPONSE, "vector result is not a list")
        if not result:
            raise SignalError(ErrorKind.NO_DATA, "query returned no series")
        if len(result) > 1:
            shown = ", ".join(_labels(series) for series in result[:3])
            more = ", …" if len(result) > 3 else ""
            raise SignalError(ErrorKind.QUERY_ERROR, f"query returned {len(result)} series ({shown}{more}); "
                                                     f"aggregate them with sum() or max()")
        series = result[0]
        if not isinstance(series, dict):
            raise SignalError(ErrorKind.BAD_RESPONSE, "vector element is not an object")
        return _number(series.get("value"))
    if result_type == "matrix":
        raise SignalError(ErrorKind.QUERY_ERROR, "query returned a range vector; a signal needs an instant "
                                                 "value (wrap it in e.g. max_over_time(...[5m]))")
    raise SignalError(ErrorKind.QUERY_ERROR, f"query returned a {result_type!s:.20} result, not a number")

"""Retry-After from the estimated time to drain: bounded, jittered, never 0, never above 60 s."""

from __future__ import annotations

import math
import random

from extproc.policy.schema import RetryAfter

#: Clients (the OpenAI SDKs among them) ignore Retry-After values above a minute.
CEILING_S = 60


def bounds(config: RetryAfter) -> tuple[int, int]:
    """The whole seconds a Retry-After may say: at least 1, at most the policy's max and a minute."""
    low = max(1, math.ceil(config.min))
    return low, max(low, min(CEILING_S, math.floor(config.max)))


def retry_after(drain_s: float, config: RetryAfter, rng: random.Random) -> int:
    """Whole seconds a rejected client should wait before trying again.

    Jitter spreads the retries of clients rejected at the same moment, so they do
    not come back as one synchronised wave.
    """
    low, high = bounds(config)
    base = drain_s if math.isfinite(drain_s) and drain_s > 0 else config.min
    base = min(max(base, low), high)
    jittered = base * rng.uniform(1.0 - config.jitter, 1.0 + config.jitter)
    return min(max(math.ceil(jittered), low), high)

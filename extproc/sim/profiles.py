"""Hardware/model profiles for the simulated engine: what one GPU server can do, in numbers.

The numbers are rough public figures for vLLM on H100s (Llama 3.1, bf16) and one L4, good enough
that the queueing behaviour — where the knee is, how the tail grows past it — looks
like the real thing. They are not a benchmark.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Profile:
    """One model on one kind of server.

    ``decode_ms`` maps a running batch size to the time of one engine step, i.e. the
    per-token latency every sequence in the batch sees; between points it is
    interpolated linearly, beyond the last point extrapolated along the last segment.
    """

    name: str
    model: str
    decode_ms: tuple[tuple[int, float], ...]
    prefill_tokens_per_s: float
    kv_cache_tokens: int
    max_running: int
    #: Tokens one step may process (decode tokens + prefill chunks), as vLLM's
    #: ``max_num_batched_tokens``; longer prompts are prefilled in chunks over several steps.
    max_batched_tokens: int
    max_model_len: int
    block_size: int = 16

    def __post_init__(self) -> None:
        problems = []
        batches = [b for b, _ in self.decode_ms]
        if not self.decode_ms:
            problems.append("decode_ms needs at least one (batch, ms) point")
        elif batches != sorted(set(batches)) or batches[0] < 1:
            problems.append("decode_ms batch sizes must be ≥ 1 and strictly increasing")
        if any(ms <= 0 for _, ms in self.decode_ms):
            problems.append("decode_ms latencies must be positive")
        if self.prefill_tokens_per_s <= 0:
            problems.append("prefill_tokens_per_s must be positive")
        if self.max_running < 1 or self.block_size < 1:
            problems.append("max_running and block_size must be ≥ 1")
        if self.max_batched_tokens <= self.max_running:
            # Otherwise a full batch of decodes would leave no budget to ever prefill.
            problems.append("max_batched_tokens must exceed max_running")
        if self.max_model_len < 2 or self.max_model_len + self.block_size > self.kv_cache_tokens:
            # A request of the maximum length must fit an otherwise empty cache, or it could never run.
            problems.append("max_model_len must be ≥ 2 and leave a block free in kv_cache_tokens")
        if problems:
            raise ValueError(f"profile {self.name!r}: " + "; ".join(problems))

    @property
    def prefill_s_per_token(self) -> float:
        return 1.0 / self.prefill_tokens_per_s

    def step_seconds(self, batch: int) -> float:
        """Duration of one decode step with ``batch`` sequences in it (before time scaling)."""
        points = self.decode_ms
        if len(points) == 1 or batch <= points[0][0]:
            return points[0][1] / 1000.0
        i = min(bisect.bisect_left(points, (batch, float("-inf"))), len(points) - 1)
        (b0, ms0), (b1, ms1) = points[i - 1], points[i]
        ms = ms0 + (ms1 - ms0) * (batch - b0) / (b1 - b0)
        return max(ms, points[0][1]) / 1000.0


LLAMA_8B_H100 = Profile(
    name="llama-8b-h100",
    model="meta-llama/Llama-3.1-8B-Instruct",
    decode_ms=((1, 4.6), (8, 5.0), (16, 5.5), (32, 6.5), (64, 8.2), (128, 11.0), (192, 13.6), (250, 16.0)),
    prefill_tokens_per_s=30_000.0,
    kv_cache_tokens=400_000,
    max_running=256,
    max_batched_tokens=8192,
    max_model_len=32_768,
)

LLAMA_70B_2XH100 = Profile(
    name="llama-70b-2xh100",
    model="meta-llama/Llama-3.1-70B-Instruct",
    decode_ms=((1, 19.0), (8, 22.0), (16, 26.0), (32, 36.0), (64, 60.0), (100, 93.0)),
    prefill_tokens_per_s=12_000.0,
    kv_cache_tokens=200_000,
    max_running=128,
    max_batched_tokens=8192,
    max_model_len=32_768,
)

#: One small GPU with little room for KV: Llama 3.1 8B on a single L4 (24 GB). Rough, public-ish
#: figures, not a benchmark: about 18 ms/token alone rising to ~60 ms at batch 64, prefill ~4k
#: tokens/s, ~40k tokens of KV cache. The batch-one figure is optimistic for bf16 weights (16 GB
#: read per step over the L4's ~300 GB/s is ~53 ms) and fits a quantized 8B better; what matters
#: here is the shape: a cache that a few dozen long requests fill, then preemption and queueing.
LLAMA_8B_L4 = Profile(
    name="llama-8b-l4",
    model="meta-llama/Llama-3.1-8B-Instruct",
    decode_ms=((1, 18.0), (8, 21.0), (16, 25.0), (32, 35.0), (64, 60.0)),
    prefill_tokens_per_s=4_000.0,
    kv_cache_tokens=40_000,
    max_running=64,
    max_batched_tokens=2048,
    max_model_len=8192,
)

#: Small and fast, for tests: four sequences, a 2048-token cache, 10–16 ms steps.
TEST = Profile(
    name="test",
    model="sim-test",
    decode_ms=((1, 10.0), (4, 16.0)),
    prefill_tokens_per_s=20_000.0,
    kv_cache_tokens=2048,
    max_running=4,
    max_batched_tokens=2048,
    max_model_len=1024,
)

PROFILES: dict[str, Profile] = {p.name: p for p in (LLAMA_8B_H100, LLAMA_70B_2XH100, LLAMA_8B_L4, TEST)}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None

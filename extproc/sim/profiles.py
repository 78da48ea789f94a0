"""Hardware/model profiles for the simulated engine: what one GPU server can do, in numbers.

The numbers are rough public figures for vLLM on H100s (Llama 3.1, bf16) and one L4, good enough
that the queueing behaviour — where the knee is, how the tail grows past it — looks
like the real thing. They are not a benchmark.

Each profile also says how its server behaves (:class:`~extproc.sim.dynamics.Dynamics`): the
vLLM-like ones are vLLM's V1 engine; two others are servers unlike it, to try an admission
controller where it was not tuned. ``llama-8b-l40s-tgi`` is a TGI-like router in front of a
batch capped at 48: a step of a large fixed cost plus a little per sequence, new requests taken
only every 20 decode steps (sooner when enough wait), prefill stalling the decode, gauges
published per step, a stream event per 8 tokens, the Prometheus client's default buckets.
``llama-13b-a100-v0`` is vLLM's V0 scheduler without chunked prefill on a cache that a few dozen
chats fill: prefill first and whole, stalling every decode; the batch bounded by the KV cache, not
by its 256 slots, so it admits, fills the cache and preempts (recompute), in a loop.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from extproc.sim.dynamics import PROMETHEUS_DEFAULT, VLLM_V1, Dynamics


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
    #: How the server schedules and what it shows (vLLM's V1 engine unless said otherwise).
    dynamics: Dynamics = VLLM_V1

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
        if not isinstance(self.dynamics, Dynamics):
            problems.append(f"dynamics must be a Dynamics, got {type(self.dynamics).__name__}")
        elif not self.dynamics.chunked_prefill and self.max_batched_tokens < self.max_model_len:
            # A prompt is prefilled whole in one step: the longest one must fit a step's budget.
            problems.append("without chunked prefill max_batched_tokens must be ≥ max_model_len")
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


def linear_steps(fixed_ms: float, per_sequence_ms: float, up_to: int) -> tuple[tuple[int, float], ...]:
    """``decode_ms`` for a step of ``fixed_ms + per_sequence_ms × running`` (exact at any batch size:
    :meth:`Profile.step_seconds` extrapolates along the line past ``up_to``)."""
    if up_to < 2:
        raise ValueError("linear_steps needs up_to ≥ 2")
    return ((1, fixed_ms + per_sequence_ms), (up_to, fixed_ms + per_sequence_ms * up_to))


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

#: A TGI-like server (Llama 3.1 8B, one L40S, ``--max-batch-size 48``): a step is 22 ms of weights
#: read plus 0.3 ms per sequence (36 ms at 48), so throughput grows almost linearly up to the cap
#: and the knee is the cap itself. Its router takes new requests into a running batch only every 20
#: decode steps (``max_waiting_tokens``), or once 1.2 × running wait (``waiting_served_ratio``),
#: and prefills them in a step of their own while the batch waits. KV (200k tokens) never binds.
#: Gauges move once per step, a stream sends an event per 8 tokens, and the histograms are the
#: Prometheus client's defaults. Rough figures, not a benchmark.
LLAMA_8B_L40S_TGI = Profile(
    name="llama-8b-l40s-tgi",
    model="meta-llama/Llama-3.1-8B-Instruct",
    decode_ms=linear_steps(22.0, 0.3, 48),
    prefill_tokens_per_s=8_000.0,
    kv_cache_tokens=200_000,
    max_running=48,
    max_batched_tokens=8192,
    max_model_len=8192,
    dynamics=Dynamics(chunked_prefill=False, admit_every_steps=20, admit_waiting_ratio=1.2,
                      gauges_at_steps=True, stream_every_tokens=8, histograms=PROMETHEUS_DEFAULT,
                      percentiles="histogram"),
)

#: vLLM's V0 scheduler with its defaults (no chunked prefill, 256 sequences) serving Llama 2 13B on
#: one A100 80 GB: ~50k tokens of KV cache at 0.8 MB a token, 17 ms a step alone rising to 44 ms at
#: 64 (the KV read grows with the batch), 6k prefill tokens/s, a 4k context. A waiting request
#: that fits is prefilled, whole, before the next decode step, so every arrival stalls the decode;
#: the cache, not the slots, bounds the batch: it admits while the prompts fit, the answers grow
#: until the cache is full, and the newest sequences are preempted and later recomputed (a long
#: stall). Its simulated percentiles are read through vLLM's buckets. Rough figures.
LLAMA_13B_A100_V0 = Profile(
    name="llama-13b-a100-v0",
    model="meta-llama/Llama-2-13b-chat-hf",
    decode_ms=((1, 17.0), (16, 22.0), (32, 29.0), (64, 44.0)),
    prefill_tokens_per_s=6_000.0,
    kv_cache_tokens=50_000,
    max_running=256,
    max_batched_tokens=4096,
    max_model_len=4096,
    dynamics=Dynamics(chunked_prefill=False, percentiles="histogram"),
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

PROFILES: dict[str, Profile] = {p.name: p for p in (LLAMA_8B_H100, LLAMA_70B_2XH100, LLAMA_8B_L4,
                                                     LLAMA_8B_L40S_TGI, LLAMA_13B_A100_V0, TEST)}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None

"""How an engine model schedules and what it shows: the options that make one server unlike another.

The engine (:mod:`extproc.sim.engine`) is a continuous-batching server; a profile's numbers
(:mod:`extproc.sim.profiles`) say how fast it is, and its :class:`Dynamics` how it behaves. The
defaults are vLLM's (V1 engine): chunked prefill, waiting requests join the batch at every step,
gauges that move the moment a request arrives, a stream chunk every ``--stream-interval`` seconds,
vLLM's own histogram buckets. Each option below changes one of these, so an admission controller
tuned against one server can be tried against others:

* ``chunked_prefill=False``: a step either prefills or decodes, never both. Waiting requests are
  prefilled whole (every prompt in one step, up to ``max_batched_tokens``) in a *prefill-only* step
  during which every decoding sequence waits: the decode stalls, and its inter-token latency jumps
  by the prefill's length. A preempted sequence's recompute is such a step too (its prompt and
  every token it had made). With the default admission (every step), a request that fits is
  prefilled before the next decode step: prefill first, as vLLM's V0 scheduler without chunked
  prefill.
* ``admit_every_steps=N`` (and ``admit_waiting_ratio=R``): a running batch takes new requests only
  once N − 1 decode steps have passed since it last did, or sooner once the waiting requests that
  fit number at least floor(R × running); an empty batch takes them at once. Requests wait, and
  are seen waiting, for up to N steps although slots are free, as under TGI's router
  (``max_waiting_tokens``, ``waiting_served_ratio``).
* ``gauges_at_steps=True``: running, waiting and KV usage are published once per step, as the
  scheduler saw them at the step's start: a request that arrives mid-step shows from the next step
  on, and one that finishes or is cancelled mid-step still shows until then.
* ``stream_every_tokens=K``: a stream sends the first token alone as soon as it exists, then one
  event per K tokens (the last event carries the rest), rather than whatever exists every
  ``--stream-interval`` seconds. Time to first token and to the last are unchanged; the proxy and
  extproc see a K-th of the events.
* ``histograms``: the bucket bounds of the TTFT, inter-token latency and request latency
  histograms ``/metrics`` exports. ``PROMETHEUS_DEFAULT`` is the Prometheus client's default set,
  coarser than vLLM's where the targets sit (nothing between 1 s and 2.5 s).
* ``percentiles``: what the offline simulator answers for a TTFT or inter-token p95 signal:
  ``"exact"`` (the nearest rank of every sample, as every recorded run of the vLLM-like profiles
  used) or ``"histogram"`` (Prometheus' ``histogram_quantile`` over this engine's buckets, as a
  scrape of its ``/metrics`` reads it live: quantised the same way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Histograms:
    """Bucket upper bounds (seconds, +Inf implied) of the latency histograms an engine exports."""

    name: str
    ttft: tuple[float, ...]
    """``vllm:time_to_first_token_seconds``."""
    itl: tuple[float, ...]
    """``vllm:inter_token_latency_seconds`` (and ``vllm:time_per_output_token_seconds``)."""
    request: tuple[float, ...]
    """``vllm:e2e_request_latency_seconds`` and ``vllm:request_queue_time_seconds``."""

    def __post_init__(self) -> None:
        for field in ("ttft", "itl", "request"):
            bounds = getattr(self, field)
            if not bounds or any(not math.isfinite(b) or b <= 0 for b in bounds) \
                    or list(bounds) != sorted(set(bounds)):
                raise ValueError(f"histograms {self.name!r}: {field} bounds must be finite, positive and "
                                 f"strictly increasing, got {bounds!r}")


#: vLLM's own bucket boundaries, so histogram_quantile gives the same answers against both.
VLLM = Histograms(
    name="vllm",
    ttft=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
          40.0, 80.0, 160.0, 640.0, 2560.0),
    itl=(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
         80.0),
    request=(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
             480.0, 960.0, 1920.0, 7680.0),
)

_PROMETHEUS_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
#: The Prometheus client libraries' default buckets, for every latency: what a server gets that never
#: chose its own. Coarser than vLLM's where targets sit, and nothing past 10 s but +Inf.
PROMETHEUS_DEFAULT = Histograms(name="prometheus-default", ttft=_PROMETHEUS_BOUNDS, itl=_PROMETHEUS_BOUNDS,
                                request=_PROMETHEUS_BOUNDS)

Percentiles = Literal["exact", "histogram"]


@dataclass(frozen=True, slots=True)
class Dynamics:
    """How one engine model schedules and what it shows (see the module doc for each option)."""

    chunked_prefill: bool = True
    """False: prefill-only steps of whole prompts, during which decoding sequences stall."""
    admit_every_steps: int = 1
    """A running batch takes waiting requests once this many steps minus one decoded since it last did."""
    admit_waiting_ratio: float | None = None
    """Or sooner, once the waiting requests that fit number floor(ratio × running) (None: never sooner)."""
    gauges_at_steps: bool = False
    """Running, waiting and KV usage as of the start of the latest step, not of the instant."""
    stream_every_tokens: int | None = None
    """One stream event per this many tokens after the first (None: every stream interval)."""
    histograms: Histograms = VLLM
    """Bucket bounds of the latency histograms ``/metrics`` exports."""
    percentiles: Percentiles = "exact"
    """How the offline simulator reads a TTFT or inter-token p95: exact, or through ``histograms``."""

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.admit_every_steps, int) or self.admit_every_steps < 1:
            problems.append(f"admit_every_steps must be an integer ≥ 1, got {self.admit_every_steps!r}")
        ratio = self.admit_waiting_ratio
        if ratio is not None and not (math.isfinite(ratio) and ratio > 0):
            problems.append(f"admit_waiting_ratio must be a positive number or None, got {ratio!r}")
        every = self.stream_every_tokens
        if every is not None and (not isinstance(every, int) or every < 1):
            problems.append(f"stream_every_tokens must be an integer ≥ 1 or None, got {every!r}")
        if self.percentiles not in ("exact", "histogram"):
            problems.append(f"percentiles must be 'exact' or 'histogram', got {self.percentiles!r}")
        if not isinstance(self.histograms, Histograms):
            problems.append(f"histograms must be a Histograms, got {type(self.histograms).__name__}")
        if problems:
            raise ValueError("engine dynamics: " + "; ".join(problems))


#: vLLM's (V1) behaviour: what every profile has unless it says otherwise.
VLLM_V1 = Dynamics()

"""Cheap completion-time estimate that learns from observed service times.

How this works: a request's service time is modelled as

    overhead + prompt_tokens × prefill_cost + output_tokens × decode_cost × slowdown

where ``output_tokens`` is the request's ``max_tokens`` (or the policy default;
never more than the policy's ``max_output_tokens``, the largest job it expects, which is
also the size of a request whose body could not be read), and
``slowdown = 1 + occupancy_slowdown × occupancy`` reflects that a batching
engine's per-token latency grows with the number of running sequences. The
policy gives priors per model; each observed service time updates an EWMA of
that model's decode cost per *requested* output token (normalised by the
slowdown it ran under). Requests that stop before ``max_tokens`` pull the
learned cost down, which is exactly the correction an upper bound needs.

A request whose body could not be read (``Job.unread``) is the largest job the
policy expects: ``max_output_tokens`` on whichever model costs most, the default
costs included. Its size is a guess, so its service time teaches nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.policy.schema import Estimation, ModelCost

#: One observation moves the estimate by at most this factor (guards against outliers).
_MAX_STEP = 4.0


@dataclass(frozen=True, slots=True)
class Job:
    """The parts of a request that its service time depends on."""

    model: str | None
    prompt_tokens: int
    output_tokens: int
    unread: bool = False
    """Its body could not be read: sized as the largest job the policy expects (see ``job``)."""


class Estimator:
    def __init__(self, config: Estimation) -> None:
        self._config = config
        self._learned: dict[str, float] = {}
        self._samples: dict[str, int] = {}

    def reconfigure(self, config: Estimation) -> None:
        """Take new priors; what was learned is kept."""
        self._config = config

    def job(self, model: str | None, prompt_chars: int, prompt_tokens: int | None,
            max_tokens: int | None, *, unreadable: bool = False) -> Job:
        """The job a request's body describes; ``unreadable``: its body could not be read, so its
        output is the largest the policy expects, never the default of a body that gave none."""
        config = self._config
        tokens = prompt_tokens if prompt_tokens is not None else round(prompt_chars / config.chars_per_token)
        if unreadable:
            return Job(model, max(0, tokens), config.max_output_tokens, unread=True)
        # (The cap also keeps an absurd limit, 400 digits long, from overflowing the float arithmetic.)
        output = config.default_max_tokens if max_tokens is None else min(max_tokens,
                                                                          config.max_output_tokens)
        return Job(model, max(0, tokens), max(1, output))

    def _key(self, model: str | None) -> str:
        return model if model is not None and model in self._config.models else "*"

    def _cost(self, model: str | None) -> ModelCost:
        return self._config.models.get(model or "", self._config.default)

    def decode_ms_per_token(self, model: str | None) -> float:
        """Current decode cost per requested token at zero occupancy (learned or prior)."""
        key = self._key(model)
        learned = self._learned.get(key)
        return learned if learned is not None else self._cost(model).decode_ms_per_token

    def slowdown(self, occupancy: float) -> float:
        return 1.0 + self._config.occupancy_slowdown * min(max(occupancy, 0.0), 1.0)

    def sized_as(self, job: Job, occupancy: float) -> str | None:
        """The model whose costs size ``job`` (None: the default costs): its own, or for a job whose
        body could not be read and that names no model, the one that makes it take longest."""
        if not job.unread or job.model is not None:
            return job.model
        return max((None, *self._config.models), key=lambda model: self._time_ms(job, model, occupancy))

    def predict(self, job: Job, occupancy: float) -> float:
        """Predicted service time in seconds at the given occupancy (0 idle … 1 full)."""
        return self._time_ms(job, self.sized_as(job, occupancy), occupancy) / 1000.0

    def _time_ms(self, job: Job, model: str | None, occupancy: float) -> float:
        cost = self._cost(model)
        return (
            cost.overhead_ms
            + job.prompt_tokens * cost.prefill_ms_per_token
            + job.output_tokens * self.decode_ms_per_token(model) * self.slowdown(occupancy)
        )

    def observe(self, job: Job, occupancy: float, service_s: float) -> None:
        """Learn from one finished request's observed service time."""
        alpha = self._config.learning_rate
        if alpha <= 0 or service_s <= 0 or job.unread:
            return
        # Keys are the policy's model names plus "*": clients cannot grow this state.
        key = self._key(job.model)
        cost = self._cost(job.model)
        decode_ms = service_s * 1000.0 - cost.overhead_ms - job.prompt_tokens * cost.prefill_ms_per_token
        sample = max(decode_ms, 0.0) / (job.output_tokens * self.slowdown(occupancy))
        current = self.decode_ms_per_token(job.model)
        sample = min(max(sample, current / _MAX_STEP), current * _MAX_STEP)
        self._learned[key] = (1 - alpha) * current + alpha * sample
        self._samples[key] = self._samples.get(key, 0) + 1

    def learned(self) -> dict[str, tuple[float, int]]:
        """Per model key: (decode ms per requested token, observations)."""
        return {k: (v, self._samples[k]) for k, v in self._learned.items()}

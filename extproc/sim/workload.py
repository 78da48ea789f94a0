"""Synthetic inference workloads: arrivals, request sizes, lanes, tenants and client retries.

Pure and seeded: the same spec and seed give the same requests, whether they
are sent over HTTP by the load runner or fed to the offline simulator. A
workload can be written to and read from a JSONL trace (one request per line).

Arrivals are open-loop (the schedule never waits for answers): Poisson, or
Gamma-distributed gaps with a chosen coefficient of variation (CV > 1 is
bursty), optionally multiplied during step bursts. Output lengths follow the
chatbot mix (short 50-token and long 2000-token answers with a chosen long
share) or a ShareGPT-like log-normal distribution.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from extproc.policy.fields import Duration


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Burst(_Spec):
    at: Duration
    duration: Annotated[Duration, Field(gt=0)]
    multiplier: Annotated[float, Field(gt=0)]


class Arrivals(_Spec):
    process: Literal["poisson", "gamma", "uniform"] = "poisson"
    rate: Annotated[float, Field(gt=0)]
    """Mean requests per second (before bursts)."""
    cv: Annotated[float, Field(gt=0)] = 1.0
    """Coefficient of variation of the gaps (gamma only; 1 is Poisson-like, >1 bursty)."""
    bursts: tuple[Burst, ...] = ()


class Lengths(_Spec):
    kind: Literal["chatbot", "sharegpt", "fixed"] = "chatbot"
    short_output: Annotated[int, Field(ge=1)] = 50
    long_output: Annotated[int, Field(ge=1)] = 2000
    long_share: Annotated[float, Field(ge=0, le=1)] = 0.2
    prompt_mean: Annotated[int, Field(ge=1)] = 200
    """Mean prompt tokens (log-normal spread for chatbot/sharegpt; exact for fixed)."""
    output: Annotated[int, Field(ge=1)] = 128
    """Output tokens for kind=fixed, and the median for sharegpt."""
    max_output: Annotated[int, Field(ge=1)] = 4096


class SloSpec(_Spec):
    ttft: Annotated[Duration, Field(gt=0)] = 2.0
    e2e: Annotated[Duration, Field(gt=0)] = 120.0


class TrafficClass(_Spec):
    name: str
    """The lane this traffic is meant for (reported per class)."""
    share: Annotated[float, Field(gt=0)] = 1.0
    path: str = "/v1/chat/completions"
    headers: dict[str, str] = Field(default_factory=dict)
    tenants: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=lambda: {"default": 1.0})
    """Tenant name → relative rate."""
    keys: dict[str, str] = Field(default_factory=dict)
    """Tenant name → the API key its clients present (``Authorization: Bearer <key>``). The gateway
    maps the key to the tenant and sets ``tenant_header`` itself; a tenant without a key sends
    ``tenant_header`` as a plain client header (which a gateway that strips it ignores)."""
    tenant_header: str = "x-extproc-client"
    lengths: Lengths | None = None
    slo: SloSpec = Field(default_factory=SloSpec)
    stream: bool = True
    include_usage: bool = True
    """A streamed request asks for its usage (``stream_options.include_usage``); the OpenAI SDKs
    do not unless told to."""


class Client(_Spec):
    """Client retry behaviour. ``openai`` mimics the OpenAI SDKs' defaults."""

    kind: Literal["openai", "none"] = "openai"
    max_retries: Annotated[int, Field(ge=0, le=10)] = 2
    initial_backoff: Annotated[float, Field(gt=0)] = 0.5
    max_backoff: Annotated[float, Field(gt=0)] = 8.0
    max_retry_after: Annotated[float, Field(gt=0)] = 60.0
    timeout: Annotated[Duration, Field(gt=0)] = 600.0


class WorkloadSpec(_Spec):
    model: str = "sim-model"
    arrivals: Arrivals
    lengths: Lengths = Field(default_factory=Lengths)
    classes: tuple[TrafficClass, ...] = (TrafficClass(name="default"),)
    client: Client = Field(default_factory=Client)


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload, in the order of its arrival."""

    index: int
    at: float
    cls: str
    tenant: str
    prompt_tokens: int
    output_tokens: int
    path: str = "/v1/chat/completions"
    headers: dict[str, str] = field(default_factory=dict)
    """What the client sends (besides its key)."""
    stream: bool = True
    model: str = "sim-model"
    key: str | None = None
    """The API key the client presents, if any."""
    gateway: dict[str, str] = field(default_factory=dict)
    """Headers the gateway sets from the key (what extproc then sees; the simulator applies them)."""
    include_usage: bool = True
    """A streamed request asks for its usage event."""

    @property
    def is_long(self) -> bool:
        return self.output_tokens >= 1000

    def body(self, chars_per_token: int = 4) -> dict[str, Any]:
        """An OpenAI-style request whose prompt has about ``prompt_tokens`` tokens."""
        chars = self.prompt_tokens * chars_per_token
        prompt = ("lorem " * (chars // 6 + 1))[:chars]
        doc: dict[str, Any] = {"model": self.model, "max_tokens": self.output_tokens, "stream": self.stream}
        if self.path.endswith("/chat/completions"):
            doc["messages"] = [{"role": "user", "content": prompt}]
        else:
            doc["prompt"] = prompt
        if self.stream and self.include_usage:
            doc["stream_options"] = {"include_usage": True}
        return doc


def load_spec(source: str | Path) -> WorkloadSpec:
    """A workload spec from a YAML/JSON file."""
    data = yaml.safe_load(Path(source).read_text())
    return WorkloadSpec.model_validate(data)


def _rate_at(arrivals: Arrivals, t: float) -> float:
    multiplier = 1.0
    for burst in arrivals.bursts:
        if burst.at <= t < burst.at + burst.duration:
            multiplier *= burst.multiplier
    return arrivals.rate * multiplier


def _gap(arrivals: Arrivals, rate: float, rng: random.Random) -> float:
    if arrivals.process == "uniform":
        return 1.0 / rate
    if arrivals.process == "gamma":
        shape = 1.0 / (arrivals.cv**2)
        return rng.gammavariate(shape, 1.0 / (rate * shape))
    return rng.expovariate(rate)


def _lognormal(mean: float, sigma: float, rng: random.Random) -> float:
    # Parameterised by its mean, so "prompt_mean" means what it says.
    return rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)


def _lengths(lengths: Lengths, rng: random.Random) -> tuple[int, int]:
    if lengths.kind == "fixed":
        return lengths.prompt_mean, lengths.output
    prompt = max(1, round(_lognormal(lengths.prompt_mean, 0.8, rng)))
    if lengths.kind == "chatbot":
        output = lengths.long_output if rng.random() < lengths.long_share else lengths.short_output
    else:
        # ShareGPT-like: heavy-tailed outputs around a median, capped.
        output = round(rng.lognormvariate(math.log(lengths.output), 0.9))
    return min(prompt, 32_000), max(1, min(output, lengths.max_output))


def _pick(weights: dict[str, float], rng: random.Random) -> str:
    names = list(weights)
    return rng.choices(names, weights=[weights[n] for n in names])[0]


def generate(spec: WorkloadSpec, duration: float, seed: int) -> list[Request]:
    """Every request arriving in [0, duration), in arrival order."""
    rng = random.Random(seed)
    shares = {c.name: c.share for c in spec.classes}
    classes = {c.name: c for c in spec.classes}
    out: list[Request] = []
    t = 0.0
    while True:
        # Thinning-free approximation: the gap uses the rate at the current time, which is
        # exact for step bursts up to one gap at each step edge.
        t += _gap(spec.arrivals, _rate_at(spec.arrivals, t), rng)
        if t >= duration:
            return out
        cls = classes[_pick(shares, rng)]
        tenant = _pick(cls.tenants, rng)
        prompt, output = _lengths(cls.lengths or spec.lengths, rng)
        out.append(make_request(spec, cls, len(out), t, prompt, output, rng, tenant=tenant))


def make_request(spec: WorkloadSpec, cls: TrafficClass, index: int, at: float, prompt_tokens: int,
                 output_tokens: int, rng: random.Random, tenant: str | None = None) -> Request:
    """A request of ``cls`` (its path, headers, stream flag; its tenant's API key, or the tenant
    header it sends itself); ``tenant`` None: picked by the class's weights."""
    if tenant is None:
        tenant = _pick(cls.tenants, rng)
    headers = dict(cls.headers)
    key = cls.keys.get(tenant)
    gateway: dict[str, str] = {}
    if key is not None:
        gateway[cls.tenant_header] = tenant
    elif len(cls.tenants) > 1 or "default" not in cls.tenants or tenant != "default":
        headers[cls.tenant_header] = tenant
    return Request(index, at, cls.name, tenant, prompt_tokens, output_tokens, cls.path, headers, cls.stream,
                   spec.model, key, gateway, cls.include_usage)


def retry_delay(client: Client, attempt: int, status: int | None, headers: dict[str, str],
                rng: random.Random) -> float | None:
    """Seconds to wait before retry number ``attempt`` (1-based), or None to give up.

    Mirrors the OpenAI SDKs: up to ``max_retries`` retries on connection errors,
    408, 409, 429 and 5xx; ``x-should-retry`` overrides; a ``retry-after`` (or
    ``retry-after-ms``) between 0 and 60 s is honoured, otherwise exponential
    backoff from 0.5 s up to 8 s with up to 25 % jitter.
    """
    if client.kind == "none" or attempt > client.max_retries:
        return None
    should = headers.get("x-should-retry")
    if should == "false":
        return None
    if should != "true" and status is not None and not (status in (408, 409, 429) or status >= 500):
        return None
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) * scale
        except ValueError:
            continue
        if 0 < seconds <= client.max_retry_after:
            return seconds
    backoff: float = min(client.initial_backoff * 2.0 ** (attempt - 1), client.max_backoff)
    return backoff * (1 - 0.25 * rng.random())


def write_trace(requests: Iterable[Request], path: str | Path) -> None:
    with Path(path).open("w") as out:
        for request in requests:
            out.write(json.dumps(asdict(request), separators=(",", ":")) + "\n")

"""Policy for the edge shed (Envoy's rate limit service) and the retry budget.

Two top-level policy keys: ``ratelimit`` (what the rate limit service answers
Envoy's ratelimit filter: lane pressure and per-tenant budgets) and
``retry_budget`` (how large a share of admitted work retries may be). Both are
strict and frozen like the rest of the policy; the rules that need other sections
to check (``extproc.policy.schema.ratelimit_problems``) run with the whole policy.

A tenant budget is a token bucket: ``requests`` (or ``tokens``) ``per`` unit of
time, refilled continuously, holding ``burst`` units' worth at most::

    ratelimit:
      budgets:
        default: {requests: 600, tokens: 200000, per: minute}
        tenants:
          acme: {requests: 6000, tokens: 2000000, per: minute}
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, field_validator

from extproc.policy.fields import Duration, HeaderName, Strict

_DescriptorValue = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")]
Unit = Literal["second", "minute", "hour", "day"]
UNIT_SECONDS: dict[str, float] = {"second": 1.0, "minute": 60.0, "hour": 3600.0, "day": 86400.0}


class TenantLimit(Strict):
    """One tenant's budget. A limit left out is no limit."""

    requests: Annotated[int | None, Field(ge=1, le=1_000_000_000)] = None
    tokens: Annotated[int | None, Field(ge=1, le=4_000_000_000)] = None
    """Tokens (prompt + completion) as the backend reports them when a response ends."""
    per: Unit = "minute"
    burst: Annotated[float, Field(gt=0, le=100)] = 1.0
    """The bucket holds this many units' worth: 1 lets a whole minute's budget go at once."""

    @property
    def unit_seconds(self) -> float:
        return UNIT_SECONDS[self.per]

    @property
    def in_words(self) -> str:
        """``600 requests and 200000 tokens per minute`` (``, burst 2`` when not 1), or ``no limit``."""
        parts = [f"{n} {kind}" for kind, n in (("requests", self.requests), ("tokens", self.tokens))
                 if n is not None]
        if not parts:
            return "no limit"
        burst = f", burst {self.burst:g}" if self.burst != 1 else ""
        return f"{' and '.join(parts)} per {self.per}{burst}"


class Budgets(Strict):
    default: TenantLimit = Field(default_factory=TenantLimit)
    """Applies to every tenant not listed under ``tenants``."""
    tenants: dict[Annotated[str, Field(min_length=1, max_length=1024)], TenantLimit] = Field(
        default_factory=dict)
    """Per-tenant budgets; each replaces the default as a whole (unset limits are no limits)."""
    max_tenants: Annotated[int, Field(ge=1, le=10_000_000)] = 100_000
    """Tenants tracked at once; the least recently seen are forgotten (and start full again)."""

    def of(self, tenant: str) -> TenantLimit:
        return self.tenants.get(tenant, self.default)

    @property
    def any(self) -> bool:
        return any(limit.requests or limit.tokens for limit in (self.default, *self.tenants.values()))

    @property
    def tokens(self) -> bool:
        """Some tenant has a token budget."""
        return any(limit.tokens for limit in (self.default, *self.tenants.values()))


def _off(value: object) -> object:
    # YAML 1.1 reads a bare `off` as false: take it as the "off" it was written as.
    return "off" if value is False else value


class RateLimit(Strict):
    """What the rate limit service answers Envoy's ratelimit filter (the edge, before ext_proc)."""

    mode: Annotated[Literal["enforce", "shadow", "off"], BeforeValidator(_off)] = "enforce"
    """shadow: decide and count, but always answer OK. off: answer OK without deciding."""
    domain: _DescriptorValue = "extproc"
    """Must equal the ratelimit filter's ``domain``; requests for other domains are let through."""
    request_descriptor: _DescriptorValue = "gpu_inference"
    """``generic_key`` of the descriptor Envoy sends as a request arrives."""
    usage_descriptor: _DescriptorValue = "gpu_inference_tokens"
    """``generic_key`` of the descriptor Envoy sends when a response ends, with the usage it read."""
    ask_usage: bool = True
    """With token budgets: set ``stream_options.include_usage`` on streamed requests that did not
    ask (the model server reports a stream's tokens only then); Envoy removes that event again
    before the client sees it. Off: streams that did not ask are charged an estimate."""
    queue_share: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Shed a lane at the edge once its queue holds this share of max_queued (and no slot is free)."""
    shed_saturated: bool = True
    """Shed at the edge the lanes that saturation sheds (a retry cannot help them soon)."""
    budgets: Budgets = Field(default_factory=Budgets)

    @property
    def asks_usage(self) -> bool:
        """Whether ext_proc asks streamed requests for their usage (token budgets are charged)."""
        return self.ask_usage and self.mode != "off" and self.budgets.tokens


class RetryBudgetPolicy(Strict):
    """Retries may be at most ``ratio`` of the admitted original requests, plus a small floor."""

    enabled: bool = True
    header: HeaderName = "x-stainless-retry-count"
    """A request whose value here is a number above 0 is a retry (the OpenAI SDKs set it)."""
    ratio: Annotated[float, Field(ge=0, le=1)] = 0.1
    min_per_second: Annotated[float, Field(ge=0, le=1_000_000)] = 1.0
    """Retries allowed per second however few originals there were (a quiet service may retry)."""
    window: Annotated[Duration, Field(gt=0, le=3600)] = 10.0

    @field_validator("header")
    @classmethod
    def _lower(cls, value: str) -> str:
        return value.lower()


"""Model servers' own /metrics pages, read directly and reduced to one number per signal.

How this works: every target of a scrape source is fetched once per round. Only the lines
of the sample names some signal wants are handed to prometheus_client's text parser (a
vLLM page is mostly histogram buckets nobody asked for). Each signal then takes, from
every target that answered, the series matching its metric (or the first name of its
preset that this target exposes) and its label matchers, and aggregates them across all
targets with max, min, sum or avg. A target that is down drops out; only when every
target failed is the signal's reading a failure.

Presets spare SREs the engines' metric names; each resolves per target, so a fleet that
mixes vLLM versions, SGLang and TensorRT-LLM still yields one number.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from extproc.policy.signals import Aggregate, Preset, Signal
from extproc.signals import ErrorKind, SignalError, fetch

#: Labels → value of one series.
Sample = tuple[Mapping[str, str], float]
#: Sample name → its series, for the names asked for; what one target's page contributes.
Page = Mapping[str, list[Sample]]

#: Text format 0.0.4: what every engine serves, and what this parser reads.
ACCEPT = "text/plain;version=0.0.4;q=1.0, */*;q=0.1"


@dataclass(frozen=True, slots=True)
class Selector:
    """A sample name and the label values a series must have."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(key) == value for key, value in self.labels)

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        return self.name + "{" + ",".join(f'{k}="{v}"' for k, v in self.labels) + "}"


#: Per preset, the engines' names for it, tried in this order on each target. The same names are the
#: ones the Gateway API Inference Extension's model-server metrics protocol lists for vLLM, SGLang,
#: trtllm-serve and Triton TensorRT-LLM.
PRESETS: dict[Preset, tuple[Selector, ...]] = {
    "kv_cache_usage": (
        # vLLM V1 engine (vllm-project/vllm, vllm/v1/metrics): "KV-cache usage. 1 means 100 percent
        # usage." (0–1).
        Selector("vllm:kv_cache_usage_perc"),
        # vLLM V0 engine (vllm/engine/metrics.py, before the V1 rename): "GPU KV-cache usage. 1 means
        # 100 percent usage." (0–1).
        Selector("vllm:gpu_cache_usage_perc"),
        # SGLang (sgl-project/sglang, python/sglang/srt/metrics/collector.py): "The token usage", the
        # share of the KV token pool in use (0–1).
        Selector("sglang:token_usage"),
        # trtllm-serve, TensorRT-LLM's own OpenAI server (NVIDIA/TensorRT-LLM,
        # tensorrt_llm/metrics/collector.py, which prefixes "trtllm_"): "KV cache utilization" (0–1).
        Selector("trtllm_kv_cache_utilization"),
        # Triton's TensorRT-LLM backend (triton-inference-server/tensorrtllm_backend, inflight batcher
        # custom metrics): KV-cache blocks in use as a fraction (0–1).
        Selector("nv_trt_llm_kv_cache_block_metrics", (("kv_cache_block_type", "fraction"),)),
    ),
    "waiting_requests": (
        # vLLM: requests waiting to be scheduled.
        Selector("vllm:num_requests_waiting"),
        # SGLang: requests in the waiting queue.
        Selector("sglang:num_queue_reqs"),
        # trtllm-serve: queued requests.
        Selector("trtllm_num_requests_waiting"),
        # Triton's TensorRT-LLM backend: requests waiting in the in-flight batcher.
        Selector("nv_trt_llm_request_metrics", (("request_type", "waiting"),)),
        # Text Generation Inference (huggingface/text-generation-inference router): requests queued.
        Selector("tgi_queue_size"),
        # Triton core, any backend: "Instantaneous number of pending requests awaiting execution per-model"
        # (a fallback for Triton without the TensorRT-LLM backend's own count).
        Selector("nv_inference_pending_request_count"),
    ),
    "running_requests": (
        Selector("vllm:num_requests_running"),
        Selector("sglang:num_running_reqs"),
        Selector("trtllm_num_requests_running"),
        # Triton's TensorRT-LLM backend: requests scheduled in the current iteration.
        Selector("nv_trt_llm_request_metrics", (("request_type", "scheduled"),)),
        # Text Generation Inference: size of the batch being decoded.
        Selector("tgi_batch_current_size"),
    ),
}


def selectors(signal: Signal) -> tuple[Selector, ...]:
    """What ``signal`` looks for on each target, best first; its own labels narrow every one."""
    extra = tuple(sorted(signal.labels.items()))
    if signal.preset is not None:
        return tuple(Selector(s.name, s.labels + extra) for s in PRESETS[signal.preset])
    if signal.metric is None:
        raise ValueError("a scrape signal needs metric or preset")
    return (Selector(signal.metric, extra),)


def names_of(signals: Collection[Signal]) -> frozenset[str]:
    """Every sample name the given signals may read."""
    return frozenset(s.name for signal in signals for s in selectors(signal))


def parse_page(text: str, names: Collection[str]) -> dict[str, list[Sample]]:
    """The series of the wanted sample names in exposition ``text``.

    Raises :class:`SignalError` (bad_response) if the lines of those names do not parse.
    """
    wanted = set(names)
    prefixes = tuple(wanted)
    lines = []
    if prefixes:
        for line in text.splitlines():
            # Cheap prefix test first; then the exact name (up to "{" or the first blank).
            if line.startswith(prefixes):
                end = len(line)
                for stop in ("{", " ", "\t"):
                    at = line.find(stop)
                    if 0 <= at < end:
                        end = at
                if line[:end] in wanted:
                    lines.append(line)
    out: dict[str, list[Sample]] = {}
    if not lines:
        return out
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for sample in family.samples:
                if sample.name in wanted:
                    out.setdefault(sample.name, []).append((sample.labels, float(sample.value)))
    except (ValueError, TypeError, IndexError) as exc:
        raise SignalError(ErrorKind.BAD_RESPONSE, f"cannot parse metrics: {exc}") from None
    return out


def aggregate(values: Sequence[float], how: Aggregate) -> float:
    if how == "max":
        return max(values)
    if how == "min":
        return min(values)
    total = math.fsum(values)
    return total if how == "sum" else total / len(values)


def read(signal: Signal, pages: Sequence[Page]) -> float:
    """The signal's number from the pages of the targets that answered.

    Raises :class:`SignalError` (no_data) when no page has a matching series with a number.
    """
    candidates = selectors(signal)
    values: list[float] = []
    for page in pages:
        for selector in candidates:
            found = [value for labels, value in page.get(selector.name, ())
                     if not math.isnan(value) and selector.matches(labels)]
            if found:
                values.extend(found)
                break
    if not values:
        wanted = " or ".join(str(s) for s in candidates)
        raise SignalError(ErrorKind.NO_DATA, f"none of the {len(pages)} target(s) that answered "
                                             f"exposes {wanted} with a number")
    return aggregate(values, signal.how)


async def scrape(session: aiohttp.ClientSession, url: str, time_limit: float,
                 names: Collection[str]) -> dict[str, list[Sample]]:
    """Fetch one target's page and keep the wanted names; raise :class:`SignalError` on failure."""
    status, body = await fetch(session, url, time_limit=time_limit, accept=ACCEPT)
    if status != 200:
        raise SignalError(ErrorKind.HTTP_STATUS, f"HTTP {status} from {url}")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise SignalError(ErrorKind.BAD_RESPONSE, f"{url} did not answer UTF-8 text") from None
    return parse_page(text, names)

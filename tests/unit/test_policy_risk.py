"""The risks of `extproc policy diff`: every change that can refuse or reorder more traffic, and why.

One table, change → risk: each row edits a policy the way an SRE would and names the risk it must
raise (where, and a phrase of why). Rows together cover every field of ``risk.CHECKED``, and
``CHECKED`` with ``risk.SAFE`` covers every field of the schema, so a field added later needs a
decision. A second table holds changes that refuse and reorder nothing and must raise no risk.
"""

from __future__ import annotations

import copy
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from extproc.policy import Policy, parse_policy
from extproc.tools import diff as df
from extproc.tools import risk

Data = dict[str, Any]
Edit = Callable[[Data], None]

#: A policy that uses every part of the schema, with room to make each stricter.
BASE: Data = {
    "trusted_headers": ["x-extproc-client", "x-team"],
    "lanes": [
        {"name": "interactive", "priority": 100, "max_inflight": 8, "max_queued": 64, "deadline": "10s",
         "borrow": True, "max_borrow": 4, "sjf_weight": 1},
        {"name": "batch", "priority": 50, "max_inflight": 4, "max_queued": 128, "deadline": "60s"},
        {"name": "best-effort", "max_inflight": 2, "max_queued": 16, "deadline": "20s", "evictable": True},
    ],
    "classification": {"default_lane": "best-effort", "rules": [
        {"name": "batch-api", "match": {"path_prefix": "/v1/batches"}, "lane": "batch"},
        {"name": "chat", "lane": "interactive", "match": {
            "path": "/v1/chat/completions", "methods": ["POST"], "headers": {"x-team": ["search"]},
            "models": ["llama"], "tenants": ["acme"]}},
        {"name": "embed", "match": {"path_regex": "^/v1/embed"}, "lane": "batch"},
    ]},
    "tenants": {"header": "x-extproc-client", "weights": {"acme": 3}},
    "estimation": {"read_body": "always", "models": {"llama": {"decode_ms_per_token": 30}}},
    "queueing": {"sjf_weight": 4},
    "capacity": {"max_inflight": 14, "max_queued": 200},
    "retry_after": {"share": 0.05},
    "signals": {
        "sources": {"prom": {"prometheus": {"url": "http://prom:9090"}},
                    "engines": {"scrape": {"targets": ["http://10.0.0.7:8000/metrics"]}}},
        "read": {"kv": {"source": "prom", "query": "max(vllm:kv_cache_usage_perc)"},
                 "queue": {"source": "engines", "preset": "waiting_requests", "on_stale": "hold"}},
        "saturation": [
            {"name": "kv-high", "signal": "kv", "above": 0.9, "below": 0.8, "shed": ["best-effort"],
             "shrink": {"batch": 0.5}},
            {"name": "queue-deep", "signal": "queue", "above": 100, "shed": ["best-effort"]},
        ]},
    "ratelimit": {"budgets": {"default": {"requests": 600, "per": "minute"},
                              "tenants": {"acme": {"requests": 6000, "tokens": 2_000_000, "burst": 2}}}},
}


def auto(d: Data) -> None:
    """The base with a self-sizing fleet limit, enforced."""
    d["capacity"] = {"max_inflight": "auto", "max_queued": 200, "auto": {
        "min": 4, "max": 64, "start": 16, "target": {"ttft_p95": "2s", "queue": 4},
        "signals": {"waiting": "queue", "ttft_p95": "ttft"}}}
    d["signals"]["read"]["ttft"] = {"source": "engines", "preset": "ttft_seconds", "quantile": 0.95}


# -- editing the policy by names -----------------------------------------------------------------------


def _step(node: Any, key: str) -> Any:
    if isinstance(node, list):
        return next(item for item in node if item["name"] == key)
    return node[key]


def put(path: str, value: Any) -> Edit:
    """Set ``path`` (``lanes.batch.deadline``: list items by name) to ``value``."""
    *parents, last = path.split(".")

    def edit(d: Data) -> None:
        node = d
        for key in parents:
            new = isinstance(node, dict) and key not in node
            node = node.setdefault(key, {}) if new else _step(node, key)
        node[last] = value
    return edit


def drop(path: str) -> Edit:
    *parents, last = path.split(".")

    def edit(d: Data) -> None:
        node = d
        for key in parents:
            node = _step(node, key)
        del node[last]
    return edit


def both(*edits: Edit) -> Edit:
    def edit(d: Data) -> None:
        for one in edits:
            one(d)
    return edit


def rule(name: str, match: Data, lane: str) -> Data:
    return {"name": name, "match": match, "lane": lane}


def insert_rule(index: int, new: Data) -> Edit:
    return lambda d: d["classification"]["rules"].insert(index, new)


def build(data: Data) -> Policy:
    return parse_policy(yaml.safe_dump(data, sort_keys=False), "test.yaml")


def pair(edit: Edit, base: Edit | None = None) -> tuple[Policy, Policy]:
    before = copy.deepcopy(BASE)
    if base is not None:
        base(before)
    after = copy.deepcopy(before)
    edit(after)
    return build(before), build(after)


@dataclass(frozen=True)
class Case:
    field: str
    """The schema field the row changes (``lanes.deadline``: a list's items are one path)."""
    edit: Edit
    path: str
    """Where the risk must be reported."""
    why: str
    """A phrase its text must hold."""
    base: Edit | None = None
    """Applied to both policies first (a stricter setting needs a laxer one to start from)."""


def _on_stale(kind: str) -> Edit:
    return put("signals.read.kv.on_stale", kind)


def _shadow_batch(d: Data) -> None:
    put("lanes.batch.shadow", True)(d)


def _quantile_queue(d: Data) -> None:
    d["signals"]["read"]["queue"] = {"source": "engines", "preset": "ttft_seconds", "quantile": 0.95,
                                     "on_stale": "hold"}


CASES = [
    Case("shadow", put("shadow", True), "shadow", "nothing is enforced any more"),
    Case("shadow", put("shadow", False), "shadow", "starts enforcing", put("shadow", True)),
    # lanes
    Case("lanes.priority", put("lanes.batch.priority", 150), "lanes.order",
         "priority order interactive > batch > best-effort → batch > interactive > best-effort"),
    Case("lanes.priority", lambda d: d["lanes"].append(
        {"name": "vip", "priority": 200, "max_inflight": 1, "deadline": "5s"}), "lanes.vip",
        "above interactive, batch, best-effort: its queued work gets freed slots before theirs"),
    Case("lanes.max_inflight", put("lanes.interactive.max_inflight", 6), "lanes.interactive.max_inflight",
         "max_inflight 8 → 6: fewer of its requests run at once"),
    Case("lanes.max_inflight", put("lanes.interactive.max_inflight", 4), "lanes.interactive.max_inflight",
         "its share of the auto limit 57% → 40%", auto),
    Case("lanes.max_queued", put("lanes.batch.max_queued", 32), "lanes.batch.max_queued",
         "max_queued 128 → 32: its queue fills sooner"),
    Case("lanes.max_queued", put("lanes.batch.max_queued", 0), "lanes.batch.max_queued",
         "batch loses its queue (max_queued 0)"),
    Case("lanes.deadline", put("lanes.batch.deadline", "30s"), "lanes.batch.deadline",
         "deadline 60s → 30s: more requests rejected as deadline_unmeetable"),
    Case("lanes.borrow", both(put("lanes.interactive.borrow", False), drop("lanes.interactive.max_borrow")),
         "lanes.interactive.borrow", "borrow true → false: it no longer uses other lanes' idle slots"),
    Case("lanes.borrow", put("lanes.batch.borrow", True), "lanes.batch.max_borrow",
         "batch may now borrow every idle slot (no max_borrow)"),
    Case("lanes.max_borrow", put("lanes.interactive.max_borrow", 2), "lanes.interactive.max_borrow",
         "max_borrow 4 → 2: it borrows fewer"),
    Case("lanes.max_borrow", put("lanes.interactive.max_borrow", 8), "lanes.interactive.max_borrow",
         "may now borrow up to 8 idle slots (was 4)"),
    Case("lanes.evictable", put("lanes.batch.evictable", True), "lanes.batch.evictable",
         "batch becomes evictable"),
    Case("lanes.evictable", put("lanes.best-effort.evictable", False), "lanes.best-effort.evictable",
         "higher lanes get queue_full instead of taking its places"),
    Case("lanes.evictable", put("lanes.best-effort.evictable", False), "lanes.evictable",
         "no lane is evictable any more"),
    Case("lanes.closed", put("lanes.batch.closed", True), "lanes.batch.closed",
         "every request it gets is rejected (lane_closed)"),
    Case("lanes.sjf_weight", put("lanes.interactive.sjf_weight", 2), "lanes.interactive.sjf_weight",
         "sjf_weight 1 → 2: short requests may overtake a long one by more"),
    Case("lanes.shadow", put("lanes.batch.shadow", False), "lanes.batch.shadow",
         "batch leaves shadow mode: it starts enforcing", _shadow_batch),
    Case("lanes.shadow", put("lanes.batch.shadow", True), "lanes.batch.shadow",
         "batch enters shadow mode: it admits everything"),
    # classification
    Case("classification.default_lane", put("classification.default_lane", "batch"),
         "classification.default_lane", "unclassified requests now land in batch (priority 50)"),
    Case("classification.lane_header", put("classification.lane_header", "x-team"),
         "classification.lane_header", "requests carrying x-team pick their lane before any rule"),
    Case("classification.rules", insert_rule(0, rule("bulk", {"path_prefix": "/v1"}, "best-effort")),
         "classification.rules.bulk",
         "batch-api, chat, embed after it no longer get the requests it matches"),
    Case("classification.rules", insert_rule(3, rule("late", {"path": "/v2"}, "batch")),
         "classification.rules.late", "no longer land in the default lane best-effort"),
    Case("classification.rules", lambda d: d["classification"]["rules"].pop(0),
         "classification.rules.batch-api", "rule batch-api removed: requests it sent to batch now go"),
    Case("classification.rules", lambda d: d["classification"]["rules"].reverse(),
         "classification.rules.order", "rules reordered (the first match wins)"),
    Case("classification.rules", insert_rule(1, rule("all", {}, "batch")), "classification.rules",
         "rule all matches every request: chat, embed after it can never match"),
    Case("classification.rules.lane", put("classification.rules.chat.lane", "batch"),
         "classification.rules.chat.lane", "rule chat now sends to batch (was interactive)"),
    Case("classification.rules.match.path", drop("classification.rules.chat.match.path"),
         "classification.rules.chat.match.path", "it now matches any path"),
    Case("classification.rules.match.path", put("classification.rules.chat.match.path", "/v2/chat"),
         "classification.rules.chat.match.path", "/v1/chat/completions → /v2/chat: it matches other"),
    Case("classification.rules.match.path_prefix", put("classification.rules.batch-api.match.path_prefix",
                                                       "/v1/b"),
         "classification.rules.batch-api.match.path_prefix", "/v1/batches → /v1/b: it matches other"),
    Case("classification.rules.match.path_regex", put("classification.rules.embed.match.path_regex", "embed"),
         "classification.rules.embed.match.path_regex", "^/v1/embed → embed: it matches other"),
    Case("classification.rules.match.path_regex", put("classification.rules.chat.match.path_regex", "^/v1/"),
         "classification.rules.chat.match.path_regex", "unset → ^/v1/: it matches fewer requests"),
    Case("classification.rules.match.methods", drop("classification.rules.chat.match.methods"),
         "classification.rules.chat.match.methods",
         "match.methods [POST] removed: it now matches every method"),
    Case("classification.rules.match.methods",
         put("classification.rules.chat.match.methods", ["POST", "PUT"]),
         "classification.rules.chat.match.methods", "added PUT: it now matches those too"),
    Case("classification.rules.match.methods", put("classification.rules.embed.match.methods", ["POST"]),
         "classification.rules.embed.match.methods", "match.methods now [POST]: it matches fewer requests"),
    Case("classification.rules.match.headers", drop("classification.rules.chat.match.headers"),
         "classification.rules.chat.match.headers.x-team", "it now matches every x-team value"),
    Case("classification.rules.match.headers",
         put("classification.rules.chat.match.headers", {"x-team": ["search", "ads"]}),
         "classification.rules.chat.match.headers.x-team", "added ads: it now matches those too"),
    Case("classification.rules.match.models",
         put("classification.rules.chat.match.models", ["llama", "qwen"]),
         "classification.rules.chat.match.models", "added qwen"),
    Case("classification.rules.match.models", put("classification.rules.chat.match.models", ["qwen"]),
         "classification.rules.chat.match.models", "removed llama: requests it no longer matches fall"),
    Case("classification.rules.match.tenants", drop("classification.rules.chat.match.tenants"),
         "classification.rules.chat.match.tenants", "it now matches every tenant"),
    Case("trusted_headers", lambda d: d["trusted_headers"].append("x-lane"), "trusted_headers",
         "x-lane is now trusted"),
    # tenants
    Case("tenants.header", both(drop("tenants.header"), drop("ratelimit.budgets.tenants")), "tenants.header",
         "every request is now tenant 'default'"),
    Case("tenants.header", put("tenants.header", "x-team"), "tenants.header",
         "requests are told apart by another header"),
    Case("tenants.header", put("tenants.header", "x-extproc-client"), "tenants.header",
         "requests are now told apart by tenant",
         both(drop("tenants.header"), drop("ratelimit.budgets.tenants"))),
    Case("tenants.default", put("tenants.default", "acme"), "tenants.default",
         "requests without a tenant now get the budget and weight of tenant 'acme'"),
    Case("tenants.weights", put("tenants.weights.acme", 1), "tenants.weights.acme",
         "tenant acme: weight 3 → 1: its queued requests get a smaller share"),
    Case("tenants.weights", put("tenants.weights.globex", 2), "tenants.weights.globex",
         "tenant globex: weight 1 → 2: other tenants' queued requests get a smaller share"),
    Case("tenants.default_weight", put("tenants.default_weight", 0.5), "tenants.default_weight",
         "default_weight 1 → 0.5 (tenants without a weight of their own): their queued requests"),
    Case("tenants.max_tenant_length", put("tenants.max_tenant_length", 16), "tenants.max_tenant_length",
         "tenants whose names agree that far now share one budget"),
    # estimation
    Case("estimation.read_body", put("estimation.read_body", "never"), "estimation.read_body",
         "request bodies are no longer read"),
    Case("estimation.read_body", put("estimation.read_body", "always"), "estimation.read_body",
         "request bodies are now read: a body that does not come within 10s is refused (body_timeout)",
         put("estimation.read_body", "never")),
    Case("estimation.max_body_bytes", put("estimation.max_body_bytes", 65536), "estimation.max_body_bytes",
         "1048576 → 65536: a model or max_tokens past that is missed"),
    Case("estimation.body_timeout", put("estimation.body_timeout", "2s"), "estimation.body_timeout",
         "10s → 2s: slower bodies are refused (body_timeout)"),
    Case("estimation.max_slow_bodies", put("estimation.max_slow_bodies", 8), "estimation.max_slow_bodies",
         "64 → 8: a client's requests beyond that many"),
    Case("estimation.max_slow_bodies", put("estimation.max_slow_bodies", 8), "estimation.max_slow_bodies",
         "0 → 8", put("estimation.max_slow_bodies", 0)),
    Case("estimation.chars_per_token", put("estimation.chars_per_token", 3), "estimation.chars_per_token",
         "4 → 3: predicted service times grow"),
    Case("estimation.default_max_tokens", put("estimation.default_max_tokens", 512),
         "estimation.default_max_tokens", "256 → 512: predicted service times grow"),
    Case("estimation.max_output_tokens", put("estimation.max_output_tokens", 65536),
         "estimation.max_output_tokens", "32768 → 65536 (bodies it cannot read, and larger max_tokens): "
         "predicted service times grow"),
    Case("estimation.unreadable_body", put("estimation.unreadable_body", "refuse"),
         "estimation.unreadable_body", "estimate → refuse: a body extproc cannot read"),
    Case("estimation.unreadable_body", put("estimation.read_body", "always"), "estimation.unreadable_body",
         "is refused (415 unsupported_encoding)",
         both(put("estimation.read_body", "never"), put("estimation.unreadable_body", "refuse"))),
    Case("estimation.model_header", put("estimation.model_header", "x-model"), "estimation.model_header",
         "unset → x-model: the model is read elsewhere"),
    Case("estimation.default.prefill_ms_per_token", put("estimation.default.prefill_ms_per_token", 0.1),
         "estimation.default", "prefill_ms_per_token 0.05 → 0.1: predicted service times grow"),
    Case("estimation.default.decode_ms_per_token", put("estimation.default.decode_ms_per_token", 20),
         "estimation.default", "decode_ms_per_token 15 → 20"),
    Case("estimation.default.overhead_ms", put("estimation.default.overhead_ms", 50), "estimation.default",
         "overhead_ms 20 → 50"),
    Case("estimation.models.prefill_ms_per_token", put("estimation.models.llama.prefill_ms_per_token", 0.1),
         "estimation.models.llama", "prefill_ms_per_token 0.05 → 0.1"),
    Case("estimation.models.decode_ms_per_token", put("estimation.models.llama.decode_ms_per_token", 40),
         "estimation.models.llama", "decode_ms_per_token 30 → 40"),
    Case("estimation.models.overhead_ms", put("estimation.models.qwen", {"overhead_ms": 80}),
         "estimation.models.qwen", "overhead_ms 20 → 80"),
    Case("estimation.occupancy_slowdown", put("estimation.occupancy_slowdown", 2),
         "estimation.occupancy_slowdown", "1 → 2: predicted service times grow"),
    Case("queueing.sjf_weight", put("queueing.sjf_weight", 8), "queueing.sjf_weight",
         "queueing.sjf_weight 4 → 8 (lanes batch, best-effort): short requests may overtake"),
    # capacity
    Case("capacity.max_inflight", put("capacity.max_inflight", 12), "capacity.max_inflight",
         "capacity.max_inflight 14 → 12: fewer requests run at once across all lanes"),
    Case("capacity.max_inflight",
         both(put("capacity.max_inflight", "auto"), put("capacity.auto.shadow", False)),
         "capacity.max_inflight", "14 → auto: the limit sizes itself in [4, 64] from 16; it can fall to 4",
         both(auto, put("capacity.max_inflight", 14), put("capacity.auto.shadow", True))),
    Case("capacity.max_inflight", both(put("capacity.max_inflight", 32), put("capacity.auto.shadow", True)),
         "capacity.max_inflight", "auto → 32: the limit no longer grows past 32 (auto could reach 64)", auto),
    Case("capacity.auto.min", put("capacity.auto.min", 2), "capacity.auto.min", "4 → 2: the limit may fall",
         auto),
    Case("capacity.auto.max", put("capacity.auto.max", 32), "capacity.auto.max",
         "64 → 32: the limit grows no", auto),
    Case("capacity.auto.start", put("capacity.auto.start", 8), "capacity.auto.start",
         "16 → 8: a fresh fleet starts with fewer slots", auto),
    Case("capacity.auto.target.ttft_p95", put("capacity.auto.target.ttft_p95", "1s"),
         "capacity.auto.target.ttft_p95", "2s → 1s: the limit falls once", auto),
    Case("capacity.auto.target.tpot_p95", both(put("capacity.auto.target.tpot_p95", "50ms"),
                                               put("capacity.auto.signals.tpot_p95", "ttft")),
         "capacity.auto.target.tpot_p95", "unset → 50ms", auto),
    Case("capacity.auto.target.queue", put("capacity.auto.target.queue", 0), "capacity.auto.target.queue",
         "4 → 0: the limit falls once the engines queue more", auto),
    Case("capacity.auto.signals.waiting", put("capacity.auto.signals.waiting", "kv"),
         "capacity.auto.signals.waiting", "queue → kv: the limit now falls on what it reads", auto),
    Case("capacity.auto.signals.running", put("capacity.auto.signals.running", "queue"),
         "capacity.auto.signals.running", "unset → queue: a starting limit begins from what it reads", auto),
    Case("capacity.auto.signals.kv_cache", both(put("capacity.auto.signals.kv_cache", "kv"),
                                                put("capacity.auto.signals.running", "queue")),
         "capacity.auto.signals.kv_cache",
         "unset → kv: a starting limit grows no further than where it says the cache fills, and no limit "
         "grows while it says the cache is 90 % full", auto),
    Case("capacity.auto.signals.ttft_p95", put("capacity.auto.signals.ttft_p95", "kv"),
         "capacity.auto.signals.ttft_p95", "ttft → kv", auto),
    Case("capacity.auto.signals.tpot_p95", put("capacity.auto.signals.tpot_p95", "ttft"),
         "capacity.auto.signals.tpot_p95", "unset → ttft", auto),
    Case("capacity.auto.cooldown", put("capacity.auto.cooldown", "2s"), "capacity.auto.cooldown",
         "6s → 2s: after a fall the limit may be cut again sooner", auto),
    Case("capacity.auto.stale_hold", put("capacity.auto.stale_hold", "10s"), "capacity.auto.stale_hold",
         "30s → 10s: without fresh signals the limit decays", auto),
    Case("capacity.max_queued", put("capacity.max_queued", 100), "capacity.max_queued",
         "200 → 100: once that many requests queue in all"),
    Case("capacity.max_queued", put("capacity.max_queued", 100), "capacity.max_queued", "unset → 100",
         drop("capacity.max_queued")),
    Case("capacity.max_hold", put("capacity.max_hold", "120s"), "capacity.max_hold",
         "it must equal the ext_proc filter's max_message_timeout"),
    Case("retry_after.share", put("retry_after.share", 0.08), "retry_after.share",
         "0.05 → 0.08: more of each lane's slots are kept for returning retries"),
    Case("retry_after.share", put("retry_after.share", 0), "retry_after.share",
         "a returning retry no longer keeps its first attempt's place"),
    # signals
    Case("signals.sources.prometheus.url", put("signals.sources.prom.prometheus.url", "http://thanos:9090"),
         "signals.read.kv", "signal kv reads another number, and saturation rule kv-high acts on it"),
    Case("signals.sources.prometheus.timeout", put("signals.sources.prom.prometheus.timeout", "1s"),
         "signals.sources.prom", "timeout 2s → 1s: more reads fail, and kv goes stale sooner",
         _on_stale("saturated")),
    Case("signals.sources.scrape.targets",
         put("signals.sources.engines.scrape.targets", ["http://10.0.0.8:8000/metrics"]),
         "signals.read.queue", "signal queue reads another number"),
    Case("signals.sources.scrape.timeout", put("signals.sources.engines.scrape.timeout", "500ms"),
         "signals.sources.engines", "timeout 1s → 500ms: more reads fail, and queue goes stale sooner"),
    Case("signals.read.source", both(put("signals.sources.engines2", {"scrape": {"targets": ["http://e2/m"]}}),
                                     put("signals.read.queue.source", "engines2")),
         "signals.read.queue", "signal queue reads another number"),
    Case("signals.read.query", put("signals.read.kv.query", "avg(vllm:kv_cache_usage_perc)"),
         "signals.read.kv", "signal kv reads another number"),
    Case("signals.read.preset", put("signals.read.queue.preset", "running_requests"), "signals.read.queue",
         "and saturation rule queue-deep and capacity.auto.signals.waiting act on it", auto),
    Case("signals.read.metric", both(drop("signals.read.queue.preset"),
                                     put("signals.read.queue.metric", "vllm:num_requests_waiting")),
         "signals.read.queue", "signal queue reads another number"),
    Case("signals.read.preset", put("signals.read.queue.preset", "running_requests"), "signals.read.queue",
         "signal queue reads another number"),
    Case("signals.read.labels", put("signals.read.queue.labels", {"model_name": "llama"}),
         "signals.read.queue", "signal queue reads another number"),
    Case("signals.read.aggregate", put("signals.read.queue.aggregate", "max"), "signals.read.queue",
         "signal queue reads another number"),
    Case("signals.read.quantile", put("signals.read.queue.quantile", 0.99), "signals.read.queue",
         "signal queue reads another number", _quantile_queue),
    Case("signals.read.window", put("signals.read.queue.window", "2m"), "signals.read.queue",
         "signal queue reads another number", _quantile_queue),
    Case("signals.read.stale_after", put("signals.read.kv.stale_after", "10s"), "signals.read.kv.stale_after",
         "30s → 10s: kv goes stale sooner (on_stale saturated)", _on_stale("saturated")),
    Case("signals.read.on_stale", _on_stale("saturated"), "signals.read.kv.on_stale",
         "ignore → saturated: while kv is stale the rules on it act as active (fail closed)"),
    Case("signals.read.on_stale", _on_stale("hold"), "signals.read.kv.on_stale",
         "ignore → hold: while kv is stale the rules on it keep their state"),
    Case("signals.saturation.signal", put("signals.saturation.kv-high.signal", "queue"),
         "signals.saturation.kv-high.signal", "judges queue (was kv)"),
    Case("signals.saturation.above", put("signals.saturation.kv-high.above", 0.85),
         "signals.saturation.kv-high.above", "above 0.9 → 0.85: it fires sooner"),
    Case("signals.saturation.below", put("signals.saturation.kv-high.below", 0.7),
         "signals.saturation.kv-high.below", "below 0.8 → 0.7: it releases later"),
    Case("signals.saturation.min_active", put("signals.saturation.kv-high.min_active", "30s"),
         "signals.saturation.kv-high.min_active", "min_active 0s → 30s: it stays active longer"),
    Case("signals.saturation.shed", put("signals.saturation.kv-high.shed", ["best-effort", "interactive"]),
         "signals.saturation.kv-high.shed", "now sheds interactive while active"),
    Case("signals.saturation.shrink", put("signals.saturation.kv-high.shrink", {"batch": 0.25}),
         "signals.saturation.kv-high.shrink", "now shrinks batch to ×0.25 while active (was ×0.5)"),
    Case("signals.saturation", lambda d: d["signals"]["saturation"].append(
        {"name": "kv-full", "signal": "kv", "above": 0.95, "shrink": {"interactive": 0.5}}),
        "signals.saturation.kv-full", "added: while kv is above 0.95 it shrinks interactive to ×0.5"),
    # the edge
    Case("ratelimit.mode", put("ratelimit.mode", "enforce"), "ratelimit.mode",
         "shadow → enforce: the edge starts refusing", put("ratelimit.mode", "shadow")),
    Case("ratelimit.domain", put("ratelimit.domain", "gpu"), "ratelimit.domain",
         "must match Envoy's ratelimit filter"),
    Case("ratelimit.request_descriptor", put("ratelimit.request_descriptor", "llm"),
         "ratelimit.request_descriptor", "must match Envoy's ratelimit filter"),
    Case("ratelimit.usage_descriptor", put("ratelimit.usage_descriptor", "llm_tokens"),
         "ratelimit.usage_descriptor", "must match Envoy's ratelimit filter"),
    Case("ratelimit.ask_usage", put("ratelimit.ask_usage", False), "ratelimit.ask_usage",
         "charged an estimate of their tokens"),
    Case("ratelimit.queue_share", put("ratelimit.queue_share", 0.5), "ratelimit.queue_share",
         "1 → 0.5: lanes are shed at the edge while their queues are less full"),
    Case("ratelimit.shed_saturated", put("ratelimit.shed_saturated", True), "ratelimit.shed_saturated",
         "lanes that saturation sheds are refused at the edge too", put("ratelimit.shed_saturated", False)),
    Case("ratelimit.budgets.default.requests", put("ratelimit.budgets.default.requests", 300),
         "ratelimit.budgets.default", "600 requests per minute → 300 requests per minute: tenants without"),
    Case("ratelimit.budgets.default.tokens", put("ratelimit.budgets.default.tokens", 100_000),
         "ratelimit.budgets.default", "→ 600 requests and 100000 tokens per minute"),
    Case("ratelimit.budgets.default.per", put("ratelimit.budgets.default.per", "hour"),
         "ratelimit.budgets.default", "600 requests per minute → 600 requests per hour"),
    Case("ratelimit.budgets.default.burst", put("ratelimit.budgets.default.burst", 1),
         "ratelimit.budgets.default", "per minute, burst 2 → 600 requests per minute:",
         put("ratelimit.budgets.default.burst", 2)),
    Case("ratelimit.budgets.tenants", put("ratelimit.budgets.tenants.free", {"requests": 20}),
         "ratelimit.budgets.tenants.free",
         "tenant free's budget 600 requests per minute (the default) → 20 requests per minute"),
    Case("ratelimit.budgets.tenants.requests", put("ratelimit.budgets.tenants.acme.requests", 3000),
         "ratelimit.budgets.tenants.acme", "more of its requests are refused at the edge (429)"),
    Case("ratelimit.budgets.tenants.tokens", put("ratelimit.budgets.tenants.acme.tokens", 1_000_000),
         "ratelimit.budgets.tenants.acme", "→ 6000 requests and 1000000 tokens per minute, burst 2"),
    Case("ratelimit.budgets.tenants.per", put("ratelimit.budgets.tenants.acme.per", "day"),
         "ratelimit.budgets.tenants.acme", "tokens per day"),
    Case("ratelimit.budgets.tenants.burst", put("ratelimit.budgets.tenants.acme.burst", 1),
         "ratelimit.budgets.tenants.acme", "burst 2 → 6000 requests and 2000000 tokens per minute:"),
    # retries
    Case("retry_budget.enabled", put("retry_budget.enabled", True), "retry_budget.enabled",
         "retries beyond 0.1 of admitted requests (plus 1/s) are refused",
         put("retry_budget.enabled", False)),
    Case("retry_budget.header", put("retry_budget.header", "x-retry"), "retry_budget.header",
         "other requests count as retries"),
    Case("retry_budget.ratio", put("retry_budget.ratio", 0.05), "retry_budget.ratio",
         "0.1 → 0.05: fewer retries are admitted"),
    Case("retry_budget.min_per_second", put("retry_budget.min_per_second", 0.5),
         "retry_budget.min_per_second", "1 → 0.5: fewer retries are admitted"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.field}:{c.why[:40]}")
def test_a_change_that_can_refuse_or_reorder_more_is_a_risk(case: Case) -> None:
    a, b = pair(case.edit, case.base)
    found = [r for r in df.diff(a, b).risks if r.path == case.path]
    assert found, f"no risk at {case.path}: {[(r.path, r.text) for r in df.diff(a, b).risks]}"
    assert any(case.why in r.text for r in found), [r.text for r in found]


SAFE_CASES = {
    "a deadline raised": put("lanes.batch.deadline", "90s"),
    "a queue raised": put("lanes.batch.max_queued", 256),
    "a priority raised, the order kept": put("lanes.interactive.priority", 200),
    "a lane renamed": both(put("lanes.best-effort.name", "spare"),
                           put("classification.default_lane", "spare"),
                           put("signals.saturation.kv-high.shed", ["spare"]),
                           put("signals.saturation.queue-deep.shed", ["spare"])),
    "a rule renamed": put("classification.rules.chat.name", "chat-v1"),
    "sjf_weight lowered": put("queueing.sjf_weight", 2),
    "a per-model cost removed (the default is lower)": drop("estimation.models.llama"),
    "costs lowered": put("estimation.default.decode_ms_per_token", 10),
    "capacity.max_queued raised": put("capacity.max_queued", 400),
    "learning": put("estimation.learning_rate", 0.3),
    "Retry-After": both(put("retry_after.min", "2s"), put("retry_after.max", "20s"),
                        put("retry_after.jitter", 0.5)),
    "a slot backstop cut": put("capacity.max_request_duration", "10m"),
    "a saturation rule removed": lambda d: d["signals"]["saturation"].pop(),
    "a saturation rule that only reports": lambda d: d["signals"]["saturation"].append(
        {"name": "watch", "signal": "kv", "above": 0.5}),
    "a signal exported as another kind": put("signals.read.kv.kind", "kv_cache_utilization"),
    "budgets raised": both(put("ratelimit.budgets.default.requests", 1200),
                           put("ratelimit.budgets.tenants.acme.burst", 3)),
    "a budget with a larger bucket at the same rate": both(put("ratelimit.budgets.default.requests", 36000),
                                                           put("ratelimit.budgets.default.per", "hour")),
    "a tenant budget above the default": put("ratelimit.budgets.tenants.big", {"requests": 6000}),
    "fewer tenants tracked": put("ratelimit.budgets.max_tenants", 1000),
    "a retry budget loosened": both(put("retry_budget.ratio", 0.2), put("retry_budget.window", "30s")),
    "a tenant weight unchanged in effect": put("tenants.weights.globex", 1),
    "body limits raised": both(put("estimation.max_body_bytes", 4 * 1024 * 1024),
                               put("estimation.body_timeout", "30s")),
    "a smaller largest job": put("estimation.max_output_tokens", 16384),
}


@pytest.mark.parametrize("name", list(SAFE_CASES))
def test_a_change_that_only_loosens_is_no_risk(name: str) -> None:
    a, b = pair(SAFE_CASES[name])
    result = df.diff(a, b)
    assert result.changes, "the edit must change something"
    assert result.risks == (), [r.text for r in result.risks]


def test_a_trusted_header_dropped_is_no_risk_of_its_own() -> None:
    def edit(d: Data) -> None:
        d["trusted_headers"].remove("x-team")
        drop("classification.rules.chat.match.headers")(d)

    a, b = pair(edit)
    # The rule that read it widens (that is a risk); dropping the header itself is not.
    assert [r.path for r in df.diff(a, b).risks] == ["classification.rules.chat.match.headers.x-team"]


# -- every field is decided -------------------------------------------------------------------------


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def schema_fields(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    """Every leaf field of the schema by path; a list's or a mapping's items are walked as one."""
    for name, info in model.model_fields.items():
        inner = _models_in(info.annotation)
        if not inner:
            yield prefix + name
        for sub in inner:
            yield from schema_fields(sub, f"{prefix}{name}.")


def test_every_schema_field_is_checked_or_known_safe() -> None:
    fields = set(schema_fields(Policy))
    assert {"lanes.deadline", "ratelimit.budgets.tenants.per"} <= fields
    assert not risk.CHECKED & set(risk.SAFE), "a field is either checked or safe"
    assert fields - risk.CHECKED - set(risk.SAFE) == set(), "decide whether a change of these is a risk"
    assert (risk.CHECKED | set(risk.SAFE)) - fields == set(), "not fields of the schema (any more)"


def test_every_checked_field_has_a_row_that_shows_its_risk() -> None:
    assert risk.CHECKED - {case.field for case in CASES} == set()


@pytest.mark.parametrize("base", [None, auto], ids=["fixed", "auto"])
def test_the_base_policies_against_themselves_have_no_changes(base: Edit | None) -> None:
    a, b = pair(lambda d: None, base)
    assert df.diff(a, b).same
    assert risk.risks(a, b, {}) == []

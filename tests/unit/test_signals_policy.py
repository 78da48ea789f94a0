"""The policy's signals section: strict models, defaults, and every cross-field problem with its key path."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from extproc.policy import Policy
from extproc.policy.loader import PolicyError, parse_policy
from extproc.policy.signals import Signal, Signals, problems

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "signals-policy.yaml"
LANES = {"interactive", "batch", "best-effort"}

VALID: dict[str, Any] = {
    "sources": {
        "prom": {"prometheus": {"url": "http://127.0.0.1:9090", "interval": "5s", "timeout": "2s"}},
        "engines": {"scrape": {"targets": ["http://127.0.0.1:8000/metrics", "http://10.0.0.2:8000/metrics"]}},
    },
    "read": {
        "pending": {"source": "prom", "query": "sum(kueue_pending_workloads)", "stale_after": "30s"},
        "kv": {"source": "engines", "preset": "kv_cache_usage", "stale_after": "10s",
               "on_stale": "saturated"},
    },
    "saturation": [
        {"name": "backlog", "signal": "pending", "above": 10, "below": 5, "min_active": "10s",
         "shed": ["best-effort"], "shrink": {"batch": 0.5}},
    ],
}


def data() -> dict[str, Any]:
    return copy.deepcopy(VALID)


def problems_of(raw: dict[str, Any], lanes: set[str] = LANES) -> list[str]:
    return problems(Signals.model_validate(raw), lanes)


def error_locs(raw: dict[str, Any]) -> list[tuple[tuple[int | str, ...], str]]:
    with pytest.raises(ValidationError) as caught:
        Signals.model_validate(raw)
    return [(tuple(e["loc"]), e["msg"]) for e in caught.value.errors()]


# -- the example and the defaults ---------------------------------------------------------------


def test_the_example_policy_is_consistent() -> None:
    raw = yaml.safe_load(EXAMPLE.read_text())
    signals = Signals.model_validate(raw.pop("signals"))
    # The rest is a complete policy of its own (the demo's lanes).
    policy = Policy.model_validate(raw)
    assert problems(signals, {lane.name for lane in policy.lanes}) == []
    assert signals.sources["prometheus"].kind == "prometheus"
    assert signals.sources["engines"].interval == 2.0
    assert signals.read["kv_cache"].exported_kind == "kv_cache_utilization"
    assert signals.read["engine_waiting"].how == "sum"
    assert [rule.name for rule in signals.saturation] == [
        "kv-cache-full", "kueue-backlog", "slow-queue", "engine-backlog"]


def test_valid_signals_parse_durations_and_defaults() -> None:
    signals = Signals.model_validate(data())
    assert problems(signals, LANES) == []
    prom = signals.sources["prom"]
    assert (prom.kind, prom.interval, prom.timeout) == ("prometheus", 5.0, 2.0)
    engines = signals.sources["engines"]
    assert (engines.kind, engines.interval, engines.timeout) == ("scrape", 2.0, 1.0)
    pending = signals.read["pending"]
    assert (pending.stale_after, pending.on_stale, pending.exported_kind) == (30.0, "ignore", "gauge")
    rule = signals.saturation[0]
    assert (rule.min_active, rule.release) == (10.0, 5.0)
    assert signals.signals_of("engines") == {"kv": signals.read["kv"]}
    assert Signals() == Signals.model_validate({})
    assert problems(Signals(), set()) == []


def test_a_rule_without_below_releases_at_above() -> None:
    raw = data()
    del raw["saturation"][0]["below"]
    assert Signals.model_validate(raw).saturation[0].release == 10.0


@pytest.mark.parametrize(("signal", "kind", "how"), [
    ({"preset": "kv_cache_usage"}, "kv_cache_utilization", "max"),
    ({"preset": "waiting_requests"}, "gauge", "sum"),
    ({"preset": "running_requests"}, "gauge", "sum"),
    ({"preset": "waiting_requests", "aggregate": "avg"}, "gauge", "avg"),
    ({"metric": "vllm:gpu_cache_usage_perc", "kind": "kv_cache_utilization"}, "kv_cache_utilization", "max"),
    ({"metric": "tgi_queue_size"}, "gauge", "max"),
    ({"preset": "kv_cache_usage", "kind": "gauge"}, "gauge", "max"),
    ({"preset": "ttft_seconds", "quantile": 0.95}, "gauge", "sum"),
    ({"preset": "inter_token_latency_seconds", "quantile": 0.5}, "gauge", "sum"),
    ({"metric": "vllm:e2e_request_latency_seconds", "quantile": 0.99}, "gauge", "sum"),
])
def test_presets_choose_kind_and_aggregation_unless_told(signal: dict[str, Any], kind: str, how: str) -> None:
    parsed = Signal.model_validate({"source": "engines", **signal})
    assert (parsed.exported_kind, parsed.how) == (kind, how)


def test_a_quantile_signal_parses_its_window() -> None:
    parsed = Signal.model_validate({"source": "engines", "preset": "ttft_seconds", "quantile": 0.95,
                                    "window": "1m", "labels": {"model_name": "llama"}})
    assert (parsed.quantile, parsed.window) == (0.95, 60.0)
    plain = Signal.model_validate({"source": "engines", "preset": "waiting_requests"})
    assert (plain.quantile, plain.window, plain.span) == (None, None, 30.0)
    assert Signal.model_validate(plain.model_dump()) == plain  # what the policy sandbox relies on
    raw = data()
    raw["read"]["ttft_p95"] = {"source": "engines", "preset": "ttft_seconds", "quantile": 0.95}
    assert problems_of(raw) == []


def test_lookback_is_how_far_back_one_reading_reaches() -> None:
    assert Signal.model_validate({"source": "engines", "preset": "ttft_seconds", "quantile": 0.95,
                                  "window": "1m"}).lookback == 60.0
    assert Signal.model_validate({"source": "engines", "preset": "ttft_seconds",
                                  "quantile": 0.95}).lookback == 30.0
    assert Signal.model_validate({"source": "engines", "preset": "waiting_requests"}).lookback is None
    query = "histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[2m])))"
    assert Signal.model_validate({"source": "prom", "query": query}).lookback == 120.0
    gauge = Signal.model_validate({"source": "prom", "query": "max(vllm:num_requests_waiting)"})
    assert gauge.lookback is None
    for text, seconds in (("rate(x[1m30s])", 90.0), ("max_over_time(x[5m:30s])", 300.0),
                          ("rate(x[1d])", 86_400.0), ("rate(x[500ms])", 0.5)):
        assert Signal.model_validate({"source": "prom", "query": text}).lookback == seconds, text


def test_models_are_frozen() -> None:
    signals = Signals.model_validate(data())
    with pytest.raises(ValidationError):
        signals.saturation[0].above = 3  # type: ignore[misc]


# -- shape errors (pydantic) ----------------------------------------------------------------------


@pytest.mark.parametrize(("mutate", "loc", "message"), [
    (lambda d: d["sources"]["prom"].update(scrape={"targets": ["http://x/metrics"]}),
     ("sources", "prom"), "exactly one of prometheus or scrape"),
    (lambda d: d["sources"].update(empty={}), ("sources", "empty"), "exactly one of prometheus or scrape"),
    (lambda d: d["sources"]["prom"]["prometheus"].update(url="ftp://prom:9090"),
     ("sources", "prom", "prometheus", "url"), "http:// or https://"),
    (lambda d: d["sources"]["prom"]["prometheus"].update(url="http://prom:9090/?x=1"),
     ("sources", "prom", "prometheus", "url"), "must not carry a ?query"),
    (lambda d: d["sources"]["prom"]["prometheus"].update(url="http://prom:99999"),
     ("sources", "prom", "prometheus", "url"), "bad port"),
    (lambda d: d["sources"]["prom"]["prometheus"].update(url="http:///api"),
     ("sources", "prom", "prometheus", "url"), "with a host"),
    (lambda d: d["sources"]["engines"]["scrape"].update(targets=["http://a/metrics#x"]),
     ("sources", "engines", "scrape", "targets"), "#fragment"),
    (lambda d: d["sources"]["engines"]["scrape"].update(targets=["http://a/m", "http://a/m"]),
     ("sources", "engines", "scrape", "targets"), "duplicate target"),
    (lambda d: d["sources"]["engines"]["scrape"].update(targets=[]),
     ("sources", "engines", "scrape", "targets"), "at least 1 item"),
    (lambda d: d["sources"]["prom"]["prometheus"].update(interval="10ms"),
     ("sources", "prom", "prometheus", "interval"), "greater than or equal to 0.05"),
    (lambda d: d["sources"]["prom"]["prometheus"].update(timeout="soon"),
     ("sources", "prom", "prometheus", "timeout"), "expected a duration"),
    (lambda d: d["sources"]["prom"]["prometheus"].update(token="x"),
     ("sources", "prom", "prometheus", "token"), "Extra inputs"),
    (lambda d: d["sources"].update({"Bad Name": d["sources"].pop("prom")}),
     ("sources", "Bad Name", "[key]"), "should match pattern"),
    (lambda d: d["read"]["kv"].update(metric="vllm:kv_cache_usage_perc"), ("read", "kv"), "metric or preset"),
    (lambda d: d["read"]["kv"].update(metric="not a metric", preset=None), ("read", "kv", "metric"),
     "pattern"),
    (lambda d: d["read"]["kv"].update(preset="gpu_temperature"), ("read", "kv", "preset"), "Input should be"),
    (lambda d: d["read"]["kv"].update(on_stale="panic"), ("read", "kv", "on_stale"), "Input should be"),
    (lambda d: d["read"]["kv"].update(aggregate="median"), ("read", "kv", "aggregate"), "Input should be"),
    (lambda d: d["read"]["kv"].update(labels={"0bad": "x"}), ("read", "kv", "labels", "0bad", "[key]"),
     "pattern"),
    (lambda d: d["read"]["kv"].update(stale_after=0), ("read", "kv", "stale_after"), "greater than 0"),
    (lambda d: d["read"]["pending"].update(query=""), ("read", "pending", "query"), "at least 1 character"),
    (lambda d: d["saturation"][0].update(above="nan"), ("saturation", 0, "above"), "finite number"),
    (lambda d: d["saturation"][0].update(below=float("inf")), ("saturation", 0, "below"), "finite number"),
    (lambda d: d["saturation"][0].update(shrink={"batch": 0}), ("saturation", 0, "shrink", "batch"),
     "greater than 0"),
    (lambda d: d["saturation"][0].update(shrink={"batch": 1.5}), ("saturation", 0, "shrink", "batch"),
     "less than or equal to 1"),
    (lambda d: d["saturation"][0].update(min_active="2h"), ("saturation", 0, "min_active"),
     "less than or equal to 3600"),
    (lambda d: d["saturation"][0].pop("above"), ("saturation", 0, "above"), "Field required"),
    (lambda d: d.update(values={}), ("values",), "Extra inputs"),
])
def test_shape_errors_name_their_key(mutate: Any, loc: tuple[Any, ...], message: str) -> None:
    raw = data()
    mutate(raw)
    errors = error_locs(raw)
    assert any(got[: len(loc)] == loc and message in msg for got, msg in errors), errors


@pytest.mark.parametrize(("signal", "loc", "message"), [
    ({"preset": "kv_cache_usage", "quantile": 0.95}, ("quantile",),
     "Value error, preset 'kv_cache_usage' is a gauge, not a histogram; quantile is only for a histogram "
     "metric or preset (inter_token_latency_seconds, ttft_seconds)"),
    ({"preset": "waiting_requests", "quantile": 0.5}, ("quantile",),
     "Value error, preset 'waiting_requests' is a gauge, not a histogram; quantile is only for a histogram "
     "metric or preset (inter_token_latency_seconds, ttft_seconds)"),
    ({"preset": "ttft_seconds"}, ("quantile",),
     "Value error, preset 'ttft_seconds' is a histogram: give the quantile to read, e.g. 0.95"),
    ({"preset": "inter_token_latency_seconds", "window": "1m"}, ("quantile",),
     "Value error, preset 'inter_token_latency_seconds' is a histogram: give the quantile to read, "
     "e.g. 0.95"),
    ({"preset": "ttft_seconds", "quantile": 0.95, "aggregate": "max"}, ("quantile",),
     "Value error, give aggregate or quantile, not both: a quantile adds up the buckets of every target"),
    ({"metric": "vllm:num_requests_waiting", "window": "1m"}, ("window",),
     "Value error, only for a signal with quantile (the time its observations count)"),
    ({"metric": "vllm:time_to_first_token_seconds_bucket", "quantile": 0.9}, (),
     "Value error, with quantile, metric names the histogram without _bucket: "
     "'vllm:time_to_first_token_seconds'"),
    ({"metric": "h", "quantile": 0.9, "labels": {"le": "0.5"}}, (),
     "Value error, a quantile reads every bucket of a series; labels cannot select le"),
    ({"metric": "h", "quantile": 1}, ("quantile",), "Input should be less than 1"),
    ({"metric": "h", "quantile": 0}, ("quantile",), "Input should be greater than 0"),
    ({"metric": "h", "quantile": 0.9, "window": "500ms"}, ("window",),
     "Input should be greater than or equal to 1"),
    ({"metric": "h", "quantile": 0.9, "window": "2h"}, ("window",),
     "Input should be less than or equal to 3600"),
])
def test_quantile_shape_errors_are_exact(signal: dict[str, Any], loc: tuple[str, ...], message: str) -> None:
    raw = data()
    raw["read"]["latency"] = {"source": "engines", **signal}
    assert error_locs(raw) == [(("read", "latency", *loc), message)]


def test_the_loader_names_the_key_of_a_quantile_error() -> None:
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["signals"]["read"]["ttft_p95"] = {"source": "engines", "preset": "ttft_seconds"}
    raw["signals"]["read"]["tpot_p95"] = {"source": "prometheus", "query": "up", "quantile": 0.95}
    with pytest.raises(PolicyError) as caught:
        parse_policy(yaml.safe_dump(raw), "policy.yaml")
    assert [(p.path, p.message) for p in caught.value.problems] == [
        ("signals.read.ttft_p95.quantile", "preset 'ttft_seconds' is a histogram: give the quantile to read, "
                                           "e.g. 0.95")]
    raw["signals"]["read"]["ttft_p95"]["quantile"] = 0.95
    with pytest.raises(PolicyError) as caught:
        parse_policy(yaml.safe_dump(raw), "policy.yaml")
    assert [(p.path, p.message) for p in caught.value.problems] == [
        ("signals.read.tpot_p95.quantile", "only for scrape sources; 'prometheus' is a prometheus source "
                                           "(use histogram_quantile in the query)")]


# -- cross-field problems -----------------------------------------------------------------------


@pytest.mark.parametrize(("mutate", "expected"), [
    (lambda d: d["read"]["pending"].update(source="thanos"),
     "signals.read.pending.source: unknown source 'thanos', expected one of ['engines', 'prom']"),
    (lambda d: d["read"]["pending"].pop("query"),
     "signals.read.pending.query: required for a signal on prometheus source 'prom'"),
    (lambda d: d["read"]["pending"].update(metric="kueue_pending_workloads"),
     "signals.read.pending.metric: only for scrape sources; 'prom' is a prometheus source "
     "(select and aggregate in the query)"),
    (lambda d: d["read"]["pending"].update(preset="waiting_requests"),
     "signals.read.pending.preset: only for scrape sources; 'prom' is a prometheus source "
     "(select and aggregate in the query)"),
    (lambda d: d["read"]["pending"].update(aggregate="sum"),
     "signals.read.pending.aggregate: only for scrape sources; 'prom' is a prometheus source "
     "(select and aggregate in the query)"),
    (lambda d: d["read"]["pending"].update(quantile=0.95),
     "signals.read.pending.quantile: only for scrape sources; 'prom' is a prometheus source "
     "(use histogram_quantile in the query)"),
    (lambda d: d["read"].update(ttft={"source": "engines", "preset": "ttft_seconds", "quantile": 0.95,
                                      "window": "2s"}),
     "signals.read.ttft.window: 2s is under two of source 'engines''s intervals (2s); the window must "
     "hold two scrapes"),
    (lambda d: d["read"].update(ttft={"source": "engines", "metric": "vllm:time_to_first_token_seconds",
                                      "quantile": 0.5, "window": "1s"}),
     "signals.read.ttft.window: 1s is under two of source 'engines''s intervals (2s); the window must "
     "hold two scrapes"),
    (lambda d: d["read"].update(ttft={"source": "engines", "preset": "ttft_seconds", "quantile": 0.95,
                                      "window": "3.9s"}),
     "signals.read.ttft.window: 3.9s is under two of source 'engines''s intervals (2s); the window must "
     "hold two scrapes"),
    (lambda d: d["read"]["pending"].update(labels={"status": "active"}),
     "signals.read.pending.labels: only for scrape sources; 'prom' is a prometheus source "
     "(match labels in the query)"),
    (lambda d: d["read"]["kv"].update(query="max(vllm:kv_cache_usage_perc)"),
     "signals.read.kv.query: 'engines' is a scrape source, which cannot run PromQL; give metric or preset"),
    (lambda d: d["read"]["kv"].pop("preset"),
     "signals.read.kv.metric: a signal on scrape source 'engines' needs metric or preset"),
    (lambda d: d["read"]["pending"].update(stale_after="5s"),
     "signals.read.pending.stale_after: 5s is not above source 'prom''s interval (5s); "
     "the signal would go stale between polls"),
    (lambda d: d["sources"]["prom"]["prometheus"].update(timeout="6s"),
     "signals.sources.prom.prometheus.timeout: 6s exceeds the interval (5s); polls would overlap"),
    (lambda d: d["saturation"].append(dict(d["saturation"][0])),
     "signals.saturation[1].name: duplicate rule name 'backlog'"),
    (lambda d: d["saturation"][0].update(signal="kueue"),
     "signals.saturation[0].signal: unknown signal 'kueue', expected one of ['kv', 'pending']"),
    (lambda d: d["saturation"][0].update(below=11),
     "signals.saturation[0].below: 11 exceeds above (10); the rule could never be released while "
     "it is triggered"),
    (lambda d: d["saturation"][0].update(shed=["best-effort", "bulk"]),
     "signals.saturation[0].shed[1]: unknown lane 'bulk', expected one of ['batch', 'best-effort', "
     "'interactive']"),
    (lambda d: d["saturation"][0].update(shed=["best-effort", "best-effort"]),
     "signals.saturation[0].shed[1]: lane 'best-effort' is listed twice"),
    (lambda d: d["saturation"][0].update(shrink={"bulk": 0.5}),
     "signals.saturation[0].shrink.bulk: unknown lane 'bulk', expected one of ['batch', 'best-effort', "
     "'interactive']"),
    (lambda d: d["saturation"][0].update(shrink={"best-effort": 0.5}),
     "signals.saturation[0].shrink.best-effort: the rule also sheds 'best-effort', so shrinking it "
     "does nothing"),
])
def test_cross_field_problems_are_one_line_each(mutate: Any, expected: str) -> None:
    raw = data()
    mutate(raw)
    assert problems_of(raw) == [expected]


def test_every_problem_is_reported_at_once() -> None:
    raw = data()
    raw["read"]["pending"]["source"] = "nowhere"
    raw["saturation"][0]["shed"] = ["x"]
    raw["saturation"][0]["below"] = 20
    found = problems_of(raw)
    assert [line.split(":")[0] for line in found] == [
        "signals.read.pending.source", "signals.saturation[0].below", "signals.saturation[0].shed[0]"]


def test_names_are_listed_as_none_when_there_are_none() -> None:
    raw = {"read": {"x": {"source": "prom", "query": "up"}}}
    assert problems_of(raw, set()) == [
        "signals.read.x.source: unknown source 'prom', expected none (define some first)"]

"""From what sources answer to one number: engines' exposition text, the Prometheus query API's JSON."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from extproc.policy.signals import Signal
from extproc.signals import ErrorKind, SignalError
from extproc.signals.prometheus import parse_response, query_url
from extproc.signals.scrape import PRESETS, Selector, aggregate, names_of, parse_page, read, selectors

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 12.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 3.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="llama",reason="capacity"} 99.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.42
# HELP vllm:num_preemptions_total Cumulative number of preemptions from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="llama"} 7.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="llama"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="llama"} 4.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="llama"} 4.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="llama"} 9.5
"""

VLLM_V0 = """\
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="old"} 0.9
vllm:num_requests_waiting{model_name="old"} 5
"""

SGLANG = """\
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen",tp_rank="0"} 0.71
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen",tp_rank="0"} 8
sglang:num_running_reqs{model_name="qwen",tp_rank="0"} 30
"""

TRTLLM_SERVE = """\
# TYPE trtllm_kv_cache_utilization gauge
trtllm_kv_cache_utilization{engine_type="trtllm",model_name="nemo"} 0.33
trtllm_num_requests_waiting{engine_type="trtllm",model_name="nemo"} 2
trtllm_num_requests_running{engine_type="trtllm",model_name="nemo"} 6
"""

TRITON_TRTLLM = """\
# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting",version="1"} 4
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="scheduled",version="1"} 9
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 13
# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="tensorrt_llm",version="1"} 0.6
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 2000
# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="tensorrt_llm",version="1"} 40
"""

TGI = """\
# TYPE tgi_queue_size gauge
tgi_queue_size 6
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 11
"""


def signal(**fields: Any) -> Signal:
    return Signal.model_validate({"source": "engines", **fields})


def pages(signal_: Signal, *texts: str) -> list[dict[str, list[tuple[Any, float]]]]:
    names = names_of([signal_])
    return [parse_page(text, names) for text in texts]


def value_of(*texts: str, **fields: Any) -> float:
    s = signal(**fields)
    return read(s, pages(s, *texts))


# -- parsing exposition text -------------------------------------------------------------------


def test_only_the_wanted_names_are_parsed_exactly() -> None:
    found = parse_page(VLLM, {"vllm:num_requests_waiting", "vllm:num_preemptions_total"})
    # vllm:num_requests_waiting_by_reason shares the prefix but is another metric.
    assert found == {
        "vllm:num_requests_waiting": [({"engine": "0", "model_name": "llama"}, 3.0)],
        "vllm:num_preemptions_total": [({"engine": "0", "model_name": "llama"}, 7.0)],
    }
    assert parse_page(VLLM, set()) == {}
    assert parse_page(VLLM, {"vllm:absent"}) == {}


def test_samples_of_histograms_are_addressed_by_their_sample_name() -> None:
    found = parse_page(VLLM, {"vllm:e2e_request_latency_seconds_count"})
    assert found == {
        "vllm:e2e_request_latency_seconds_count": [({"engine": "0", "model_name": "llama"}, 4.0)]}


def test_lines_without_labels_type_or_help_and_with_timestamps_parse() -> None:
    text = "foo 1\nfoo{a=\"x\"} 2 1700000000000\n  \n# just a comment\nfoo{a=\"y\"} NaN\n"
    assert parse_page(text, {"foo"}) == {"foo": [({}, 1.0), ({"a": "x"}, 2.0), ({"a": "y"}, pytest.approx(
        math.nan, nan_ok=True))]}


@pytest.mark.parametrize("text", [
    'foo{a="x" 1\n',
    "foo one\n",
    'foo{a=x} 1\n',
    'foo{a="x"}\n',
])
def test_a_broken_line_of_a_wanted_metric_is_a_bad_response(text: str) -> None:
    with pytest.raises(SignalError) as caught:
        parse_page(text, {"foo"})
    assert caught.value.kind is ErrorKind.BAD_RESPONSE
    assert "cannot parse metrics" in caught.value.message


def test_broken_lines_of_other_metrics_do_not_matter() -> None:
    assert parse_page("bar{{{ garbage\nfoo 2\n", {"foo"}) == {"foo": [({}, 2.0)]}


# -- presets and selection -----------------------------------------------------------------------


@pytest.mark.parametrize(("text", "preset", "expected"), [
    (VLLM, "kv_cache_usage", 0.42),
    (VLLM_V0, "kv_cache_usage", 0.9),
    (SGLANG, "kv_cache_usage", 0.71),
    (TRTLLM_SERVE, "kv_cache_usage", 0.33),
    (TRITON_TRTLLM, "kv_cache_usage", 0.6),
    (VLLM, "waiting_requests", 3),
    (VLLM_V0, "waiting_requests", 5),
    (SGLANG, "waiting_requests", 8),
    (TRTLLM_SERVE, "waiting_requests", 2),
    (TRITON_TRTLLM, "waiting_requests", 4),  # the batcher's own count, before Triton's generic one
    (TGI, "waiting_requests", 6),
    (VLLM, "running_requests", 12),
    (SGLANG, "running_requests", 30),
    (TRTLLM_SERVE, "running_requests", 6),
    (TRITON_TRTLLM, "running_requests", 9),
    (TGI, "running_requests", 11),
])
def test_presets_find_each_engines_own_metric(text: str, preset: str, expected: float) -> None:
    assert value_of(text, preset=preset) == pytest.approx(expected)


def test_triton_without_the_trtllm_backend_falls_back_to_pending_requests() -> None:
    text = 'nv_inference_pending_request_count{model="resnet",version="1"} 5\n'
    assert value_of(text, preset="waiting_requests") == 5


def test_a_preset_resolves_per_target_in_a_mixed_fleet() -> None:
    assert value_of(VLLM, SGLANG, TRTLLM_SERVE, TRITON_TRTLLM, preset="kv_cache_usage") == pytest.approx(0.71)
    assert value_of(VLLM, SGLANG, TGI, preset="waiting_requests") == 3 + 8 + 6


def test_a_target_exposing_old_and_new_names_counts_once() -> None:
    both = VLLM + 'vllm:gpu_cache_usage_perc{model_name="llama"} 0.99\n'
    assert value_of(both, preset="kv_cache_usage") == pytest.approx(0.42)


def test_labels_narrow_the_series_of_a_metric_or_preset() -> None:
    text = 'x{pool="a"} 1\nx{pool="b"} 5\nx{pool="b",zone="z"} 7\n'
    assert value_of(text, metric="x") == 7
    assert value_of(text, metric="x", labels={"pool": "a"}) == 1
    assert value_of(text, metric="x", labels={"pool": "b"}, aggregate="sum") == 12
    assert value_of(VLLM, preset="waiting_requests", labels={"model_name": "llama"}) == 3
    with pytest.raises(SignalError) as caught:
        value_of(VLLM, preset="waiting_requests", labels={"model_name": "other"})
    assert caught.value.kind is ErrorKind.NO_DATA


@pytest.mark.parametrize(("how", "expected"), [("max", 5.0), ("min", 1.0), ("sum", 9.0), ("avg", 3.0)])
def test_aggregation_across_series_and_targets(how: str, expected: float) -> None:
    assert value_of("m 1\n", "m 3\nm{x=\"y\"} 5\n", metric="m", aggregate=how) == expected
    assert aggregate([2.0], how) == 2.0  # type: ignore[arg-type]


def test_nan_series_are_skipped_and_only_nan_is_no_data() -> None:
    assert value_of('m{a="1"} NaN\nm{a="2"} 4\n', metric="m") == 4
    with pytest.raises(SignalError) as caught:
        value_of("m NaN\n", metric="m")
    assert caught.value.kind is ErrorKind.NO_DATA


def test_no_matching_metric_says_what_was_looked_for() -> None:
    with pytest.raises(SignalError) as caught:
        value_of(TGI, TGI, preset="kv_cache_usage")
    assert caught.value.kind is ErrorKind.NO_DATA
    message = caught.value.message
    assert message.startswith("none of the 2 target(s) that answered exposes vllm:kv_cache_usage_perc or ")
    assert 'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}' in message
    with pytest.raises(SignalError):
        read(signal(metric="m"), [])


def test_selectors_add_the_signals_labels_to_every_candidate() -> None:
    found = selectors(signal(preset="kv_cache_usage", labels={"model": "m"}))
    assert [str(s) for s in found][-1] == ('nv_trt_llm_kv_cache_block_metrics'
                                           '{kv_cache_block_type="fraction",model="m"}')
    assert found[0] == Selector("vllm:kv_cache_usage_perc", (("model", "m"),))
    assert len(found) == len(PRESETS["kv_cache_usage"])
    names = names_of([signal(metric="a"), signal(preset="running_requests")])
    assert names >= {"a", "vllm:num_requests_running", "tgi_batch_current_size"}
    with pytest.raises(ValueError, match="metric or preset"):
        selectors(signal())


# -- the Prometheus query API ----------------------------------------------------------------------


def answer(result_type: str, result: Any) -> bytes:
    return json.dumps({"status": "success", "data": {"resultType": result_type, "result": result}}).encode()


def series(value: str, **labels: str) -> dict[str, Any]:
    return {"metric": labels, "value": [1700000000.5, value]}


def failure(status: int, body: bytes) -> SignalError:
    with pytest.raises(SignalError) as caught:
        parse_response(status, body)
    return caught.value


def test_a_vector_of_one_series_and_a_scalar_are_numbers() -> None:
    assert parse_response(200, answer("vector", [series("12", cluster_queue="q")])) == 12.0
    assert parse_response(200, answer("scalar", [1700000000, "0.25"])) == 0.25
    assert parse_response(200, answer("vector", [series("+Inf")])) == math.inf
    assert parse_response(200, answer("vector", [series("-Inf")])) == -math.inf


def test_several_series_ask_for_aggregation() -> None:
    result = [series(str(i), cluster_queue=f"q{i}") for i in range(5)]
    error = failure(200, answer("vector", result))
    assert error.kind is ErrorKind.QUERY_ERROR
    assert error.message == ('query returned 5 series ({cluster_queue="q0"}, {cluster_queue="q1"}, '
                             '{cluster_queue="q2"}, …); aggregate them with sum() or max()')
    assert "3 series" in failure(200, answer("vector", result[:3])).message


@pytest.mark.parametrize(("status", "body", "kind", "text"), [
    (200, answer("vector", []), ErrorKind.NO_DATA, "no series"),
    (200, answer("vector", [series("NaN")]), ErrorKind.NO_DATA, "NaN"),
    (200, answer("scalar", [1, "NaN"]), ErrorKind.NO_DATA, "NaN"),
    (200, answer("matrix", [{"metric": {}, "values": [[1, "1"]]}]), ErrorKind.QUERY_ERROR, "range vector"),
    (200, answer("string", [1, "hello"]), ErrorKind.QUERY_ERROR, "string result"),
    (400, json.dumps({"status": "error", "errorType": "bad_data",
                      "error": "1:5: parse error: unexpected <EOF>"}).encode(),
     ErrorKind.QUERY_ERROR, "bad_data: 1:5: parse error"),
    (422, json.dumps({"status": "error", "errorType": "execution", "error": "many-to-many"}).encode(),
     ErrorKind.QUERY_ERROR, "execution: many-to-many"),
    (503, json.dumps({"status": "error", "errorType": "timeout", "error": "query timed out"}).encode(),
     ErrorKind.TIMEOUT, "timed the query out"),
    (503, json.dumps({"status": "error", "errorType": "unavailable", "error": "shutting down"}).encode(),
     ErrorKind.HTTP_STATUS, "HTTP 503: unavailable: shutting down"),
    (502, b"<html>Bad Gateway</html>", ErrorKind.HTTP_STATUS, "HTTP 502"),
    (404, answer("vector", []), ErrorKind.HTTP_STATUS, "HTTP 404"),
    (200, b"<html>login</html>", ErrorKind.BAD_RESPONSE, "not JSON"),
    (200, b"\xff\xfe", ErrorKind.BAD_RESPONSE, "not JSON"),
    (200, b"[1, 2]", ErrorKind.BAD_RESPONSE, "not a JSON object"),
    (200, b'{"status": "success"}', ErrorKind.BAD_RESPONSE, "data object"),
    (200, b'{"status": "success", "data": {"resultType": "vector", "result": {}}}', ErrorKind.BAD_RESPONSE,
     "not a list"),
    (200, answer("vector", ["x"]), ErrorKind.BAD_RESPONSE, "not an object"),
    (200, answer("vector", [{"metric": {}, "value": [1, 2]}]), ErrorKind.BAD_RESPONSE, "pair"),
    (200, answer("vector", [{"metric": {}}]), ErrorKind.BAD_RESPONSE, "pair"),
    (200, answer("vector", [series("twelve")]), ErrorKind.BAD_RESPONSE, "not a number"),
])
def test_every_other_answer_is_a_typed_error(status: int, body: bytes, kind: ErrorKind, text: str) -> None:
    error = failure(status, body)
    assert error.kind is kind
    assert text in error.message
    assert str(error) == f"{kind.value}: {error.message}"


def test_the_query_endpoint_keeps_a_path_prefix() -> None:
    assert query_url("http://prom:9090") == "http://prom:9090/api/v1/query"
    assert query_url("https://gw.example/prometheus/") == "https://gw.example/prometheus/api/v1/query"

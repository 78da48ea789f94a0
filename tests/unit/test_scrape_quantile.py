"""Latency percentiles from scraped histograms: the quantile arithmetic and the window of snapshots.

Everything here is pure: pages are parsed from exposition text written in the test, and time
is a number passed to the window, as the hub passes its clock.
"""

from __future__ import annotations

import math
from typing import Any, get_args

import pytest

from extproc.policy.signals import PRESET_AGGREGATE, Preset, Signal
from extproc.signals import ErrorKind, SignalError
from extproc.signals.scrape import (
    MAX_SNAPSHOTS,
    PRESETS,
    HistogramWindow,
    Page,
    histogram_quantile,
    histogram_series,
    merge,
    names_of,
    parse_page,
    read,
    selectors,
)

INF = math.inf
#: The bucket bounds of the histograms written below, as the exposition text spells them.
LE = ("0.1", "0.5", "1", "+Inf")


def signal(**fields: Any) -> Signal:
    return Signal.model_validate({"source": "engines", "metric": "ttft", "quantile": 0.5, "window": "10s",
                                  **fields})


def histogram(counts: tuple[float, ...], name: str = "ttft", le: tuple[str, ...] = LE, **labels: str) -> str:
    """One series as an engine exposes it: cumulative _bucket lines, then _sum and _count (not read)."""
    own = [f'{key}="{value}"' for key, value in labels.items()]
    lines = [f"# TYPE {name} histogram"]
    for bound, count in zip(le, counts, strict=True):
        labels_text = ",".join([*own, f'le="{bound}"'])
        lines.append(f"{name}_bucket{{{labels_text}}} {count}")
    lines += [f"{name}_sum{{{','.join(own)}}} 12.5", f"{name}_count{{{','.join(own)}}} {counts[-1]}"]
    return "\n".join(lines) + "\n"


class Rounds:
    """A window fed the way the hub feeds it: target → page text, at a given time."""

    def __init__(self, **fields: Any) -> None:
        self.signal = signal(**fields)
        self.window = HistogramWindow(self.signal)

    def page(self, text: str) -> Page:
        return parse_page(text, names_of([self.signal]))

    def at(self, now: float, targets: list[str] | None = None, **texts: str) -> float | None:
        self.window.observe(now, {target: self.page(text) for target, text in texts.items()}, targets)
        return self.window.value()

    def no_data(self, now: float, targets: list[str] | None = None, **texts: str) -> str:
        with pytest.raises(SignalError) as caught:
            self.at(now, targets, **texts)
        assert caught.value.kind is ErrorKind.NO_DATA
        return caught.value.message


# -- histogram_quantile: Prometheus' arithmetic -------------------------------------------------------

BUCKETS = {0.1: 10.0, 0.5: 60.0, 1.0: 90.0, INF: 100.0}


@pytest.mark.parametrize(("q", "expected"), [
    (0.05, 0.05),  # the first bucket starts at 0
    (0.1, 0.1),
    (0.5, 0.1 + 0.4 * 40 / 50),
    (0.8, 0.5 + 0.5 * 20 / 30),
    (0.9, 1.0),
])
def test_the_quantile_interpolates_linearly_within_its_bucket(q: float, expected: float) -> None:
    assert histogram_quantile(q, BUCKETS) == pytest.approx(expected)


def test_a_quantile_in_the_inf_bucket_is_the_highest_finite_bound() -> None:
    assert histogram_quantile(0.95, BUCKETS) == 1.0
    assert histogram_quantile(0.5, {0.1: 0.0, 0.5: 0.0, INF: 7.0}) == 0.5


def test_counts_that_fall_with_the_bound_are_raised_to_the_running_maximum() -> None:
    assert histogram_quantile(0.5, {0.1: 10.0, 0.5: 8.0, INF: 10.0}) == pytest.approx(0.05)
    assert histogram_quantile(0.5, {0.1: math.nan, 0.5: 10.0, INF: 10.0}) == pytest.approx(0.3)


def test_a_first_bound_at_or_below_zero_is_the_answer_in_it() -> None:
    assert histogram_quantile(0.2, {0.0: 5.0, 1.0: 10.0, INF: 10.0}) == 0.0


@pytest.mark.parametrize("buckets", [
    {},
    {0.1: 0.0, 1.0: 0.0, INF: 0.0},  # no observations
    {0.1: 3.0, 1.0: 5.0},  # no +Inf bucket
    {INF: 5.0},  # no finite bucket
])
def test_no_quantile_where_prometheus_answers_nan(buckets: dict[float, float]) -> None:
    assert histogram_quantile(0.5, buckets) is None


def test_buckets_of_other_layouts_add_up_at_every_bound() -> None:
    merged = merge([((0.1, 0.5, INF), (1.0, 4.0, 5.0)), ((0.2, INF), (2.0, 3.0))])
    # At 0.2 the first part has its 0.1 count: all that is known to be <= 0.2.
    assert merged == {0.1: 1.0, 0.2: 3.0, 0.5: 6.0, INF: 8.0}
    assert merge([]) == {}


# -- what is read from a page ---------------------------------------------------------------------------


def test_only_bucket_lines_are_parsed_for_a_quantile_signal() -> None:
    s = signal()
    assert names_of([s]) == {"ttft_bucket"}
    page = parse_page(histogram((1, 2, 3, 4), model_name="m") + "ttft_other 5\n", names_of([s]))
    assert list(page) == ["ttft_bucket"]
    assert [labels["le"] for labels, _ in page["ttft_bucket"]] == list(LE)
    assert histogram_series(selectors(s), page) == {("ttft_bucket", (("model_name", "m"),)):
                                         {0.1: 1.0, 0.5: 2.0, 1.0: 3.0, INF: 4.0}}


def test_buckets_without_a_number_are_skipped() -> None:
    s = signal()
    text = 'ttft_bucket{le="0.1"} NaN\nttft_bucket{le="soon"} 3\nttft_bucket{le="+Inf"} 4\nttft_bucket 9\n'
    page = parse_page(text, names_of([s]))
    assert histogram_series(selectors(s), page) == {("ttft_bucket", ()): {INF: 4.0}}


def test_the_presets_list_every_preset_and_histograms_add_up() -> None:
    assert set(PRESETS) == set(get_args(Preset)) == set(PRESET_AGGREGATE)
    assert PRESET_AGGREGATE["ttft_seconds"] == PRESET_AGGREGATE["inter_token_latency_seconds"] == "sum"
    assert signal(metric=None, preset="ttft_seconds").how == "sum"


def test_quantile_signals_are_read_only_through_a_window() -> None:
    with pytest.raises(ValueError, match="HistogramWindow"):
        read(signal(), [])
    with pytest.raises(ValueError, match="with quantile"):
        HistogramWindow(Signal.model_validate({"source": "engines", "metric": "m"}))


# -- the window ---------------------------------------------------------------------------------------


def test_the_first_round_is_only_the_baseline() -> None:
    r = Rounds()
    assert r.at(0, a=histogram((5, 5, 5, 5))) is None
    # 10 observations in (0.1, 0.5] since: the median is half-way through that bucket.
    assert r.at(1, a=histogram((5, 15, 15, 15))) == pytest.approx(0.3)


def test_a_series_seen_for_the_first_time_later_is_a_baseline_too_not_an_error() -> None:
    r = Rounds()
    r.at(0, a=histogram((5, 5, 5, 5)))
    assert r.at(1, a=histogram((5, 15, 15, 15))) == pytest.approx(0.3)
    # Target a is replaced by b: b's first scrape is only its baseline, no reading and no error.
    assert r.at(2, targets=["b"], b=histogram((1, 1, 1, 1))) is None
    assert r.at(3, targets=["b"], b=histogram((1, 11, 11, 11))) == pytest.approx(0.3)


def test_observations_older_than_the_window_stop_counting() -> None:
    r = Rounds()
    r.at(0, a=histogram((0, 0, 0, 0)))
    assert r.at(1, a=histogram((0, 10, 10, 10))) == pytest.approx(0.3)
    for now in range(2, 11):
        # The snapshot at 0 is the oldest within the 10 s window up to now = 10.
        assert r.at(now, a=histogram((0, 10, 10, 10))) == pytest.approx(0.3)
    assert r.no_data(11, a=histogram((0, 10, 10, 10))) == "no observations of ttft_bucket in the last 10s"


def test_an_idle_engine_has_no_quantile() -> None:
    r = Rounds()
    r.at(0, a=histogram((3, 3, 3, 3)))
    assert r.no_data(1, a=histogram((3, 3, 3, 3))) == "no observations of ttft_bucket in the last 10s"


def test_a_restarted_engine_counts_its_new_values_as_the_increase() -> None:
    r = Rounds()
    r.at(0, a=histogram((0, 100, 100, 100)))
    assert r.at(1, a=histogram((0, 110, 110, 110))) == pytest.approx(0.3)
    # Restarted: 4 observations <= 0.1 since. With the 10 before: 14, the median is the 7th.
    assert r.at(2, a=histogram((4, 4, 4, 4))) == pytest.approx(0.1 + 0.4 * 3 / 10)
    assert r.window.buckets() == {0.1: 4.0, 0.5: 14.0, 1.0: 14.0, INF: 14.0}
    # Counting goes on from the new values.
    r.at(3, a=histogram((4, 4, 24, 24)))
    assert r.window.buckets() == {0.1: 4.0, 0.5: 14.0, 1.0: 34.0, INF: 34.0}


def test_another_bucket_layout_is_a_reset_too() -> None:
    r = Rounds()
    r.at(0, a=histogram((0, 100, 100, 100)))
    assert r.at(1, a=histogram((3, 6), le=("0.2", "+Inf"))) == pytest.approx(0.2)
    assert r.window.buckets() == {0.2: 3.0, INF: 6.0}


def test_the_buckets_of_every_target_add_up() -> None:
    r = Rounds(quantile=0.75)
    r.at(0, a=histogram((0, 0, 0, 0)), b=histogram((0, 0, 0, 0)))
    # a: 10 in (0.1, 0.5]; b: 10 in (0.5, 1]. Of 20, the 15th is half-way through (0.5, 1].
    value = r.at(1, a=histogram((0, 10, 10, 10)), b=histogram((0, 0, 10, 10)))
    assert value == pytest.approx(0.75)
    assert r.window.buckets() == {0.1: 0.0, 0.5: 10.0, 1.0: 20.0, INF: 20.0}
    assert value == histogram_quantile(0.75, r.window.buckets())


def test_labels_select_the_series_and_the_matching_ones_add_up() -> None:
    def page(a: float, b: float) -> str:
        return histogram((0, a, a, a), model_name="a") + histogram((0, 0, 0, b), model_name="b")

    only_a = Rounds(labels={"model_name": "a"})
    both = Rounds(quantile=0.75)
    for r in (only_a, both):
        r.at(0, t=page(0, 0))
    # b's slow requests are another model's: only_a ignores them.
    assert only_a.at(1, t=page(10, 30)) == pytest.approx(0.3)
    assert both.at(1, t=page(10, 30)) == 1.0  # the 30th of 40 is in +Inf
    assert Rounds(labels={"model_name": "c"}).no_data(0, t=page(1, 1)) == (
        'none of the 1 target(s) that answered exposes ttft_bucket{model_name="c"}')


def test_no_target_exposing_the_histogram_is_no_data() -> None:
    r = Rounds(metric=None, preset="ttft_seconds")
    message = r.no_data(0, a="vllm:num_requests_waiting 1\n", b="")
    assert message == ("none of the 2 target(s) that answered exposes "
                       "vllm:time_to_first_token_seconds_bucket or sglang:time_to_first_token_seconds_bucket "
                       "or trtllm_time_to_first_token_seconds_bucket")


def test_a_failed_target_keeps_its_observations_and_a_removed_one_is_dropped() -> None:
    r = Rounds(quantile=0.75)
    r.at(0, a=histogram((0, 0, 0, 0)), b=histogram((0, 0, 0, 0)))
    r.at(1, a=histogram((0, 10, 10, 10)), b=histogram((0, 0, 10, 10)))
    # b does not answer: what it reported within the window still counts.
    assert r.at(2, ["a", "b"], a=histogram((0, 10, 10, 10))) == pytest.approx(0.75)
    # b is no longer a target: gone, with its snapshots.
    assert r.at(3, ["a"], a=histogram((0, 10, 10, 10))) == pytest.approx(0.1 + 0.4 * 7.5 / 10)
    assert r.window.snapshots == 4  # a's, at 0, 1, 2 and 3
    # A page without the series drops it too.
    assert r.no_data(4, a="") == "none of the 1 target(s) that answered exposes ttft_bucket"
    assert r.window.snapshots == 0


def test_memory_stays_bounded_however_short_the_interval() -> None:
    r = Rounds(window="64s")
    r.at(0, a=histogram((0, 0, 0, 0)))
    for step in range(1, 2001):  # 200 s of 100 ms rounds, one observation each
        value = r.at(step / 10, a=histogram((0, step, step, step)))
        assert value == pytest.approx(0.3)
    assert r.window.snapshots <= MAX_SNAPSHOTS + 2
    # The baseline is at most one kept spacing (64 s / MAX_SNAPSHOTS) inside the window.
    assert 625 <= r.window.buckets()[INF] <= 640


@pytest.mark.parametrize(("preset", "name"), [
    (preset, selector.name) for preset in ("ttft_seconds", "inter_token_latency_seconds")
    for selector in PRESETS[preset]
])
def test_histogram_presets_read_each_engines_own_name(preset: str, name: str) -> None:
    r = Rounds(metric=None, preset=preset)
    r.at(0, a=histogram((0, 0, 0, 0), name=name))
    assert r.at(1, a=histogram((0, 10, 10, 10), name=name)) == pytest.approx(0.3)


def test_vllm_serving_the_new_and_the_deprecated_name_counts_once() -> None:
    r = Rounds(metric=None, preset="inter_token_latency_seconds")

    def page(n: float) -> str:
        return (histogram((0, n, n, n), name="vllm:inter_token_latency_seconds")
                + histogram((0, n, n, n), name="vllm:time_per_output_token_seconds"))

    r.at(0, a=page(0))
    r.at(1, a=page(10))
    assert r.window.buckets()[INF] == 10


def test_a_histogram_without_an_inf_bucket_is_no_data() -> None:
    r, finite = Rounds(), ("0.1", "0.5", "1")
    r.at(0, a=histogram((0, 0, 0), le=finite))
    assert r.no_data(1, a=histogram((0, 5, 5), le=finite)) == 'ttft_bucket has no le="+Inf" bucket'

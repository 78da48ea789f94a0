"""Frames of `extproc top`, rendered from state documents without a socket or a terminal."""

from __future__ import annotations

import copy
import io
import re
import time
from typing import Any

import pytest

from extproc.tools.top import (
    ASCII,
    bar,
    clean,
    fit,
    fmt_count,
    fmt_duration,
    fmt_rate,
    fmt_value,
    paint,
    render,
    state_url,
    wants_ascii,
    wants_colour,
)

NOW = 1764680000.0


def lane(name: str, **fields: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": name, "priority": 0, "inflight": 0, "limit": 4, "effective_limit": 4, "borrowed": 0,
        "queued": 0, "max_queued": 10, "paused": False, "closed": False, "shadow": False, "retired": False,
        "shed": None, "wait_p50_s": None, "wait_p95_s": None, "admit_per_s": 0.0, "reject_per_s": 0.0,
        "shadow_reject_per_s": 0.0, "rejections": {},
    }
    doc.update(fields)
    return doc


def realistic() -> dict[str, Any]:
    """A busy extproc: five lanes in every state, one saturation rule firing, a stale signal."""
    return {
        "version": 1, "time": NOW + 0.1, "uptime_s": 123.4, "draining": False, "shadow": False,
        "policy": {"file": "examples/policy.yaml", "sha256": "ab12cd34ef567890", "loaded_at": NOW - 300,
                   "reloads_ok": 2, "reloads_failed": 1, "stale_since": NOW - 90,
                   "last_error": ["policy.yaml:3: lanes[0].x: extra inputs are not permitted",
                                  "policy.yaml:9: lanes[1].deadline: expected a duration"]},
        "capacity": {"limit": 64, "inflight": 12, "queued": 120},
        "window_s": 60,
        "lanes": [
            lane("interactive", priority=100, inflight=3, limit=50, effective_limit=50, max_queued=200,
                 wait_p50_s=0.01, wait_p95_s=0.2, admit_per_s=12.3, reject_per_s=0.5,
                 rejections={"queue_full": 10, "deadline": 2}),
            lane("batch", priority=10, inflight=8, limit=10, effective_limit=5, borrowed=3, queued=120,
                 max_queued=200, wait_p50_s=1.5, wait_p95_s=12.75, admit_per_s=3.2, reject_per_s=4.0,
                 rejections={"queue_full": 130}),
            lane("best-effort", inflight=1, shed="kueue-backlog", reject_per_s=7.5, rejections={"shed": 400}),
            lane("experimental", paused=True, shadow=True, shadow_reject_per_s=1.2, max_queued=0),
            lane("legacy", retired=True, closed=True, max_queued=0),
        ],
        "signals": [
            {"name": "kueue_pending", "value": 3.0, "age_s": 2.1, "stale": False, "error": None},
            {"name": "vllm_kv_usage", "value": 0.9312, "age_s": 45.0, "stale": True,
             "error": "connection refused"},
            {"name": "queue_wait_p95", "value": None, "age_s": None, "stale": True, "error": None},
        ],
        "saturation": [
            {"rule": "kueue-backlog", "signal": "kueue_pending", "active": True, "since": NOW - 75,
             "shed": ["best-effort"], "shrink": {"batch": 0.5}},
            {"rule": "kv-pressure", "signal": "vllm_kv_usage", "active": False, "since": None, "shed": [],
             "shrink": {}},
        ],
    }


LANES = ("interactive", "batch", "best-effort", "experimental", "legacy")


def lines_of(frame: str) -> list[str]:
    return frame.split("\n")


def row(frame: str, name: str) -> str:
    """The table row of one lane (its name at the start of the line)."""
    rows = [line for line in lines_of(frame) if line.startswith(name + " ")]
    assert len(rows) == 1, f"{name!r} rows {rows} in:\n{frame}"
    return rows[0]


def after(frame: str, name: str) -> str:
    """The line right after a lane's row: where flags go when they do not fit beside it."""
    lines = lines_of(frame)
    return lines[lines.index(row(frame, name)) + 1]


def assert_fits(frame: str, width: int, height: int) -> None:
    lines = lines_of(frame)
    assert len(lines) <= height, f"{len(lines)} lines > {height}:\n{frame}"
    too_long = [line for line in lines if len(line) > width]
    assert not too_long, f"lines wider than {width}: {too_long}"
    assert "\x1b" not in frame
    assert all(c == "\n" or c.isprintable() for c in frame)


# --- a wide terminal: everything on one screen ----------------------------------------------------


def test_wide_frame_shows_the_header_every_lane_and_every_section() -> None:
    frame = render(realistic(), 120, 50, source="127.0.0.1:9091")
    assert_fits(frame, 120, 50)
    title = lines_of(frame)[0]
    assert title.startswith("extproc top  127.0.0.1:9091  up 2m03s")
    assert time.strftime("%H:%M:%S", time.localtime(NOW + 0.1)) in title
    assert "policy examples/policy.yaml @ab12cd34  reloads 2 ok, 1 failed  loaded 5m00s ago" in frame
    assert ("! file invalid for 1m30s, old policy kept: policy.yaml:3: lanes[0].x: extra inputs are not "
            "permitted (+1 more)") in frame
    assert "12/64 in flight  120 queued  rates over 1m00s" in frame
    head = next(line for line in lines_of(frame) if line.startswith("LANE"))
    for label in ("IN FLIGHT", "QUEUED", "WAIT p50/p95", "ADM/s", "REJ/s", "FLAGS"):
        assert label in head

    interactive = row(frame, "interactive")
    assert re.search(r"█·+ 3/50 ", interactive), interactive
    assert re.search(r"·+ +0/200 ", interactive), interactive
    assert re.search(r"10ms/200ms +12\.3 +0\.50$", interactive), interactive
    batch = row(frame, "batch")
    # 8 in flight against a limit shrunk to 5 (3 of them borrowed): a full bar, and why.
    assert re.search(r"█+ +8/5 ", batch), batch
    assert "·" not in batch.split("8/5")[0], batch
    assert re.search(r"█+·+ 120/200 ", batch), batch
    assert "1.50s/12.8s" in batch
    assert batch.endswith("LIMIT 10→5, BORROW 3")
    assert row(frame, "best-effort").endswith("SHED kueue-backlog")
    assert "–/–" in row(frame, "best-effort")
    assert row(frame, "experimental").endswith("PAUSED, SHADOW, would reject 1.2/s")
    assert row(frame, "legacy").endswith("CLOSED, RETIRED")

    assert "  kueue-backlog  ACTIVE 1m15s  kueue_pending  shed best-effort  shrink batch×0.5" in frame
    assert re.search(r"^  kv-pressure +idle +vllm_kv_usage$", frame, re.MULTILINE)
    assert re.search(r"^  kueue_pending +3  2\.10s ago$", frame, re.MULTILINE)
    assert re.search(r"^  vllm_kv_usage +0\.9312  45\.0s ago +STALE  error: connection refused$", frame,
                     re.MULTILINE)
    assert re.search(r"^  queue_wait_p95 +–  never read +STALE$", frame, re.MULTILINE)
    assert re.search(r"^  batch +queue_full 130$", frame, re.MULTILINE)
    assert re.search(r"^  interactive +queue_full 10  deadline 2$", frame, re.MULTILINE)


def test_a_saturation_rule_shows_its_reading_and_why_it_cannot_judge() -> None:
    state = realistic()
    state["saturation"][0].update(value=42.0, stale=False, error=None)
    state["saturation"][1].update(value=None, stale=True, error="prometheus: connection refused")
    frame = render(state, 120, 60)
    assert "  kueue-backlog  ACTIVE 1m15s  kueue_pending=42  shed best-effort  shrink batch×0.5" in frame
    assert re.search(r"^  kv-pressure +idle +vllm_kv_usage  STALE  error: prometheus: connection refused$",
                     frame, re.MULTILINE)


def test_bars_are_proportional_and_never_hide_a_small_nonzero_count() -> None:
    assert bar(0, 10, 10) == "·" * 10
    assert bar(1, 200, 10) == "█" + "·" * 9
    assert bar(199, 200, 10) == "█" * 9 + "·"
    assert bar(5, 10, 10) == "█" * 5 + "·" * 5
    assert bar(12, 10, 4) == "████"
    assert bar(3, 0, 4) == bar(3, None, 4) == bar(None, 5, 4) == "····"
    assert bar(1, 2, 0) == ""
    assert bar(1, 2, 4, ASCII) == "##.."


# --- an 80x24 terminal over SSH -------------------------------------------------------------------


def test_80x24_keeps_every_lane_whole_with_its_flags_under_it() -> None:
    frame = render(realistic(), 80, 24, source="127.0.0.1:9091")
    assert_fits(frame, 80, 24)
    for name in LANES:
        assert row(frame, name)
    assert re.search(r"3/50 +·+ +0/200 +10ms/200ms +12\.3 +0\.50$", row(frame, "interactive"))
    # No room beside the numbers: flags take the next line, indented under the numbers.
    assert after(frame, "batch").strip() == "LIMIT 10→5, BORROW 3"
    assert after(frame, "best-effort").strip() == "SHED kueue-backlog"
    assert after(frame, "experimental").strip() == "PAUSED, SHADOW, would reject 1.2/s"
    assert after(frame, "legacy").strip() == "CLOSED, RETIRED"
    assert after(frame, "batch").startswith(" " * 14)
    assert "█" in row(frame, "batch")
    # The saturation rule that is shedding made it onto the screen; what did not fit is counted.
    assert "kueue-backlog  ACTIVE 1m15s" in frame
    assert lines_of(frame)[-1] == "… 2 more lines: enlarge the window"


def test_short_flags_stay_beside_readable_bars_and_long_ones_move_under() -> None:
    state = realistic()
    state["lanes"] = state["lanes"][:3]
    state["lanes"][1].update(borrowed=0, inflight=4)
    frame = render(state, 80, 40)
    assert_fits(frame, 80, 40)
    assert re.search(r"^batch +█{5}· +4/5 +█{4}·· 120/200 .* 4\.0  LIMIT 10→5$", row(frame, "batch"))
    assert re.search(r"^interactive +█·{5} +3/50 ", row(frame, "interactive"))
    assert after(frame, "best-effort").strip() == "SHED kueue-backlog"


def test_narrower_than_the_bars_drops_the_bars_not_the_numbers() -> None:
    frame = render(realistic(), 60, 40)
    assert_fits(frame, 60, 40)
    assert "█" not in row(frame, "batch")
    assert re.search(r"^batch +8/5 +120/200 +1\.50s/12\.8s +3\.2 +4\.0$", row(frame, "batch"))


@pytest.mark.parametrize("width", [20, 30, 40, 50])
def test_very_narrow_terminals_stack_each_lane_on_two_lines(width: int) -> None:
    frame = render(realistic(), width, 200)
    assert_fits(frame, width, 200)
    lines = lines_of(frame)
    for name in LANES:
        first = next(i for i, line in enumerate(lines) if line.startswith(f"{name}  in flight")
                     or (width < 30 and line.startswith(name[: width - 1])))
        assert lines[first + 1].startswith("  wait ")
    if width >= 40:
        assert "batch  in flight 8/5  queued 120/200" in lines


@pytest.mark.parametrize("width", [20, 33, 47, 61, 72, 80, 95, 132, 200])
@pytest.mark.parametrize("height", [1, 5, 12, 24, 60])
def test_every_size_fits_the_terminal(width: int, height: int) -> None:
    previous = realistic()
    state = realistic()
    state["draining"] = state["shadow"] = True
    assert_fits(render(state, width, height, previous, source="extproc.example:9091",
                       error="cannot reach extproc.example:9091: connection refused"), width, height)


def test_below_the_minimum_width_the_frame_is_drawn_at_the_minimum() -> None:
    assert_fits(render(realistic(), 3, 10), 20, 10)


def test_a_short_terminal_keeps_lanes_before_the_other_sections() -> None:
    frame = render(realistic(), 120, 12)
    assert_fits(frame, 120, 12)
    for name in LANES:
        assert row(frame, name)
    assert "SIGNALS" not in frame
    assert re.fullmatch(r"… \d+ more lines: enlarge the window", lines_of(frame)[-1])


def test_more_lanes_than_rows_counts_the_ones_left_out() -> None:
    state = realistic()
    state["lanes"] = [lane(f"lane-{i:02d}") for i in range(30)]
    frame = render(state, 80, 24)
    assert_fits(frame, 80, 24)
    assert "lane-00" in frame
    assert "lane-29" not in frame
    assert lines_of(frame)[-1].endswith("more lines: enlarge the window")


def test_long_names_and_paths_are_cut_with_a_mark_at_the_right_end() -> None:
    state = realistic()
    state["lanes"][0]["name"] = "interactive-" + "x" * 50
    state["policy"]["file"] = "/etc/extproc/" + "deep/" * 20 + "policy.yaml"
    frame = render(state, 80, 40)
    assert_fits(frame, 80, 40)
    assert "interactive-xxxxxxx…" in frame
    policy_line = next(line for line in lines_of(frame) if line.startswith("policy "))
    assert policy_line.startswith("policy …")
    assert "/policy.yaml @ab12cd34  reloads 2 ok" in policy_line


# --- status a frame must never lose --------------------------------------------------------------


@pytest.mark.parametrize("width", [20, 40, 80, 120])
def test_draining_and_shadow_mode_survive_any_width(width: int) -> None:
    state = realistic()
    state["draining"] = True
    state["shadow"] = True
    title = lines_of(render(state, width, 24, source="a-long-host-name.example.internal:9091"))[0]
    assert title.endswith("SHADOW MODE") or width < 35
    assert "DRAINING" in title


def test_a_fetch_error_goes_right_under_the_title_over_the_last_good_state() -> None:
    frame = render(realistic(), 100, 40, source="127.0.0.1:9091",
                   error="cannot reach 127.0.0.1:9091: connection refused; retrying every 1s")
    clock = time.strftime("%H:%M:%S", time.localtime(NOW + 0.1))
    assert lines_of(frame)[1] == (f"! cannot reach 127.0.0.1:9091: connection refused; retrying every 1s "
                                  f"(showing the state of {clock})")
    assert row(frame, "batch")


def test_a_fetch_error_before_any_state_is_the_whole_frame() -> None:
    frame = render({}, 80, 24, source="127.0.0.1:9091", error="401: token required")
    assert lines_of(frame) == ["extproc top  127.0.0.1:9091", "! 401: token required"]


def test_control_characters_in_the_document_cannot_reach_the_terminal() -> None:
    state = realistic()
    state["signals"][1]["error"] = "boom\x1b[2J\x1b]0;pwned\x07\nsecond line\r\tend"
    state["lanes"][0]["name"] = "inter\x1b[31mactive"
    state["policy"]["last_error"] = ["line 1\u2028line 2"]
    frame = render(state, 120, 60, error="bad\x1b[H")
    assert_fits(frame, 120, 60)
    assert "error: boom [2J ]0;pwned second line end" in frame
    assert clean("a\x00b\u200bc  \n d") == "a b c d"


# --- tolerance: other versions of the document --------------------------------------------------


def test_missing_optional_keys_show_as_dashes() -> None:
    frame = render({"version": 1, "lanes": [{"name": "interactive"}], "signals": [{"name": "kv"}],
                    "saturation": [{"rule": "r"}]}, 100, 30)
    assert_fits(frame, 100, 30)
    assert re.search(r"^interactive +·+ +–/– +·+ +–/– +–/– +– +–$", row(frame, "interactive"))
    assert re.search(r"^  kv  –  never read$", frame, re.MULTILINE)
    assert re.search(r"^  r  idle  –$", frame, re.MULTILINE)
    assert "version" not in frame  # no version key is not an unknown version


def test_values_of_the_wrong_type_are_shown_as_missing_not_fatal() -> None:
    state: dict[str, Any] = {
        "version": 1, "time": "soon", "uptime_s": True, "draining": "yes",
        "policy": ["not", "a", "mapping"], "capacity": {"limit": "64", "inflight": float("nan")},
        "lanes": [{"name": 42, "inflight": "3", "limit": None, "rejections": ["queue_full"],
                   "shed": {"x": 1}},
                  "not a lane", None,
                  {"name": "ok", "inflight": 1, "limit": 2, "rejections": {"a": "many"}}],
        "signals": {"kv": 1},
        "saturation": [{"rule": None, "active": 1, "shed": "best-effort", "shrink": [1]}],
        "unknown_section": {"anything": [1, 2, 3]},
    }
    frame = render(state, 80, 24)
    assert_fits(frame, 80, 24)
    assert "DRAINING" not in frame  # only a real true counts
    assert re.search(r"^42 +·+ +–/– ", frame, re.MULTILINE)
    assert row(frame, "ok")
    assert re.search(r"^capacity ·+  –/– in flight  – queued$", frame, re.MULTILINE)
    assert re.search(r"^  – +idle +–$", frame, re.MULTILINE)


def test_an_unknown_version_is_rendered_with_a_warning() -> None:
    state = realistic()
    state["version"] = 2
    state["lanes"][0]["new_field"] = {"nested": True}
    frame = render(state, 100, 40)
    assert "! state document version 2; this top reads version 1: some values may be missing" in frame
    assert row(frame, "interactive")


def test_no_lanes_says_so() -> None:
    assert "no lanes" in lines_of(render({"version": 1, "lanes": []}, 80, 24))


# --- what changed since the last frame ----------------------------------------------------------


def test_rejections_show_what_grew_since_the_previous_frame() -> None:
    previous = realistic()
    state = copy.deepcopy(previous)
    state["lanes"][1]["rejections"] = {"queue_full": 135, "deadline": 1}
    state["lanes"][2]["rejections"] = {"shed": 10}  # went down: extproc restarted
    frame = render(state, 120, 60, previous)
    assert "REJECTIONS since start (+ since the last frame)" in frame
    assert re.search(r"^  batch +queue_full 135 \(\+5\)  deadline 1 \(\+1\)$", frame, re.MULTILINE)
    assert re.search(r"^  best-effort +shed 10$", frame, re.MULTILINE)
    assert re.search(r"^  interactive +queue_full 10  deadline 2$", frame, re.MULTILINE)


def test_lanes_without_rejections_are_left_out_of_the_rejections_section() -> None:
    state = realistic()
    for each in state["lanes"]:
        each["rejections"] = {"queue_full": 0}
    assert "REJECTIONS" not in render(state, 120, 60)


# --- ascii, colour ------------------------------------------------------------------------------


def test_ascii_frames_encode_as_ascii() -> None:
    frame = render(realistic(), 80, 60, ascii=True)
    frame.encode("ascii")
    assert re.search(r"#\.+ 3/50", row(frame, "interactive"))
    assert "LIMIT 10->5, BORROW 3" in frame
    assert "shrink batchx0.5" in frame
    assert "-/-" in row(frame, "best-effort")


def test_paint_only_adds_colour_codes() -> None:
    frame = render(realistic(), 120, 60)
    painted = paint(frame)
    assert painted != frame
    assert re.sub(r"\x1b\[[0-9;]*m", "", painted) == frame
    assert "\x1b[31mSTALE\x1b[0m" in painted
    assert "\x1b[31mACTIVE 1m15s\x1b[0m" in painted
    assert "\x1b[33mSHED kueue-backlog\x1b[0m" in painted
    assert painted.startswith("\x1b[1mextproc top")


class FakeStream(io.StringIO):
    def __init__(self, tty: bool, encoding: str = "utf-8") -> None:
        super().__init__()
        self._tty = tty
        self._encoding = encoding

    def isatty(self) -> bool:
        return self._tty

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._encoding


def test_colour_only_on_a_terminal_without_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert wants_colour(FakeStream(tty=True))
    assert not wants_colour(FakeStream(tty=False))
    monkeypatch.setenv("NO_COLOR", "1")
    assert not wants_colour(FakeStream(tty=True))
    monkeypatch.setenv("NO_COLOR", "")
    assert wants_colour(FakeStream(tty=True))


def test_ascii_is_chosen_for_terminals_that_cannot_encode_the_glyphs() -> None:
    assert not wants_ascii(FakeStream(tty=True, encoding="utf-8"))
    assert wants_ascii(FakeStream(tty=True, encoding="ascii"))
    assert wants_ascii(FakeStream(tty=True, encoding="latin-1"))
    assert wants_ascii(FakeStream(tty=True, encoding="no-such-codec"))
    assert not wants_ascii(io.StringIO())


# --- units --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("seconds", "text"), [
    (None, "–"), (-1, "0.0ms"), (0, "0.0ms"), (0.0004, "0.4ms"), (0.00996, "10ms"), (0.012, "12ms"),
    (0.9994, "999ms"), (0.9996, "1.00s"), (1.25, "1.25s"), (9.999, "10.0s"), (12.75, "12.8s"),
    (59.96, "1m00s"), (123.4, "2m03s"), (3599.4, "59m59s"), (3599.6, "1h00m"), (3600, "1h00m"),
    (11520, "3h12m"),
    (86400 * 2 + 3600 * 4 + 5, "2d04h"),
])
def test_durations_read_in_the_right_unit(seconds: float | None, text: str) -> None:
    assert fmt_duration(seconds) == text


@pytest.mark.parametrize(("rate", "text"), [
    (None, "–"), (0, "0"), (-2, "0"), (0.05, "0.05"), (0.5, "0.50"), (0.996, "1.0"), (12.34, "12.3"),
    (99.96, "100"), (450.2, "450"), (9999.4, "9999"), (12_345, "12k"),
])
def test_rates_are_short(rate: float | None, text: str) -> None:
    assert fmt_rate(rate) == text


def test_counts_values_and_cuts() -> None:
    assert [fmt_count(None), fmt_count(12.0), fmt_count(None, ASCII)] == ["–", "12", "-"]
    assert [fmt_value(v) for v in (3.0, 0.93124, -2.5, 1e20, None)] == ["3", "0.9312", "-2.5", "1e+20", "–"]
    cuts = [fit("abcdef", 6), fit("abcdefg", 6), fit("abc", 0), fit("abc", 1)]
    assert cuts == ["abcdef", "abcde…", "", "a"]
    assert fit("abcdefg", 6, ASCII) == "abcde~"


# --- the address --------------------------------------------------------------------------------


@pytest.mark.parametrize(("target", "url", "name"), [
    ("127.0.0.1:9091", "http://127.0.0.1:9091/admin/state", "127.0.0.1:9091"),
    ("[::1]:9091", "http://[::1]:9091/admin/state", "[::1]:9091"),
    ("http://extproc.ns.svc:9091", "http://extproc.ns.svc:9091/admin/state", "extproc.ns.svc:9091"),
    ("https://proxy.example/", "https://proxy.example/admin/state", "proxy.example"),
    ("https://proxy.example/extproc/admin/state", "https://proxy.example/extproc/admin/state",
     "proxy.example"),
])
def test_state_url_from_an_address_or_a_url(target: str, url: str, name: str) -> None:
    assert state_url(target) == (url, name)


@pytest.mark.parametrize("target", ["9091", "localhost", "host:port", ":9091", "http://"])
def test_state_url_rejects_what_is_not_an_address(target: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        state_url(target)

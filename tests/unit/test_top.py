"""Frames of `extproc top`, rendered from admin API State messages without a socket or a terminal."""

from __future__ import annotations

import io
import json
import re
import time
from typing import Any

import pytest
from rich.cells import cell_len

from extproc.api.admin.v1 import admin_pb2 as pb
from extproc.api.document import to_document
from extproc.operations import STATE_VERSION
from extproc.tools.top import (
    ASCII,
    READS_VERSION,
    FetchError,
    bar,
    clean,
    fmt_duration,
    fmt_rate,
    fmt_value,
    parse_state,
    render,
    state_url,
    wants_ascii,
    wants_colour,
)

NOW = 1764680000.0
SGR = re.compile(r"\x1b\[[0-9;]*m")


def lane(name: str, **fields: Any) -> pb.Lane:
    values: dict[str, Any] = {"name": name, "limit": 4, "effective_limit": 4, "max_queued": 10}
    values.update(fields)
    return pb.Lane(**values)


def realistic() -> pb.State:
    """A busy extproc: five lanes in every state, one saturation rule firing, a stale signal."""
    return pb.State(
        version=1, time=NOW + 0.1, uptime_s=123.4, window_s=60,
        policy=pb.Policy(file="examples/policy.yaml", sha256="ab12cd34ef567890", loaded_at=NOW - 300,
                         reloads_ok=2, reloads_failed=1, stale_since=NOW - 90,
                         last_error=["policy.yaml:3: lanes[0].x: extra inputs are not permitted",
                                     "policy.yaml:9: lanes[1].deadline: expected a duration"]),
        capacity=pb.Capacity(limit=64, inflight=12, queued=120),
        lanes=[
            lane("interactive", priority=100, inflight=3, limit=50, effective_limit=50, max_queued=200,
                 wait_p50_s=0.01, wait_p95_s=0.2, admit_per_s=12.3, reject_per_s=0.5,
                 rejections={"queue_full": 10, "deadline": 2}),
            lane("batch", priority=10, inflight=8, limit=10, effective_limit=5, borrowed=3, queued=120,
                 max_queued=200, wait_p50_s=1.5, wait_p95_s=12.75, admit_per_s=3.2, reject_per_s=4.0,
                 rejections={"queue_full": 130}),
            lane("best-effort", inflight=1, shed="kueue-backlog", reject_per_s=7.5, rejections={"shed": 400}),
            lane("experimental", paused=True, shadow=True, shadow_reject_per_s=1.2, max_queued=0),
            lane("legacy", retired=True, closed=True, limit=0, effective_limit=0, max_queued=0),
        ],
        signals=[
            pb.Signal(name="kueue_pending", value=3.0, age_s=2.1),
            pb.Signal(name="vllm_kv_usage", value=0.9312, age_s=45.0, stale=True, error="connection refused"),
            pb.Signal(name="queue_wait_p95", stale=True),
        ],
        saturation=[
            pb.SaturationRule(rule="kueue-backlog", signal="kueue_pending", active=True, since=NOW - 75,
                              shed=["best-effort"], shrink={"batch": 0.5}),
            pb.SaturationRule(rule="kv-pressure", signal="vllm_kv_usage"),
        ],
        tenants=[pb.Tenant(name="acme", weight=2, queued=0), pb.Tenant(name="globex", weight=1)],
    )


LANES = ("interactive", "batch", "best-effort", "experimental", "legacy")


def lines_of(frame: str) -> list[str]:
    return frame.split("\n")


def row(frame: str, name: str) -> str:
    """The table row of one lane (its name at the start of the line)."""
    rows = [line for line in lines_of(frame) if line.startswith(name + " ")]
    assert len(rows) == 1, f"{name!r} rows {rows} in:\n{frame}"
    return rows[0]


def status_of(frame: str, name: str) -> str:
    """A lane's status words: its row's FLAGS column (never wrapped), or the lines under its row."""
    lines = lines_of(frame)
    start = lines.index(row(frame, name))
    head = next(line for line in lines if line.startswith("LANE"))
    below = []
    for line in lines[start + 1:]:
        if not line.startswith("  ") or line.startswith("   "):
            break
        below.append(line.strip())
    if "FLAGS" in head:
        assert below == [], f"the FLAGS column wrapped under {name}:\n{frame}"
        return lines[start][head.find("FLAGS"):].strip()
    return ", ".join(below)


def assert_fits(frame: str, width: int, height: int | None = None) -> None:
    lines = lines_of(frame)
    if height is not None:
        assert len(lines) <= height, f"{len(lines)} lines > {height}:\n{frame}"
    too_long = [line for line in lines if cell_len(line) > width]
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
    assert re.search(r"^capacity █+·+  12/64 in flight  120 queued  rates over 1m00s$", frame, re.MULTILINE)
    head = next(line for line in lines_of(frame) if line.startswith("LANE"))
    assert re.fullmatch(r"LANE +IN FLIGHT +QUEUED +WAIT p50/p95 +ADM/s +REJ/s +FLAGS", head)

    interactive = row(frame, "interactive")
    assert re.search(r"█·+ 3/50 +·+ +0/200 +10ms/200ms +12\.3 +0\.50$", interactive), interactive
    batch = row(frame, "batch")
    # 8 in flight against a limit shrunk to 5 (3 of them borrowed): a full bar, and why.
    assert re.search(r"^batch +█+ +8/5 +█+·+ 120/200 +1\.50s/12\.8s +3\.2 +4\.0 +LIMIT 10→5, BORROW 3$",
                     batch)
    assert row(frame, "best-effort").endswith("SHED kueue-backlog")
    assert "–/–" in row(frame, "best-effort")
    assert row(frame, "experimental").endswith("PAUSED, SHADOW, would reject 1.2/s")
    assert row(frame, "legacy").endswith("CLOSED, RETIRED")

    assert re.search(r"^  kueue-backlog  ACTIVE 1m15s  kueue_pending  shed best-effort  shrink batch×0\.5$",
                     frame, re.MULTILINE)
    assert re.search(r"^  kv-pressure +idle +vllm_kv_usage$", frame, re.MULTILINE)
    assert re.search(r"^  kueue_pending +3  2\.10s ago$", frame, re.MULTILINE)
    assert re.search(r"^  vllm_kv_usage +0\.9312  45\.0s ago +STALE  error: connection refused$", frame,
                     re.MULTILINE)
    assert re.search(r"^  queue_wait_p95 +–  never read +STALE$", frame, re.MULTILINE)
    assert re.search(r"^  batch +queue_full 130$", frame, re.MULTILINE)
    assert re.search(r"^  interactive +queue_full 10  deadline 2$", frame, re.MULTILINE)
    assert "TENANTS" not in frame  # nobody waits: nothing to share out


def test_a_saturation_rule_shows_its_reading_and_why_it_cannot_judge() -> None:
    state = realistic()
    state.saturation[0].value = 42.0
    state.saturation[1].stale = True
    state.saturation[1].error = "prometheus: connection refused"
    frame = render(state, 120, 60)
    assert "  kueue-backlog  ACTIVE 1m15s  kueue_pending=42  shed best-effort  shrink batch×0.5" in frame
    assert re.search(r"^  kv-pressure +idle +vllm_kv_usage +STALE  error: prometheus: connection refused$",
                     frame, re.MULTILINE)


def test_tenants_are_shown_while_one_has_requests_queued() -> None:
    state = realistic()
    state.tenants[1].queued = 7
    state.tenants[1].queued_by_lane.update({"batch": 5, "interactive": 2})
    state.tenants.append(pb.Tenant(name="initech", weight=0.5, queued=9, queued_by_lane={"batch": 9}))
    frame = render(state, 120, 60)
    section = lines_of(frame)[lines_of(frame).index("TENANTS") + 1:]
    assert re.match(r"^  initech +weight 0\.5  queued 9  batch 9$", section[0])
    assert re.match(r"^  globex +weight 1 +queued 7  batch 5, interactive 2$", section[1])
    assert re.match(r"^  acme +weight 2 +queued 0$", section[2])


def test_bars_are_proportional_and_never_hide_a_small_nonzero_count() -> None:
    assert bar(0, 10, 10) == "·" * 10
    assert bar(1, 200, 10) == "█" + "·" * 9
    assert bar(199, 200, 10) == "█" * 9 + "·"
    assert bar(5, 10, 10) == "█" * 5 + "·" * 5
    assert bar(12, 10, 4) == "████"
    assert bar(3, 0, 4) == "····"
    assert bar(1, 2, 0) == ""
    assert bar(1, 2, 4, ASCII) == "##.."


# --- an 80x24 terminal over SSH -------------------------------------------------------------------


def test_80x24_keeps_every_lane_with_its_bars_and_status_words() -> None:
    frame = render(realistic(), 80, 24, source="127.0.0.1:9091")
    assert_fits(frame, 80, 24)
    assert len(lines_of(frame)) == 24
    interactive = row(frame, "interactive")
    assert re.search(r"^interactive +█·+ 3/50 +·+ +0/200 +10ms/200ms +12\.3 +0\.50$", interactive)
    assert re.search(r"^batch +█+ +8/5 +█+·+ 120/200 ", row(frame, "batch"))
    # No room beside the numbers for all of them: each lane's status words go on a line under its
    # row, whole; every row stays one line.
    head = next(line for line in lines_of(frame) if line.startswith("LANE"))
    assert re.fullmatch(r"LANE +IN FLIGHT +QUEUED +WAIT p50/p95 +ADM/s +REJ/s", head)
    assert lines_of(frame)[lines_of(frame).index(interactive) + 1].startswith("batch ")
    assert lines_of(frame)[lines_of(frame).index(row(frame, "batch")) + 1] == "  LIMIT 10→5, BORROW 3"
    assert status_of(frame, "batch") == "LIMIT 10→5, BORROW 3"
    assert status_of(frame, "best-effort") == "SHED kueue-backlog"
    assert status_of(frame, "experimental") == "PAUSED, SHADOW, would reject 1.2/s"
    assert status_of(frame, "legacy") == "CLOSED, RETIRED"
    # The saturation rule that is shedding made it onto the screen; what did not fit is counted.
    assert "kueue-backlog  ACTIVE 1m15s" in frame
    assert re.fullmatch(r"… \d+ more lines: enlarge the window", lines_of(frame)[-1])


def test_narrower_than_the_bars_drops_the_bars_not_the_numbers() -> None:
    state = realistic()
    del state.lanes[2:]
    frame = render(state, 60, 40)
    assert_fits(frame, 60, 40)
    assert "█" not in row(frame, "batch")
    assert re.search(r"^batch +8/5 +120/200 +1\.50s/12\.8s +3\.2 +4\.0$", row(frame, "batch"))
    assert status_of(frame, "batch") == "LIMIT 10→5, BORROW 3"


def test_status_words_beside_the_numbers_only_when_the_longest_fits_on_its_row() -> None:
    state = realistic()
    del state.lanes[3:]  # the longest left: "SHED kueue-backlog"
    frame = render(state, 100, 40)
    assert_fits(frame, 100, 40)
    assert row(frame, "batch").endswith("4.0  LIMIT 10→5, BORROW 3")
    assert status_of(frame, "best-effort") == "SHED kueue-backlog"
    state.lanes[2].shed = "a-saturation-rule-with-a-long-name"
    frame = render(state, 100, 40)
    assert_fits(frame, 100, 40)
    assert "FLAGS" not in frame
    assert status_of(frame, "best-effort") == "SHED a-saturation-rule-with-a-long-name"


@pytest.mark.parametrize("width", [80, 61, 47, 33, 20])
def test_every_status_word_is_shown_whole_at_any_width(width: int) -> None:
    """At 80 columns (and narrower) no row wraps, no line is too long, and every status word is
    there in full: a lane with all of them keeps all of them, broken onto lines between words."""
    state = realistic()
    state.lanes.append(lane("everything", closed=True, retired=True, paused=True, shed="kv", shadow=True,
                            limit=8, effective_limit=2, borrowed=1, shadow_reject_per_s=3.5))
    frame = render(state, width, None)
    assert_fits(frame, width)
    words = ["CLOSED", "RETIRED", "PAUSED", "SHED kv", "SHADOW", "LIMIT 8→2", "BORROW 1",
             "would reject 3.5/s"]
    lines = lines_of(frame)
    # Each word on one line, whole (a word of a line of words may end it, or be followed by ", ").
    found = [w for w in words if any(re.search(rf"(^|  |, ){re.escape(w)}(,|$)", line) for line in lines)]
    assert found == words, frame
    assert "…" not in "".join(line for line in lines if "SHED kv" in line or "would reject" in line)


@pytest.mark.parametrize("width", [20, 30, 40, 50])
def test_very_narrow_terminals_stack_each_lane_on_its_own_lines(width: int) -> None:
    frame = render(realistic(), width, None)
    assert_fits(frame, width)
    lines = lines_of(frame)
    for name in LANES:
        first = next(i for i, line in enumerate(lines) if line.startswith(f"{name}  in flight")
                     or (width < 30 and line.startswith(name[: width - 1])))
        assert lines[first + 1].startswith("  wait ")
    if width >= 40:
        assert "batch  in flight 8/5  queued 120/200" in lines
        assert "  PAUSED, SHADOW, would reject 1.2/s"[:width - 1] in frame


@pytest.mark.parametrize("width", [20, 33, 47, 61, 72, 80, 95, 132, 200])
@pytest.mark.parametrize("height", [1, 5, 12, 24, 60])
def test_every_size_fits_the_terminal(width: int, height: int) -> None:
    previous = realistic()
    state = realistic()
    state.draining = state.shadow = True
    state.tenants[0].queued = 3
    frame = render(state, width, height, previous, source="extproc.example:9091",
                   error="cannot reach extproc.example:9091: connection refused")
    assert_fits(frame, width, height)
    assert "DRAINING" in lines_of(frame)[0]


def test_below_the_minimum_width_the_frame_is_drawn_at_the_minimum() -> None:
    assert_fits(render(realistic(), 3, 10), 20, 10)


def test_a_short_terminal_keeps_lanes_before_the_other_sections() -> None:
    frame = render(realistic(), 120, 12)
    assert_fits(frame, 120, 12)
    for name in LANES:
        assert row(frame, name)
    assert "SIGNALS" not in frame
    assert "" not in lines_of(frame)  # blank lines go before any content does
    assert re.fullmatch(r"… \d+ more lines: enlarge the window", lines_of(frame)[-1])


def test_more_lanes_than_rows_counts_the_ones_left_out() -> None:
    state = realistic()
    del state.lanes[:]
    state.lanes.extend(lane(f"lane-{i:02d}") for i in range(30))
    frame = render(state, 80, 24)
    assert_fits(frame, 80, 24)
    assert "lane-00" in frame
    assert "lane-29" not in frame
    assert lines_of(frame)[-1].endswith("more lines: enlarge the window")


def test_long_names_and_paths_are_cut_with_a_mark() -> None:
    state = realistic()
    state.lanes[0].name = "interactive-" + "x" * 50
    state.policy.file = "/etc/extproc/" + "deep/" * 20 + "policy.yaml"
    frame = render(state, 100, 40)
    assert_fits(frame, 100, 40)
    assert re.search(r"^interactive-x{7}… ", frame, re.MULTILINE)
    policy_line = next(line for line in lines_of(frame) if line.startswith("policy "))
    # Of a path, the end is kept: the file name tells which policy it is.
    assert policy_line.startswith("policy …")
    assert "/policy.yaml @ab12cd34  reloads 2 ok" in policy_line


# --- status a frame must never lose --------------------------------------------------------------


@pytest.mark.parametrize("width", [20, 40, 80, 120])
def test_draining_and_shadow_mode_survive_any_width(width: int) -> None:
    state = realistic()
    state.draining = True
    state.shadow = True
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
    frame = render(None, 80, 24, source="127.0.0.1:9091", error="401: token required")
    assert lines_of(frame) == ["extproc top  127.0.0.1:9091", "! 401: token required"]


def test_control_characters_from_the_server_cannot_reach_the_terminal() -> None:
    state = realistic()
    state.signals[1].error = "boom\x1b[2J\x1b]0;pwned\x07\nsecond line\r\tend"
    state.lanes[0].name = "inter\x1b[31mactive"
    state.lanes[2].shed = "[bold]rule\x9b2J"
    state.policy.last_error[0] = "line 1\u2028line 2"
    state.saturation[0].shrink["\x1b[5mlane"] = 0.25
    state.lanes[1].rejections["\x1b]8;;http://x\x07link"] = 1
    state.tenants.append(pb.Tenant(name="t\x1b[1m", queued=1, queued_by_lane={"\x07b": 1}))
    frame = render(state, 120, 60, error="bad\x1b[H")
    assert_fits(frame, 120, 60)
    assert "error: boom [2J ]0;pwned second line end" in frame
    assert "SHED [bold]rule 2J" in frame  # shown as text, never read as markup
    assert "old policy kept: line 1 line 2" in frame
    assert "shrink [5mlane×0.25, batch×0.5" in frame
    assert "]8;;http://x link 1" in frame
    assert re.search(r"^  t \[1m +weight 0 +queued 1  b 1$", frame, re.MULTILINE)
    # With colour on, the only escape sequences are the colours themselves.
    painted = render(state, 120, 60, error="bad\x1b[H", colour=True)
    assert SGR.sub("", painted) == frame
    assert clean("a\x00b\u200bc  \n d") == "a b c d"


# --- the typed contract ---------------------------------------------------------------------------


def test_the_version_this_top_reads_is_the_one_extproc_serves() -> None:
    assert READS_VERSION == STATE_VERSION


def test_unset_optional_fields_show_as_dashes() -> None:
    state = pb.State(version=1, time=NOW, lanes=[pb.Lane(name="interactive", limit=2, effective_limit=2)],
                     signals=[pb.Signal(name="kv")], saturation=[pb.SaturationRule(rule="r", active=True)],
                     policy=pb.Policy(file="p.yaml", last_error=["broken"]))
    frame = render(state, 100, 30)
    assert_fits(frame, 100, 30)
    assert re.search(r"^interactive +·+ +0/2 +·+ +0/0 +–/– +0 +0$", row(frame, "interactive"))
    assert re.search(r"^  kv  –  never read$", frame, re.MULTILINE)
    assert re.search(r"^  r  ACTIVE  –$", frame, re.MULTILINE)
    assert "! file invalid, old policy kept: broken" in frame  # no stale_since: no duration
    assert "capacity" not in frame  # an unset message is left out, not drawn as zeros
    assert "version" not in frame


def test_a_json_document_is_read_leniently_but_not_blindly() -> None:
    doc: dict[str, Any] = to_document(realistic())
    doc["a_future_key"] = {"anything": [1, 2]}
    doc["lanes"][0]["a_future_field"] = True
    doc["lanes"][1]["wait_p50_s"] = None
    state = parse_state(json.dumps(doc).encode(), "x:1")
    assert state.lanes[0].name == "interactive"
    assert not state.lanes[1].HasField("wait_p50_s")
    assert state.lanes[1].HasField("wait_p95_s")

    doc["lanes"][0]["inflight"] = "three"
    with pytest.raises(FetchError, match=r"^x:1 sent a state this top cannot read: .*inflight"):
        parse_state(json.dumps(doc).encode(), "x:1")
    for body in (b"[1, 2]", b"<html>", b""):
        with pytest.raises(FetchError, match="did not answer with a JSON object"):
            parse_state(body, "x:1")


def test_an_unknown_version_is_rendered_with_a_warning() -> None:
    state = realistic()
    state.version = 2
    frame = render(state, 100, 40)
    assert "! state version 2; this top reads version 1: some values may be missing" in frame
    assert row(frame, "interactive")


def test_no_lanes_says_so() -> None:
    assert "no lanes" in lines_of(render(pb.State(version=1), 80, 24))


# --- what changed since the last frame ----------------------------------------------------------


def test_rejections_show_what_grew_since_the_previous_frame() -> None:
    previous = realistic()
    state = realistic()
    state.lanes[1].rejections.clear()
    state.lanes[1].rejections.update({"queue_full": 135, "deadline": 1})
    state.lanes[2].rejections["shed"] = 10  # went down: extproc restarted
    frame = render(state, 120, 60, previous)
    assert "REJECTIONS since start (+ since the last frame)" in frame
    assert re.search(r"^  batch +queue_full 135 \(\+5\)  deadline 1 \(\+1\)$", frame, re.MULTILINE)
    assert re.search(r"^  best-effort +shed 10$", frame, re.MULTILINE)
    assert re.search(r"^  interactive +queue_full 10  deadline 2$", frame, re.MULTILINE)


def test_lanes_without_rejections_are_left_out_of_the_rejections_section() -> None:
    state = realistic()
    for each in state.lanes:
        each.rejections.clear()
        each.rejections["queue_full"] = 0
    assert "REJECTIONS" not in render(state, 120, 60)


# --- ascii, colour ------------------------------------------------------------------------------


def test_ascii_frames_encode_as_ascii_and_keep_their_columns() -> None:
    state = realistic()
    state.lanes[1].name = "batch-日本"
    frame = render(state, 100, 60, ascii=True)
    frame.encode("ascii")
    assert re.search(r"#\.+ 3/50", row(frame, "interactive"))
    assert "LIMIT 10->5, BORROW 3" in frame
    assert "shrink batchx0.5" in frame
    assert "-/-" in row(frame, "best-effort")
    # A wide character is two cells: two marks keep the columns after it where they were.
    assert row(frame, "batch-????").index("8/5") == row(frame, "interactive").index("3/50") + 1
    assert "~" in render(state, 40, 20, ascii=True)  # rich's cuts too


def test_colour_marks_alarms_red_and_notices_yellow_and_adds_nothing_else() -> None:
    state = realistic()
    state.draining = True
    painted = render(state, 120, 60, colour=True)
    assert SGR.sub("", painted) == render(state, 120, 60)
    red, yellow = "\x1b[31m", "\x1b[33m"
    for word in ("DRAINING", "STALE", "ACTIVE 1m15s", "CLOSED"):
        assert f"{red}{word}" in painted, word
    for word in ("SHED kueue-backlog", "PAUSED", "LIMIT 10→5", "BORROW 3"):
        assert f"{yellow}{word}" in painted, word
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
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich would colour a pipe for this; a pipe gets plain text
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
    (0, "0"), (-2, "0"), (0.05, "0.05"), (0.5, "0.50"), (0.996, "1.0"), (12.34, "12.3"),
    (99.96, "100"), (450.2, "450"), (9999.4, "9999"), (12_345, "12k"), (float("nan"), "–"),
])
def test_rates_are_short(rate: float, text: str) -> None:
    assert fmt_rate(rate) == text


def test_values() -> None:
    assert [fmt_value(v) for v in (3.0, 0.93124, -2.5, 1e20, None, float("inf"))] == [
        "3", "0.9312", "-2.5", "1e+20", "–", "–"]
    assert fmt_value(None, ASCII) == "-"


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


def test_a_self_sized_limit_shows_where_it_is_why_it_moved_and_what_is_wrong() -> None:
    state = realistic()
    state.capacity.auto.CopyFrom(pb.AutoCapacity(
        limit=37, min=4, max=512, mode="enforce", reason="engine_queue",
        why="the engines queue 12 requests (target 0)", since=NOW - 30.1, stale=True, leader=False,
        unreachable="tpot_p95 80ms > target 1ms at min 4"))
    frame = render(state, 140, 60)
    assert ("limit 37 (auto in [4, 512], following the fleet): engine_queue 30.2s ago: the engines queue "
            "12 requests (target 0)") in frame
    assert "! no fresh engine signal: the limit holds, then decays to min" in frame
    assert "! target unreachable: tpot_p95 80ms > target 1ms at min 4" in frame
    assert "auto" not in render(realistic(), 140, 60).split("capacity", 1)[1].split("\n", 1)[0]


def test_refusals_no_single_lane_owns_have_a_row_of_their_own() -> None:
    previous = realistic()
    previous.any_lane_rejections["tenant_request_budget"] = 40
    state = realistic()
    state.any_lane_rejections.update({"tenant_request_budget": 52, "overloaded": 3})
    frame = render(state, 120, 60, previous)
    assert re.search(r"^  \* \(any lane\) +tenant_request_budget 52 \(\+12\)  overloaded 3 \(\+3\)$", frame,
                     re.MULTILINE)
    state.any_lane_rejections.clear()
    assert "any lane" not in render(state, 120, 60)

"""Trace replay: formats, streaming, time compression, windows, rate scaling, class mapping, bad lines."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from extproc.sim.profiles import LLAMA_70B_2XH100
from extproc.sim.simulate import Simulator
from extproc.sim.traces import Assign, Replay, Trace, TraceError, detect, parse_map, parse_window
from extproc.sim.workload import Arrivals, TrafficClass, WorkloadSpec, generate, write_trace

ROOT = Path(__file__).resolve().parents[2]
AZURE = ROOT / "tests" / "data" / "traces" / "azure-2023-conv-excerpt.csv"
CHATBOT = ROOT / "examples" / "workloads" / "chatbot.yaml"

SPEC = WorkloadSpec(arrivals=Arrivals(rate=1.0), classes=(
    TrafficClass(name="interactive", share=3, tenants={"acme": 3, "globex": 1},
                 keys={"acme": "sk-demo-acme", "globex": "sk-demo-globex"}),
    TrafficClass(name="batch", share=1, path="/v1/completions"),
))
BURSTGPT_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"


def burstgpt(tmp_path: Path, rows: list[str]) -> Path:
    path = tmp_path / "burst.csv"
    path.write_text("\n".join([BURSTGPT_HEADER, *rows]) + "\n")
    return path


def mooncake(tmp_path: Path, records: list[dict[str, object]], name: str = "mooncake.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_formats_are_detected_from_the_header_or_first_record(tmp_path: Path) -> None:
    assert detect(AZURE) == "azure"
    assert detect(burstgpt(tmp_path, ["5,ChatGPT,10,20,30,Conversation log"])) == "burstgpt"
    assert detect(mooncake(tmp_path, [{"timestamp": 0, "input_length": 5, "output_length": 6,
                                       "hash_ids": [1]}])) == "mooncake"
    own = tmp_path / "own.jsonl"
    write_trace(generate(WorkloadSpec(arrivals=Arrivals(rate=5)), 2, 1), own)
    assert detect(own) == "jsonl"
    log = tmp_path / "extproc.log"
    log.write_text("2026-12-03 10:00:00 [info] extproc serving\n"
                   + json.dumps({"event": "decision", "arrival": 1.0}) + "\n")
    assert detect(log) == "decision-log"
    unknown = tmp_path / "x.csv"
    unknown.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(TraceError, match=r"x.csv:1: unknown trace format: header 'a,b,c'"):
        detect(unknown)
    empty = tmp_path / "empty.csv"
    empty.write_text("\n\n")
    with pytest.raises(TraceError, match="empty"):
        detect(empty)


def test_azure_timestamps_with_seven_fractional_digits_keep_their_gaps() -> None:
    trace = Trace(AZURE, assign=Assign(SPEC))
    requests = list(trace)
    assert len(requests) == 300
    assert trace.requests == 300
    # 18:15:46.6805900, 18:15:50.9951690, 18:15:51.2224670 (the file's first three rows)
    assert [round(r.at, 7) for r in requests[:3]] == [0.0, 4.314579, 4.541877]
    assert (requests[0].prompt_tokens, requests[0].output_tokens) == (374, 44)
    assert [r.index for r in requests] == list(range(300))
    assert all(b.at >= a.at for a, b in itertools.pairwise(requests))


def test_classes_by_ratio_carry_the_class_path_tenant_and_key() -> None:
    requests = list(Trace(AZURE, assign=Assign(SPEC), replay=Replay(seed=3)))
    by_class = {c: [r for r in requests if r.cls == c] for c in ("interactive", "batch")}
    assert 0.6 < len(by_class["interactive"]) / len(requests) < 0.9  # share 3:1
    chat = by_class["interactive"][0]
    assert chat.path == "/v1/chat/completions"
    assert chat.key == {"acme": "sk-demo-acme", "globex": "sk-demo-globex"}[chat.tenant]
    assert chat.gateway == {"x-extproc-client": chat.tenant}
    assert {r.path for r in by_class["batch"]} == {"/v1/completions"}
    assert list(Trace(AZURE, assign=Assign(SPEC), replay=Replay(seed=3))) == requests  # seeded


def test_classes_and_tenants_from_columns(tmp_path: Path) -> None:
    path = burstgpt(tmp_path, ["0.5,ChatGPT,100,20,120,Conversation log",
                               "1.0,GPT-4,300,0,300,API log",
                               '2.0,ChatGPT,50,10,60,"API log"'])
    trace = Trace(path, assign=Assign(SPEC, "Model", {"ChatGPT": "interactive", "GPT-4": "batch"},
                                      tenant_column="Log Type"))
    requests = list(trace)
    assert [r.cls for r in requests] == ["interactive", "batch", "interactive"]
    assert [r.tenant for r in requests] == ["Conversation log", "API log", "API log"]
    assert [r.at for r in requests] == [0.0, 0.5, 1.5]  # from the first record
    assert requests[1].output_tokens == 1  # a failed request (0 tokens): replayed asking for one
    assert requests[1].headers == {"x-extproc-client": "API log"}  # no key: the client header
    unmapped = Trace(path, assign=Assign(SPEC, "Model", {"ChatGPT": "interactive"}))
    with pytest.raises(TraceError, match="line 3: Model 'GPT-4' is not in --class-map"):
        list(unmapped)
    with pytest.raises(TraceError, match="--class-map names classes the workload does not have: nope"):
        Trace(path, assign=Assign(SPEC, "Model", {"ChatGPT": "nope"}))
    with pytest.raises(TraceError, match="needs --class-map"):
        Trace(path, assign=Assign(SPEC, "Model"))
    with pytest.raises(TraceError, match="has no lanes or tenants: give a workload"):
        Trace(path)


def test_mooncake_times_are_milliseconds(tmp_path: Path) -> None:
    path = mooncake(tmp_path, [
        {"timestamp": 0, "input_length": 655, "output_length": 52, "hash_ids": [46, 47]},
        {"timestamp": 10535, "input_length": 672, "output_length": 26, "hash_ids": [46, 47]},
    ])
    requests = list(Trace(path, assign=Assign(SPEC)))
    assert [(r.at, r.prompt_tokens, r.output_tokens) for r in requests] == [(0.0, 655, 52), (10.535, 672, 26)]


def test_speedup_window_and_rate_scale(tmp_path: Path) -> None:
    path = mooncake(tmp_path, [{"timestamp": t * 1000, "input_length": 10, "output_length": 10}
                               for t in range(10)])
    base = Assign(SPEC)
    windowed = list(Trace(path, assign=base, replay=Replay(window=(2.0, 6.0), speedup=2.0)))
    assert [r.at for r in windowed] == [0.0, 0.5, 1.0, 1.5]  # 2, 3, 4, 5 s, twice as fast
    doubled = list(Trace(path, assign=base, replay=Replay(rate_scale=2.0)))
    assert len(doubled) == 20
    assert [r.index for r in doubled] == list(range(20))
    many = mooncake(tmp_path, [{"timestamp": t, "input_length": 10, "output_length": 10}
                               for t in range(2000)], "many.jsonl")
    thinned = list(Trace(many, assign=base, replay=Replay(rate_scale=0.25, seed=5)))
    assert 400 < len(thinned) < 600
    assert len(list(Trace(many, assign=base, replay=Replay(limit=7)))) == 7
    with pytest.raises(TraceError, match="--speedup must be a positive number"):
        Trace(path, assign=base, replay=Replay(speedup=0))
    with pytest.raises(TraceError, match="--window must be START:END"):
        Trace(path, assign=base, replay=Replay(window=(5.0, 2.0)))
    assert parse_window("10:20") == (10.0, 20.0)
    assert parse_window("10:") == (10.0, None)
    assert parse_map("ChatGPT=interactive, GPT-4=batch") == {"ChatGPT": "interactive", "GPT-4": "batch"}
    with pytest.raises(ValueError, match="VALUE=CLASS"):
        parse_map("ChatGPT")


def test_a_bad_line_names_the_file_and_its_line_or_is_skipped_and_counted(tmp_path: Path) -> None:
    lines = AZURE.read_text().splitlines()
    lines[3] = "2023-11-16 18:15:51.3910170,ninety,16"  # line 4 of the file, header counted
    lines[5] = "2023-11-16 18:15:52,1"
    path = tmp_path / "azure.csv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=r"azure.csv:4: not an Azure trace row"):
        list(Trace(path, assign=Assign(SPEC)))
    trace = Trace(path, assign=Assign(SPEC), replay=Replay(skip_bad=True))
    assert len(list(trace)) == 298
    assert trace.bad == 2
    broken = mooncake(tmp_path, [{"timestamp": 0, "input_length": 1, "output_length": 1}])
    broken.write_text(broken.read_text() + "{not json\n")
    with pytest.raises(TraceError, match=r"mooncake.jsonl:2: not JSON"):
        list(Trace(broken, assign=Assign(SPEC)))
    backwards = mooncake(tmp_path, [{"timestamp": 5, "input_length": 1, "output_length": 1},
                                    {"timestamp": 1, "input_length": 1, "output_length": 1}], "back.jsonl")
    with pytest.raises(TraceError, match=r"back.jsonl:2: out of arrival order"):
        list(Trace(backwards, assign=Assign(SPEC)))


def test_a_decision_log_is_put_back_in_arrival_order_in_a_bounded_buffer(tmp_path: Path) -> None:
    def record(arrival: float) -> str:
        return json.dumps({"event": "decision", "arrival": arrival, "lane": "a", "tenant": "t",
                           "path": "/v1/x", "headers": {}, "model": "m", "prompt_tokens": 3,
                           "output_tokens": 4})

    log = tmp_path / "extproc.log"
    # Written when each request ended: 12.0 ended before 11.5 and 11.0.
    retry = json.dumps({"event": "decision", "arrival": 12.5, "lane": "a", "retry": True})
    sdk_retry = json.dumps({"event": "decision", "arrival": 12.7, "lane": "a",
                            "headers": {"x-stainless-retry-count": "1"}})
    log.write_text("\n".join([*(record(a) for a in (10.0, 12.0, 11.5, 11.0, 13.0)), retry, sdk_retry]) + "\n")
    # Retries are not replayed: the replay's own clients retry what is refused.
    assert [r.at for r in Trace(log)] == [0.0, 1.0, 1.5, 2.0, 3.0]
    with pytest.raises(TraceError, match=r"extproc.log:4: .* more out of order than the reorder buffer"):
        list(Trace(log, replay=Replay(reorder=1)))


def test_a_large_trace_streams(tmp_path: Path) -> None:
    path = tmp_path / "large.jsonl"
    with path.open("w") as out:
        for t in range(20_000):
            out.write(f'{{"timestamp": {t}, "input_length": 100, "output_length": 20, "hash_ids": [1, 2]}}\n')
    # Larger than the peak allowed below, whole or as requests in memory (several MB), and no larger:
    # tracemalloc makes every line costly.
    assert path.stat().st_size > 1_400_000
    trace = Trace(path, assign=Assign(SPEC))
    tracemalloc.start()
    try:
        count = sum(1 for _ in trace)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 20_000
    assert peak < 1_000_000, peak  # a few requests at a time, not the file


def test_the_simulator_reads_a_stream_as_it_goes() -> None:
    spec = WorkloadSpec(arrivals=Arrivals(rate=20))
    requests = generate(spec, 20, 4)
    sim = Simulator(LLAMA_70B_2XH100, time_scale=0.1)
    assert sim.run(iter(requests), None).results == sim.run(requests, None).results
    backwards = [requests[1], requests[0]]
    with pytest.raises(ValueError, match="arrival order"):
        sim.run(backwards, None)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "extproc", "simulate", "--policy", "examples/demo-policy.yaml",
               "--workload", str(CHATBOT), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_simulate_replays_a_public_trace_at_a_load(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    result = run_cli("--trace", str(AZURE), "--load", "1.5", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "--speedup" in result.stderr
    doc = json.loads(out.read_text())
    assert doc["requests"] == 300
    assert doc["trace"]["format"] == "azure"
    assert doc["trace"]["speedup"] > 1
    # What the load was computed from, and what it came to: the trace's own mix and span.
    assert doc["load"] == 1.5
    assert doc["trace"]["requests"] == 300
    assert doc["trace"]["mean_prompt_tokens"] > doc["trace"]["mean_output_tokens"] > 0
    assert doc["trace"]["span_s"] == pytest.approx(doc["duration_s"] * doc["trace"]["speedup"], rel=0.01)
    assert set(doc["runs"]) == {"no admission control", "fifo, capped queue", "policy (demo-policy.yaml)"}
    lanes = doc["runs"]["policy (demo-policy.yaml)"]["lanes"]
    assert {"interactive", "batch", "best-effort"} <= set(lanes)
    assert lanes["interactive"]["engine_ttft"]["p99"] <= lanes["interactive"]["ttft"]["p99"]


def test_simulate_says_which_line_is_bad(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text(AZURE.read_text().replace("2023-11-16 18:15:51.2224670,879,55", "garbage,1,2"))
    result = run_cli("--trace", str(bad))
    assert result.returncode == 2
    assert "bad.csv:4: not an Azure trace row" in result.stderr
    assert "Traceback" not in result.stderr
    skipped = run_cli("--trace", str(bad), "--skip-bad", "--json", str(tmp_path / "o.json"))
    assert skipped.returncode == 0, skipped.stderr
    assert "skipped 1 malformed lines" in skipped.stderr
    assert json.loads((tmp_path / "o.json").read_text())["requests"] == 299


def test_mapping_options_are_for_public_traces_only(tmp_path: Path) -> None:
    own = tmp_path / "own.jsonl"
    write_trace(generate(WorkloadSpec(arrivals=Arrivals(rate=5)), 2, 1), own)
    with pytest.raises(TraceError, match="are for public traces; a jsonl trace carries"):
        Trace(own, assign=Assign(SPEC, tenant_column="x"))
    assert len(list(Trace(own, assign=Assign(SPEC)))) > 0  # the default mapping is harmless
    with pytest.raises(TraceError, match="--max-requests must be at least 1"):
        Trace(own, replay=Replay(limit=0))
    with pytest.raises(TraceError, match="no such file"):
        Trace(tmp_path / "missing.csv")

"""The admin API's generated code matches protos/, and its JSON documents keep their shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from extproc.api.admin.v1 import admin_pb2 as pb
from extproc.api.document import from_document, to_document

ROOT = Path(__file__).resolve().parents[2]
PROTOS = sorted((ROOT / "protos").rglob("*.proto"))


def generate(out: Path) -> None:
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={out}",
                    f"--pyi_out={out}", f"--grpc_python_out={out}", *map(str, PROTOS)],
                   check=True, capture_output=True, text=True)


def test_the_checked_in_code_is_what_make_protos_generates(tmp_path: Path) -> None:
    assert PROTOS, "no .proto under protos/"
    generate(tmp_path)
    made = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert made, "protoc wrote nothing"
    for relative in made:
        checked_in = ROOT / relative
        assert checked_in.exists(), f"{relative} is not checked in: run `make protos`"
        assert checked_in.read_bytes() == (tmp_path / relative).read_bytes(), (
            f"{relative} differs from what protos/ generates: run `make protos`")


def test_generated_modules_live_in_regular_packages() -> None:
    for directory in (ROOT / "extproc" / "api", ROOT / "extproc" / "api" / "admin",
                      ROOT / "extproc" / "api" / "admin" / "v1"):
        assert (directory / "__init__.py").exists(), directory


def test_the_document_prints_every_field_by_its_proto_name_with_null_for_unset_optionals() -> None:
    state = pb.State(version=1, lanes=[pb.Lane(name="a", inflight=2, limit=4, rejections={"queue_full": 3})],
                     policy=pb.Policy(file="p.yaml", last_error=["p.yaml:3: lanes[0]"]))
    doc = to_document(state)
    assert list(doc) == [f.name for f in pb.State.DESCRIPTOR.fields]
    (lane,) = doc["lanes"]
    assert list(lane) == [f.name for f in pb.Lane.DESCRIPTOR.fields]
    assert (lane["wait_p50_s"], lane["shed"], lane["paused"], lane["queued"]) == (None, None, False, 0)
    assert lane["rejections"] == {"queue_full": 3}
    assert doc["policy"]["stale_since"] is None
    assert doc["policy"]["last_error"] == ["p.yaml:3: lanes[0]"]
    assert doc["capacity"] is None  # an unset message is null too
    # Counts are JSON numbers, not the strings protobuf prints for 64-bit integers.
    assert json.loads(json.dumps(doc))["lanes"][0]["inflight"] == 2


def test_a_document_reads_back_into_the_same_message() -> None:
    state = pb.State(version=1, time=1764680000.5, draining=True,
                     lanes=[pb.Lane(name="a", wait_p95_s=0.0, shed="kv")],
                     saturation=[pb.SaturationRule(rule="kv", since=12.5, shrink={"a": 0.5})],
                     signals=[pb.Signal(name="kv", value=0.0, stale=True, error="unreachable")],
                     tenants=[pb.Tenant(name="acme", weight=2.0, queued=3, queued_by_lane={"a": 3})])
    again = from_document(json.loads(json.dumps(to_document(state))), pb.State)
    assert again == state
    # A zero that was set stays set: 0.0 is a value, null is none.
    assert again.lanes[0].HasField("wait_p95_s")
    assert not again.lanes[0].HasField("wait_p50_s")


def test_reading_is_lenient_about_unknown_keys_and_strict_about_types() -> None:
    newer = {"version": 2, "added_later": {"x": 1}, "lanes": [{"name": "a", "new": 1}]}
    state = from_document(newer, pb.State)
    assert (state.version, state.lanes[0].name) == (2, "a")
    with pytest.raises(ValueError, match="inflight"):
        from_document({"lanes": [{"inflight": "lots"}]}, pb.State)
    with pytest.raises(ValueError, match="JSON object"):
        from_document([1, 2], pb.State)

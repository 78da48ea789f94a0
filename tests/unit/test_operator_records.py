"""Operator actions are records in the decision log: drain, undrain, pause, resume and every reload
that changed the policy in force, each with when, which policy, and what asked for it."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from extproc import operations as operations_mod
from extproc.controller import Controller
from extproc.metrics import Metrics
from extproc.operations import Operations
from extproc.policy import load_policy
from extproc.policy.watcher import PolicyFile
from tests.unit.test_policy_watcher import BIGGER, GOOD, Inline


class Recorder:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.records.append({"event": event, **fields})


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    out = Recorder()
    monkeypatch.setattr(operations_mod, "log", out)
    return out


def operated(path: Path) -> Operations:
    policy = load_policy(path)
    controller = Controller(policy, Metrics(CollectorRegistry()))
    box: list[Operations] = []
    policy_file = PolicyFile(str(path), policy, controller.reconfigure, decoder=Inline(),
                             on_result=lambda result: box[0].reloaded(result))
    box.append(Operations(controller, policy_file, clock=lambda: 1700000000.25))
    return box[0]


async def test_each_action_is_one_record_with_the_policy_in_force(tmp_path: Path, recorder: Recorder) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    first = hashlib.sha256(GOOD.encode()).hexdigest()
    ops = operated(path)
    ops.pause("a")
    ops.resume("a")
    ops.drain()
    ops.undrain()
    with pytest.raises(KeyError):
        ops.pause("no-such-lane")  # refused: nothing happened, nothing recorded
    assert (await ops.reload()).changed is False  # the same file: nothing changed, nothing recorded
    path.write_text(BIGGER)
    assert (await ops.reload()).changed
    second = hashlib.sha256(BIGGER.encode()).hexdigest()
    ops.drain("shutdown")
    assert recorder.records == [
        {"event": "operator", "action": "pause", "at": 1700000000.25, "policy": first, "trigger": "admin",
         "lane": "a"},
        {"event": "operator", "action": "resume", "at": 1700000000.25, "policy": first, "trigger": "admin",
         "lane": "a"},
        {"event": "operator", "action": "drain", "at": 1700000000.25, "policy": first, "trigger": "admin"},
        {"event": "operator", "action": "undrain", "at": 1700000000.25, "policy": first, "trigger": "admin"},
        {"event": "operator", "action": "reload", "at": 1700000000.25, "policy": second, "trigger": "admin",
         "previous": first},
        {"event": "operator", "action": "drain", "at": 1700000000.25, "policy": second,
         "trigger": "shutdown"},
    ]
    assert ops.controller.machine.draining


async def test_a_reload_the_watcher_finds_is_recorded_and_a_bad_one_is_not(tmp_path: Path,
                                                                            recorder: Recorder) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    ops = operated(path)
    path.write_text("lanes: [")
    assert not (await ops.policy_file.reload("watch")).ok
    path.write_text(BIGGER)
    assert (await ops.policy_file.reload("watch")).changed
    assert [(r["action"], r["trigger"]) for r in recorder.records] == [("reload", "watch")]

"""Hot reload of the policy file: swaps, rejections, ConfigMap symlink swaps, the watch loop."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from extproc.policy import Policy, load_policy
from extproc.policy.watcher import PolicyFile, ReloadResult

GOOD = """\
lanes:
  - {name: a, max_inflight: 4, max_queued: 10, deadline: 5s}
classification: {default_lane: a}
"""
BIGGER = GOOD.replace("max_inflight: 4", "max_inflight: 8")
BAD = GOOD.replace("max_inflight: 4", "max_inflight: -1")


def watched(path: Path) -> tuple[PolicyFile, list[Policy], list[ReloadResult]]:
    applied: list[Policy] = []
    results: list[ReloadResult] = []
    pf = PolicyFile(str(path), load_policy(path), applied.append, on_result=results.append)
    return pf, applied, results


def test_a_changed_file_is_swapped_in(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    pf, applied, results = watched(path)
    assert pf.reload("watch") == ReloadResult(ok=True, changed=False, sha256=pf.sha256)
    assert applied == []
    assert results == []
    path.write_text(BIGGER)
    result = pf.reload("watch")
    assert result.ok
    assert result.changed
    assert [p.lanes[0].max_inflight for p in applied] == [8]
    assert pf.policy is applied[0]
    assert pf.reloads_ok == 1
    assert results == [result]


def test_a_bad_file_keeps_the_old_policy_and_says_where_it_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    pf, applied, results = watched(path)
    old = pf.policy
    path.write_text(BAD)
    result = pf.reload("sighup")
    assert not result.ok
    assert applied == []
    assert pf.policy is old
    assert pf.reloads_failed == 1
    (problem,) = result.problems
    assert problem.startswith(f"{path}:2: lanes[0].max_inflight: ")
    assert pf.last_error == result.problems
    # A bad file is reported once, not on every poll; an explicit reload reports it again.
    assert not pf.reload("watch").ok
    assert pf.reloads_failed == 1
    assert not pf.reload("watch").ok
    assert pf.reloads_failed == 1
    assert not pf.reload("admin").ok
    assert pf.reloads_failed == 2
    # Reverted to the policy in force: nothing to swap, but the file is good again.
    path.write_text(GOOD)
    reverted = pf.reload("watch")
    assert (reverted.ok, reverted.changed, pf.last_error) == (True, False, None)
    # Fixed: swapped in, and the error is cleared.
    path.write_text(BAD)
    pf.reload("watch")
    path.write_text(BIGGER)
    assert pf.reload("watch").changed
    assert pf.last_error is None
    assert applied[0].lanes[0].max_inflight == 8
    assert [r.ok for r in results] == [False, False, True, False, True]


def test_a_missing_or_oversized_file_is_an_error_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    pf, applied, _ = watched(path)
    path.unlink()
    result = pf.reload("watch")
    assert not result.ok
    assert "cannot read file" in result.problems[0]
    path.write_bytes(b"#" * (5 * 1024 * 1024))
    assert "a policy is at most" in pf.reload("watch").problems[0]
    path.write_bytes(b"\xff\xfe lanes")
    assert "not UTF-8" in pf.reload("watch").problems[0]
    assert applied == []


def _configmap(directory: Path, version: str, text: str) -> None:
    """What the kubelet does on a ConfigMap update: a new timestamped dir, then swap ``..data``."""
    stamped = directory / f"..{version}"
    stamped.mkdir()
    (stamped / "policy.yaml").write_text(text)
    link = directory / "..data_tmp"
    link.symlink_to(stamped.name)
    os.replace(link, directory / "..data")


def test_a_configmap_symlink_swap_is_noticed(tmp_path: Path) -> None:
    mount = tmp_path / "policy"
    mount.mkdir()
    _configmap(mount, "2026_12_02_10_00_00.1", GOOD)
    (mount / "policy.yaml").symlink_to("..data/policy.yaml")
    pf, applied, _ = watched(mount / "policy.yaml")
    _configmap(mount, "2026_12_02_10_05_00.2", BIGGER)
    assert pf.reload("watch").changed
    assert applied[0].lanes[0].max_inflight == 8


async def test_the_watch_loop_applies_changes_and_survives_errors(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    applied: list[Policy] = []

    first, second = asyncio.Event(), asyncio.Event()

    def apply(policy: Policy) -> None:
        applied.append(policy)
        if len(applied) == 1:
            first.set()
            raise RuntimeError("applying failed")
        second.set()

    pf = PolicyFile(str(path), load_policy(path), apply)
    task = asyncio.create_task(pf.watch(0.01))
    try:
        path.write_text(BIGGER)
        async with asyncio.timeout(5):
            await first.wait()
        # The failed apply did not kill the loop: it tries again and the next apply succeeds.
        async with asyncio.timeout(5):
            await second.wait()
        assert pf.policy.lanes[0].max_inflight == 8
        assert not task.done()
    finally:
        task.cancel()

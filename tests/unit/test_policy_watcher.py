"""Hot reload of the policy file: swaps, rejections, ConfigMap symlink swaps, the watch loop."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from extproc.policy import Policy, load_policy
from extproc.policy.loader import PolicyError, decode_policy
from extproc.policy.sandbox import decode_isolated
from extproc.policy.watcher import PolicyFile, ReloadResult

GOOD = """\
lanes:
  - {name: a, max_inflight: 4, max_queued: 10, deadline: 5s}
classification: {default_lane: a}
"""
BIGGER = GOOD.replace("max_inflight: 4", "max_inflight: 8")
BAD = GOOD.replace("max_inflight: 4", "max_inflight: -1")


class Inline:
    """Decodes in this process (the sandbox's child is tested on its own below) and counts calls."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, raw: bytes, source: str) -> Policy:
        self.calls += 1
        return decode_policy(raw, source)


def watched(path: Path, decoder: Inline | None = None) -> tuple[PolicyFile, list[Policy], list[ReloadResult]]:
    applied: list[Policy] = []
    results: list[ReloadResult] = []
    pf = PolicyFile(str(path), load_policy(path), applied.append, on_result=results.append,
                    decoder=decoder or Inline())
    return pf, applied, results


async def test_a_changed_file_is_swapped_in(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    pf, applied, results = watched(path)
    assert await pf.reload("watch") == ReloadResult(ok=True, changed=False, sha256=pf.sha256)
    assert applied == []
    assert results == []
    path.write_text(BIGGER)
    result = await pf.reload("watch")
    assert result.ok
    assert result.changed
    assert [p.lanes[0].max_inflight for p in applied] == [8]
    assert pf.policy is applied[0]
    assert pf.reloads_ok == 1
    assert results == [result]


async def test_a_bad_file_keeps_the_old_policy_and_says_where_it_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    pf, applied, results = watched(path)
    old = pf.policy
    path.write_text(BAD)
    result = await pf.reload("sighup")
    assert not result.ok
    assert applied == []
    assert pf.policy is old
    assert pf.reloads_failed == 1
    (problem,) = result.problems
    assert problem.startswith(f"{path}:2: lanes[0].max_inflight: ")
    assert pf.last_error == result.problems
    # A bad file is reported once, not on every poll; an explicit reload reports it again.
    assert not (await pf.reload("watch")).ok
    assert pf.reloads_failed == 1
    assert not (await pf.reload("watch")).ok
    assert pf.reloads_failed == 1
    assert not (await pf.reload("admin")).ok
    assert pf.reloads_failed == 2
    # Reverted to the policy in force: nothing to swap, but the file is good again.
    path.write_text(GOOD)
    reverted = await pf.reload("watch")
    assert (reverted.ok, reverted.changed, pf.last_error) == (True, False, None)
    # Fixed: swapped in, and the error is cleared.
    path.write_text(BAD)
    await pf.reload("watch")
    path.write_text(BIGGER)
    assert (await pf.reload("watch")).changed
    assert pf.last_error is None
    assert applied[0].lanes[0].max_inflight == 8
    assert [r.ok for r in results] == [False, False, True, False, True]


async def test_a_missing_or_oversized_file_is_an_error_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    pf, applied, _ = watched(path)
    path.unlink()
    result = await pf.reload("watch")
    assert not result.ok
    assert "cannot read file" in result.problems[0]
    path.write_bytes(b"#" * (2 * 1024 * 1024))
    assert "a policy is at most" in (await pf.reload("watch")).problems[0]
    path.write_bytes(b"\xff\xfe lanes")
    assert "not UTF-8" in (await pf.reload("watch")).problems[0]
    assert applied == []


def _configmap(directory: Path, version: str, text: str) -> None:
    """What the kubelet does on a ConfigMap update: a new timestamped dir, then swap ``..data``."""
    stamped = directory / f"..{version}"
    stamped.mkdir()
    (stamped / "policy.yaml").write_text(text)
    link = directory / "..data_tmp"
    link.symlink_to(stamped.name)
    os.replace(link, directory / "..data")


async def test_a_configmap_symlink_swap_is_noticed(tmp_path: Path) -> None:
    mount = tmp_path / "policy"
    mount.mkdir()
    _configmap(mount, "2026_12_02_10_00_00.1", GOOD)
    (mount / "policy.yaml").symlink_to("..data/policy.yaml")
    pf, applied, _ = watched(mount / "policy.yaml")
    _configmap(mount, "2026_12_02_10_05_00.2", BIGGER)
    assert (await pf.reload("watch")).changed
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

    pf = PolicyFile(str(path), load_policy(path), apply, decoder=Inline())
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


async def test_a_known_bad_content_is_never_decoded_again(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    decoder = Inline()
    pf, _, _ = watched(path, decoder)
    path.write_text(BAD)
    first = await pf.reload("watch")
    assert (first.ok, decoder.calls) == (False, 1)
    # Saved again (new mtime, same bytes), asked by SIGHUP and the admin port: same problems, no decode.
    path.write_text(BAD)
    for trigger in ("watch", "sighup", "admin"):
        again = await pf.reload(trigger)
        assert again.problems == first.problems
    assert decoder.calls == 1
    # Another bad content is decoded once too; going back to the first is still known.
    path.write_text(BAD + "\n# edited\n")
    await pf.reload("watch")
    path.write_text(BAD)
    await pf.reload("watch")
    assert decoder.calls == 2


async def test_stale_since_marks_how_long_the_file_has_been_bad(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    clock = [1000.0]
    pf = PolicyFile(str(path), load_policy(path), lambda _: None, clock=lambda: clock[0], decoder=Inline())
    assert pf.stale_since is None
    path.write_text(BAD)
    await pf.reload("watch")
    assert pf.stale_since == 1000.0
    clock[0] = 1010.0
    path.write_text(BAD + "\n# still bad\n")
    await pf.reload("watch")
    assert pf.stale_since == 1000.0  # since the first failure, not the latest
    path.write_text(BIGGER)
    assert (await pf.reload("watch")).changed
    assert pf.stale_since is None


async def test_the_watch_loop_reads_only_files_that_changed_and_refuses_big_ones_unread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    decoder = Inline()
    pf, applied, results = watched(path, decoder)
    reads: list[str] = []
    import extproc.policy.watcher as watcher

    real = watcher.read_policy

    def counting(p: str) -> bytes:
        reads.append(p)
        return real(p)

    monkeypatch.setattr(watcher, "read_policy", counting)
    assert not pf.changed_on_disk()
    # A 3 MB file saved over the live one: refused from its size, never read nor decoded.
    path.write_bytes(b"lanes: [" + b"x" * (3 * 1024 * 1024) + b"]")
    assert not pf.changed_on_disk()
    assert not pf.changed_on_disk()
    assert reads == []
    assert decoder.calls == 0
    assert len(results) == 1
    assert not results[0].ok
    assert "a policy is at most 1048576 bytes" in results[0].problems[0]
    assert pf.stale_since is not None
    path.write_text(BIGGER)
    assert pf.changed_on_disk()
    assert (await pf.reload("watch")).changed
    assert applied[-1].lanes[0].max_inflight == 8
    assert not pf.changed_on_disk()


# --- the sandbox: a child process with a time cap ------------------------------------------------

BOMB = "\n".join([
    'a: &a ["x","x","x","x","x","x","x","x","x"]',
    *(f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},"
      f"*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)}]" for i in range(8)),
    "lanes: [{name: a, max_inflight: 1, deadline: 1s}]",
    "classification: {default_lane: a}",
    # Each item is wrong, and each error shows (a summary of) its input: 9^9 strings deep.
    "trusted_headers: *i",
])


async def test_the_sandbox_returns_the_same_policy_and_the_same_problems(tmp_path: Path) -> None:
    policy = await decode_isolated(BIGGER.encode(), "p.yaml")
    assert policy == decode_policy(BIGGER.encode(), "p.yaml")
    with pytest.raises(PolicyError) as caught:
        await decode_isolated(BAD.encode(), "p.yaml")
    with pytest.raises(PolicyError) as inline:
        decode_policy(BAD.encode(), "p.yaml")
    assert [str(p) for p in caught.value.problems] == [str(p) for p in inline.value.problems]


async def test_the_sandbox_keeps_the_column_of_a_yaml_error() -> None:
    text = b"lanes: [1, 2\nclassification: {}\n"
    with pytest.raises(PolicyError) as caught:
        await decode_isolated(text, "p.yaml")
    with pytest.raises(PolicyError) as inline:
        decode_policy(text, "p.yaml")
    assert caught.value.problems == inline.value.problems
    (problem,) = caught.value.problems
    assert str(problem).startswith("p.yaml:2:15: not valid YAML: expected ',' or ']', but got ':'")


async def test_a_reload_of_invalid_yaml_reports_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    pf = PolicyFile(str(path), load_policy(path), lambda _: None)  # the sandbox decodes, as when serving
    path.write_text("lanes:\n  - name: a\n\tmax_inflight: 1\n")
    result = await pf.reload("watch")
    assert not result.ok
    assert result.problems == (
        f"{path}:3:1: not valid YAML: found character '\\t' that cannot start any token",)
    assert pf.last_error == result.problems


async def test_a_yaml_alias_bomb_is_stopped_by_the_time_cap() -> None:
    loop = asyncio.get_running_loop()
    cap = 1.5
    started = loop.time()
    with pytest.raises(PolicyError) as caught:
        await decode_isolated(BOMB.encode(), "bomb.yaml", time_cap=cap)
    assert "took longer than 1.5 s" in str(caught.value)
    # Stopped at the cap, not when the decoding ends (half a minute on a test machine): a margin
    # of twice the cap for starting and killing the child.
    assert loop.time() - started < 3 * cap


async def test_the_event_loop_keeps_turning_while_the_sandbox_works() -> None:
    loop = asyncio.get_running_loop()
    ticks = 0
    gaps: list[float] = []

    async def ticker() -> None:
        nonlocal ticks
        last = loop.time()
        while True:
            await asyncio.sleep(0.01)
            now = loop.time()
            gaps.append(now - last)
            last = now
            ticks += 1

    cap = 1.0
    task = asyncio.create_task(ticker())
    try:
        with pytest.raises(PolicyError):
            await decode_isolated(BOMB.encode(), "bomb.yaml", time_cap=cap)
    finally:
        task.cancel()
    # The child does the work: the loop keeps turning all along. Decoding in this process (in a
    # thread, say) would stop it for the whole decode, far past the cap: validating the bomb holds
    # the GIL in one call. A busy shared machine delays some ticks, never by the whole cap.
    assert ticks > 20
    assert max(gaps) < cap

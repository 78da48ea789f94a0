"""Hot reload: notice a changed policy file, validate it, swap it in, or keep the old one.

How this works: every ``interval`` seconds the file is ``stat``-ed (following symlinks);
only when its identity, size or times changed is it read and hashed. That catches every
way a file can change — an editor's rename-over, an in-place write, and a Kubernetes
ConfigMap update, which swaps the ``..data`` symlink of the mounted directory so that the
path suddenly resolves to a new file (inotify watches on the old file never fire for that).

Nothing about a bad file may cost the data path: a file over the size cap is refused from
its size alone; a content hash already known bad is refused without decoding it again; a
new content is decoded and validated in a child process (``sandbox``) that is killed when
its time cap passes, so the event loop only ever waits on a pipe. A good policy is applied
(an atomic swap in the scheduler); a bad one is logged once with file, line, key path and
reason, counted, and the old policy stays — ``stale_since`` says since when.
SIGHUP and the admin endpoint call :meth:`PolicyFile.reload` directly.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from extproc.policy.loader import MAX_POLICY_BYTES, PolicyError, Problem, read_policy, too_large
from extproc.policy.sandbox import decode_isolated
from extproc.policy.schema import Policy

log = structlog.get_logger("extproc.policy")

#: How many bad contents are remembered (each by hash, with its problems).
_KNOWN_BAD = 16

Decoder = Callable[[bytes, str], Awaitable[Policy]]
_StatKey = tuple[int, int, int, int, int]


@dataclass(frozen=True)
class ReloadResult:
    ok: bool
    changed: bool
    sha256: str
    problems: tuple[str, ...] = ()
    previous: str = ""
    """With ``changed``: the sha256 of the policy it replaced."""
    trigger: str = ""
    """What asked for the reload: ``watch``, ``sighup``, ``admin``."""


def _stat_key(path: str) -> _StatKey | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class PolicyFile:
    """The policy file a running extproc serves from, and how its reloads went."""

    def __init__(self, path: str, policy: Policy, apply: Callable[[Policy], None], *,
                 on_result: Callable[[ReloadResult], None] | None = None,
                 clock: Callable[[], float] = time.time, decoder: Decoder = decode_isolated) -> None:
        self.path = path
        self.policy = policy
        self._apply = apply
        self._on_result = on_result
        self._clock = clock
        self._decode = decoder
        self._seen = _stat_key(path)
        try:
            self.sha256 = hashlib.sha256(read_policy(path)).hexdigest()
        except PolicyError:
            # Started from a policy that was read some other way (tests); the first poll decides.
            self.sha256 = ""
            self._seen = None
        self.loaded_at = clock()
        self.reloads_ok = 0
        self.reloads_failed = 0
        #: The problems of the last failed attempt, until a good file replaces it.
        self.last_error: tuple[str, ...] | None = None
        #: When the file on disk stopped being the policy in force (epoch seconds; None: it is).
        self.stale_since: float | None = None
        self._failed_sha = ""
        self._bad: OrderedDict[str, tuple[Problem, ...]] = OrderedDict()
        self._lock = asyncio.Lock()

    async def reload(self, trigger: str = "request") -> ReloadResult:
        """Read the file again and swap it in if it changed and is valid."""
        async with self._lock:
            return await self._reload(trigger)

    async def _reload(self, trigger: str) -> ReloadResult:
        self._seen = _stat_key(self.path)
        try:
            raw = read_policy(self.path)
        except PolicyError as exc:
            problem = exc.problems[0] if exc.problems else Problem(self.path, None, "", "unreadable")
            # Keyed by what was wrong, so the watcher reports an unchanged problem once.
            return self._failed(tuple(exc.problems), f"unreadable: {problem.message}", trigger)
        sha = hashlib.sha256(raw).hexdigest()
        if sha == self.sha256:
            result = ReloadResult(ok=True, changed=False, sha256=sha)
            if self.last_error is None:
                return result
            # A bad edit was reverted: the file on disk is the policy in force again.
            self.last_error = None
            self.stale_since = None
            self._failed_sha = ""
            log.info("policy file matches the policy in force again", file=self.path, trigger=trigger)
            return self._report(result)
        known = self._bad.get(sha)
        if known is not None:
            self._bad.move_to_end(sha)
            return self._failed(known, sha, trigger)
        try:
            policy = await self._decode(raw, self.path)
        except PolicyError as exc:
            problems = tuple(exc.problems)
            self._bad[sha] = problems
            while len(self._bad) > _KNOWN_BAD:
                self._bad.popitem(last=False)
            return self._failed(problems, sha, trigger)
        self._apply(policy)
        previous = self.sha256
        self.policy, self.sha256, self.loaded_at = policy, sha, self._clock()
        self.reloads_ok += 1
        self.last_error = None
        self.stale_since = None
        self._failed_sha = ""
        log.info("policy reloaded", file=self.path, trigger=trigger, sha256=sha[:12], previous=previous[:12],
                 lanes=[lane.name for lane in policy.lanes])
        return self._report(ReloadResult(ok=True, changed=True, sha256=sha, previous=previous,
                                         trigger=trigger))

    def _failed(self, found: tuple[Problem, ...], sha: str, trigger: str) -> ReloadResult:
        problems = tuple(str(p) for p in found)
        if trigger == "watch" and sha == self._failed_sha:
            # Known bad and already reported: the watcher stays quiet until the file changes again.
            return ReloadResult(ok=False, changed=False, sha256=sha, problems=problems)
        self.reloads_failed += 1
        self.last_error = problems
        if self.stale_since is None:
            self.stale_since = self._clock()
        self._failed_sha = sha
        log.error("policy reload rejected; the previous policy stays in force", file=self.path,
                  trigger=trigger, problems=list(problems))
        return self._report(ReloadResult(ok=False, changed=False, sha256=sha, problems=problems))

    def _report(self, result: ReloadResult) -> ReloadResult:
        if self._on_result is not None:
            self._on_result(result)
        return result

    def changed_on_disk(self) -> bool:
        """Whether the file's identity, size or times differ from when it was last read."""
        key = _stat_key(self.path)
        if key is None:
            return self._seen is not None or self.last_error is None
        if key != self._seen and key[2] > MAX_POLICY_BYTES:
            # Refused from its size alone: never read, and reported once per new file.
            self._seen = key
            self._failed((too_large(self.path, key[2]),), f"size:{key[2]}:{key[3]}", "watch")
            return False
        return key != self._seen

    async def watch(self, interval: float) -> None:
        """Poll the file until cancelled."""
        while True:
            await asyncio.sleep(interval)
            try:
                if self.changed_on_disk():
                    await self.reload("watch")
            except Exception:
                # Applying a valid policy must never take the watcher down with it; the next
                # poll tries again.
                self._seen = None
                log.exception("policy reload failed unexpectedly", file=self.path)

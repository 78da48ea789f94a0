"""Hot reload: notice a changed policy file, validate it, swap it in, or keep the old one.

How this works: the file is read and hashed every ``interval`` seconds. Reading is
cheaper than it sounds (a policy is a few KiB) and catches every way a file can
change — an editor's rename-over, an in-place write, and a Kubernetes ConfigMap
update, which swaps the ``..data`` symlink of the mounted directory so that the
path suddenly resolves to a new file (inotify watches on the old file never fire
for that). When the hash differs from the policy in force, the new text is
validated; a good policy is applied (an atomic swap in the scheduler), a bad one
is logged with file, line, key path and reason, counted, and the old policy stays.
SIGHUP and the admin endpoint call :meth:`PolicyFile.reload` directly.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from extproc.policy.loader import PolicyError, decode_policy, read_policy
from extproc.policy.schema import Policy

log = structlog.get_logger("extproc.policy")


@dataclass(frozen=True)
class ReloadResult:
    ok: bool
    changed: bool
    sha256: str
    problems: tuple[str, ...] = ()


class PolicyFile:
    """The policy file a running extproc serves from, and how its reloads went."""

    def __init__(self, path: str, policy: Policy, apply: Callable[[Policy], None], *,
                 on_result: Callable[[ReloadResult], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.policy = policy
        self._apply = apply
        self._on_result = on_result
        self._clock = clock
        try:
            self.sha256 = hashlib.sha256(read_policy(path)).hexdigest()
        except PolicyError:
            # Started from a policy that was read some other way (tests); the first poll decides.
            self.sha256 = ""
        self.loaded_at = clock()
        self.reloads_ok = 0
        self.reloads_failed = 0
        #: The problems of the last failed attempt, until a good file replaces it.
        self.last_error: tuple[str, ...] | None = None
        self._failed_sha = ""

    def reload(self, trigger: str = "request") -> ReloadResult:
        """Read the file again and swap it in if it changed and is valid."""
        try:
            raw = read_policy(self.path)
        except PolicyError as exc:
            return self._failed(exc, f"unreadable: {exc}", trigger)
        sha = hashlib.sha256(raw).hexdigest()
        if sha == self.sha256:
            result = ReloadResult(ok=True, changed=False, sha256=sha)
            if self.last_error is None:
                return result
            # A bad edit was reverted: the file on disk is the policy in force again.
            self.last_error = None
            self._failed_sha = ""
            log.info("policy file matches the policy in force again", file=self.path, trigger=trigger)
            return self._report(result)
        try:
            policy = decode_policy(raw, self.path)
        except PolicyError as exc:
            return self._failed(exc, sha, trigger)
        self._apply(policy)
        previous = self.sha256
        self.policy, self.sha256, self.loaded_at = policy, sha, self._clock()
        self.reloads_ok += 1
        self.last_error = None
        self._failed_sha = ""
        log.info("policy reloaded", file=self.path, trigger=trigger, sha256=sha[:12], previous=previous[:12],
                 lanes=[lane.name for lane in policy.lanes])
        return self._report(ReloadResult(ok=True, changed=True, sha256=sha))

    def _failed(self, error: PolicyError, sha: str, trigger: str) -> ReloadResult:
        problems = tuple(str(p) for p in error.problems)
        if trigger == "watch" and sha == self._failed_sha:
            # Known bad and already reported: the watcher stays quiet until the file changes again.
            return ReloadResult(ok=False, changed=False, sha256=sha, problems=problems)
        self.reloads_failed += 1
        self.last_error = problems
        self._failed_sha = sha
        log.error("policy reload rejected; the previous policy stays in force", file=self.path,
                  trigger=trigger, problems=list(problems))
        return self._report(ReloadResult(ok=False, changed=False, sha256=sha, problems=problems))

    def _report(self, result: ReloadResult) -> ReloadResult:
        if self._on_result is not None:
            self._on_result(result)
        return result

    async def watch(self, interval: float) -> None:
        """Poll the file until cancelled."""
        while True:
            await asyncio.sleep(interval)
            try:
                self.reload("watch")
            except Exception:
                # Applying a valid policy must never take the watcher down with it.
                log.exception("policy reload failed unexpectedly", file=self.path)

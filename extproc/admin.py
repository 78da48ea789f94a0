"""What an operator can see and do on a running extproc: the state document and the operations.

The HTTP adapter (servers/admin.py) only maps routes onto these methods; ``extproc top``
and dashboards read :meth:`Admin.state`. The document's shape is versioned: add keys,
never rename them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from extproc.controller import Controller
from extproc.core.saturation import RuleState
from extproc.policy.watcher import PolicyFile, ReloadResult
from extproc.signals.hub import SignalHub

STATE_VERSION = 1


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


class Admin:
    def __init__(self, controller: Controller, policy_file: PolicyFile, *,
                 signals: SignalHub | None = None, clock: Callable[[], float] = time.time) -> None:
        self.controller = controller
        self.policy_file = policy_file
        self.signals = signals
        self._clock = clock
        self._started = clock()

    # -- operations ------------------------------------------------------------------

    async def reload(self) -> ReloadResult:
        return await self.policy_file.reload("admin")

    def drain(self) -> None:
        self.controller.drain()

    def undrain(self) -> None:
        self.controller.undrain()

    def pause(self, lane: str) -> None:
        self.controller.pause(lane)

    def resume(self, lane: str) -> None:
        self.controller.resume(lane)

    # -- the state document -----------------------------------------------------------

    def state(self) -> dict[str, Any]:
        controller = self.controller
        scheduler = controller.scheduler
        now = controller.now()
        views = scheduler.snapshot(now)
        recent = controller.recent.summary(now)
        counts = controller.metrics.rejection_counts()
        policy_file = self.policy_file
        lanes = []
        for name, view in sorted(views.items(), key=lambda item: (-item[1].priority, item[0])):
            r = recent.get(name)
            lanes.append({
                "name": name,
                "priority": view.priority,
                "inflight": view.inflight,
                "limit": view.limit,
                "effective_limit": view.effective_limit,
                "borrowed": view.borrowed,
                "queued": view.queued,
                "max_queued": view.max_queued,
                "paused": view.paused,
                "closed": view.closed,
                "shadow": view.shadow,
                "retired": view.retired,
                "shed": view.shed_by,
                "wait_p50_s": _round(r.wait_p50) if r else None,
                "wait_p95_s": _round(r.wait_p95) if r else None,
                "admit_per_s": round(r.admit_per_s, 3) if r else 0.0,
                "reject_per_s": round(r.reject_per_s, 3) if r else 0.0,
                "shadow_reject_per_s": round(r.shadow_reject_per_s, 3) if r else 0.0,
                "rejections": counts.get(name, {}),
            })
        wall = self._clock()
        doc: dict[str, Any] = {
            "version": STATE_VERSION,
            "time": round(wall, 3),
            "uptime_s": round(wall - self._started, 1),
            "draining": scheduler.draining,
            "shadow": scheduler.policy.shadow,
            "policy": {
                "file": policy_file.path,
                "sha256": policy_file.sha256,
                "loaded_at": round(policy_file.loaded_at, 3),
                "reloads_ok": policy_file.reloads_ok,
                "reloads_failed": policy_file.reloads_failed,
                "last_error": list(policy_file.last_error) if policy_file.last_error else None,
                # Since when the file on disk has been invalid while the previous policy serves.
                "stale_since": round(policy_file.stale_since, 3) if policy_file.stale_since else None,
            },
            "capacity": {
                "limit": scheduler.policy.total_capacity,
                "inflight": scheduler.total_inflight,
                "queued": scheduler.total_queued,
            },
            "window_s": controller.recent.window_s,
            "lanes": lanes,
            "signals": self._signals(now),
            "saturation": [self._rule(rule, now, wall) for rule in controller.saturation.rules(now)],
        }
        return doc

    def _signals(self, now: float) -> list[dict[str, Any]]:
        if self.signals is None:
            return []
        return [{
            "name": s.name,
            "source": s.source,
            "kind": s.kind,
            "value": s.value,
            "age_s": _round(s.age, 2),
            "stale": s.stale,
            "error": s.error,
        } for s in self.signals.status(now)]

    @staticmethod
    def _rule(rule: RuleState, now: float, wall: float) -> dict[str, Any]:
        return {
            "rule": rule.name,
            "signal": rule.signal,
            "active": rule.active,
            # The scheduler's clock is monotonic: shown as wall-clock time for humans.
            "since": round(wall - (now - rule.since), 3) if rule.since is not None else None,
            "value": rule.value,
            "stale": rule.stale,
            "error": rule.error,
            "shed": list(rule.shed),
            "shrink": dict(rule.shrink),
        }

"""What an operator can see and do on a running extproc: the state document and the operations.

The snapshot is the admin API's ``State`` message (``protos/extproc/api/admin/v1/admin.proto``).
The adapters only map requests onto these methods: the HTTP admin port (servers/admin.py)
serves it as the JSON document ``/admin/state``, the gRPC admin port (servers/admin_grpc.py)
as itself; ``extproc top`` and dashboards read it. Add fields, never rename them.

Every action that changes what is decided is written to the decision log as an ``operator``
record beside the requests' records: ``drain``, ``undrain``, ``pause``, ``resume`` (with its
``lane``), and ``reload`` (a changed policy in force, whatever asked for it: with ``previous``),
each with ``at`` (epoch seconds, as a request's ``arrival``), ``policy`` (the sha256 of the policy
file in force after it) and ``trigger`` (``admin``, ``shutdown``, ``watch``, ``sighup``). A replay
(``simulate --verify``) applies them where they happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import structlog

from extproc.api.admin.v1 import admin_pb2 as pb
from extproc.controller import Controller
from extproc.core.decision import ANY_LANE
from extproc.core.machine import LaneView
from extproc.core.saturation import RuleState
from extproc.policy.watcher import PolicyFile, ReloadResult
from extproc.signals.hub import SignalHub

#: The decision log's logger: operator records go where the requests' records go.
log = structlog.get_logger("extproc.decision")
#: The version of the state snapshot's meaning (``State.version``).
STATE_VERSION = 1
_UINT32_MAX = 2**32 - 1


def _count(value: float) -> int:
    """A count as the API's 32-bit unsigned integer (saturating, never wrapping)."""
    return min(max(int(value), 0), _UINT32_MAX)


class Operations:
    def __init__(self, controller: Controller, policy_file: PolicyFile, *,
                 signals: SignalHub | None = None, clock: Callable[[], float] = time.time) -> None:
        self.controller = controller
        self.policy_file = policy_file
        self.signals = signals
        self._clock = clock
        self._started = clock()

    # -- operations ------------------------------------------------------------------

    async def reload(self) -> ReloadResult:
        # (Its record is written by ``reloaded``, as every reload's is.)
        return await self.policy_file.reload("admin")

    def drain(self, trigger: str = "admin") -> None:
        self.controller.drain()
        self.record("drain", trigger)

    def undrain(self, trigger: str = "admin") -> None:
        self.controller.undrain()
        self.record("undrain", trigger)

    def pause(self, lane: str, trigger: str = "admin") -> None:
        self.controller.pause(lane)
        self.record("pause", trigger, lane=lane)

    def resume(self, lane: str, trigger: str = "admin") -> None:
        self.controller.resume(lane)
        self.record("resume", trigger, lane=lane)

    def reloaded(self, result: ReloadResult) -> None:
        """A reload's result, whatever asked for it: a changed policy in force is recorded."""
        if result.ok and result.changed:
            self.record("reload", result.trigger or "admin", previous=result.previous)

    def record(self, action: str, trigger: str, **fields: str) -> None:
        """Write one operator record (see the module docstring)."""
        log.info("operator", action=action, at=round(self._clock(), 3), policy=self.policy_file.sha256,
                 trigger=trigger, **fields)

    def lanes(self) -> list[str]:
        """The lanes an operator may name (for the error that answers an unknown one)."""
        return sorted(self.controller.machine.snapshot(self.controller.now()))

    # -- the state snapshot ------------------------------------------------------------

    def state(self) -> pb.State:
        controller = self.controller
        machine = controller.machine
        now = controller.now()
        views = machine.snapshot(now)
        recent = controller.recent.summary(now)
        counts = controller.metrics.rejection_counts()
        policy_file = self.policy_file
        lanes = []
        for name, view in sorted(views.items(), key=lambda item: (-item[1].priority, item[0])):
            r = recent.get(name)
            lane = pb.Lane(
                name=name, priority=view.priority, inflight=view.inflight, limit=view.limit,
                effective_limit=view.effective_limit, borrowed=view.borrowed, queued=view.queued,
                max_queued=view.max_queued, paused=view.paused, closed=view.closed, shadow=view.shadow,
                retired=view.retired, shed=view.shed_by,
                admit_per_s=round(r.admit_per_s, 3) if r else 0.0,
                reject_per_s=round(r.reject_per_s, 3) if r else 0.0,
                shadow_reject_per_s=round(r.shadow_reject_per_s, 3) if r else 0.0,
                rejections={reason: _count(n) for reason, n in counts.get(name, {}).items()},
            )
            if r is not None and r.wait_p50 is not None:
                lane.wait_p50_s = round(r.wait_p50, 4)
            if r is not None and r.wait_p95 is not None:
                lane.wait_p95_s = round(r.wait_p95, 4)
            lanes.append(lane)
        wall = self._clock()
        policy = pb.Policy(
            file=policy_file.path, sha256=policy_file.sha256, loaded_at=round(policy_file.loaded_at, 3),
            reloads_ok=_count(policy_file.reloads_ok), reloads_failed=_count(policy_file.reloads_failed),
            last_error=list(policy_file.last_error or ()))
        if policy_file.stale_since:
            policy.stale_since = round(policy_file.stale_since, 3)
        return pb.State(
            version=STATE_VERSION,
            time=round(wall, 3),
            uptime_s=round(wall - self._started, 1),
            draining=machine.draining,
            shadow=machine.policy.shadow,
            policy=policy,
            capacity=pb.Capacity(limit=_count(machine.policy.total_capacity),
                                 inflight=_count(machine.total_inflight),
                                 queued=_count(machine.total_queued),
                                 auto=self._auto(now, wall)),
            window_s=controller.recent.window_s,
            lanes=lanes,
            signals=self._signals(now),
            saturation=[self._rule(rule, now, wall) for rule in controller.machine.saturation.rules(now)],
            tenants=self._tenants(views),
            any_lane_rejections={reason: _count(n) for reason, n in counts.get(ANY_LANE, {}).items()},
            any_lane_reject_per_s=round(recent[ANY_LANE].reject_per_s, 3) if ANY_LANE in recent else 0.0,
        )

    def _auto(self, now: float, wall: float) -> pb.AutoCapacity | None:
        controller = self.controller
        auto = controller.machine.auto
        if auto is None:
            return None
        state = auto.state()
        out = pb.AutoCapacity(
            limit=_count(state.limit), min=_count(state.min), max=_count(state.max),
            mode="shadow" if state.shadow else "enforce", reason=state.reason, why=state.why,
            since=round(wall - (now - state.since), 3), stale=state.stale,
            leader=controller.ledger is None or controller.fleet_leader,
            signals={role: value for role, value in state.signals.items() if value is not None})
        if state.unreachable is not None:
            out.unreachable = state.unreachable
        return out

    def _tenants(self, views: Mapping[str, LaneView]) -> list[pb.Tenant]:
        tenants = self.controller.machine.policy.tenants
        queued: dict[str, dict[str, int]] = {}
        for lane, view in views.items():
            for tenant, n in view.tenants.items():
                queued.setdefault(tenant, {})[lane] = n
        names = sorted(set(queued) | set(tenants.weights))
        return [pb.Tenant(name=name, weight=tenants.weights.get(name, tenants.default_weight),
                          queued=_count(sum(queued.get(name, {}).values())),
                          queued_by_lane={lane: _count(n) for lane, n in queued.get(name, {}).items()})
                for name in names]

    def _signals(self, now: float) -> list[pb.Signal]:
        if self.signals is None:
            return []
        out = []
        for s in self.signals.status(now):
            signal = pb.Signal(name=s.name, source=s.source, kind=s.kind, stale=s.stale)
            if s.value is not None:
                signal.value = s.value
            if s.age is not None:
                signal.age_s = round(s.age, 2)
            if s.error is not None:
                signal.error = s.error
            out.append(signal)
        return out

    @staticmethod
    def _rule(rule: RuleState, now: float, wall: float) -> pb.SaturationRule:
        out = pb.SaturationRule(rule=rule.name, signal=rule.signal, active=rule.active, stale=rule.stale,
                                shed=list(rule.shed), shrink=dict(rule.shrink))
        if rule.since is not None:
            # The controller's clock is monotonic: shown as wall-clock time for humans.
            out.since = round(wall - (now - rule.since), 3)
        if rule.value is not None:
            out.value = rule.value
        if rule.error is not None:
            out.error = rule.error
        return out


def reload_response(result: ReloadResult) -> pb.ReloadResponse:
    return pb.ReloadResponse(ok=result.ok, changed=result.changed, sha256=result.sha256,
                             problems=list(result.problems))

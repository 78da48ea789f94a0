from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadResponse(_message.Message):
    __slots__ = ("ok", "changed", "sha256", "problems")
    OK_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    changed: bool
    sha256: str
    problems: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ok: _Optional[bool] = ..., changed: _Optional[bool] = ..., sha256: _Optional[str] = ..., problems: _Optional[_Iterable[str]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UndrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("draining",)
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    def __init__(self, draining: _Optional[bool] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("lane",)
    LANE_FIELD_NUMBER: _ClassVar[int]
    lane: str
    def __init__(self, lane: _Optional[str] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("lane",)
    LANE_FIELD_NUMBER: _ClassVar[int]
    lane: str
    def __init__(self, lane: _Optional[str] = ...) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("lane", "paused")
    LANE_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    lane: str
    paused: bool
    def __init__(self, lane: _Optional[str] = ..., paused: _Optional[bool] = ...) -> None: ...

class State(_message.Message):
    __slots__ = ("version", "time", "uptime_s", "draining", "shadow", "policy", "capacity", "window_s", "lanes", "signals", "saturation", "tenants", "any_lane_rejections", "any_lane_reject_per_s")
    class AnyLaneRejectionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SHADOW_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    SIGNALS_FIELD_NUMBER: _ClassVar[int]
    SATURATION_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    ANY_LANE_REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    ANY_LANE_REJECT_PER_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    time: float
    uptime_s: float
    draining: bool
    shadow: bool
    policy: Policy
    capacity: Capacity
    window_s: float
    lanes: _containers.RepeatedCompositeFieldContainer[Lane]
    signals: _containers.RepeatedCompositeFieldContainer[Signal]
    saturation: _containers.RepeatedCompositeFieldContainer[SaturationRule]
    tenants: _containers.RepeatedCompositeFieldContainer[Tenant]
    any_lane_rejections: _containers.ScalarMap[str, int]
    any_lane_reject_per_s: float
    def __init__(self, version: _Optional[int] = ..., time: _Optional[float] = ..., uptime_s: _Optional[float] = ..., draining: _Optional[bool] = ..., shadow: _Optional[bool] = ..., policy: _Optional[_Union[Policy, _Mapping]] = ..., capacity: _Optional[_Union[Capacity, _Mapping]] = ..., window_s: _Optional[float] = ..., lanes: _Optional[_Iterable[_Union[Lane, _Mapping]]] = ..., signals: _Optional[_Iterable[_Union[Signal, _Mapping]]] = ..., saturation: _Optional[_Iterable[_Union[SaturationRule, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[Tenant, _Mapping]]] = ..., any_lane_rejections: _Optional[_Mapping[str, int]] = ..., any_lane_reject_per_s: _Optional[float] = ...) -> None: ...

class Policy(_message.Message):
    __slots__ = ("file", "sha256", "loaded_at", "reloads_ok", "reloads_failed", "last_error", "stale_since")
    FILE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    LOADED_AT_FIELD_NUMBER: _ClassVar[int]
    RELOADS_OK_FIELD_NUMBER: _ClassVar[int]
    RELOADS_FAILED_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    STALE_SINCE_FIELD_NUMBER: _ClassVar[int]
    file: str
    sha256: str
    loaded_at: float
    reloads_ok: int
    reloads_failed: int
    last_error: _containers.RepeatedScalarFieldContainer[str]
    stale_since: float
    def __init__(self, file: _Optional[str] = ..., sha256: _Optional[str] = ..., loaded_at: _Optional[float] = ..., reloads_ok: _Optional[int] = ..., reloads_failed: _Optional[int] = ..., last_error: _Optional[_Iterable[str]] = ..., stale_since: _Optional[float] = ...) -> None: ...

class Capacity(_message.Message):
    __slots__ = ("limit", "inflight", "queued", "auto")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    AUTO_FIELD_NUMBER: _ClassVar[int]
    limit: int
    inflight: int
    queued: int
    auto: AutoCapacity
    def __init__(self, limit: _Optional[int] = ..., inflight: _Optional[int] = ..., queued: _Optional[int] = ..., auto: _Optional[_Union[AutoCapacity, _Mapping]] = ...) -> None: ...

class AutoCapacity(_message.Message):
    __slots__ = ("limit", "min", "max", "mode", "reason", "why", "since", "stale", "unreachable", "leader", "signals")
    class SignalsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    SIGNALS_FIELD_NUMBER: _ClassVar[int]
    limit: int
    min: int
    max: int
    mode: str
    reason: str
    why: str
    since: float
    stale: bool
    unreachable: str
    leader: bool
    signals: _containers.ScalarMap[str, float]
    def __init__(self, limit: _Optional[int] = ..., min: _Optional[int] = ..., max: _Optional[int] = ..., mode: _Optional[str] = ..., reason: _Optional[str] = ..., why: _Optional[str] = ..., since: _Optional[float] = ..., stale: _Optional[bool] = ..., unreachable: _Optional[str] = ..., leader: _Optional[bool] = ..., signals: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Lane(_message.Message):
    __slots__ = ("name", "priority", "inflight", "limit", "effective_limit", "borrowed", "queued", "max_queued", "paused", "closed", "shadow", "retired", "shed", "wait_p50_s", "wait_p95_s", "admit_per_s", "reject_per_s", "shadow_reject_per_s", "rejections")
    class RejectionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    BORROWED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    SHADOW_FIELD_NUMBER: _ClassVar[int]
    RETIRED_FIELD_NUMBER: _ClassVar[int]
    SHED_FIELD_NUMBER: _ClassVar[int]
    WAIT_P50_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_P95_S_FIELD_NUMBER: _ClassVar[int]
    ADMIT_PER_S_FIELD_NUMBER: _ClassVar[int]
    REJECT_PER_S_FIELD_NUMBER: _ClassVar[int]
    SHADOW_REJECT_PER_S_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    priority: int
    inflight: int
    limit: int
    effective_limit: int
    borrowed: int
    queued: int
    max_queued: int
    paused: bool
    closed: bool
    shadow: bool
    retired: bool
    shed: str
    wait_p50_s: float
    wait_p95_s: float
    admit_per_s: float
    reject_per_s: float
    shadow_reject_per_s: float
    rejections: _containers.ScalarMap[str, int]
    def __init__(self, name: _Optional[str] = ..., priority: _Optional[int] = ..., inflight: _Optional[int] = ..., limit: _Optional[int] = ..., effective_limit: _Optional[int] = ..., borrowed: _Optional[int] = ..., queued: _Optional[int] = ..., max_queued: _Optional[int] = ..., paused: _Optional[bool] = ..., closed: _Optional[bool] = ..., shadow: _Optional[bool] = ..., retired: _Optional[bool] = ..., shed: _Optional[str] = ..., wait_p50_s: _Optional[float] = ..., wait_p95_s: _Optional[float] = ..., admit_per_s: _Optional[float] = ..., reject_per_s: _Optional[float] = ..., shadow_reject_per_s: _Optional[float] = ..., rejections: _Optional[_Mapping[str, int]] = ...) -> None: ...

class Signal(_message.Message):
    __slots__ = ("name", "source", "kind", "value", "age_s", "stale", "error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    kind: str
    value: float
    age_s: float
    stale: bool
    error: str
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ..., kind: _Optional[str] = ..., value: _Optional[float] = ..., age_s: _Optional[float] = ..., stale: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class SaturationRule(_message.Message):
    __slots__ = ("rule", "signal", "active", "since", "value", "stale", "error", "shed", "shrink")
    class ShrinkEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RULE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SHED_FIELD_NUMBER: _ClassVar[int]
    SHRINK_FIELD_NUMBER: _ClassVar[int]
    rule: str
    signal: str
    active: bool
    since: float
    value: float
    stale: bool
    error: str
    shed: _containers.RepeatedScalarFieldContainer[str]
    shrink: _containers.ScalarMap[str, float]
    def __init__(self, rule: _Optional[str] = ..., signal: _Optional[str] = ..., active: _Optional[bool] = ..., since: _Optional[float] = ..., value: _Optional[float] = ..., stale: _Optional[bool] = ..., error: _Optional[str] = ..., shed: _Optional[_Iterable[str]] = ..., shrink: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Tenant(_message.Message):
    __slots__ = ("name", "weight", "queued", "queued_by_lane")
    class QueuedByLaneEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BY_LANE_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    queued: int
    queued_by_lane: _containers.ScalarMap[str, int]
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ..., queued: _Optional[int] = ..., queued_by_lane: _Optional[_Mapping[str, int]] = ...) -> None: ...

"""What changed between two policies, in words: ``extproc policy diff``.

How this works: the two validated policies are walked side by side over the
pydantic models themselves, field by field, so a field added to the schema later
is reported without a change here. Values are compared by what they mean, not
where they sit: lanes by name (a removed and an added lane with nearly the same
settings read as a rename), rules by name (unnamed ones by what they match) with
their order compared separately because the first match wins, tuples of plain
values (trusted headers, methods) as sets, and mappings (tenant weights, model
costs) by key. A few derived facts are compared too (total slots, priority
order, whether bodies are read). A budget is said whole, with its period (``20 requests per
minute``): its numbers mean nothing without it. The changes that can refuse or reorder more
traffic than before are found by ``extproc.tools.risk`` and printed first, as risks.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from extproc.policy.fields import Duration
from extproc.policy.loader import PolicyError, load_policy
from extproc.policy.ratelimit import TenantLimit
from extproc.policy.schema import Lane, Policy
from extproc.tools.explain import describe_match, duration
from extproc.tools.risk import Risk, by_priority, keyed_rules, risks

#: The validator that reads ``250ms``: a field carrying it holds seconds, shown as a duration.
_DURATION_MARK = typing.get_args(Duration)[1]
#: A removed and an added lane that differ in at most this many other fields look renamed.
_RENAME_MAX_DIFFERENCES = 2
#: A rank, not a quantity: a percentage of it means nothing.
_PRIORITY = Lane.model_fields["priority"]
#: A limit cut to this share of its old value (or less) is flagged.
_DEEP_CUT = 0.5


@dataclass(frozen=True, slots=True)
class Difference:
    section: str
    """The top-level policy key it belongs to (``lanes``, ``capacity``, …)."""
    path: str
    """Where, by names rather than indices: ``lanes.interactive.max_inflight``."""
    text: str


@dataclass(frozen=True, slots=True)
class PolicyDiff:
    changes: tuple[Difference, ...]
    risks: tuple[Risk, ...]
    """The changes that can refuse or reorder more traffic than before, each with why."""

    @property
    def same(self) -> bool:
        return not self.changes


# -- values in words ----------------------------------------------------------------------------------


def _is_duration(info: FieldInfo | None) -> bool:
    return info is not None and _DURATION_MARK in info.metadata


def _fmt(value: object, info: FieldInfo | None = None) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if _is_duration(info) and isinstance(value, int | float):
        return duration(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, TenantLimit):
        return value.in_words
    if isinstance(value, BaseModel):
        return "{" + summary(value) + "}"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    return str(value)


def _pct(old: object, new: object, info: FieldInfo | None = None) -> str:
    if isinstance(old, bool) or isinstance(new, bool) or info is _PRIORITY:
        return ""
    if not isinstance(old, int | float) or not isinstance(new, int | float) or old == 0:
        return ""
    change = (new - old) / abs(old) * 100
    sign = "+" if change > 0 else "−"
    return f" ({sign}{abs(change):.0f}%)"


def summary(model: BaseModel) -> str:
    """The fields that say something: required ones and those not at their default (a name is said apart)."""
    parts = []
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if name == "name":
            continue
        if info.is_required() or value != info.get_default(call_default_factory=True):
            parts.append(f"{name} {_fmt(value, info)}")
    return ", ".join(parts)


# -- the generic walk -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Where:
    section: str
    path: str
    """Dotted key path by names (for --json)."""
    label: str
    """How a line names the place: ``interactive: max_inflight`` or ``capacity.max_inflight``."""

    def child(self, key: str) -> _Where:
        sep = "" if self.label.endswith(": ") else "."
        return _Where(self.section, f"{self.path}.{key}", f"{self.label}{sep}{key}")

    def change(self, text: str) -> Difference:
        return Difference(self.section, self.path, f"{self.label.removesuffix(': ')}{text}")


def _named(items: tuple[Any, ...]) -> bool:
    return bool(items) and all(isinstance(i, BaseModel) and isinstance(getattr(i, "name", None), str)
                               for i in items)


def _plain(items: tuple[Any, ...]) -> bool:
    return all(isinstance(i, str | int | float | bool) for i in items)


def _compare(old: object, new: object, where: _Where, info: FieldInfo | None = None) -> Iterator[Difference]:
    if old == new:
        return
    if isinstance(old, TenantLimit) and isinstance(new, TenantLimit):
        yield where.change(f" {old.in_words} → {new.in_words}")
    elif isinstance(old, BaseModel) and isinstance(new, BaseModel) and type(old) is type(new):
        for name, field in type(old).model_fields.items():
            yield from _compare(getattr(old, name), getattr(new, name), where.child(name), field)
    elif isinstance(old, dict) and isinstance(new, dict):
        for key in [*old, *(k for k in new if k not in old)]:
            sub = where.child(str(key))
            if key not in new:
                yield sub.change(f" removed (was {_fmt(old[key])})")
            elif key not in old:
                yield sub.change(f" added: {_fmt(new[key])}")
            else:
                yield from _compare(old[key], new[key], sub)
    elif isinstance(old, tuple) and isinstance(new, tuple) and (_named(old) or _named(new)):
        before = {i.name: i for i in old}
        after = {i.name: i for i in new}
        for key in [*before, *(k for k in after if k not in before)]:
            sub = where.child(key)
            if key not in after:
                yield sub.change(f" removed ({summary(before[key])})")
            elif key not in before:
                yield sub.change(f" added ({summary(after[key])})")
            else:
                yield from _compare(before[key], after[key], sub)
    elif isinstance(old, tuple) and isinstance(new, tuple) and _plain(old) and _plain(new):
        # Every list of plain values in a policy is a set: order carries no meaning.
        added = [v for v in new if v not in old]
        removed = [v for v in old if v not in new]
        if added:
            yield where.change(f": added {', '.join(_fmt(v) for v in added)}")
        if removed:
            yield where.change(f": removed {', '.join(_fmt(v) for v in removed)}")
    elif isinstance(old, tuple) and isinstance(new, tuple):
        for i in range(max(len(old), len(new))):
            sub = where.child(f"[{i}]")
            if i >= len(new):
                yield sub.change(f" removed ({_fmt(old[i])})")
            elif i >= len(old):
                yield sub.change(f" added ({_fmt(new[i])})")
            else:
                yield from _compare(old[i], new[i], sub)
    elif old is None and isinstance(new, BaseModel):
        yield where.change(f" added ({summary(new)})")
    elif new is None and isinstance(old, BaseModel):
        yield where.change(f" removed (was {summary(old)})")
    else:
        yield where.change(f" {_fmt(old, info)} → {_fmt(new, info)}{_pct(old, new, info)}")


def compare(old: BaseModel, new: BaseModel, section: str) -> list[Difference]:
    """Field-by-field differences of two values of one model type, as lines under ``section``."""
    return list(_compare(old, new, _Where(section, section, section)))


# -- lanes and rules ------------------------------------------------------------------------------------


def _differences(a: Lane, b: Lane) -> int:
    return sum(1 for name in type(a).model_fields if name != "name" and getattr(a, name) != getattr(b, name))


def _renames(a: Policy, b: Policy) -> dict[str, str]:
    """Old name → new name, for removed lanes that reappear under another name with much the same settings."""
    before = {lane.name: lane for lane in a.lanes}
    after = {lane.name: lane for lane in b.lanes}
    removed = [before[n] for n in before if n not in after]
    added = [after[n] for n in after if n not in before]
    out: dict[str, str] = {}
    for lane in removed:
        taken = set(out.values())
        candidates = [(_differences(lane, other), other.name) for other in added if other.name not in taken]
        if candidates:
            count, name = min(candidates)
            if count <= _RENAME_MAX_DIFFERENCES:
                out[lane.name] = name
    return out


def _lanes(a: Policy, b: Policy, renames: dict[str, str]) -> Iterator[Difference]:
    before = {lane.name: lane for lane in a.lanes}
    after = {lane.name: lane for lane in b.lanes}
    for name, lane in before.items():
        if name in renames:
            new = renames[name]
            same = _differences(lane, after[new]) == 0
            yield Difference("lanes", f"lanes.{new}", f"{name} → {new}: looks renamed"
                         + (" (same settings)" if same else " (other changes below)"))
            yield from _compare(lane.model_copy(update={"name": new}), after[new],
                                _Where("lanes", f"lanes.{new}", f"{new}: "))
        elif name not in after:
            yield Difference("lanes", f"lanes.{name}", f"{name} removed ({summary(lane)})")
        else:
            yield from _compare(lane, after[name], _Where("lanes", f"lanes.{name}", f"{name}: "))
    for name, lane in after.items():
        if name not in before and name not in renames.values():
            yield Difference("lanes", f"lanes.{name}", f"{name} added ({summary(lane)})")
    order_a = [renames.get(lane.name, lane.name) for lane in by_priority(a)]
    order_b = [lane.name for lane in by_priority(b)]
    common = set(order_a) & set(order_b)
    order_a = [n for n in order_a if n in common]
    order_b = [n for n in order_b if n in common]
    if order_a != order_b:
        yield Difference("lanes", "lanes.order",
                         f"priority order {' > '.join(order_a)} → {' > '.join(order_b)} "
                         "(queued work of higher lanes gets freed slots first)")


def _rules(a: Policy, b: Policy, renames: dict[str, str]) -> Iterator[Difference]:
    before = keyed_rules(a.classification.rules)
    after = keyed_rules(b.classification.rules)
    for key, (_, rule) in before.items():
        where = _Where("classification", f"classification.rules.{key}", f"rule {key}: ")
        if key not in after:
            sent = f" (it sent {describe_match(rule.match)} to {rule.lane})" if rule.name else ""
            yield where.change(f" removed{sent}")
            continue
        new = after[key][1]
        # Its lane is said in words below; every other field (the match, fields to come) generically.
        yield from _compare(rule.model_copy(update={"lane": new.lane}), new, where)
        # A rule that follows its lane's rename is not a change of its own (the rename is said under lanes).
        if renames.get(rule.lane, rule.lane) != new.lane:
            yield where.change(f" now sends to {new.lane} (was {rule.lane})")
    for key, (i, rule) in after.items():
        if key not in before:
            what = f" ({describe_match(rule.match)} → {rule.lane})" if rule.name else ""
            yield Difference("classification", f"classification.rules.{key}",
                         f"rule {key} added as rules[{i}]{what}")
    order_a = [k for k in before if k in after]
    order_b = [k for k in after if k in before]
    if order_a != order_b:
        yield Difference("classification", "classification.rules.order",
                     f"rules reordered (the first match wins): {', '.join(order_a)} → {', '.join(order_b)}")


# -- the whole diff -------------------------------------------------------------------------------------


def _derived(a: Policy, b: Policy) -> Iterator[Difference]:
    if a.total_capacity != b.total_capacity and None in (a.capacity.max_inflight, b.capacity.max_inflight):
        old, new = a.total_capacity, b.total_capacity
        yield Difference("capacity", "capacity.total", f"total slots {old} → {new}{_pct(old, new)}; where "
                     "capacity.max_inflight is unset, it is the lanes' max_inflight summed")
    if a.needs_body != b.needs_body:
        yield Difference("estimation", "estimation.reads_body",
                     "request bodies are now read (one buffered body round per request)" if b.needs_body
                     else "request bodies are no longer read (every request is sized as default_max_tokens)")


def diff(a: Policy, b: Policy) -> PolicyDiff:
    """Every difference from ``a`` to ``b`` in words, and the risks among them."""
    renames = _renames(a, b)
    changes: list[Difference] = []
    for name, field in type(a).model_fields.items():
        old, new = getattr(a, name), getattr(b, name)
        if name == "lanes":
            changes += _lanes(a, b, renames)
        elif name == "classification":
            top = _Where(name, name, name)
            for sub, sub_field in type(old).model_fields.items():
                if sub == "rules":
                    changes += _rules(a, b, renames)
                elif getattr(old, sub) != getattr(new, sub):
                    changes += _compare(getattr(old, sub), getattr(new, sub), top.child(sub), sub_field)
        else:
            changes += _compare(old, new, _Where(name, name, name), field)
    changes += _derived(a, b)
    order = list(type(a).model_fields)
    changes.sort(key=lambda c: order.index(c.section) if c.section in order else len(order))
    return PolicyDiff(tuple(changes), tuple(risks(a, b, renames)) if changes else ())


# -- output and the command ----------------------------------------------------------------------------


def render(result: PolicyDiff, a_name: str, b_name: str) -> str:
    """The risks first (what to read before applying), then every change by section."""
    if result.same:
        return f"{a_name} → {b_name}: no changes"
    count, risky = len(result.changes), len(result.risks)
    lines = [f"{a_name} → {b_name}: {count} change{'s' if count > 1 else ''}, "
             f"{risky or 'no'} risk{'' if risky == 1 else 's'}"]
    if result.risks:
        lines += ["", "risks: what can refuse or reorder more traffic than before"]
        lines += [f"  ! {risk.text}" for risk in result.risks]
    section = ""
    for change in result.changes:
        if change.section != section:
            section = change.section
            lines += ["", section]
        lines.append(f"  {change.text}")
    return "\n".join(lines)


def as_json(result: PolicyDiff, a_name: str, b_name: str) -> dict[str, Any]:
    return {
        "a": a_name, "b": b_name, "same": result.same,
        "risks": [{"path": r.path, "text": r.text} for r in result.risks],
        "changes": [{"section": c.section, "path": c.path, "text": c.text} for c in result.changes],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("old", metavar="A", help="the policy as it is")
    parser.add_argument("new", metavar="B", help="the policy as it would be")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def command(args: argparse.Namespace) -> int:
    """Exit 0 when the policies mean the same, 1 when they differ, 2 when one cannot be loaded."""
    policies: list[Policy] = []
    status = 0
    for path in (args.old, args.new):
        try:
            policies.append(load_policy(path))
        except PolicyError as exc:
            print(f"{path}: {len(exc.problems)} problem(s)", file=sys.stderr)
            for problem in exc.problems:
                print(f"  {problem}", file=sys.stderr)
            status = 2
    if status:
        return status
    result = diff(policies[0], policies[1])
    print(json.dumps(as_json(result, args.old, args.new), indent=2) if args.json
          else render(result, args.old, args.new))
    return 0 if result.same else 1

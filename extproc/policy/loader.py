"""Read a policy file strictly and explain every problem in it.

How this works: the YAML text is composed into a node tree first (which keeps
line numbers), converted to plain data with a loader that refuses duplicate
keys, then validated by the pydantic schema. Each validation error's location
is turned into a key path such as ``lanes[1].max_inflight`` and looked up in the
node tree to find its line, so an SRE sees ``policy.yaml:14: lanes[1].max_inflight:
…`` rather than a stack trace. Text that is not YAML has no key path: the parser's
mark gives line and column instead (``policy.yaml:3:1: not valid YAML: …``).
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from extproc.policy.schema import Policy

#: A policy file larger than this is surely not a policy file (the largest example is a few KiB).
#: A hot reload refuses a bigger file from its size alone, without reading it.
MAX_POLICY_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Problem:
    file: str
    line: int | None
    path: str
    message: str
    column: int | None = None
    """1-based, where the YAML parser stopped (text that is not YAML has a place, not a key path)."""

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        if self.line and self.column:
            return f"{where}:{self.column}: {self.path + ': ' if self.path else ''}{self.message}"
        return f"{where}: {self.path or '(top level)'}: {self.message}"


class PolicyError(Exception):
    """The policy file cannot be used; ``problems`` says why, each with file, line and key path."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, Hashable):
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark, "found unhashable key", key_node.start_mark
            )
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {seen[key]})", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)


def _format_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _parse_path(text: str) -> tuple[int | str, ...]:
    parts: list[int | str] = []
    for chunk in text.replace("[", ".[").split("."):
        if not chunk:
            continue
        if chunk.startswith("[") and chunk.endswith("]") and chunk[1:-1].isdigit():
            parts.append(int(chunk[1:-1]))
        else:
            parts.append(chunk)
    return tuple(parts)


def _line_of(root: yaml.Node | None, loc: tuple[int | str, ...]) -> int | None:
    """Line of the deepest node that exists along ``loc`` (1-based)."""
    node = root
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.value == str(part):
                    line = key_node.start_mark.line + 1
                    node = value_node
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                return line
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _describe(error: Any) -> str:
    msg = str(error["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    if error["type"] == "extra_forbidden":
        return "unknown key (check its spelling and indentation)"
    if error["type"] == "missing":
        return "required key is missing"
    if "input" in error and error["type"] not in ("value_error", "model_type", "dict_type"):
        shown = repr(error["input"])
        if len(shown) > 60:
            shown = shown[:57] + "..."
        msg = f"{msg} (got {shown})"
    return msg


def _yaml_problem(source: str, exc: yaml.MarkedYAMLError) -> Problem:
    """Where the parser stopped (line and column, 1-based) and, if it says, what it was inside."""
    mark = exc.problem_mark or exc.context_mark
    line, column = (mark.line + 1, mark.column + 1) if mark is not None else (None, None)
    message = f"not valid YAML: {exc.problem or exc}"
    inside = exc.context_mark
    if exc.problem and exc.context and inside is not None and inside is not mark:
        message += f" ({exc.context} at line {inside.line + 1}, column {inside.column + 1})"
    return Problem(source, line, "", message, column)


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    """Validate policy text; raise PolicyError listing every problem found."""
    try:
        root = yaml.compose(text, Loader=_StrictLoader)
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as exc:
        raise PolicyError([_yaml_problem(source, exc)]) from None
    except yaml.YAMLError as exc:
        raise PolicyError([Problem(source, None, "", f"not valid YAML: {exc}")]) from None
    except RecursionError:
        # PyYAML's composer recurses once per nesting level.
        raise PolicyError([Problem(source, None, "", "not valid YAML: nested too deeply")]) from None
    if not isinstance(data, dict):
        raise PolicyError(
            [Problem(source, 1, "", f"expected a mapping of policy keys, got {type(data).__name__}")]
        )
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        problems: list[Problem] = []
        errors = exc.errors()
        for error in errors:
            loc = tuple(error["loc"])
            if error["type"] == "too_short" and any(
                len(e["loc"]) > len(loc) and tuple(e["loc"][: len(loc)]) == loc for e in errors
            ):
                continue  # a list that is "empty after validation" because its items failed
            if (error["type"] == "value_error" and "\n" in str(error["msg"])) or (
                error["type"] == "value_error" and ": " in str(error["msg"]) and not loc
            ):
                # Cross-field checks report one "path: message" per line.
                for entry in _describe(error).split("\n"):
                    path, _, message = entry.partition(": ")
                    sub = loc + _parse_path(path)
                    problems.append(Problem(source, _line_of(root, sub), _format_path(sub), message))
                continue
            problems.append(
                Problem(source, _line_of(root, loc), _format_path(loc), _describe(error))
            )
        raise PolicyError(problems) from None


def load_policy(path: str | Path) -> Policy:
    """Read and validate a policy file; raise PolicyError naming the file on any problem."""
    return decode_policy(read_policy(path), str(path))


def read_policy(path: str | Path) -> bytes:
    """A policy file's bytes (what a reload hashes and then decodes); PolicyError if unreadable."""
    source = str(path)
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            # One byte more than allowed tells a file over the limit (whose size the file system
            # may not know, e.g. a pipe) without reading all of it.
            raw = b"" if size > MAX_POLICY_BYTES else file.read(MAX_POLICY_BYTES + 1)
    except OSError as exc:
        raise PolicyError([Problem(source, None, "", f"cannot read file: {exc.strerror}")]) from None
    if size > MAX_POLICY_BYTES or len(raw) > MAX_POLICY_BYTES:
        raise PolicyError([too_large(source, max(size, len(raw)))])
    return raw


def too_large(source: str, size: int) -> Problem:
    return Problem(source, None, "", f"file is {size} bytes; a policy is at most {MAX_POLICY_BYTES} bytes")


def decode_policy(raw: bytes, source: str) -> Policy:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError([Problem(source, None, "", f"not UTF-8 text: {exc.reason}")]) from None
    return parse_policy(text, source)

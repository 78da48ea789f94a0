"""Shared helpers for the unit tests: small valid policies that a test can tweak."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from extproc.policy import Policy, parse_policy

PolicyData = dict[str, Any]

#: A minimal valid policy: two lanes, a default lane, nothing else.
MINIMAL: PolicyData = {
    "lanes": [
        {"name": "interactive", "priority": 100, "max_inflight": 4, "max_queued": 8, "deadline": "10s"},
        {"name": "batch", "priority": 10, "max_inflight": 2, "max_queued": 8, "deadline": "30s"},
    ],
    "classification": {"default_lane": "batch"},
}


def dump(data: PolicyData) -> str:
    """Block-style YAML, keys in the order given, one key per line."""
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def line_of(text: str, fragment: str, occurrence: int = 1) -> int:
    """1-based number of the ``occurrence``-th line that starts with ``fragment``.

    Indentation and list dashes are ignored, so ``"name: batch"`` finds ``- name: batch``.
    """
    seen = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if re.sub(r"^\s*(?:-\s+)*", "", line).startswith(fragment):
            seen += 1
            if seen == occurrence:
                return number
    raise AssertionError(f"{fragment!r} (occurrence {occurrence}) not in:\n{text}")


@pytest.fixture
def policy_data() -> PolicyData:
    """A fresh copy of the minimal valid policy, to tweak."""
    return copy.deepcopy(MINIMAL)


@pytest.fixture
def build_policy() -> Callable[[PolicyData], Policy]:
    """Parse a policy dict the way a file would be parsed (YAML text through the loader)."""

    def build(data: PolicyData) -> Policy:
        return parse_policy(dump(data), "test.yaml")

    return build

"""Request facts → lane and tenant.

Only headers the policy lists in ``trusted_headers`` are ever looked at, so a
client cannot pick its own lane or tenant with a header the policy did not
choose to trust. Rules are tried in order; the first that matches wins.

Rules see the path as a backend would route it: percent-decoded, dot segments
resolved, slashes merged, query dropped. Envoy normalizes paths itself when its
connection manager is told to (the shipped configs do); doing it here as well means
``/v1/chat/%63ompletions`` cannot dodge a rule for ``/v1/chat/completions`` behind a
gateway that does not.

A classification is a pure function of the method, the path without its query, the model and
the trusted headers' values, and requests repeat a few of those: each :class:`Classifier`
remembers its answers by them (at most ``_KEPT``, none whose key is longer than ``_KEY_CHARS``:
paths and header values are the client's choice; all forgotten at once when full).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote

from extproc.policy.schema import Match, Policy

#: The prefix of the headers extproc sets itself; a client's own are dropped unless trusted.
HEADER_PREFIX = "x-extproc-"
#: The most classifications a classifier remembers, and the longest key it keeps one for.
_KEPT = 4096
_KEY_CHARS = 1024


def normalize_path(raw: str) -> str:
    """``raw`` (a request's ``:path``) as a backend routes it: no query or fragment, percent-decoded
    once (escaped slashes too), dot segments resolved, repeated slashes merged; a trailing slash kept."""
    path = raw.partition("?")[0].partition("#")[0]
    if "%" in path:
        path = unquote(path, errors="replace")
    if "//" not in path and "/." not in path and path.startswith("/"):
        return path
    normal = posixpath.normpath("/" + path.lstrip("/"))
    if path.endswith("/") and normal != "/":
        normal += "/"
    return "/" + normal.lstrip("/")


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What is known about one request before it is decided."""

    method: str
    path: str
    headers: Mapping[str, str]
    """Lower-cased header names; untrusted ones may be present but are never read here."""
    model: str | None = None
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class Classification:
    lane: str
    tenant: str
    rule: str
    """Name of the matching rule, ``lane_header`` or ``default``."""


class Classifier:
    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self._trusted = frozenset(policy.trusted_headers)
        self._lanes = frozenset(lane.name for lane in policy.lanes)
        #: Models a rule names (sorted): where the model decides the lane.
        self.models: tuple[str, ...] = tuple(sorted({m for rule in policy.classification.rules
                                                     for m in rule.match.models}))
        self._regex = {
            i: re.compile(rule.match.path_regex)
            for i, rule in enumerate(policy.classification.rules)
            if rule.match.path_regex is not None
        }
        #: The headers a classification may read, in a fixed order (the memo's key has their values).
        self._read = tuple(sorted(self._trusted))
        self._known: dict[tuple[str | None, ...], Classification] = {}

    def trusted(self, name: str) -> bool:
        return name in self._trusted

    def tenant(self, facts: RequestFacts) -> str:
        tenants = self._policy.tenants
        if tenants.header and tenants.header in self._trusted:
            value = facts.headers.get(tenants.header, "").strip()
            if value:
                return value[: tenants.max_tenant_length]
        return tenants.default

    def classify(self, facts: RequestFacts) -> Classification:
        key = (facts.method, facts.path.partition("?")[0], facts.model, *map(facts.headers.get, self._read))
        known = self._known.get(key)
        if known is None:
            known = self._classify(facts)
            if sum(len(part) for part in key if part) <= _KEY_CHARS:
                if len(self._known) >= _KEPT:
                    self._known.clear()
                self._known[key] = known
        return known

    def _classify(self, facts: RequestFacts) -> Classification:
        tenant = self.tenant(facts)
        cls = self._policy.classification
        if cls.lane_header and cls.lane_header in self._trusted:
            wanted = facts.headers.get(cls.lane_header, "").strip().lower()
            if wanted in self._lanes:
                return Classification(wanted, tenant, "lane_header")
        path = normalize_path(facts.path)
        for i, rule in enumerate(cls.rules):
            if self._matches(i, rule.match, facts, path, tenant):
                return Classification(rule.lane, tenant, rule.name or f"rules[{i}]")
        return Classification(cls.default_lane, tenant, "default")

    def _matches(
        self, index: int, match: Match, facts: RequestFacts, path: str, tenant: str
    ) -> bool:
        if match.path is not None and path != match.path:
            return False
        if match.path_prefix is not None and not path.startswith(match.path_prefix):
            return False
        if match.path_regex is not None and self._regex[index].fullmatch(path) is None:
            return False
        if match.methods and facts.method.upper() not in match.methods:
            return False
        if match.models and facts.model not in match.models:
            return False
        if match.tenants and tenant not in match.tenants:
            return False
        for name, values in match.headers.items():
            # The schema refuses rules on untrusted headers; checking again keeps this
            # function safe on its own.
            if name not in self._trusted or facts.headers.get(name) not in values:
                return False
        return True

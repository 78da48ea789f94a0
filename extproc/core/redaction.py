"""What a log may say about a trusted header's value: itself, or a keyed hash of it.

The decision log is replayable (it records the headers the policy trusts, so a new policy can
classify last week's traffic again), and it is read by more people than the gateway's secrets
should be. A trusted value is logged as it is when the policy itself names it (a tenant with a
weight, a lane, a value a rule matches: it is in the policy file already) or when it does not
look like a credential (a short name). Anything else — a bearer token, an ``sk-…`` key, a long
opaque string — is logged as ``h:`` and the first 16 hex digits of an HMAC-SHA256 under the
process's log key. A replay classifies the hash like any unknown value (it matches no rule and
is its own tenant), so lanes and tenants replay alike; with ``--log-key-file`` shared by every
replica, the same value hashes the same everywhere and across restarts.

Every decision line shows its request's tenant and trusted headers, so what a value is logged as is
remembered, per header and value (a pure function of them, the policy and the key): the same few
tenants and lanes come again and again. The values come from clients, so the memory is bounded: at
most ``_KEPT`` of them, none longer than ``MAX_SHOWN`` (a longer one is worked out anew each time),
all forgotten at once when full.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Mapping

from extproc.policy.schema import Policy

#: Prefix of a redacted value in logs.
HASHED = "h:"
#: Longer values are logged as their hash too: a log line must not carry a 64 KB header.
MAX_SHOWN = 256
_SCHEMES = re.compile(r"^(bearer|basic|digest|token|apikey)\s", re.IGNORECASE)
_KEY_PREFIXES = ("sk-", "sk_", "pk-", "pk_", "rk_", "ghp_", "gho_", "github_pat_", "xoxb-", "xoxp-", "aiza",
                 "eyj")  # the last: a JWT
_OPAQUE = re.compile(r"^[A-Za-z0-9+/=_.\-~]{24,}$")
#: The most values a redactor remembers how to log.
_KEPT = 4096


def looks_secret(value: str) -> bool:
    """Whether ``value`` looks like a credential rather than a name."""
    if _SCHEMES.match(value):
        return True
    lowered = value.lower()
    if lowered.startswith(_KEY_PREFIXES):
        return True
    # A long unbroken token with letters and digits mixed: a key, a hash, a JWT segment.
    return bool(_OPAQUE.match(value)) and any(c.isdigit() for c in value) and any(c.isalpha() for c in value)


class Redactor:
    """Redacts trusted header values (and tenants derived from them) for one policy."""

    def __init__(self, policy: Policy, key: bytes | None = None) -> None:
        self.policy = policy
        self._key = key or secrets.token_bytes(32)
        known: dict[str, set[str]] = {}
        tenants = policy.tenants
        if tenants.header:
            known.setdefault(tenants.header, set()).update(tenants.weights)
            known[tenants.header].add(tenants.default)
        lane_header = policy.classification.lane_header
        if lane_header:
            known.setdefault(lane_header, set()).update(lane.name for lane in policy.lanes)
        for rule in policy.classification.rules:
            for name, values in rule.match.headers.items():
                known.setdefault(name, set()).update(values)
            if tenants.header:
                known.setdefault(tenants.header, set()).update(rule.match.tenants)
        self._known = {name: frozenset(values) for name, values in known.items()}
        self._tenants = self._known.get(tenants.header or "", frozenset())
        #: What a (header, value) is logged as; a tenant's entry has the header None.
        self._shown: dict[tuple[str | None, str], str] = {}

    def value(self, header: str, value: str) -> str:
        shown = self._shown.get((header, value))
        if shown is None:
            shown = value if value in self._known.get(header, ()) or not self._hides(value) \
                else self.hashed(value)
            self._keep((header, value), shown)
        return shown

    def tenant(self, tenant: str) -> str:
        shown = self._shown.get((None, tenant))
        if shown is None:
            shown = tenant if tenant in self._tenants or not self._hides(tenant) else self.hashed(tenant)
            self._keep((None, tenant), shown)
        return shown

    @staticmethod
    def _hides(value: str) -> bool:
        return len(value) > MAX_SHOWN or looks_secret(value)

    def _keep(self, key: tuple[str | None, str], shown: str) -> None:
        if len(key[1]) > MAX_SHOWN:
            return
        if len(self._shown) >= _KEPT:
            self._shown.clear()
        self._shown[key] = shown

    def headers(self, headers: Mapping[str, str], names: tuple[str, ...]) -> dict[str, str]:
        """The ``names`` present in ``headers``, each value as a log may show it."""
        return {name: self.value(name, headers[name]) for name in names if name in headers}

    def hashed(self, value: str) -> str:
        digest = hmac.new(self._key, value.encode("utf-8", "replace"), hashlib.sha256).hexdigest()
        return HASHED + digest[:16]

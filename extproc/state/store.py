"""Which ledger a store URL names (the port's implementations, picked in one place)."""

from __future__ import annotations

from extproc.state import LEASE_TTL, BudgetStore, Ledger
from extproc.state.fallback import FailMode, FallbackLedger
from extproc.state.memory import MemoryLedger
from extproc.state.redis import RedisLedger


def open_ledger(store: str | None = None, *, prefix: str = "extproc", fail_open: bool = True,
                ttl: float = LEASE_TTL, timeout: float = 0.05, fleet_size: int = 1) -> Ledger:
    """The ledger a store URL names: none or ``memory://`` → in-process; ``redis://`` and friends → Redis.

    A Redis ledger comes wrapped in the outage fallback (``fail_open``: admit within this
    replica's share of the limits while Redis is unreachable; otherwise refuse). ``fleet_size``:
    the replicas the operator runs, so that one that has seen fewer takes no more than its part.
    """
    if not store or store.startswith("memory:"):
        return MemoryLedger(ttl=ttl)
    primary = RedisLedger(store, prefix=prefix, ttl=ttl, timeout=timeout)
    mode = FailMode.OPEN if fail_open else FailMode.CLOSED
    return FallbackLedger(primary, mode=mode, fleet_size=fleet_size)


def budget_store(ledger: Ledger | None) -> BudgetStore | None:
    """The fleet-wide budget store behind ``ledger`` (None: budgets stay per replica, in memory)."""
    return ledger if isinstance(ledger, FallbackLedger | RedisLedger) else None

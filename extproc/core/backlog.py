"""Usage charges the fleet's store has not taken yet: kept while it is unreachable, sent when it is back.

How this works: a charge (tokens a finished response used) that could not be sent to the store
is kept here, merged per budget and tenant (one pending amount per ``(kind, tenant)``, the
latest rate), so a long outage costs one entry per tenant, not one per response. At most
``max_tenants`` entries are kept; past that the tenant charged least recently is dropped (and
counted): its usage then never reaches the fleet, which forgives it, as a budget forgets a
tenant it evicts. When the store answers again the backlog goes in chunks (``REPLAY_CHUNK``
operations a call), one after another.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import replace

from extproc.core.edge import BudgetAsk


class Backlog:
    def __init__(self, max_tenants: int) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be at least 1, got {max_tenants}")
        self.max_tenants = max_tenants
        self._asks: OrderedDict[tuple[str, str], BudgetAsk] = OrderedDict()
        self.dropped = 0
        """Entries dropped to stay within ``max_tenants`` since start."""

    def __len__(self) -> int:
        return len(self._asks)

    def keep(self, asks: Iterable[BudgetAsk]) -> int:
        """Add charges (only ``charge`` operations are kept); returns how many entries were dropped."""
        before = self.dropped
        for ask in asks:
            if ask.op != "charge" or ask.amount <= 0:
                continue
            key = (ask.kind, ask.tenant)
            kept = self._asks.pop(key, None)
            self._asks[key] = ask if kept is None else replace(ask, amount=kept.amount + ask.amount)
        while len(self._asks) > self.max_tenants:
            self._asks.popitem(last=False)
            self.dropped += 1
        return self.dropped - before

    def take(self) -> list[BudgetAsk]:
        """Everything kept, oldest first; the backlog is empty afterwards."""
        asks = list(self._asks.values())
        self._asks.clear()
        return asks

"""One lane's queue: weighted fair sharing between tenants, slack-weighted SJF within each.

How this works: each entry gets a fixed *rank* when it is queued,

    rank = arrival + min(sjf_weight × predicted_service, time_to_deadline)

— a virtual start deadline. Ordering by rank is shortest-job-first among
requests that arrived close together, but a request can only be overtaken by
later arrivals whose rank is smaller, and every later arrival has rank ≥ its
arrival time: once the clock passes an entry's rank, nothing new can jump
ahead of it. That bounds starvation (a long job waits at most its rank offset
plus the time to drain what was already ahead). Jobs close to their deadline
rank by the deadline itself, earliest first. Because ranks never change, a
heap per tenant suffices.

Between tenants the queue is start-time fair: each tenant carries a virtual
time that advances by ``predicted_service / weight`` whenever one of its
entries is served, and the backlogged tenant with the smallest virtual time is
served next. A tenant that was idle rejoins at the current virtual time, so it
cannot save up credit; one whose queue emptied only for a moment keeps the charge
it has not yet worked off (it is forgotten once the virtual time passes it), so
it cannot shed its debt by keeping a single request queued. Shares are therefore
proportional to weights in predicted GPU-seconds, not in request counts.

Across a fleet, each replica's queue is also charged the work other replicas served for its
tenants (``charge``): a tenant's virtual time then counts what it got fleet-wide, and every
replica serves next the tenant furthest behind *in the fleet*, so shares follow the weights
however the load balancer spreads the requests.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

#: Smallest cost a served entry charges its tenant (keeps zero-size jobs fair).
_MIN_COST = 1e-3


@dataclass(slots=True, eq=False)
class Entry:
    id: int
    tenant: str
    arrival: float
    deadline: float
    predicted: float
    rank: float
    queued: bool = True


def rank_of(arrival: float, deadline: float, predicted: float, sjf_weight: float) -> float:
    return arrival + min(sjf_weight * predicted, max(deadline - arrival, 0.0))


@dataclass(slots=True)
class _Tenant:
    vtime: float
    heap: list[tuple[float, int, int, Entry]] = field(default_factory=list)
    size: int = 0

    def head(self) -> Entry | None:
        while self.heap and not self.heap[0][3].queued:
            heapq.heappop(self.heap)
        return self.heap[0][3] if self.heap else None


class LaneQueue:
    def __init__(self, weight: Callable[[str], float]) -> None:
        self._weight = weight
        self._tenants: dict[str, _Tenant] = {}
        self._vtime = 0.0
        self._seq = itertools.count()
        self._size = 0
        self._work = 0.0

    def __len__(self) -> int:
        return self._size

    @property
    def work(self) -> float:
        """Sum of queued entries' predicted service, in seconds."""
        return self._work if self._size else 0.0

    def push(self, entry: Entry) -> None:
        tenant = self._tenants.get(entry.tenant)
        if tenant is None:
            tenant = self._tenants[entry.tenant] = _Tenant(vtime=self._vtime)
        elif tenant.size == 0:
            tenant.vtime = max(tenant.vtime, self._vtime)
        # The sequence number keeps entries apart that share rank and id: a request put back in the
        # queue (its withdrawn entry may still lie in the heap) comes back under its old id.
        heapq.heappush(tenant.heap, (entry.rank, entry.id, next(self._seq), entry))
        tenant.size += 1
        self._size += 1
        self._work += entry.predicted

    def peek(self) -> Entry | None:
        """The entry that would be served next."""
        best: tuple[float, float, int] | None = None
        chosen: Entry | None = None
        for tenant in self._tenants.values():
            head = tenant.head()
            if head is None:
                continue
            key = (tenant.vtime, head.rank, head.id)
            if best is None or key < best:
                best, chosen = key, head
        return chosen

    def pop(self) -> Entry | None:
        entry = self.peek()
        if entry is None:
            return None
        tenant = self._tenants[entry.tenant]
        self._vtime = max(self._vtime, tenant.vtime)
        tenant.vtime += max(entry.predicted, _MIN_COST) / self._weight(entry.tenant)
        self._take(entry, tenant)
        # Idle tenants whose charge the virtual time has caught up with are owed nothing.
        for name in [n for n, t in self._tenants.items() if t.size == 0 and t.vtime <= self._vtime]:
            del self._tenants[name]
        return entry

    def charge(self, tenant: str, cost: float) -> None:
        """Work (predicted seconds) other replicas served for ``tenant``: its virtual time advances as
        if served here. A tenant this queue does not know rejoins at the current virtual time anyway."""
        state = self._tenants.get(tenant)
        if state is not None and cost > 0:
            state.vtime += cost / self._weight(tenant)

    def refund(self, entry: Entry) -> None:
        """Undo what serving ``entry`` charged its tenant: it was not served after all (the shared
        store refused its slot, and it goes back in the queue)."""
        state = self._tenants.get(entry.tenant)
        if state is not None:
            state.vtime -= max(entry.predicted, _MIN_COST) / self._weight(entry.tenant)

    def remove(self, entry: Entry) -> bool:
        """Withdraw a queued entry (client gone, deadline passed, evicted)."""
        tenant = self._tenants.get(entry.tenant)
        if not entry.queued or tenant is None:
            return False
        self._take(entry, tenant)
        return True

    def _take(self, entry: Entry, tenant: _Tenant) -> None:
        entry.queued = False
        tenant.size -= 1
        self._size -= 1
        self._work -= entry.predicted
        if self._size == 0:
            # Nobody is waiting: every tenant starts afresh at the current virtual time.
            self._tenants.clear()
        elif tenant.size == 0 and tenant.vtime <= self._vtime:
            # An idle tenant rejoins at the current virtual time: no saved-up credit.
            del self._tenants[entry.tenant]

    def entries(self) -> Iterator[Entry]:
        for tenant in self._tenants.values():
            for _, _, _, entry in tenant.heap:
                if entry.queued:
                    yield entry

    def crowding(self, tenant: str) -> Entry | None:
        """When the queue is full: the entry to push out so that ``tenant`` may queue, if any.

        Fair service needs fair queue space: otherwise a full queue fills with the
        entries of the tenants served least, and a heavier tenant's arrivals are
        refused for want of room although it is owed service. The entry pushed out is
        the worst-ranked one of the tenant that holds the most places per unit of
        weight, provided it holds more than ``tenant`` would after queueing.
        """
        mine = self._tenants[tenant].size if tenant in self._tenants else 0
        most = (mine + 1) / self._weight(tenant)
        hog: _Tenant | None = None
        for name, other in self._tenants.items():
            if name != tenant and other.size and other.size / self._weight(name) > most:
                hog, most = other, other.size / self._weight(name)
        if hog is None:
            return None
        return max((e for _, _, _, e in hog.heap if e.queued), key=lambda e: (e.rank, e.id))

    def worst(self) -> Entry | None:
        """The entry with the worst rank: the one to evict first."""
        return max(self.entries(), key=lambda e: (e.rank, e.id), default=None)

    def worst_of(self, tenant: str) -> Entry | None:
        """``tenant``'s entry with the worst rank (None: it has none queued)."""
        state = self._tenants.get(tenant)
        if state is None:
            return None
        return max((e for _, _, _, e in state.heap if e.queued), key=lambda e: (e.rank, e.id), default=None)

    def tenants(self) -> dict[str, int]:
        return {name: t.size for name, t in self._tenants.items() if t.size}

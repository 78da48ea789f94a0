"""Envoy's rate limit service: the gRPC adapter of the edge shed (``core/edge.py``).

How this works: Envoy's ratelimit filter runs before ext_proc and, as a request
arrives, calls ``ShouldRateLimit`` with a descriptor built from what Envoy knows
then: ``generic_key`` (the policy's ``request_descriptor``), ``method``, ``path``
and the headers the policy may trust, each under its own name. Each arrival
descriptor is judged by the decision machine (``core/machine.py``: the one
intake, the scheduler's own admission rule, the tenant budgets); a usage
descriptor (``usage_descriptor``, sent when a response ends, with the usage the proxy
read from the body, or an estimate's inputs: ``core/usage.py``) is charged to the
tenant's token budget.

Every answer carries ``statuses``, which Envoy turns into ``x-ratelimit-*``
headers. A lane's status counts places (slots + queue places before the edge
sheds) rather than a rate, so it has no unit and its header no window. An
OVER_LIMIT answer is rendered like every refusal (``core.decision.reject``). In
shadow mode everything is decided and counted, but the answer is always a plain OK.

With a fleet's shared store (``store``), tenant budgets are one per tenant for the whole fleet:
each arrival's budget operations (``Machine.assess``) go to the store in one atomic script, and
its answer (the levels) becomes the verdicts (``core.budget.verdict``); usage charges are queued
by the edge and sent in the background, off the request's path. While the store is unreachable
the replica decides alone: failing open with its part of every budget (``1 / parts``: the
replicas the slot ledger counts in the outage, at least the fleet size), failing closed
refusing every request that has a budget.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from envoy.config.core.v3.base_pb2 import HeaderValue
from envoy.service.ratelimit.v3 import rls_pb2 as pb
from envoy.service.ratelimit.v3 import rls_pb2_grpc as pb_grpc

from extproc.core.backlog import Backlog
from extproc.core.decision import Reason, Rejection
from extproc.core.intake import JUDGED_HEADER
from extproc.core.machine import REQUEST_ID, UNLIMITED, BucketVerdict, BudgetAsk, Check, Judgement, Machine
from extproc.core.redaction import Redactor
from extproc.core.usage import USAGE, USAGE_ENTRIES, Charge, charged
from extproc.metrics import RateLimitMetrics
from extproc.policy.ratelimit import RateLimit
from extproc.state import BucketOp, BudgetStore, LedgerUnavailable, StoreDown

SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
_UINT32 = UNLIMITED
#: The most budget operations in one store call when charging usage: a script runs alone on the
#: store, and 200 bucket operations take a few milliseconds, well within its timeout (50 ms).
REPLAY_CHUNK = 200
__all__ = ["SERVICE", "Inline", "RateLimitService", "add_to_server"]

log = structlog.get_logger("extproc.ratelimit")

_Limit = pb.RateLimitResponse.RateLimit
_UNITS = {"second": _Limit.SECOND, "minute": _Limit.MINUTE, "hour": _Limit.HOUR, "day": _Limit.DAY}


# -- the service --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Inline:
    """The edge's answer to an arrival judged in ext_proc (``RateLimitService.judge_inline``): what the
    ratelimit filter reads from a call's answer, without the answer."""

    status: Check | None
    """The status the answer reports, which the filter renders as ``x-ratelimit-*`` headers (None:
    none has a limit, or shadow mode, which reports none)."""
    shed: Rejection | None = None
    """Over the limit: the refusal (its headers and body; the filter's own 429)."""
    shadow: str | None = None
    """In shadow mode, what the edge would have shed for (its reason; "" if none is known)."""


def _entries(descriptor: Any) -> dict[str, str]:
    return {e.key.lower(): e.value for e in descriptor.entries}


def _hits(request: pb.RateLimitRequest, descriptor: Any, default: int) -> int:
    """What a descriptor stands for: its own hits_addend if set (0 included), else the request's,
    else ``default``."""
    if descriptor.HasField("hits_addend"):
        return int(descriptor.hits_addend.value)
    return int(request.hits_addend) or default


class RateLimitService(pb_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    """``ShouldRateLimit`` for Envoy's ratelimit filter.

    ``config`` returns the current ``ratelimit`` policy (read on every call, so a
    policy reload applies at once); ``machine`` decides (the live controller's).
    """

    def __init__(self, machine: Machine, metrics: RateLimitMetrics, config: Callable[[], RateLimit], *,
                 clock: Callable[[], float] = time.monotonic, log_key: bytes | None = None,
                 wall: Callable[[], float] = time.time, store: BudgetStore | None = None,
                 store_timeout: float = 0.02, refused: Callable[[str, Reason, str], None] | None = None,
                 policy_hash: Callable[[], str] = str) -> None:
        self.machine = machine
        #: Told of every request the edge sheds (its lane label, reason and tenant), to count it as every
        #: refusal is counted (``Controller.refused``).
        self.refused = refused
        #: The sha256 of the policy file in force, for the records of sheds.
        self.policy_hash = policy_hash
        self.metrics = metrics
        self.config = config
        self.now = clock
        #: Epoch seconds: ext_proc records when it admitted a request in them (for an estimate).
        self.wall = wall
        #: The fleet's shared budgets (None: this replica's own, in memory). While it is unreachable,
        #: the machine's own budgets hold this replica's part.
        self.store = store
        machine.budgets_shared = store is not None
        #: The longest an arrival waits for the store (seconds), well within Envoy's ratelimit timeout.
        self.store_timeout = store_timeout
        self.alone = False
        """Whether the last budget decision was taken without the store."""
        self._flushing: set[asyncio.Task[None]] = set()
        #: Arrivals' store calls still on their way (a timed-out one goes on, shielded): awaited at close.
        self._calls: set[asyncio.Future[Any]] = set()
        #: Usage charges the store missed while it was unreachable and no part of a budget took
        #: (failing closed), sent when it is back.
        self.backlog = Backlog(config().budgets.max_tenants)
        self._redactor: Redactor | None = None
        self._log_key = log_key or secrets.token_bytes(32)
        self._warned: set[str] = set()
        self.log: structlog.typing.FilteringBoundLogger = log.bind()
        metrics.watch(machine.budget_sizes)

    async def ShouldRateLimit(self, request: pb.RateLimitRequest,
                              context: grpc.aio.ServicerContext[Any, Any]) -> pb.RateLimitResponse:
        try:
            if self.store is not None:
                response = await self.decide_shared(request)
            else:
                response = self.decide(request)
        except Exception:
            self.metrics.errors.inc()
            self.log.exception("rate limit decision failed")
            raise
        if response.overall_code == pb.RateLimitResponse.OK and self._arrival_in(request):
            # The filter adds it to the request (after the proxy's strip of every client x-extproc-*):
            # ext_proc then never judges this arrival a second time, whatever else the proxy says
            # (a config with the arrival descriptor and x-extproc-edge both, as while rolling out).
            response.request_headers_to_add.add(key=JUDGED_HEADER, value="1")
        return response

    def _arrival_in(self, request: pb.RateLimitRequest) -> bool:
        config = self.config()
        if config.mode == "off" or request.domain != config.domain:
            return False
        return any(_entries(d).get("generic_key") == config.request_descriptor for d in request.descriptors)

    async def judge_inline(self, entries: Mapping[str, str], request_id: str = "") -> Inline | None:
        """The edge's answer to one arrival judged in ext_proc's headers phase (the proxy says so
        with ``x-extproc-edge``: its ratelimit filter then sends no arrival descriptor): what
        ``decide`` answers the filter's call for the descriptor that call would carry (``entries``:
        its method, path and the headers the policy reads, ``Intake.descriptor``; ``request_id``:
        Envoy's, as the call's ``request_id`` entry carries it), judged, counted and logged alike,
        without building the call's messages. None: the edge is off, or failed (counted and logged as a
        call's error); the request goes on to ext_proc's decision, as the filter fails open."""
        try:
            config = self.config()
            if config.mode == "off":
                return None
            if self.store is None:
                return self._inline(self.machine.judge(config, entries, 1, self.now()), entries, request_id)
            now = self.now()
            assessment = self.machine.assess(config, entries, 1, now)
            verdicts = await self._settle(list(assessment.asks), now) if assessment.asks else []
            answer = self._inline(self.machine.conclude(assessment, verdicts), entries, request_id)
            self._flush_soon()
            return answer
        except Exception:
            self.metrics.errors.inc()
            self.log.exception("rate limit decision failed (judged in ext_proc): the request goes on")
            return None

    def _inline(self, judgement: Judgement, entries: Mapping[str, str], request_id: str) -> Inline:
        """``decide``'s answer for one arrival descriptor, as the filter reads it."""
        self._count(judgement, entries, request_id)
        if judgement.shadow:
            reason = judgement.reason
            return _NOTHING if not judgement.over else Inline(None, shadow=reason.value if reason else "")
        status = judgement.status if judgement.status.limit > 0 else None
        if not judgement.over:
            return Inline(status)
        return Inline(status, shed=self._shed([judgement]))

    async def decide_shared(self, request: pb.RateLimitRequest) -> pb.RateLimitResponse:
        """``decide`` with the fleet's budgets: every arrival's budget operations in one store call."""
        config = self.config()
        judged: dict[int, Judgement] = {}
        if config.mode != "off" and request.domain == config.domain:
            now = self.now()
            assessed = []
            for i, descriptor in enumerate(request.descriptors):
                entries = _entries(descriptor)
                if entries.get("generic_key") != config.request_descriptor:
                    continue
                assessed.append((i, self.machine.assess(config, entries, _hits(request, descriptor, 1), now)))
            asks = [ask for _, assessment in assessed for ask in assessment.asks]
            verdicts = iter(await self._settle(asks, now) if asks else [])
            for i, assessment in assessed:
                judged[i] = self.machine.conclude(assessment, [next(verdicts) for _ in assessment.asks])
        response = self.decide(request, judged)
        self._flush_soon()
        return response

    def _flush_soon(self) -> None:
        """Send queued usage charges and the backlog in the background (``_flush``), if any."""
        if self.machine.pending_charges or (self.backlog and not self.alone):
            task = asyncio.get_running_loop().create_task(self._flush())
            self._flushing.add(task)
            task.add_done_callback(self._flushing.discard)

    async def _settle(self, asks: list[BudgetAsk], now: float) -> list[BucketVerdict]:
        """``asks`` against the fleet's buckets; alone (see the module docstring) if unreachable."""
        store = self.store
        assert store is not None
        ops = [BucketOp(f"{ask.kind}:{ask.tenant}", ask.op, ask.rate.per_second, ask.rate.burst, ask.amount)
               for ask in asks]
        # Bounded well within Envoy's ratelimit timeout: past it Envoy passes the request unjudged
        # (failure_mode_deny false) while the script still charges. The call is shielded, not
        # cancelled (that would drop a pooled connection); one that answers late has charged the
        # fleet's buckets as well as this replica's part: stricter, never looser.
        call = asyncio.ensure_future(store.buckets(ops))
        call.add_done_callback(_retrieve)
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)
        try:
            async with asyncio.timeout(self.store_timeout):
                levels = await asyncio.shield(call)
        except TimeoutError:
            self.metrics.budget_timeouts.inc()
            return self._settle_alone(store, asks, now)
        except LedgerUnavailable:
            return self._settle_alone(store, asks, now)
        if self.alone:
            self.alone = False
            self.log.info("tenant budgets shared again")
        return self.machine.budgets_answered(asks, [(level.allowed, level.level) for level in levels])

    def _settle_alone(self, store: BudgetStore, asks: list[BudgetAsk], now: float) -> list[BucketVerdict]:
        if not self.alone:
            self.alone = True
            self.log.warning("tenant budgets decided without the shared store", parts=store.parts,
                             mode="fail_open" if store.fail_open else "fail_closed")
        self.metrics.budget_alone.inc(len(asks))
        return self.machine.budgets_alone(asks, now, parts=store.parts, fail_open=store.fail_open)

    async def _flush(self, sending: _Sending | None = None) -> None:
        """Send the queued usage charges and the backlog, in chunks of at most ``REPLAY_CHUNK``
        operations, one store call after another.

        Off the request's path, so bounded only by the store's own timeouts. Chunked because one
        script runs alone on the store: a whole outage's backlog in one call (thousands of tenants)
        would outlast the store's timeout and hold every replica's decisions up meanwhile. While the
        store is known to be away (``StoreDown``: nothing of that chunk was sent) the unsent charges
        go, failing open, to this replica's part of each budget, which it decides on meanwhile (and
        nowhere else: that part is how the outage's usage was enforced); failing closed, to the
        backlog, replayed when the store is back. Backlog charges not sent go back to it. A call that
        failed on its way (a timeout, a lost answer) may have run: the script is atomic, so either all
        of its chunk was charged or none. Those charges are not replayed: a replay could charge a
        response twice fleet-wide; at worst a tenant is forgiven one chunk of usage at the start of an
        outage. (The local part and the
        fleet's bucket are never decided on together, so charging both is not charging twice.)

        ``sending`` shows what is left to send and what is on its way (``close`` reads it)."""
        store = self.store
        assert store is not None
        fresh = self.machine.take_charges()
        replay = self.backlog.take()
        sending = sending if sending is not None else _Sending()
        sending.pending = [(ask, False) for ask in replay] + [(ask, True) for ask in fresh]
        while sending.pending:
            chunk, sending.pending = sending.pending[:REPLAY_CHUNK], sending.pending[REPLAY_CHUNK:]
            sending.in_flight = len(chunk)
            ops = [BucketOp(f"{ask.kind}:{ask.tenant}", ask.op, ask.rate.per_second, ask.rate.burst,
                            ask.amount) for ask, _ in chunk]
            try:
                await store.buckets(ops)
            except StoreDown:
                unsent, sending.pending = chunk + sending.pending, []
                # Failing open, a fresh charge goes to this replica's part of the budget, which it
                # enforces meanwhile: accounted for, so not kept (replayed into the fleet's bucket,
                # refilled by then, it would lock the tenant out as long again for usage it was
                # already held to). Failing closed it is accounted nowhere: kept for the fleet.
                self._keep([ask for ask, new in unsent if not (new and store.fail_open)])
                self._settle_alone(store, [ask for ask, new in unsent if new], self.now())
                return
            except LedgerUnavailable:
                self._settle_alone(store, [ask for ask, new in chunk if new], self.now())
                self.log.warning("token usage in doubt (the store may have charged it): not replayed",
                                 charges=len(chunk))
            except Exception:
                self.log.warning("could not charge token usage", exc_info=True, charges=len(chunk))
            finally:
                sending.in_flight = 0

    def _keep(self, asks: list[BudgetAsk]) -> None:
        self.backlog.max_tenants = self.config().budgets.max_tenants
        dropped = self.backlog.keep(asks)
        if dropped:
            self.metrics.charges_dropped.inc(dropped)

    async def close(self, grace_s: float = 1.0) -> None:
        """At shutdown: let the charges and arrivals' calls on their way reach the store, and send the
        backlog if it can (each wait at most ``grace_s``). The last flush is shielded: cut short, its
        store call would be lost with the charges it carries; past ``grace_s`` what it has not sent yet
        goes back to the backlog, and is logged."""
        pending = self._flushing | self._calls
        if pending:
            await asyncio.wait(pending, timeout=grace_s)
        if self.store is not None and (self.machine.pending_charges or self.backlog):
            sending = _Sending()
            flush = asyncio.ensure_future(self._flush(sending))
            flush.add_done_callback(_retrieve)
            try:
                async with asyncio.timeout(grace_s):
                    await asyncio.shield(flush)
            except TimeoutError:
                unsent, sending.pending = sending.pending, []  # the flush stops after its call in flight
                self._keep([ask for ask, _ in unsent])
                self.log.warning("shutdown: token usage not sent to the shared store in time",
                                 charges=len(unsent), in_doubt=sending.in_flight)
        if self.backlog:
            self.log.warning("token usage never sent to the shared store", tenants=len(self.backlog))

    def decide(self, request: pb.RateLimitRequest, judged: Mapping[int, Judgement] | None = None
               ) -> pb.RateLimitResponse:
        """Answer one request (``judged``: arrival descriptors already judged, by index)."""
        config = self.config()
        response = pb.RateLimitResponse(overall_code=pb.RateLimitResponse.OK)
        if config.mode == "off" or request.domain != config.domain:
            if config.mode != "off":
                self._ignore("unknown_domain", request.domain)
            for _ in request.descriptors:
                response.statuses.add(code=pb.RateLimitResponse.OK)
            return response
        now = self.now()
        shed: list[Judgement] = []
        for i, descriptor in enumerate(request.descriptors):
            entries = _entries(descriptor)
            kind = entries.get("generic_key")
            status = response.statuses.add(code=pb.RateLimitResponse.OK)
            if kind == config.usage_descriptor:
                self._usage(config, entries, _hits(request, descriptor, 0), now)
            elif kind == config.request_descriptor:
                judgement = judged[i] if judged is not None and i in judged \
                    else self.machine.judge(config, entries, _hits(request, descriptor, 1), now)
                self._count(judgement, entries, entries.get(REQUEST_ID, ""))
                if judgement.shadow:
                    if judgement.over:
                        # The access log shows it: %DYNAMIC_METADATA(envoy.filters.http.ratelimit:shadow)%.
                        reason = judgement.reason
                        response.dynamic_metadata.update({"shadow": reason.value if reason else ""})
                    continue
                _fill(status, judgement.status)
                if judgement.over:
                    status.code = pb.RateLimitResponse.OVER_LIMIT
                    shed.append(judgement)
            else:
                self._ignore("unknown_descriptor", kind or "")
        if shed:
            self._over_limit(response, shed)
        return response

    # -- internals ----------------------------------------------------------------------------

    def _usage(self, config: RateLimit, entries: dict[str, str], hits: int, now: float) -> None:
        """Charge a finished response's tokens: what the model server reported (the ``usage`` entry
        the proxy read from the body, or a backend's own count as hits_addend), else an estimate
        from what ext_proc admitted."""
        if USAGE in entries:
            charge = charged(entries, self.wall())
            for key in USAGE_ENTRIES:
                entries.pop(key, None)  # not headers: never classified as such
        else:  # a config that reports tokens as hits_addend (a backend that sends a header)
            charge = Charge(hits, "reported") if hits > 0 else Charge(0, "unknown")
        if charge.source == "reported":
            if charge.tokens <= 0:
                return
            self.metrics.usage_reports.inc()
            self.metrics.usage_tokens.inc(charge.tokens)
        elif charge.source == "estimated":
            self.metrics.usage_estimates.inc()
            self.metrics.usage_estimated_tokens.inc(charge.tokens)
        else:
            self.metrics.usage_unknown.inc()
        if charge.tokens > 0:
            self.machine.charge(config, entries, charge.tokens, now)

    def _redaction(self) -> Redactor:
        policy = self.machine.policy
        if self._redactor is None or self._redactor.policy is not policy:
            self._redactor = Redactor(policy, self._log_key)
        return self._redactor

    def _count(self, judgement: Judgement, entries: Mapping[str, str], request_id: str) -> None:
        reason = judgement.reason
        code = "over_limit" if judgement.over else "ok"
        self.metrics.decisions_of(judgement.lane, code, reason.value if reason else "none",
                                  "true" if judgement.shadow else "false").inc()
        if judgement.over:
            redactor = self._redaction()
            # Like a decision record, replayable: when, where to, and the trusted headers it carried.
            # request_id: Envoy's (the descriptor's request_id entry), so the proxy's access log joins it.
            self.log.info("edge_shed", request_id=request_id, policy=self.policy_hash(),
                          lane=judgement.lane, tenant=redactor.tenant(judgement.tenant),
                          reason=reason.value if reason else None, shadow=judgement.shadow,
                          arrival=round(time.time(), 3), method=entries.get("method", ""),
                          path=entries.get("path", "").split("?", 1)[0],
                          headers=redactor.headers(entries, self.machine.policy.trusted_headers))

    def _ignore(self, kind: str, value: str) -> None:
        self.metrics.ignored.labels(kind).inc()
        key = f"{kind}:{value}"
        # One warning per distinct value (and a bounded number of them): a misconfigured Envoy
        # would otherwise log on every request.
        if key not in self._warned and len(self._warned) < 64:
            self._warned.add(key)
            self.log.warning("rate limit request not for this service; answered OK", kind=kind, value=value)

    def _over_limit(self, response: pb.RateLimitResponse, shed: list[Judgement]) -> None:
        response.overall_code = pb.RateLimitResponse.OVER_LIMIT
        rejection = self._shed(shed)
        response.response_headers_to_add.extend(HeaderValue(key=k, value=v) for k, v in rejection.headers)
        response.raw_body = rejection.body

    def _shed(self, shed: list[Judgement]) -> Rejection:
        """The refusal of an arrival some of whose descriptors are over their limits, counted."""
        answer = self.machine.shed(shed, self.now())
        if self.refused is not None:
            self.refused(answer.counted_as, answer.reason, answer.tenant)
        if answer.rule is not None and answer.lane is not None and self.metrics.saturation is not None:
            self.metrics.saturation.labels(answer.lane, answer.rule, answer.signal or "").inc()
        return answer.rejection


#: An arrival judged in shadow mode that would pass: nothing to report, nothing to shed.
_NOTHING = Inline(None)


class _Sending:
    """One flush's charges left to send (each with whether it is fresh rather than from the
    backlog), and how many are in the store call on its way."""

    __slots__ = ("in_flight", "pending")

    def __init__(self) -> None:
        self.pending: list[tuple[BudgetAsk, bool]] = []
        self.in_flight = 0


def _retrieve(call: asyncio.Future[Any]) -> None:
    """Consume the outcome of a store call nobody waits for any more (no 'never retrieved' log)."""
    if not call.cancelled():
        call.exception()


def _fill(status: pb.RateLimitResponse.DescriptorStatus, check: Check) -> None:
    if check.limit <= 0:
        return
    status.current_limit.name = check.name
    status.current_limit.requests_per_unit = min(check.limit, _UINT32)
    status.current_limit.unit = _UNITS.get(check.unit or "", _Limit.UNKNOWN)
    status.limit_remaining = min(check.remaining, _UINT32)
    if math.isfinite(check.reset_s) and check.reset_s > 0:
        status.duration_until_reset.seconds = min(math.ceil(check.reset_s), _UINT32)


def add_to_server(service: RateLimitService, server: grpc.aio.Server) -> None:
    pb_grpc.add_RateLimitServiceServicer_to_server(service, server)

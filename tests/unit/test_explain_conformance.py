"""``policy explain`` says what the live path answers: 1,000 random (policy, state, request) triples.

For each, explain's verdict at the state (``explain(..., state=, spent=)``) is compared with what the
live adapters answer in process over the same state: a Controller with its ext_proc servicer and its
rate limit service (the edge judged in the headers phase, as a proxy with ``x-extproc-edge`` asks),
brought to the state through the adapters' own calls (requests submitted, retries let through and
ended, the tenant's arrivals judged by the rate limit service, a usage report charged to it), then
the sample sent as Envoy sends it. Compared: where it was decided (edge or ext_proc), the outcome
(admitted, held, refused), the reason, the status and the Retry-After. The samples' bodies carry
token limits as clients write them (some the model servers refuse) and Content-Encodings extproc
decodes or cannot, under either choice of ``estimation.unreadable_body``.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ratelimit.v3 import rls_pb2
from prometheus_client import CollectorRegistry

from extproc.controller import Controller
from extproc.core.decision import Outcome
from extproc.metrics import Metrics, RateLimitMetrics
from extproc.policy import Policy
from extproc.servers.extproc import ExternalProcessor
from extproc.servers.ratelimit import RateLimitService
from extproc.tools import explain as ex
from extproc.tools.scenario import LaneLoad, Spent

TRIPLES = 1000
NOW = 1000.0
#: Token limits as clients send them: read as the model servers read them, or refused as they would.
TOKEN_LIMITS: list[object] = [10, 200, 2000, "2000", 2000.0, 10**12, "abc", -1, 12.5]
ENCODINGS = ["gzip", "GZIP", "identity", "x-foo", "identity, identity", "GZIP2", "identity;q=1", "gzip, gzip"]


def random_policy(rng: random.Random) -> Policy:
    names = ["gold", "silver", "bronze"][: rng.randint(1, 3)]
    lanes = []
    for i, name in enumerate(names):
        lane: dict[str, Any] = {"name": name, "priority": rng.choice([0, 10, 100]) + i,
                                "max_inflight": rng.randint(1, 4), "max_queued": rng.randint(0, 3),
                                "deadline": f"{rng.choice([1, 5, 30])}s"}
        if rng.random() < 0.4:
            lane["borrow"] = True
            if rng.random() < 0.5:
                lane["max_borrow"] = rng.randint(0, 2)
        if rng.random() < 0.08:
            lane["closed"] = True
        if rng.random() < 0.3:
            lane["evictable"] = True
        lanes.append(lane)
    doc: dict[str, Any] = {
        "lanes": lanes,
        "trusted_headers": ["x-tenant", "x-lane"],
        "tenants": {"header": "x-tenant", "default": "anon", "weights": {"a": rng.choice([1, 2])}},
        "classification": {"default_lane": names[-1],
                           "rules": [{"match": {"headers": {"x-lane": [n]}}, "lane": n} for n in names]},
        "retry_after": {"min": 1, "max": 30, "jitter": rng.choice([0, 0.2]), "share": rng.choice([0, 0.5])},
        "estimation": {"read_body": rng.choice(["auto", "always", "never"]),
                       "unreadable_body": rng.choice(["estimate", "refuse"]),
                       "max_output_tokens": rng.choice([1000, 32768])},
        "queueing": {"sjf_weight": rng.choice([0, 1])},
    }
    total = sum(lane["max_inflight"] for lane in lanes)
    if rng.random() < 0.5:
        doc["capacity"] = {"max_inflight": rng.randint(max(lane["max_inflight"] for lane in lanes), total)}
        if rng.random() < 0.3:
            doc["capacity"]["max_queued"] = rng.randint(0, 4)
    if rng.random() < 0.6:
        doc["retry_budget"] = {"ratio": rng.choice([0, 0.1, 0.5]), "min_per_second": rng.choice([0, 0.1, 1]),
                               "window": "10s"}
    else:
        doc["retry_budget"] = {"enabled": False}
    mode = rng.choice(["off", "enforce", "enforce", "shadow"])
    if mode == "off":
        doc["ratelimit"] = {"mode": "off"}
    else:
        budget: dict[str, Any] = {"per": rng.choice(["second", "minute"])}
        if rng.random() < 0.6:
            budget["requests"] = rng.randint(1, 5)
        if rng.random() < 0.4:
            budget["tokens"] = rng.randint(50, 500)
        doc["ratelimit"] = {"mode": mode, "queue_share": rng.choice([0.25, 0.5, 1]),
                            "budgets": {"default": budget}}
    return Policy.model_validate(doc)


@dataclass(frozen=True)
class Triple:
    policy: Policy
    loads: dict[str, LaneLoad]
    spent: Spent
    headers: dict[str, str]
    body: bytes | None


def random_triple(seed: int) -> Triple:
    rng = random.Random(seed)
    policy = random_policy(rng)
    loads = {}
    for lane in policy.lanes:
        if rng.random() < 0.7:
            loads[lane.name] = LaneLoad(rng.randint(0, lane.max_inflight + 1),
                                        rng.randint(0, lane.max_queued + 1))
    spent = Spent(retry_budget=rng.random() < 0.25, tenant_requests=rng.random() < 0.25,
                  tenant_tokens=rng.random() < 0.2)
    headers = {"x-tenant": rng.choice(["a", "b", "anon"]),
               "x-lane": rng.choice([lane.name for lane in policy.lanes]), "content-type": "application/json"}
    retries = rng.choice([0, 0, 1, 2])
    if retries:
        headers["x-stainless-retry-count"] = str(retries)
    body = None
    if rng.random() < 0.8:
        doc: dict[str, Any] = {"model": "m", "max_tokens": rng.choice(TOKEN_LIMITS),
                               "messages": [{"role": "user", "content": "x" * rng.randint(1, 400)}]}
        if rng.random() < 0.2:
            doc["max_completion_tokens"] = rng.choice([0, None, 50, "abc"])
        body = json.dumps(doc).encode()
        if rng.random() < 0.3:
            # Encodings extproc reads, and bodies it cannot: unknown, stacked, or not what they say.
            encoding = rng.choice(ENCODINGS)
            headers["content-encoding"] = encoding
            if encoding.strip().lower() == "gzip" and rng.random() < 0.7:
                body = gzip.compress(body)
        headers["content-length"] = str(len(body))
    if not loads and not spent.any:
        spent = Spent(retry_budget=True)  # a described state (explain's default scenarios are its own)
    return Triple(policy, loads, spent, headers, body)


@dataclass(frozen=True)
class Verdict:
    at: str
    outcome: str
    reason: str | None
    status: int | None
    retry_after: str | None


def explained(triple: Triple, seed: int) -> Verdict:
    request = ex.SampleRequest("POST", "/v1/chat/completions", dict(triple.headers), triple.body)
    expl = ex.explain(triple.policy, request, state=triple.loads, spent=triple.spent, seed=seed)
    (result,) = expl.scenarios
    outcome = "held" if result.outcome is Outcome.QUEUED else result.outcome.value
    refused = result.outcome is Outcome.REJECTED
    return Verdict(result.at, outcome, result.reason.value if refused and result.reason else None,
                   result.status if refused else None,
                   str(result.retry_after) if refused and result.retry_after is not None else None)


class Live:
    """The live adapters in process, on a frozen clock."""

    def __init__(self, policy: Policy, seed: int) -> None:
        registry = CollectorRegistry()
        self.controller = Controller(policy, Metrics(registry), clock=lambda: NOW, rng=random.Random(seed),
                                     edge_rng=random.Random(seed + 1))
        self.edge = RateLimitService(self.controller.machine, RateLimitMetrics(registry),
                                     lambda: self.controller.policy.ratelimit, clock=lambda: NOW)
        self.processor = ExternalProcessor(self.controller, edge=self.edge)

    def reach(self, triple: Triple) -> None:
        """The state, through the adapters: requests like the sample's fill the lanes (submitted as the
        servicer submits them), other clients' retries spend the retry budget, the tenant's arrivals and
        a usage report spend its budgets at the rate limit service."""
        controller, policy = self.controller, triple.policy
        arrival = controller.machine.intake.request("POST", "/v1/chat/completions", triple.headers,
                                                    triple.body)
        tenant, job = arrival.tenant, arrival.job
        for name, load in triple.loads.items():
            for _ in range(load.inflight):
                decision = controller.submit(name, tenant, job)
                if decision.outcome is not Outcome.ADMITTED:
                    if decision.outcome is Outcome.QUEUED:
                        controller.release(decision.ticket, learn=False)
                    break
        for name, load in triple.loads.items():
            for _ in range(load.queued):
                decision = controller.submit(name, tenant, job)
                if decision.outcome is Outcome.ADMITTED:
                    controller.release(decision.ticket, learn=False)
                if decision.outcome is not Outcome.QUEUED:
                    break
        if triple.spent.retry_budget and policy.retry_budget.enabled:
            for _ in range(100_000):
                decision = controller.submit(arrival.lane, "other-client", type(job)(None, 1, 1), retry=True)
                if decision.reason is not None and decision.reason.value == "retry_budget":
                    break
                controller.release(decision.ticket, learn=False)
        config = policy.ratelimit
        limits = config.budgets.of(tenant)
        entries = {"generic_key": config.request_descriptor,
                   **controller.machine.intake.descriptor("POST", "/v1/chat/completions", triple.headers)}
        if triple.spent.tenant_requests and config.mode != "off" and limits.requests is not None:
            hits = 1
            while hits >= 1:
                answer = self.edge.decide(_rls(config.domain, entries, hits))
                # (In shadow mode a refusal is answered OK, and says so in the metadata.)
                refused = answer.statuses[0].code == rls_pb2.RateLimitResponse.OVER_LIMIT \
                    or "shadow" in answer.dynamic_metadata.fields
                hits = hits // 2 if refused else hits * 2
        if triple.spent.tenant_tokens and config.mode != "off" and limits.tokens is not None:
            usage = {"generic_key": config.usage_descriptor,
                     **{k: v for k, v in triple.headers.items() if k in policy.trusted_headers}}
            self.edge.decide(_rls(config.domain, usage, int(limits.tokens * limits.burst) + 2))

    async def answer(self, triple: Triple) -> Verdict:
        head = pb.ProcessingRequest()
        head.request_headers.end_of_stream = triple.body is None
        for key, value in (":method", "POST"), (":path", "/v1/chat/completions"), *triple.headers.items(), \
                ("x-extproc-edge", "1"):
            head.request_headers.headers.headers.add(key=key, raw_value=value.encode())
        body = pb.ProcessingRequest()
        body.request_body.body = triple.body or b""
        body.request_body.end_of_stream = True
        answers: list[pb.ProcessingResponse] = []
        more = asyncio.Event()

        async def messages() -> AsyncIterator[pb.ProcessingRequest]:
            yield head
            await more.wait()
            if triple.body is not None:
                yield body
            await asyncio.Event().wait()

        stream = self.processor.Process(messages(), None)
        try:
            async for response in stream:
                answers.append(response)
                if response.mode_override.request_body_mode == ProcessingMode.BUFFERED_PARTIAL:
                    more.set()  # the body is asked for
                    continue
                break
        finally:
            await stream.aclose()
        return _verdict(answers[-1])


def _rls(domain: str, entries: dict[str, str], hits: int) -> rls_pb2.RateLimitRequest:
    request = rls_pb2.RateLimitRequest(domain=domain)
    descriptor = request.descriptors.add()
    descriptor.hits_addend.value = hits
    for key, value in entries.items():
        descriptor.entries.add(key=key, value=value)
    return request


def _verdict(response: pb.ProcessingResponse) -> Verdict:
    if response.HasField("override_message_timeout"):
        return Verdict("ext_proc", "held", None, None, None)
    if response.HasField("immediate_response"):
        shed = response.immediate_response
        headers = {h.header.key: h.header.raw_value.decode() for h in shed.headers.set_headers}
        at = "edge" if headers.get("x-envoy-ratelimited") == "true" else "ext_proc"
        return Verdict(at, "rejected", headers.get("x-extproc-reason"), shed.status.code,
                       headers.get("retry-after"))
    return Verdict("ext_proc", "admitted", None, None, None)


def test_explain_answers_as_the_live_servicer_and_rate_limit_service_do() -> None:
    disagreements = []
    kinds: dict[tuple[str, str], int] = {}
    reasons: set[str | None] = set()

    async def run() -> None:
        for seed in range(TRIPLES):
            triple = random_triple(seed)
            said = explained(triple, seed)
            live = Live(triple.policy, seed)
            live.reach(triple)
            answered = await live.answer(triple)
            kinds[(answered.at, answered.outcome)] = kinds.get((answered.at, answered.outcome), 0) + 1
            reasons.add(answered.reason)
            if said != answered:
                disagreements.append((seed, said, answered))

    asyncio.run(run())
    assert disagreements[:5] == []
    # The triples reach every kind of answer, so the comparison can fail on each.
    assert {("ext_proc", "admitted"), ("ext_proc", "held"), ("ext_proc", "rejected"),
            ("edge", "rejected")} <= set(kinds), kinds
    # ... and the refusals of bodies: one extproc cannot read (refused by policy), a token limit refused.
    assert {"unsupported_encoding", "bad_request"} <= reasons, reasons

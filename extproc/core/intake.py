"""One intake: what a request is, the way every part sees it.

How this works: a request arrives as method, path, headers and perhaps a first body chunk;
it leaves as a classified request — lane, tenant, rule, the job the estimator sizes, whether
it is a retry — or as a refusal (a header classification reads came twice; a body the
model servers would refuse, or one extproc cannot read when the policy refuses those). The live
ext_proc handler calls :meth:`Intake.head` on the request headers and :meth:`Intake.arrival`
once it has the body (or knows it will not read one); ``policy explain`` and the simulator
call :meth:`Intake.request` in one go; the edge, which never sees a body, asks
:meth:`Intake.lanes` for every lane the request could land in. Each step is here once, so
the answers cannot drift apart:

* client-sent ``x-extproc-*`` headers the policy does not trust are dropped first;
* a header the policy trusts may come once: twice is a refusal, never a merged value;
* the model comes from the policy's model header, else from the body;
* the body is read only when the policy needs it (and is there), within ``max_body_bytes``;
* a body whose token limit the model servers refuse is refused (400 bad_request), as they would;
  one extproc cannot decode is sized as the largest job the policy expects, or refused (415
  unsupported_encoding), as ``estimation.unreadable_body`` says (:meth:`Intake.refusal`);
* a request whose retry header (``x-stainless-retry-count``) is above 0 is a retry.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from extproc.core.body import BodyFacts, read_request_body
from extproc.core.classify import HEADER_PREFIX, Classification, Classifier, RequestFacts
from extproc.core.decision import Reason
from extproc.core.estimate import Estimator, Job
from extproc.core.overload import ARRIVAL_HEADER
from extproc.core.retry_budget import is_retry
from extproc.core.usage import FILTER_HEADER
from extproc.policy.schema import Policy

_NO_BODY = BodyFacts()
#: Set by the proxy (never by a client: its first filter strips every x-extproc-*) when its ratelimit
#: filter sends no arrival descriptor: ext_proc then judges the arrival at the edge itself, in the
#: headers phase, one gRPC call fewer per request (servers/extproc.py).
EDGE_HEADER = "x-extproc-edge"
#: Added by the ratelimit filter to a request whose arrival the rate limit call judged (after the
#: proxy's strip: no client can send it): ext_proc then does not judge it again, even told to.
JUDGED_HEADER = "x-extproc-edge-judged"
#: The proxy's own word to ext_proc: read, never dropped as a client's (the routes drop them).
PROXY_HEADERS = frozenset({FILTER_HEADER, EDGE_HEADER, JUDGED_HEADER, ARRIVAL_HEADER})


@dataclass(frozen=True, slots=True)
class Head:
    """A request as its headers tell it."""

    method: str
    path: str
    headers: Mapping[str, str]
    """Lower-case names, untrusted ``x-extproc-*`` already dropped."""
    stripped: tuple[str, ...]
    """The client's ``x-extproc-*`` headers that were dropped."""
    model: str | None
    """From the policy's model header (None: not sent, or no model header)."""
    request_id: str
    read_body: bool
    """Whether the body is to be read before deciding (the policy needs it and one is coming)."""
    repeated: str | None = None
    """A trusted header that came more than once: the request is refused, never classified."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request refused at its intake, before it is classified: why, and the words for its client."""

    reason: Reason
    detail: str


@dataclass(frozen=True, slots=True)
class Arrival:
    """A classified request, ready for admission."""

    head: Head
    facts: RequestFacts
    body: BodyFacts
    body_read: bool
    classification: Classification
    job: Job
    retry: bool

    @property
    def lane(self) -> str:
        return self.classification.lane

    @property
    def tenant(self) -> str:
        return self.classification.tenant

    @property
    def model_from(self) -> str:
        """Where the model came from, in words ("" when no model is known)."""
        if self.head.model is not None:
            return "header"
        return "body" if self.facts.model is not None else ""


class Intake:
    """The intake of one policy (build a new one when the policy changes)."""

    def __init__(self, policy: Policy, estimator: Estimator | None = None) -> None:
        self.policy = policy
        self.classifier = Classifier(policy)
        self.estimator = estimator or Estimator(policy.estimation)
        self._trusted = frozenset(policy.trusted_headers)
        self._model_header = policy.estimation.model_header
        self._needs_body = policy.needs_body
        # Recognised whether or not the retry budget is on: a retry may claim its booked return.
        self._retry_header: str | None = policy.retry_budget.header
        #: The headers an arrival descriptor carries (the policy's trusted ones and the retry header),
        #: when the edge is judged in ext_proc: what the ratelimit filter's descriptor would list.
        named = policy.trusted_headers
        if self._retry_header:
            named = (*named, self._retry_header)
        self.edge_headers = tuple(dict.fromkeys(named))

    def descriptor(self, method: str, path: str, headers: Mapping[str, str]) -> dict[str, str]:
        """The arrival descriptor's entries the proxy's ratelimit filter sends for a request (besides
        ``generic_key``): its method and path, and the headers the policy reads (``edge_headers``)."""
        out = {"method": method, "path": path}
        out.update((name, headers[name]) for name in self.edge_headers if name in headers)
        return out

    def trusted(self, name: str) -> bool:
        return name in self._trusted

    def head(self, method: str, path: str, headers: Mapping[str, str], *, repeated: Iterable[str] = (),
             has_body: bool = True) -> Head:
        """The request headers (lower-case names; a repeated header's values joined with commas,
        its name in ``repeated``), and whether a body follows."""
        stripped = tuple(k for k in headers if k.startswith(HEADER_PREFIX) and k not in self._trusted
                         and k not in PROXY_HEADERS)
        if stripped:
            headers = {k: v for k, v in headers.items() if k not in stripped}
        twice = next((k for k in repeated if k in self._trusted), None)
        model = (headers.get(self._model_header) or None) if self._model_header else None
        return Head(method, path, headers, stripped, model, headers.get("x-request-id", ""),
                    self._needs_body and has_body, twice)

    def read(self, head: Head, chunk: bytes, end_of_stream: bool) -> BodyFacts:
        """What the first body chunk says, read within the policy's ``max_body_bytes``."""
        return read_request_body(chunk, end_of_stream, head.headers, self.policy.estimation.max_body_bytes)

    def refusal(self, body: BodyFacts) -> Refusal | None:
        """What a read body says of its request before it is classified: refused when it cannot be
        read and the policy refuses such bodies (415), or when the model servers would refuse its
        token limit (400); None: classify and decide it."""
        if body.unreadable and self.policy.estimation.unreadable_body == "refuse":
            return Refusal(Reason.UNSUPPORTED_ENCODING, f"{body.note[:1].upper()}{body.note[1:]}.")
        if body.invalid:
            return Refusal(Reason.BAD_REQUEST, f"{body.invalid}.")
        return None

    def arrival(self, head: Head, body: BodyFacts | None = None) -> Arrival:
        """Classify and size the request; ``body`` is what its body said (None: not read)."""
        facts_body = body or _NO_BODY
        model = head.model if head.model is not None else facts_body.model
        facts = RequestFacts(method=head.method, path=head.path, headers=head.headers, model=model,
                             request_id=head.request_id)
        classification = self.classifier.classify(facts)
        job = self.estimator.job(model, facts_body.prompt_chars, facts_body.prompt_tokens,
                                 facts_body.max_tokens, unreadable=facts_body.unreadable)
        retry = self._retry_header is not None and is_retry(head.headers, self._retry_header)
        return Arrival(head, facts, facts_body, body is not None, classification, job, retry)

    def request(self, method: str, path: str, headers: Mapping[str, str], body: bytes | None = None,
                *, repeated: Iterable[str] = ()) -> Arrival:
        """The whole intake at once, the body (if any) arriving in one chunk as Envoy hands it over
        when it fits its buffer. A request without a content-length is taken at its body's size."""
        head = self.head(method, path, headers, repeated=repeated, has_body=bool(body))
        if not head.read_body or body is None:
            return self.arrival(head)
        if "content-length" not in head.headers:
            head = replace(head, headers={**head.headers, "content-length": str(len(body))})
        return self.arrival(head, self.read(head, body, True))

    def sized(self, head: Head, *, model: str | None, prompt_tokens: int, output_tokens: int | None
              ) -> Arrival:
        """The request whose body is known only by its sizes (a replayed trace): as if its body had
        said so, when the policy reads bodies, and as if unread otherwise."""
        if not head.read_body:
            return self.arrival(head)
        said = BodyFacts(model=model, max_tokens=output_tokens, prompt_tokens=prompt_tokens)
        return self.arrival(head, said)

    def tenant(self, method: str, path: str, headers: Mapping[str, str]) -> str:
        """The request's tenant, from its headers alone."""
        head = self.head(method, path, headers, has_body=False)
        return self.classifier.tenant(RequestFacts(method, path, head.headers, head.model))

    def lanes(self, method: str, path: str, headers: Mapping[str, str]) -> list[str]:
        """Every lane the request could land in before its body is read (the edge's view): one,
        unless a rule on the model decides and the model is not in a header."""
        head = self.head(method, path, headers)
        if head.model is not None or not self.classifier.models:
            return [self.arrival(head).lane]
        out: list[str] = []
        for model in (None, *self.classifier.models):
            facts = RequestFacts(method=method, path=path, headers=head.headers, model=model)
            lane = self.classifier.classify(facts).lane
            if lane not in out:
                out.append(lane)
        return out

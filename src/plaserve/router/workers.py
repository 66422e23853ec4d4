"""Per-worker state: health, circuit breaker, requests in flight, and the virtual backlog.

A request is priced on a worker by its cost model, after what the worker's prefix cache likely holds
of its prompt (:mod:`plaserve.router.prefixes`).

The virtual backlog ``B_k`` of worker ``k`` is the predicted prefill work (seconds, by the worker's
cost model) that stands between a new request and its first token there:

* **router accounting**: every request adds its predicted cost when it is dispatched and takes it
  away when its first token comes back, so ``B_k`` = the sum over requests still waiting for their
  first token;
* **reconciled with ``/load``** when the worker reports one (plaserve workers): the reported
  ``backlog_s`` (short + long) is the worker's own view, which also knows partial progress, cache hits
  and requests from other clients. A report asked for at ``sent`` and received at ``received`` (both
  dated back by the report's ``age_s``, how old the state it describes was: plaserve publishes it as
  each engine step starts) is drained at one second of work per second since ``received`` (a busy
  worker works off its queue in real time) and the router adds the costs of its requests dispatched
  after ``sent`` that still wait for a first token, which the report cannot contain:

      B_k(now) = max(0, backlog_s - max(now - received, done)) + sum(cost of waiting requests dispatched after sent)

  where ``done`` sums the costs of the requests the report contains (dispatched before ``sent``) whose
  first token has come back since: a finished prefill is work the worker has certainly done, however
  little time passed (without it a report taken while the previous turn of a conversation waited
  would keep that turn's cost on the worker after its answer, and steer the next turn away from the
  cache that holds its history). A request dispatched at the very instant of ``sent`` counts as
  unseen: counting it twice is the safe error.
  A report older than ``load_stale_s`` is ignored and the router's accounting is used alone, as for
  backends without ``/load``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Sequence

from plaserve.cost import CostModel
from plaserve.router.breaker import CircuitBreaker
from plaserve.router.config import BreakerConfig
from plaserve.router.prefixes import PrefixIndex, PromptKey


@dataclass
class InFlight:
    """One request the router has sent to a worker and not seen finish."""

    cost: float  # predicted prefill seconds on this worker
    tokens: int  # prompt tokens (all prompts of the request)
    length_class: str
    dispatched: float  # router clock
    prefill_done: bool = False  # first token seen


@dataclass(frozen=True)
class LoadReport:
    """What a worker's ``GET /load`` said, and when."""

    backlog_s: float
    sent: float  # router clock when the poll was sent
    received: float  # ...and when the answer arrived
    num_requests: int | None = None


class Worker:
    """One backend server, as the router sees it.

    Times are the router's monotonic clock, passed in by the caller, so that every decision made from
    this state can be replayed in tests.
    """

    def __init__(
        self,
        url: str,
        cost_model: CostModel,
        breaker: BreakerConfig,
        *,
        healthy: bool = True,
        prefix_cache_tokens: int = 0,
    ) -> None:
        self.url = url.rstrip("/")
        self.cost_model = (
            cost_model  # the model that prices requests here (see plaserve.router.costs)
        )
        self.reports_cost = False  # the cost model is the worker's own, from its /load
        self.breaker = CircuitBreaker(breaker)
        self.healthy = healthy
        self.removed = False  # deleted by the operator: no new requests; those in flight finish
        self.inflight: dict[int, InFlight] = {}
        self._load: LoadReport | None = None
        self._load_done = 0.0  # costs of the requests in the report whose first token came since
        self.supports_load: bool | None = None  # None: not asked yet
        self.supports_tokenize: bool | None = None
        self.response_prefix: str | None = None  # the ids of the Responses it keeps (its /load)
        # the prompts sent here, as far as its prefix cache holds them (its /load resizes it)
        self.prefixes = PrefixIndex(prefix_cache_tokens)
        self.cached_tokens_total = 0  # prompt tokens priced as cached here, every request so far
        # ...and what the worker says it served from its cache, ever (its /load; None: it does not)
        self.cache_hit_tokens: int | None = None
        self.health_path = (
            "/health"  # becomes /v1/models for servers with only the OpenAI endpoints
        )
        self.check_failures = 0  # consecutive failed health checks
        self.check_successes = 0
        self.requests_total = 0
        self.work_total = 0.0  # predicted prefill seconds of every request dispatched here
        self.failures_total = 0
        # Requests waiting for their first byte from this worker: cancelled when it goes unhealthy,
        # so they try elsewhere at once instead of waiting for a timeout.
        self.waiting: set[asyncio.Task] = set()
        self.abandoned: set[asyncio.Task] = set()

    def __repr__(self) -> str:
        return f"Worker({self.url!r}, healthy={self.healthy}, inflight={len(self.inflight)})"

    @property
    def load(self) -> LoadReport | None:
        """The latest ``/load`` report (None: none, or the worker left the rotation)."""
        return self._load

    @load.setter
    def load(self, report: LoadReport | None) -> None:
        self._load, self._load_done = report, 0.0

    # --- what policies read ------------------------------------------------------------------
    def cost(self, tokens: Sequence[int], prompt: PromptKey | None = None) -> float:
        """Predicted prefill seconds of a request with these prompt lengths (one entry per prompt);
        one prompt with its ``prompt`` key is priced after the part of it likely cached here."""
        if prompt is not None and len(tokens) == 1:
            h = self.prefixes.cached_tokens(prompt, tokens[0])
            return self.cost_model.prefill_time(tokens[0] - h, h)
        return sum(self.cost_model.prefill_time(n) for n in tokens)

    def backlog(self, now: float, load_stale_s: float = float("inf")) -> float:
        """The virtual backlog ``B_k`` in seconds (module docstring)."""
        report = self.load
        if report is None or now - report.received > load_stale_s:
            return sum(r.cost for r in self.inflight.values() if not r.prefill_done)
        unseen = sum(
            r.cost
            for r in self.inflight.values()
            if not r.prefill_done and r.dispatched >= report.sent
        )
        return self._reported_left(report, now) + unseen

    def _reported_left(self, report: LoadReport, now: float) -> float:
        """What is left at ``now`` of the backlog ``report`` counted."""
        return max(0.0, report.backlog_s - max(now - report.received, self._load_done))

    @property
    def num_inflight(self) -> int:
        """Requests sent and not finished (prefill or decode)."""
        return len(self.inflight)

    @property
    def inflight_tokens(self) -> int:
        """Prompt tokens of the requests sent and not finished."""
        return sum(r.tokens for r in self.inflight.values())

    def available(self, now: float) -> bool:
        """Whether new requests may be sent here."""
        return self.healthy and not self.removed and self.breaker.allows(now)

    # --- what the proxy reports ----------------------------------------------------------------
    def start(
        self,
        rid: int,
        cost: float,
        tokens: int,
        length_class: str,
        now: float,
        prompt: PromptKey | None = None,
    ) -> None:
        """A request was dispatched here (its ``prompt`` is remembered as cached here from now)."""
        if prompt is not None:
            self.cached_tokens_total += self.prefixes.cached_tokens(prompt, tokens)
            self.prefixes.add(prompt)
        self.inflight[rid] = InFlight(cost, tokens, length_class, now)
        self.requests_total += 1
        self.work_total += cost
        self.breaker.on_dispatch(now)

    def first_token(self, rid: int) -> None:
        """The request's first token came back: its prefill is no longer in the backlog."""
        entry = self.inflight.get(rid)
        if entry is None or entry.prefill_done:
            return
        entry.prefill_done = True
        if self._load is not None and entry.dispatched < self._load.sent:
            self._load_done += entry.cost

    def finish(self, rid: int, ok: bool, now: float, *, worker_fault: bool | None = None) -> None:
        """The request left this worker. ``worker_fault`` (default: not ``ok``) feeds the breaker;
        a client that went away or a 4xx answer is not the worker's fault."""
        self.inflight.pop(rid, None)
        fault = (not ok) if worker_fault is None else worker_fault
        if fault:
            self.failures_total += 1
            self.breaker.record_failure(now)
        elif ok:
            self.breaker.record_success()

    def set_healthy(self, healthy: bool) -> None:
        """Enter or leave the rotation; leaving it cancels the requests still waiting for a first byte."""
        self.healthy = healthy
        if not healthy:
            for task in list(self.waiting):
                self.abandoned.add(task)
                task.cancel()

    def remove(self) -> None:
        """The operator removed the worker: no new requests; those in flight finish there."""
        self.removed = True

    def drain_eta(self, level: float, now: float, load_stale_s: float) -> float | None:
        """Seconds until the backlog falls to ``level`` by the worker working off its reported backlog
        alone (None: it will not, without an event such as a first token, or it is there already)."""
        report = self.load
        if report is None or now - report.received > load_stale_s:
            return None
        excess = self.backlog(now, load_stale_s) - level
        if not 0 < excess <= self._reported_left(report, now):
            return None
        # the reported part drains once the time since the report passes what first tokens took off
        return excess + max(0.0, self._load_done - (now - report.received))

    def describe(self, now: float, load_stale_s: float) -> dict:
        """The worker's state as JSON (``GET /workers``)."""
        return {
            "url": self.url,
            "healthy": self.healthy,
            "breaker": self.breaker.state(now),
            "available": self.available(now),
            "backlog_s": round(self.backlog(now, load_stale_s), 6),
            "inflight": self.num_inflight,
            "inflight_tokens": self.inflight_tokens,
            "requests_total": self.requests_total,
            "failures_total": self.failures_total,
            "supports_load": self.supports_load,
            "health_path": self.health_path,
            "cost_model": self.cost_model.as_dict(),
            "prefix_index": {"chunks": len(self.prefixes), "capacity": self.prefixes.capacity},
            "cached_tokens_total": self.cached_tokens_total,
            "cache_hit_tokens": self.cache_hit_tokens,
        }

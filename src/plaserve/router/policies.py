"""Routing policies: which worker gets a request, and when.

Every policy picks from the workers in rotation (healthy, not removed, circuit not open), given the
request's prompt lengths and class. The proxy keeps the state they read
(:class:`plaserve.router.workers.Worker`) and calls them with its clock, so decisions replay exactly
in tests.

Baselines (dispatch at once, ties to the worker listed first):

* ``round_robin``: the next worker in turn.
* ``least_requests``: fewest requests in flight.
* ``least_tokens``: fewest prompt tokens in flight (requests sent and not finished).
* ``power_of_two``: two workers drawn at random, the one with fewer requests in flight.

``pla`` (prefill-length-aware). A request's *finish* on worker ``k`` is ``B_k + cost_k``: the
virtual backlog plus the request's own predicted prefill, i.e. when its first token would come there.
With two or more workers, ``R`` of them form the short pool (its size set by the controller in
:mod:`plaserve.router.pools`; which workers, floats: those kept clear).

* A **short** request goes to the earliest finish. That is a short-pool worker unless a long-pool one
  is as free; short prompts are cheap, so one there barely delays long work.
* A **long** request may go to worker ``k`` when ``B_k`` is under ``long_hold_horizon_s`` *and*, with
  it added, at least ``R`` workers still have a backlog within ``short_spill_budget_s``: a short
  request then never queues longer than that behind long work. Of those workers, the earliest finish.
  When none qualifies, the request *waits in the router* (FIFO) until one does, instead of being
  committed to a queue where it would sit behind seconds of work while another worker frees up
  first. When the oldest waiting request cannot go anywhere, a younger one that can goes first (a
  small long prompt that fits the budget of a clear worker).
* Among equally early workers (idle ones), the one given the least work so far: it spreads work
  evenly when nothing else tells the workers apart.

Below two workers, or while no short request has come for the controller's window, no worker is
kept clear (``R = 0``); the horizon still applies.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Sequence

from plaserve.router.config import RouterConfig
from plaserve.router.pools import LONG, SHORT, PoolController
from plaserve.router.prefixes import PromptKey
from plaserve.router.workers import Worker


@dataclass(frozen=True)
class Job:
    """What a policy knows of a request."""

    tokens: tuple[int, ...]  # prompt tokens of each prompt (a completion request may carry several)
    length_class: str  # SHORT or LONG
    arrival: float = 0.0  # router clock when the request came in
    prompt: PromptKey | None = None  # its one prompt's key: priced after each worker's cached part

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)

    @classmethod
    def of(
        cls,
        tokens: tuple[int, ...],
        prompt: PromptKey | None,
        arrival: float,
        short_threshold: int,
        workers: Sequence[Worker],
    ) -> "Job":
        """A request's job, classed by the tokens it would prefill on the worker that likely caches
        most of its prompt (the workers' schedulers class it by its uncached tokens too)."""
        new = sum(tokens)
        if prompt is not None and len(tokens) == 1:
            new -= max((w.prefixes.cached_tokens(prompt, new) for w in workers), default=0)
        return cls(tokens, SHORT if new < short_threshold else LONG, arrival, prompt)


class Policy:
    """Base class. :meth:`choose` places a new request; policies that may hold requests back also
    implement :meth:`next_held`."""

    name = ""

    def choose(self, job: Job, workers: Sequence[Worker], now: float) -> Worker | None:
        """The worker for ``job`` among ``workers`` (non-empty, all in rotation), or None to hold the
        job in the router until :meth:`next_held` releases it."""
        raise NotImplementedError

    def next_held(
        self, held: Sequence[Job], workers: Sequence[Worker], now: float
    ) -> tuple[int, Worker] | None:
        """Which held job (its index in ``held``, oldest first) may go now, and where; None: none."""
        return None

    def choose_now(self, job: Job, workers: Sequence[Worker], now: float) -> Worker:
        """A worker for ``job`` without holding it (a retry after a failure should not wait again)."""
        chosen = self.choose(job, workers, now)
        return chosen if chosen is not None else workers[0]

    def next_wakeup(self, workers: Sequence[Worker], now: float) -> float | None:
        """Seconds after which a held job may be placeable with no event in between (None: only an
        event can change that)."""
        return None

    def on_dispatch(self, job: Job, worker: Worker, cost: float, now: float) -> None:
        """``job`` is being sent to ``worker`` (called before its backlog includes the job)."""

    def on_first_token(self, job: Job, worker: Worker, cost: float, now: float) -> None:
        """A streamed ``job`` got its first token from ``worker``."""

    def tick(self, workers: Sequence[Worker], now: float) -> None:
        """Periodic housekeeping (the pool controller), with the workers in rotation."""

    def describe(self, now: float) -> dict:
        return {"policy": self.name}


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, job: Job, workers: Sequence[Worker], now: float) -> Worker:
        return workers[next(self._counter) % len(workers)]


class LeastRequests(Policy):
    name = "least_requests"

    def choose(self, job: Job, workers: Sequence[Worker], now: float) -> Worker:
        return min(workers, key=lambda w: w.num_inflight)


class LeastTokens(Policy):
    name = "least_tokens"

    def choose(self, job: Job, workers: Sequence[Worker], now: float) -> Worker:
        return min(workers, key=lambda w: w.inflight_tokens)


class PowerOfTwo(Policy):
    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, job: Job, workers: Sequence[Worker], now: float) -> Worker:
        if len(workers) == 1:
            return workers[0]
        i, j = sorted(self._rng.sample(range(len(workers)), 2))
        return workers[j] if workers[j].num_inflight < workers[i].num_inflight else workers[i]


class PlaPolicy(Policy):
    """Length-aware routing with a floating short pool (module docstring)."""

    name = "pla"
    max_scan = 64  # held requests looked at per release, oldest first: bounds the work per event

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pools = PoolController(config.pools)
        self._stale = config.health.load_stale_s
        self._budget = config.pools.short_spill_budget_s
        self._horizon = config.pools.long_hold_horizon_s

    def backlog(self, w: Worker, now: float) -> float:
        return w.backlog(now, self._stale)

    def _place(
        self, job: Job, workers: Sequence[Worker], backlogs: list[float], now: float
    ) -> Worker | None:
        costs = [w.cost(job.tokens, job.prompt) for w in workers]
        if job.length_class == SHORT:
            i = min(
                range(len(workers)), key=lambda i: (backlogs[i] + costs[i], workers[i].work_total)
            )
            return workers[i]
        clear, reserve = sum(b <= self._budget for b in backlogs), self.pools.reserved(now)
        best: tuple[float, float, int] | None = None
        for i, w in enumerate(workers):
            if backlogs[i] >= self._horizon:
                continue
            # Workers within the budget after this request lands on worker i.
            still_clear = (
                clear - (backlogs[i] <= self._budget) + (backlogs[i] + costs[i] <= self._budget)
            )
            if still_clear < reserve:
                continue
            key = (backlogs[i] + costs[i], w.work_total, i)
            if best is None or key < best:
                best = key
        return None if best is None else workers[best[2]]

    def choose(self, job: Job, workers: Sequence[Worker], now: float) -> Worker | None:
        self.pools.set_workers(len(workers), now)
        return self._place(job, workers, [self.backlog(w, now) for w in workers], now)

    def next_held(
        self, held: Sequence[Job], workers: Sequence[Worker], now: float
    ) -> tuple[int, Worker] | None:
        self.pools.set_workers(len(workers), now)
        backlogs = [self.backlog(w, now) for w in workers]
        for i, job in enumerate(held[: self.max_scan]):
            w = self._place(job, workers, backlogs, now)
            if w is not None:
                return i, w
        return None

    def choose_now(self, job: Job, workers: Sequence[Worker], now: float) -> Worker:
        chosen = self.choose(job, workers, now)
        if chosen is not None:
            return chosen
        return min(
            workers,
            key=lambda w: (self.backlog(w, now) + w.cost(job.tokens, job.prompt), w.work_total),
        )

    def next_wakeup(self, workers: Sequence[Worker], now: float) -> float | None:
        # Reported backlogs drain with time: the next moment one crosses the horizon or the budget.
        # A millisecond past the crossing, so the backlog is under the level when we look again.
        etas = [
            eta
            for w in workers
            for level in (self._horizon, self._budget)
            if (eta := w.drain_eta(level, now, self._stale)) is not None
        ]
        return min(etas) + 1e-3 if etas else None

    def on_dispatch(self, job: Job, worker: Worker, cost: float, now: float) -> None:
        # Predicted TTFT as the client sees it: time already spent in the router, plus the backlog,
        # plus the request's own prefill.
        predicted = (now - job.arrival) + self.backlog(worker, now) + cost
        self.pools.observe_dispatch(
            job.length_class, predicted, self.config.slo.for_cost(cost), now
        )

    def on_first_token(self, job: Job, worker: Worker, cost: float, now: float) -> None:
        self.pools.observe_first_token(
            job.length_class, now - job.arrival, self.config.slo.for_cost(cost), now
        )

    def tick(self, workers: Sequence[Worker], now: float) -> None:
        self.pools.set_workers(len(workers), now)
        self.pools.tick(now)

    def short_pool(self, workers: Sequence[Worker], now: float) -> list[Worker]:
        """The workers kept clear now (the least backlog first): the short pool as it stands."""
        return sorted(workers, key=lambda w: self.backlog(w, now))[: self.pools.reserved(now)]

    def describe(self, now: float) -> dict:
        return {"policy": self.name, "pools": self.pools.describe(now)}


def make_policy(config: RouterConfig) -> Policy:
    """The policy ``config.policy`` names."""
    if config.policy == "pla":
        return PlaPolicy(config)
    if config.policy == "power_of_two":
        return PowerOfTwo(config.seed)
    return {
        "round_robin": RoundRobin,
        "least_requests": LeastRequests,
        "least_tokens": LeastTokens,
    }[config.policy]()

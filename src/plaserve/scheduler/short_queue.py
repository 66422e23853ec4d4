"""pla's short queue: deadline order, the batch forming at its head, and when that batch leaves.

Short requests wait in earliest-deadline order. A batch forms at the head; it leaves when it is full
or when the batch window (:class:`~plaserve.scheduler.window.AdaptiveWindow`) since its oldest member
ends. Once it leaves, its members are *ready*: the head-of-line guarantee counts from then, and a
ready request keeps its place whatever the late set says.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from plaserve.request import Request
from plaserve.scheduler.buckets import batch_sizes, make_buckets
from plaserve.scheduler.deadlines import DeadlinePlan, deadline
from plaserve.scheduler.window import AdaptiveWindow


@dataclass
class ShortBatch:
    """The batch forming at the head of the short queue: its members in priority order, the length
    they are padded to (None: varlen, each its own length) and how many members make it full."""

    reqs: list[Request]
    bucket: int | None
    target: int

    def tokens(self, req: Request) -> int:
        """Tokens ``req`` costs in the batch: its padded length, or its uncached prompt."""
        return self.bucket or req.uncached_estimate


class ShortQueue:
    """The short requests' window, length buckets and ready set.

    ``threshold``: prompts with fewer uncached tokens are short (the largest bucket holds them);
    ``max_batch``: the deepest static batch size; ``w_min``, ``w_max``: the window's bounds.
    """

    def __init__(self, threshold: int, max_batch: int, w_min: float, w_max: float) -> None:
        self.buckets = make_buckets(threshold)
        self.batch_sizes = batch_sizes(max_batch)
        self.window = AdaptiveWindow(w_min, w_max)
        self.ready: dict[Request, float] = {}  # request -> when its batch's window closed
        self.last_dispatch = float("-inf")  # when the last short batch ran

    def observe_arrival(self, req: Request) -> None:
        self.window.observe_arrival(req.metrics.arrival_time)

    def forget(self, req: Request) -> None:
        """Drop a finished request's state."""
        self.ready.pop(req, None)

    def candidates(self, waiting: Iterable[Request], plan: DeadlinePlan) -> list[Request]:
        """Waiting short requests, most urgent first: the ready ones by deadline (nothing passes them:
        the head-of-line guarantee), then the others by deadline, those the late set gives up
        (:meth:`DeadlinePlan.yields`) after the rest."""

        def key(r: Request) -> tuple[bool, bool, float]:
            forming = r not in self.ready
            return forming, forming and plan.yields(r), deadline(r)

        return sorted((r for r in waiting if r.length_class == "short"), key=key)

    def fill(
        self,
        cands: list[Request],
        tokens: Callable[[Request], int],
        max_tokens: int,
        plan: DeadlinePlan,
    ) -> list[Request]:
        """``cands[0]`` and, in order, each later candidate that fits in ``max_tokens`` (counting
        ``tokens(r)`` per request) and keeps the batch's predicted finish, were it to run now with the
        riders, within the deadline of every member that is on time in it and does not yield: in a
        burst one large batch would make all its members late, where smaller ones keep most on time.

        A member late already as it joins (its deadline before the batch's finish with it) bounds
        nothing: any later batch would serve it later still, so a smaller batch cannot bring it back
        on time and only puts off everyone behind it. Where every candidate is that late (deep in a
        burst) the batch fills the token budget, as fcfs fills a step (docs/POLICIES.md, "Bursts")."""
        c0 = plan.cost.c0
        batch: list[Request] = []
        # tokens, predicted seconds, earliest deadline of the members on time
        used, work, due = (
            0,
            c0 + plan.rider_time,
            float("inf"),
        )
        for r in cands:
            n = tokens(r)
            w = plan.cost.prefill_time(n) - c0
            finish = plan.now + work + w
            if batch and (used + n > max_tokens or finish > due):
                continue
            if not plan.yields(r) and deadline(r) >= finish:
                due = min(due, deadline(r))
            batch.append(r)
            used, work = used + n, work + w
        return batch

    def ready_at(self, batch: ShortBatch) -> float:
        """When ``batch`` leaves: once full, else at the end of its window (at once where the window is
        shut). The window is at most ``W_max``, tens of milliseconds against SLOs of a quarter second and
        more, so a batch does not also leave early on low deadline slack (docs/POLICIES.md says what
        dropping that rule changed)."""
        arrivals = [r.metrics.arrival_time for r in batch.reqs]
        oldest = min(arrivals)
        if len(batch.reqs) >= batch.target:
            # Full since its last member arrived; the members are in priority order, not arrival order,
            # so that may be later than the longest window would have let the oldest wait.
            return min(max(arrivals[: batch.target]), oldest + self.window.w_max)
        return oldest + self.window.width(batch.target, len(batch.reqs))

    def mark_ready(self, reqs: Iterable[Request], at: float) -> None:
        """Record ``reqs`` as ready from ``at`` (a request stays ready from the first time)."""
        for r in reqs:
            if r not in self.ready:
                self.ready[r] = max(at, self.last_dispatch, r.metrics.arrival_time)

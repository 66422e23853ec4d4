"""The deadline plan of one pla decision: each request's TTFT deadline, the late set, the riders' time.

A :class:`DeadlinePlan` is built at the start of every decision (``schedule`` or ``next_wakeup``) from
the queues as they stand and thrown away after it: nothing it computes outlives the decision, so no
cache has to be reset when a request arrives, is preempted or finishes.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TypeVar

from plaserve.cost import CostModel
from plaserve.request import Request, RequestStatus

T = TypeVar("T")


def moore_hodgson_late(
    jobs: Iterable[T], start: float, work: Callable[[T], float], deadline: Callable[[T], float]
) -> set[T]:
    """The jobs that one machine serving ``jobs`` from ``start`` with the fewest late ones leaves late
    (Moore-Hodgson: earliest deadline first; whenever a job would finish late, give up the longest taken
    so far; of equally long ones, the latest in that order). Exact when all jobs are ready at ``start``.
    The jobs must be distinct objects that hash by identity (or indices)."""
    t, taken, late = start, [], set()
    for i, job in enumerate(sorted(jobs, key=deadline)):
        w = work(job)
        t += w
        heapq.heappush(taken, (-w, -i, job))
        if t > deadline(job):
            longest, _, dropped = heapq.heappop(taken)
            t += longest
            late.add(dropped)
    return late


def deadline(req: Request) -> float:
    """When ``req``'s first token is due: arrival plus its TTFT SLO."""
    return req.metrics.arrival_time + req.ttft_slo


def tokens_left(req: Request) -> tuple[int, int]:
    """The prefill tokens ``req`` has still to compute and the history they attend to: for a waiting
    request, its uncached prompt after its cached prefix; for one under way, the rest of its prompt."""
    if req.status is RequestStatus.WAITING:
        return req.uncached_estimate, req.num_prompt_tokens - req.uncached_estimate
    return req.num_pending_tokens, req.num_computed_tokens


@dataclass
class DeadlinePlan:
    """What one decision at time ``now`` knows about deadlines.

    ``pending``: the waiting requests (prefills under way keep going whatever the plan says, so they
    are left out; docs/POLICIES.md: counting them changed next to nothing); ``riders``:
    the decoding requests whose tokens ride along a short batch (none where short batches run padded);
    ``late_yield``: how many of its SLOs a late request yields for (0: never).
    """

    now: float
    cost: CostModel
    pending: Sequence[Request]
    riders: Sequence[Request]
    late_yield: float

    @cached_property
    def rider_time(self) -> float:
        """Predicted time the riders add to a short batch. The deadline checks count it: with a few
        dozen requests decoding it is a good part of a short batch's time on a CPU. It counts every
        rider even where a backlog keeps them off the batch: an upper bound."""
        if not self.riders:
            return 0.0
        return self.cost.batch_time([(1, r.num_tokens) for r in self.riders]) - self.cost.c0

    @cached_property
    def late(self) -> frozenset[Request]:
        """The pending prefills that a schedule making the fewest of them late would leave late, if
        nothing else arrived: Moore-Hodgson over the pending prefills, from the end of the next step's
        fixed costs (``c0`` and the riders), each priced with the history it attends to. It gives up a
        request that could still make its deadline where serving it would make others miss theirs,
        which a test of each request on its own misses."""
        c0 = self.cost.c0
        return frozenset(
            moore_hodgson_late(
                self.pending,
                self.now + c0 + self.rider_time,
                lambda r: self.cost.prefill_time(*tokens_left(r)) - c0,
                deadline,
            )
        )

    def yields(self, req: Request) -> bool:
        """Whether ``req`` gives way to the requests that can still meet their deadlines: the late set
        holds it and it has waited less than ``late_yield`` of its SLOs (so it cannot starve)."""
        if self.now - req.metrics.arrival_time >= self.late_yield * req.ttft_slo:
            return False
        return req in self.late

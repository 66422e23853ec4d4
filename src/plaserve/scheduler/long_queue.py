"""pla's long queue: the order long prefills advance in, and the size of the next chunk."""

from __future__ import annotations

from collections.abc import Iterable

from plaserve.request import Request
from plaserve.scheduler.deadlines import DeadlinePlan, tokens_left


class LongQueue:
    """Long prefills: aged shortest-first, advanced one chunk per long step.

    ``chunk_size``: prefill tokens per chunk; ``max_tokens``: the per-step token budget no chunk
    exceeds; ``aging``: seconds of predicted work one second of waiting is worth in the order.
    """

    def __init__(self, chunk_size: int, max_tokens: int, aging: float) -> None:
        self.chunk_size, self.max_tokens, self.aging = chunk_size, max_tokens, aging

    def order(
        self, running: Iterable[Request], waiting: Iterable[Request], plan: DeadlinePlan
    ) -> list[Request]:
        """Long prefills in the order they advance: those under way first (a started prompt keeps
        going, so its blocks are not held idle), then waiting ones by :meth:`priority`, those the late
        set gives up (:meth:`DeadlinePlan.yields`) after the rest."""
        under_way = [r for r in running if r.length_class == "long" and r.in_prefill]
        queued = [r for r in waiting if r.length_class == "long"]
        return under_way + sorted(queued, key=lambda r: (plan.yields(r), self.priority(r, plan)))

    def priority(self, req: Request, plan: DeadlinePlan) -> float:
        """Shortest predicted prefill first, aged: each second of waiting counts as ``aging`` seconds
        less work, so a long request waits behind shorter ones only for a bounded time."""
        waited = plan.now - req.metrics.arrival_time
        return plan.cost.prefill_time(req.uncached_estimate) - self.aging * waited

    def chunk_budget(self, queue: list[Request], whole: bool = False) -> int:
        """Prefill tokens of the next chunk. ``whole``: the step budget, as fcfs runs a prompt (where no
        short prompt is there to pass it, cutting it only adds per-step costs, and the decodes riding
        each chunk, to its TTFT). Otherwise ``chunk_size``, stretched by up to half a chunk (within the
        step budget) when that finishes the head of ``queue``: a stub left over would wait behind up to
        ``K`` short batches for a step of its own, adding their time to its TTFT for little work."""
        if whole:
            return self.max_tokens
        if not queue:
            return self.chunk_size
        left, _ = tokens_left(queue[0])  # a waiting request's cached prefix is not computed again
        stretched = min(self.chunk_size + self.chunk_size // 2, self.max_tokens)
        return left if self.chunk_size < left <= stretched else self.chunk_size

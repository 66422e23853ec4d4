"""What every scheduling policy shares: the queues, KV-block bookkeeping, admission, preemption.

A policy subclasses :class:`Scheduler` and implements :meth:`Scheduler.schedule`, which picks the work
of one engine step as a :class:`ScheduledBatch`. The scheduler never touches the model: the engine (or
a test, or the simulator) executes the batch and reports back with :meth:`Scheduler.on_batch_done`.
What the engine needs of any policy goes through this class: the static shapes to build runners for
(:meth:`Scheduler.static_shapes`) and the cost model to schedule by (:meth:`Scheduler.set_cost_model`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from plaserve.config import SchedulerConfig
from plaserve.cost import CostModel
from plaserve.kv_blocks import BlockAllocator
from plaserve.request import Request, RequestStatus


@dataclass
class BatchItem:
    """Compute ``num_tokens`` tokens of ``request`` starting at its ``num_computed_tokens``."""

    request: Request
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this item completes the request's pending tokens, so a token is sampled."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


@dataclass
class ScheduledBatch:
    """The work of one engine step.

    ``kind`` names the step for metrics and policies ("mixed", "short", "long", "decode").
    ``bucket`` is set when the prefill items run as one right-padded static-shape batch of that length.
    """

    items: list[BatchItem]
    kind: str = "mixed"
    bucket: int | None = None
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    """Base scheduler: owns the waiting queue, the running set and every request's KV blocks."""

    name = "base"

    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, cost: CostModel) -> None:
        self.config = config
        self.kv = allocator
        self.cost = cost
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # --- queue membership -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a new request, classified short or long by its tokens left after the prefix cache."""
        uncached = req.num_prompt_tokens - self.kv.peek_prefix(
            req.token_ids[: req.num_reusable_tokens]
        )
        self.classify(req, uncached)
        self.waiting.append(req)

    def classify(self, req: Request, uncached: int) -> None:
        """Set what the policies read of a request with ``uncached`` prompt tokens to compute: that
        estimate, its length class (short below ``short_threshold``) and its TTFT SLO."""
        req.uncached_estimate = uncached
        req.length_class = "short" if uncached < self.config.short_threshold else "long"
        req.ttft_slo = self.config.slo.ttft(self.cost, uncached)

    def static_shapes(self) -> list[tuple[int, int]]:
        """The ``(batch, bucket)`` shapes the policy runs right-padded batches in: the static runners
        (CUDA graphs) the engine builds. None by default: every step runs varlen."""
        return []

    def long_chunk_size(self) -> int | None:
        """Prefill tokens per long chunk under the current cost model; None: the policy does not cut
        long prompts into chunks of their own (fcfs and spf fill a token budget)."""
        return None

    def set_cost_model(self, cost: CostModel) -> None:
        """Schedule by ``cost`` from the next decision on (the engine's online refit replaces it)."""
        self.cost = cost

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def next_wakeup(self, now: float) -> float | None:
        """When :meth:`schedule` will next have work if nothing arrives (None: no work left)."""
        return now if self.has_unfinished() else None

    def finish(self, req: Request, reason: str) -> None:
        """Mark ``req`` finished (``"stop"``, ``"length"``, ``"abort"``, or ``"error"`` when no token could
        be sampled) and free its blocks."""
        if req.finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.free(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason

    # --- KV blocks ---------------------------------------------------------------------------
    def blocks_needed(self, req: Request, num_tokens: int) -> int:
        """New blocks ``req`` needs so its first ``num_computed + num_tokens`` slots exist."""
        bs = self.kv.block_size
        return max(0, -(-(req.num_computed_tokens + num_tokens) // bs) - len(req.block_table))

    def can_reserve(self, req: Request, num_tokens: int) -> bool:
        return self.kv.can_allocate(self.blocks_needed(req, num_tokens))

    def reserve(self, req: Request, num_tokens: int) -> None:
        req.block_table += self.kv.allocate(self.blocks_needed(req, num_tokens))

    def admit(self, req: Request) -> None:
        """Attach the longest cached prefix to a request that holds no blocks yet.

        At least one token is always left to compute, because sampling needs its logits (and with
        prompt logprobs, every token whose logits they still need; see ``Request.num_reusable_tokens``).
        """
        assert not req.block_table
        req.block_table = self.kv.match_prefix(req.token_ids[: req.num_reusable_tokens])
        req.num_committed_blocks = len(req.block_table)
        req.num_computed_tokens = len(req.block_table) * self.kv.block_size
        if not req.output_token_ids:  # the first admission, not a recompute after preemption
            req.metrics.num_cached_tokens = req.num_computed_tokens

    def free(self, req: Request) -> None:
        """Give back every block of ``req``."""
        self.kv.release(req.block_table)
        req.block_table, req.num_computed_tokens, req.num_committed_blocks = [], 0, 0

    def preempt(self, req: Request) -> None:
        """Take ``req``'s blocks away; it goes back to the head of the queue and is recomputed later
        (its prefix is likely still in the cache)."""
        self.running.remove(req)
        self.free(req)
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)

    def try_start(self, req: Request, max_tokens: int) -> int:
        """Admit waiting ``req``, reserve blocks for up to ``max_tokens`` of it and move it to running.

        Returns the tokens reserved (0 when there was no room; the request then stays waiting as it was).
        """
        if not req.block_table:
            self.admit(req)
        n = min(req.num_pending_tokens, max_tokens)
        if n <= 0 or not self.can_reserve(req, n):
            self.free(req)
            return 0
        self.reserve(req, n)
        self.waiting.remove(req)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        return n

    def reserve_or_preempt(
        self, req: Request, num_tokens: int, scheduled: list[BatchItem], preempted: list[Request]
    ) -> bool:
        """Reserve blocks for a running request, preempting the newest running requests that are
        not in ``scheduled`` when memory is short. False if ``req`` itself had to go."""
        while not self.can_reserve(req, num_tokens):
            # Built only when memory is short: for every request of a decode batch it would cost
            # O(batch) each, O(batch^2) a step.
            busy = {id(item.request) for item in scheduled}
            victims = [r for r in self.running if id(r) not in busy]
            victim = victims[-1]  # req itself is unscheduled, so never empty
            self.preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        self.reserve(req, num_tokens)
        return True

    def pack(
        self, order: list[Request], budget: int, items: list[BatchItem], preempted: list[Request]
    ) -> int:
        """Append work for the requests of ``order`` to ``items`` within ``budget`` tokens: a running
        request continues (preempting newer ones if memory is short), a waiting one starts. Stops at the
        first request that cannot start. Returns the budget left."""
        for req in order:
            if budget == 0:
                break
            if req.status is RequestStatus.RUNNING:
                n = min(req.num_pending_tokens, budget)
                if not self.reserve_or_preempt(req, n, items, preempted):
                    continue
            else:
                # No new starts in a step that had to preempt, nor beyond the sequence limit.
                if preempted or len(self.running) >= self.max_num_seqs:
                    break
                n = self.try_start(req, budget)
                if n == 0:
                    break
            items.append(BatchItem(req, n))
            budget -= n
        return budget

    # --- the step -----------------------------------------------------------------------------
    def schedule(self, now: float) -> ScheduledBatch:
        """The work of the next step (possibly empty). Implemented by each policy."""
        raise NotImplementedError

    def on_batch_done(self, batch: ScheduledBatch, start: float, end: float) -> None:
        """Advance computed-token counts after ``batch`` ran and index newly full blocks."""
        for item in batch.items:
            req = item.request
            if req.finished:  # aborted while the step ran
                continue
            if req.in_prefill and item.num_tokens > 0:
                req.metrics.prefill_chunks.append((start, end, item.num_tokens))
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = start
            req.num_computed_tokens += item.num_tokens
            req.num_committed_blocks = self.kv.commit(
                req.block_table, req.token_ids, req.num_computed_tokens, req.num_committed_blocks
            )

"""Step policies. ``fcfs`` is vLLM's default behaviour: first come first served, chunked prefill
under a per-step token budget, decodes mixed into the same step."""

from __future__ import annotations

from plaserve.scheduler.base import BatchItem, ScheduledBatch, Scheduler


class FcfsScheduler(Scheduler):
    """First come, first served with chunked prefill and decode mixed in (vLLM's default)."""

    name = "fcfs"

    def schedule(self, now: float) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        items: list[BatchItem] = []
        preempted = []
        # Running requests first (decodes and unfinished prefills), oldest first.
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted by an older request in this loop
                continue
            n = min(req.num_pending_tokens, budget)
            if self.reserve_or_preempt(req, n, items, preempted):
                items.append(BatchItem(req, n))
                budget -= n
        # Then new requests in arrival order while budget, sequence slots and memory last.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            n = self.try_start(req, budget)
            if n == 0:
                break
            items.append(BatchItem(req, n))
            budget -= n
        return ScheduledBatch(items, kind="mixed", preempted=preempted)

"""How pla composes one step from its parts: short batches padded to static shapes, or varlen.

Each step runs one of a short batch, a long chunk or a decode batch. What else rides along depends on
how short batches run:

* :class:`StaticComposer` — right-padded to a ``(batch, bucket)`` grid shape (a CUDA graph on a GPU).
  A padded batch cannot carry other work, so decodes ride long chunks and get a step of their own when
  the cadence makes them due.
* :class:`VarlenComposer` — each prompt at its own length (CPU, where padding would be pure extra
  compute). Decodes ride every step, except while shorts are backed up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from plaserve.request import Request
from plaserve.scheduler.base import ScheduledBatch
from plaserve.scheduler.buckets import pick_bucket_batch
from plaserve.scheduler.deadlines import DeadlinePlan
from plaserve.scheduler.short_queue import ShortBatch, ShortQueue

if TYPE_CHECKING:
    from plaserve.scheduler.pla import PlaScheduler


@dataclass
class Decision:
    """What one pla decision has found before it composes the step."""

    plan: DeadlinePlan
    decodes: list[Request]  # requests decoding now
    long_pending: bool  # a long prefill is waiting or under way
    short: ShortBatch | None  # the batch forming at the head of the short queue
    short_ready: bool  # ...and it leaves now
    waiting_shorts: int  # short requests waiting
    decode_due: bool  # the cadence wants decodes in this step
    long_due: bool  # the cadence wants a long chunk in this step


class Composer(Protocol):
    """How short batches form and how one step is put together around them."""

    shorts_carry_decodes: bool  # decodes ride short batches (so their deadline checks count them)

    def static_shapes(self) -> list[tuple[int, int]]:
        """The ``(batch, bucket)`` shapes short batches run in (none: varlen)."""
        ...

    def form(self, cands: list[Request], plan: DeadlinePlan) -> ShortBatch:
        """The batch forming from ``cands`` (the short queue's candidates, most urgent first; not empty)."""
        ...

    def compose(self, s: PlaScheduler, d: Decision) -> ScheduledBatch:
        """The step to run (empty: nothing to do)."""
        ...


class StaticComposer:
    """Short batches run right-padded to a static ``(batch, bucket)`` shape.

    ``token_cap``: the most tokens, padding included, one padded batch may hold (the step budget, and
    the engine's graph-memory budget when it sets one).
    """

    shorts_carry_decodes = False  # a padded batch has no room for decode rows

    def __init__(self, shorts: ShortQueue, token_cap: int) -> None:
        self.shorts, self.token_cap = shorts, token_cap

    def max_batch_for(self, bucket: int) -> int:
        """Deepest batch size for ``bucket`` within :attr:`token_cap` (at least 1)."""
        cap = max(1, self.token_cap // bucket)
        return max(b for b in self.shorts.batch_sizes if b <= cap)

    def static_shapes(self) -> list[tuple[int, int]]:
        """Every ``(batch, bucket)`` a short batch can have. A bucket larger than :attr:`token_cap` gets
        no entry: its batches take the varlen fallback."""
        return [
            (b, k)
            for k in self.shorts.buckets
            for b in self.shorts.batch_sizes
            if b <= self.max_batch_for(k) and b * k <= self.token_cap
        ]

    def form(self, cands: list[Request], plan: DeadlinePlan) -> ShortBatch:
        """The head request's bucket and the next candidates of that bucket, as deep as the cap allows,
        each joining only if the batch stays on time (:meth:`ShortQueue.fill`)."""
        reqs, bucket = pick_bucket_batch(
            cands, lambda r: r.uncached_estimate, self.shorts.buckets, self.max_batch_for
        )
        depth = self.max_batch_for(bucket)
        return ShortBatch(
            self.shorts.fill(reqs, lambda r: bucket, depth * bucket, plan), bucket, depth
        )

    def compose(self, s: PlaScheduler, d: Decision) -> ScheduledBatch:
        batch = s.decode_step(d.decodes) if d.decode_due else ScheduledBatch([])
        if not batch and d.short_ready and not d.long_due:
            items = s.start_shorts(d.short.reqs, d.short.bucket)
            # A request that hit the prefix cache after all cannot run padded from position 0: the batch
            # then takes the varlen eager path (a grid fallback).
            padded = all(it.request.num_computed_tokens == 0 for it in items)
            batch = ScheduledBatch(items, kind="short", bucket=d.short.bucket if padded else None)
        if not batch and d.long_pending:
            batch = s.long_step(d.plan, d.decodes)
        return batch or s.decode_step(d.decodes)


class VarlenComposer:
    """Short batches run varlen: any lengths together, up to the step's token budget."""

    shorts_carry_decodes = True

    def __init__(self, shorts: ShortQueue, max_tokens: int, threshold: int) -> None:
        self.shorts, self.max_tokens, self.threshold = shorts, max_tokens, threshold

    def static_shapes(self) -> list[tuple[int, int]]:
        return []

    def form(self, cands: list[Request], plan: DeadlinePlan) -> ShortBatch:
        """Candidates of any length up to the token budget, each joining only if the batch stays on time
        (:meth:`ShortQueue.fill`). Full at as many requests of the batch's mean length as the budget holds."""
        reqs = self.shorts.fill(cands, lambda r: r.uncached_estimate, self.max_tokens, plan)
        mean = max(1.0, sum(r.uncached_estimate for r in reqs) / len(reqs))
        return ShortBatch(reqs, None, max(len(reqs), int(self.max_tokens // mean)))

    def backlog(self, d: Decision) -> bool:
        """Whether short requests are backed up: some wait, and either more of them than the forming batch
        takes or a long prefill competes with them. Then decodes ride only when the cadence makes them
        due: on a CPU a decode token costs about as much as a prompt token, and decodes riding every step
        of a backlog worked off one short batch at a time take a larger share of the machine than fcfs's
        fewer, larger steps give them; the backlog's TTFT pays for it."""
        return d.short is not None and (d.long_pending or d.waiting_shorts > len(d.short.reqs))

    def compose(self, s: PlaScheduler, d: Decision) -> ScheduledBatch:
        riders = d.decodes if d.decode_due or not self.backlog(d) else []
        batch = ScheduledBatch([])
        if d.short_ready and not d.long_due:
            batch = s.with_decodes(
                ScheduledBatch(s.start_shorts(d.short.reqs, self.threshold), kind="short"), riders
            )
        if not batch and d.long_pending:
            batch = s.long_step(d.plan, riders)
        return batch or s.decode_step(d.decodes)

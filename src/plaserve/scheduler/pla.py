"""``pla``, the prefill-length-aware policy, wired from its parts.

* :mod:`~plaserve.scheduler.deadlines` — the deadline plan of one decision (deadlines, the late set);
* :mod:`~plaserve.scheduler.short_queue` — the short queue: window, buckets, the forming batch;
* :mod:`~plaserve.scheduler.long_queue` — the long queue: aged order, chunk sizes;
* :mod:`~plaserve.scheduler.cadence` — the counters behind ``K`` and ``D``;
* :mod:`~plaserve.scheduler.busy` — how busy the machine has been (light load: long prompts run whole);
* :mod:`~plaserve.scheduler.compose` — the step: padded static short batches, or varlen.

The guarantees and the rules are in docs/ARCHITECTURE.md; what each rule changed, in docs/POLICIES.md.
"""

from __future__ import annotations

from plaserve.cost import CostModel, chunk_size_for
from plaserve.request import Request, RequestStatus
from plaserve.scheduler.base import BatchItem, ScheduledBatch, Scheduler
from plaserve.scheduler.busy import BusyMeter
from plaserve.scheduler.cadence import Cadence
from plaserve.scheduler.compose import Composer, Decision, StaticComposer, VarlenComposer
from plaserve.scheduler.deadlines import DeadlinePlan, tokens_left
from plaserve.scheduler.long_queue import LongQueue
from plaserve.scheduler.short_queue import ShortBatch, ShortQueue

# Short arrivals count as paused after this many of their mean gaps without one (and a chunk's time):
# a steady stream leaves a gap that long exp(-3), 5 %, of the time.
QUIET_GAPS = 3.0


class PlaScheduler(Scheduler):
    """Length-aware: a short and a long queue, an adaptive batch window, chunked long prefills and a
    cadence that bounds how long either kind, or a decode gap, can last."""

    name = "pla"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        c = self.config
        self.shorts = ShortQueue(c.short_threshold, c.max_short_batch, c.w_min, c.w_max)
        self.longs = LongQueue(self.long_chunk_size(), self.max_num_batched_tokens, c.long_aging)
        self.cadence = Cadence(c.max_consecutive_short, c.max_prefill_steps_between_decodes)
        self.busy = BusyMeter()
        if c.static_short_batches:
            cap = min(
                self.max_num_batched_tokens,
                c.max_static_batch_tokens or self.max_num_batched_tokens,
            )
            self.composer: Composer = StaticComposer(self.shorts, cap)
        else:
            self.composer = VarlenComposer(
                self.shorts, self.max_num_batched_tokens, c.short_threshold
            )

    def long_chunk_size(self) -> int:
        """Tokens per long chunk: the configured size, or where none is set the one
        :func:`~plaserve.cost.chunk_size_for` gives under the current cost model: the short threshold
        while the model has no per-step cost (as the FLOP-count model at start-up), larger once a
        fitted or refitted model finds small steps costly (as on bfloat16 CPUs), but never one
        predicted to take longer than the TTFT SLO floor (docs/POLICIES.md)."""
        c = self.config
        if c.long_chunk_size is not None:
            return c.long_chunk_size
        return chunk_size_for(
            self.cost, c.short_threshold, self.max_num_batched_tokens, c.slo.floor
        )

    def set_cost_model(self, cost: CostModel) -> None:
        super().set_cost_model(cost)
        self.longs.chunk_size = self.long_chunk_size()

    # --- queue membership -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        super().add(req)
        if req.length_class == "short":
            self.shorts.observe_arrival(req)

    def preempt(self, req: Request) -> None:
        super().preempt(req)
        # It recomputes prompt and output so far; a long recompute belongs on the chunked path.
        if req.num_tokens >= self.config.short_threshold:
            req.length_class = "long"

    def finish(self, req: Request, reason: str) -> None:
        super().finish(req, reason)
        self.shorts.forget(req)

    def static_shapes(self) -> list[tuple[int, int]]:
        return self.composer.static_shapes()

    # --- what one decision knows --------------------------------------------------------------
    def decoding(self) -> list[Request]:
        return [r for r in self.running if not r.in_prefill]

    def short_waits(self) -> bool:
        """Whether any short request is waiting."""
        return any(r.length_class == "short" for r in self.waiting)

    def long_pending(self) -> bool:
        """Whether any long prefill is waiting or under way."""
        return any(r.length_class == "long" for r in self.waiting) or any(
            r.length_class == "long" and r.in_prefill for r in self.running
        )

    def plan(self, now: float) -> DeadlinePlan:
        """The deadline plan of a decision at ``now``, over the queues as they stand."""
        riders = self.decoding() if self.composer.shorts_carry_decodes else []
        return DeadlinePlan(now, self.cost, list(self.waiting), riders, self.config.late_yield)

    def short_batch(self, plan: DeadlinePlan) -> ShortBatch | None:
        """The batch forming at the head of the short queue (None: no short waits)."""
        cands = self.shorts.candidates(self.waiting, plan)
        return self.composer.form(cands, plan) if cands else None

    def short_batch_plan(self, now: float) -> ShortBatch | None:
        """:meth:`short_batch` of a decision at ``now``."""
        return self.short_batch(self.plan(now))

    def next_wakeup(self, now: float) -> float | None:
        if self.running or self.long_pending():
            return now
        plan = self.plan(now)
        batch = self.short_batch(plan)
        return None if batch is None else max(now, self.shorts.ready_at(batch))

    # --- the step -------------------------------------------------------------------------
    def schedule(self, now: float) -> ScheduledBatch:
        plan = self.plan(now)
        decodes = self.decoding()
        long_pending = self.long_pending()
        short = self.short_batch(plan)
        ready_at = self.shorts.ready_at(short) if short is not None else None
        short_ready = ready_at is not None and ready_at <= now
        if short_ready:
            # The moment the head-of-line guarantee starts to count; ready requests keep their place.
            self.shorts.mark_ready(short.reqs, ready_at)
        decision = Decision(
            plan,
            decodes,
            long_pending,
            short,
            short_ready,
            sum(1 for r in self.waiting if r.length_class == "short"),
            self.cadence.decode_due(bool(decodes)),
            self.cadence.long_due(long_pending),
        )
        batch = self.composer.compose(self, decision)
        if batch.kind == "short":
            self.shorts.last_dispatch = now
        self.cadence.record(batch)
        return batch

    # --- the steps the composers build ------------------------------------------------------
    def add_decodes(
        self, items: list[BatchItem], preempted: list[Request], decodes: list[Request]
    ) -> None:
        """Append one token for every request of ``decodes`` still running (preempting if short of memory)."""
        for req in decodes:
            if req in self.running and self.reserve_or_preempt(req, 1, items, preempted):
                items.append(BatchItem(req, 1))

    def decode_step(self, decodes: list[Request]) -> ScheduledBatch:
        batch = ScheduledBatch([], kind="decode")
        self.add_decodes(batch.items, batch.preempted, decodes)
        return batch

    def with_decodes(self, batch: ScheduledBatch, decodes: list[Request]) -> ScheduledBatch:
        """Add one token for every decoding request to a varlen prefill step (none to an empty one)."""
        if batch.items:
            self.add_decodes(batch.items, batch.preempted, decodes)
        return batch

    def start_shorts(self, reqs: list[Request], max_tokens: int) -> list[BatchItem]:
        """Start short requests of ``reqs`` in order, each whole (at most ``max_tokens``), until one does
        not start."""
        items: list[BatchItem] = []
        for req in reqs:
            if len(self.running) >= self.max_num_seqs:
                break
            n = self.try_start(req, max_tokens)
            if n == 0:
                break
            if n < req.num_pending_tokens:
                # Its cached prefix was evicted since arrival: it is long now. Back to the queue.
                self.running.remove(req)
                self.free(req)
                self.waiting.appendleft(req)
                req.status = RequestStatus.WAITING
                req.length_class, req.uncached_estimate = "long", req.num_tokens
                continue
            items.append(BatchItem(req, n))
        return items

    def light_load(self, now: float) -> bool:
        """Whether the machine is lightly loaded: no short request waits, and steps took less than
        ``light_load`` (0.5) of the recent past (:class:`BusyMeter`; never before it has watched a whole
        horizon). Then a long prefill runs whole, as fcfs runs it: chunks are there to let shorts pass,
        and on a machine this idle few arrive meanwhile. In a busy spell chunks stay on, as the next
        short is likely to arrive while a whole prompt would hold the machine. docs/POLICIES.md ("The
        light-load threshold at 0.5") says why it is 0.5 and what the rules tried beside it changed."""
        if self.short_waits():
            return False
        share = self.busy.share(now)
        return share is not None and share < self.config.light_load

    def on_batch_done(self, batch: ScheduledBatch, start: float, end: float) -> None:
        super().on_batch_done(batch, start, end)
        self.busy.record(start, end)

    def shorts_quiet(self, now: float) -> bool:
        """Whether short requests have stopped coming for now: none waits, and none has arrived for
        :data:`QUIET_GAPS` of their mean gaps, nor for as long as a long chunk is predicted to take
        (as after a burst's shorts are served)."""
        if self.short_waits():
            return False
        chunk_time = self.cost.prefill_time(self.longs.chunk_size)
        return self.shorts.window.quiet(now, QUIET_GAPS, chunk_time)

    def long_step(self, plan: DeadlinePlan, decodes: list[Request]) -> ScheduledBatch:
        """One chunk (:meth:`LongQueue.chunk_budget`) of the request at the head of the long queue, with
        ``decodes`` riding along. Where short requests keep coming, the chunk holds that one request:
        topping a partial last chunk up from the next one starts that one early only for it to wait
        half done behind the shorts, and it then goes, under way, before the shorter long requests
        that arrive after it. Where they have stopped coming (:meth:`shorts_quiet`), the next long
        requests fill what the head leaves of the chunk, each only if that leaves it at most a chunk
        to go: two prompts of 1,000 tokens in one step cost much less than two steps of 1,000 (the
        step's fixed cost, the matmuls' rows; docs/POLICIES.md, "Topping a long chunk up")."""
        items: list[BatchItem] = []
        preempted: list[Request] = []
        queue = self.longs.order(self.running, self.waiting, plan)
        budget = self.longs.chunk_budget(queue, self.light_load(plan.now))
        budget = self.pack(queue[:1], budget, items, preempted)
        if self.shorts_quiet(plan.now):
            for req in queue[1:]:
                if budget == 0 or tokens_left(req)[0] - budget > self.longs.chunk_size:
                    break
                budget = self.pack([req], budget, items, preempted)
        return self.with_decodes(ScheduledBatch(items, kind="long", preempted=preempted), decodes)

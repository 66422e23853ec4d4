"""Step policies: what one engine step computes.

* ``fcfs`` — vLLM's default: first come first served; running requests (decodes and unfinished
  prefills) first, then new prompts, chunked to fill a per-step token budget; decodes share the step.
* ``spf`` — shortest prefill first: as fcfs, but waiting prompts start in order of their uncached
  length (SGLang's shortest-first style). Good for short TTFT; can starve long prompts.
* ``pla`` — prefill-length-aware (ours): short and long prompts in separate queues; each step runs one
  of a short batch (bucketed, right-padded, static shape), one long chunk, or a decode batch. Decodes
  ride along varlen steps; without static short batches, waiting shorts ride along long chunks too.
  Both queues are deadline-aware: shorts go earliest TTFT deadline first, longs shortest first (aged);
  in both, requests that the fewest-late order of the queue gives up wait behind the others (for a
  bounded time), and a short batch takes no member that would make another one late.

Guarantees of ``pla`` (``K = max_consecutive_short``, ``D = max_prefill_steps_between_decodes``):

* **Head of line.** Once its batch's window has closed and it is at the head of the short queue, a
  short request is dispatched after at most one long chunk (besides the step already running; a chunk
  is ``long_chunk_size`` tokens, or up to half as many again when that finishes a request); decode
  steps run in between only as the decode cadence requires.
* **Long progress.** While a long prefill is pending, at most ``K`` short batches run in a row before
  its next chunk. A long request at the head of the long queue with ``C`` chunks left therefore finishes
  its prefill within ``C * (K + 1)`` prefill steps (plus the decode steps between them).
* **Late requests.** A request that the fewest-late order of the queue would serve late (one that
  cannot make its SLO, or whose service would make others miss theirs) queues behind the others, but
  only until it has waited ``late_yield`` SLOs; then it takes its place by deadline (shorts) or aged
  length (longs) again. A short request whose window has closed keeps its place regardless. Under
  overload this is what keeps a burst's late requests from making the next ones late too.
* **Decode cadence.** While requests are decoding, at most ``D`` prefill steps without decode tokens
  run in a row, so a token's gap is bounded by ``D + 1`` steps. On the varlen path decodes ride along
  every prefill step unless short requests are backed up (:meth:`short_backlog`); then they ride every
  ``D + 1``-th step, and prefill goes first in between. With static short batches they ride every long
  chunk, and a decode step of their own follows at most ``D`` short batches.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import TypeVar

from plaserve.engine.request import Request, RequestStatus
from plaserve.scheduler.base import BatchItem, ScheduledBatch, Scheduler
from plaserve.scheduler.buckets import batch_sizes, make_buckets, pick_bucket_batch
from plaserve.scheduler.window import AdaptiveWindow

T = TypeVar("T")


class FcfsScheduler(Scheduler):
    """First come, first served with chunked prefill and decode mixed in (vLLM's default)."""

    name = "fcfs"

    def waiting_order(self) -> list[Request]:
        """The order in which waiting requests may start."""
        return list(self.waiting)

    def schedule(self, now: float) -> ScheduledBatch:
        items: list[BatchItem] = []
        preempted: list[Request] = []
        # Running requests first (decodes and unfinished prefills), oldest first; then new ones.
        self.pack([*self.running, *self.waiting_order()], self.max_num_batched_tokens, items, preempted)
        return ScheduledBatch(items, kind="mixed", preempted=preempted)


def moore_hodgson_late(jobs: Iterable[T], start: float, work: Callable[[T], float],
                       deadline: Callable[[T], float]) -> set[T]:
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


class SpfScheduler(FcfsScheduler):
    """Shortest (uncached) prefill first; otherwise identical to fcfs."""

    name = "spf"

    def waiting_order(self) -> list[Request]:
        # Stable sort: equal lengths keep arrival order. Lengths are the arrival-time estimates, so a
        # step does not re-hash every waiting prompt against the prefix cache.
        return sorted(self.waiting, key=lambda r: r.uncached_estimate)


class PlaScheduler(Scheduler):
    """Length-aware: dual queues, adaptive window, bucketed short batches, chunked longs, decode steps."""

    name = "pla"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        c = self.config
        self.buckets = make_buckets(c.short_threshold)
        self.batch_sizes = batch_sizes(c.max_short_batch)
        self.window = AdaptiveWindow(c.w_min, c.w_max)
        self.consecutive_short = 0  # short batches since the last long chunk
        self.prefill_steps_since_decode = 0
        self.last_short_dispatch = float("-inf")
        self._now = 0.0  # time of the step being scheduled (set by at())
        self._late: set[Request] | None = None  # late_set(), once computed for this time and queue
        self._rider_time: float | None = None  # rider_time(), once computed for this time

    @property
    def long_chunk_time(self) -> float:
        """Predicted time of one long chunk: the slack margin a short batch keeps."""
        return self.cost.prefill_time(self.config.long_chunk_size)

    # --- queues ---------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        super().add(req)
        self._late = None  # computed without it
        if req.length_class == "short":
            self.window.observe_arrival(req.metrics.arrival_time)

    def preempt(self, req: Request) -> None:
        super().preempt(req)
        self._late = None
        # It recomputes prompt and output so far; a long recompute belongs on the chunked path.
        if req.num_tokens >= self.config.short_threshold:
            req.length_class = "long"

    @property
    def static_token_cap(self) -> int:
        """Most tokens (padding included) one static short batch may hold: the per-batch token cap, and
        the engine's graph-memory budget (``max_static_batch_tokens``) when it sets one."""
        return min(self.max_num_batched_tokens, self.config.max_static_batch_tokens or self.max_num_batched_tokens)

    def max_batch_for(self, bucket: int) -> int:
        """Deepest batch size for ``bucket`` within :attr:`static_token_cap` (at least 1)."""
        cap = max(1, self.static_token_cap // bucket)
        return max(b for b in self.batch_sizes if b <= cap)

    def grid_shapes(self) -> list[tuple[int, int]]:
        """Every ``(batch, bucket)`` a short batch can have: the static runner grid to build. A bucket
        larger than :attr:`static_token_cap` gets no entry: its batches take the varlen fallback."""
        return [(b, k) for k in self.buckets for b in self.batch_sizes
                if b <= self.max_batch_for(k) and b * k <= self.static_token_cap]

    def _uncached(self, req: Request) -> int:
        return req.uncached_estimate

    def short_candidates(self) -> list[Request]:
        """Waiting short requests, most urgent first: those whose batch window already closed, by
        deadline (so the head-of-line guarantee holds: nothing passes them), then the others by deadline,
        except that a request the fewest-late order gives up goes after the others (see :meth:`yields`)."""
        shorts = [r for r in self.waiting if r.length_class == "short"]

        def key(r: Request) -> tuple[bool, bool, float]:
            waiting_for_window = r.metrics.ready_time is None
            return waiting_for_window, waiting_for_window and self.yields(r), self.deadline(r)
        return sorted(shorts, key=key)

    # --- deadlines ------------------------------------------------------------------------
    @staticmethod
    def deadline(req: Request) -> float:
        """When ``req``'s first token is due: arrival plus its TTFT SLO."""
        return req.metrics.arrival_time + req.ttft_slo

    def yields(self, req: Request) -> bool:
        """Whether ``req`` gives way to the requests that can still meet their deadlines: the fewest-late
        order of the queue serves it late (:meth:`late_set`), and it has waited less than ``late_yield``
        of its SLOs.

        Serving by urgency alone lets the requests an overload has already made late make the on-time
        ones late too; yielding serves the on-time ones first, and the bound keeps the late ones from
        starving.
        """
        waited = self._now - req.metrics.arrival_time
        if waited >= self.config.late_yield * req.ttft_slo:
            return False
        return req in self.late_set()

    def late_set(self) -> set[Request]:
        """The pending prefills that a schedule making the fewest of them late would leave late, if
        nothing else arrived: Moore-Hodgson over the queue as it stands (earliest deadline first; when one
        would finish late, the longest so far is given up), from the end of the next step's fixed costs
        (``c0`` and the decodes riding along), as :meth:`on_time_batch` prices a batch. It gives up a
        request that could still make its deadline where serving it would make another miss theirs,
        which a test of each request on its own misses. Prefills under way count like the rest, though
        the long queue runs them first: counting them as fixed cost more violations in simulated replays
        (454 against 441 over the code-trace slices), since short batches pass them anyway. Computed
        once per :meth:`at` and queue (the sort and the batch checks ask for it per request)."""
        if self._late is None:
            pending = [r for r in self.running if r.in_prefill] + list(self.waiting)
            self._late = moore_hodgson_late(pending, self._now + self.cost.c0 + self.rider_time(),
                                            lambda r: self.cost.prefill_time(*self._tokens_left(r)) - self.cost.c0,
                                            self.deadline)
        return self._late

    def _tokens_left(self, req: Request) -> tuple[int, int]:
        """The prefill tokens ``req`` has still to compute and the history they attend to: for a waiting
        request, its uncached prompt after its cached prefix; for one under way, the rest of its prompt."""
        if req.status is RequestStatus.WAITING:
            return self._uncached(req), req.num_prompt_tokens - self._uncached(req)
        return req.num_pending_tokens, req.num_computed_tokens

    def long_pending(self) -> bool:
        """Whether any long prefill is waiting or under way."""
        return any(r.length_class == "long" and (r in self.waiting or r.in_prefill)
                   for r in (*self.running, *self.waiting))

    def decoding(self) -> list[Request]:
        return [r for r in self.running if not r.in_prefill]

    def rider_time(self) -> float:
        """Predicted time the decoding requests add to a short batch they ride along (none with static
        batches, which leave decodes to steps of their own). The deadline checks count it: with a few
        dozen requests decoding it is a good part of a short batch's time on a CPU, and leaving it out
        let batches finish just after their members' deadlines. It counts every decoding request even
        where they will skip the batch (a backlog, :meth:`short_backlog`): an upper bound, which kept
        more requests on time in simulated replays than counting only the steps they ride."""
        if self._rider_time is None:  # asked for by every deadline check of a decision: once per at()
            decodes = [] if self.config.static_short_batches else self.decoding()
            self._rider_time = self.cost.batch_time([(1, r.num_tokens) for r in decodes]) - self.cost.c0 if decodes else 0.0
        return self._rider_time

    # --- the window -----------------------------------------------------------------------
    def short_batch_plan(self) -> tuple[list[Request], int | None] | None:
        """The batch forming at the head of the short queue, and its bucket (None: varlen).

        Static batches take one bucket, that of the most urgent request (see :func:`pick_bucket_batch`).
        Varlen batches need no common shape, so they take short requests of any length up to the
        per-batch token cap. Either way a request joins only if the batch stays predicted to meet the
        deadline of every member that is not given up (:meth:`on_time_batch`): on a burst, one
        large batch would make every member wait for all of them.
        """
        cands = self.short_candidates()
        if not cands:
            return None
        if self.config.static_short_batches:
            reqs, bucket = pick_bucket_batch(cands, self._uncached, self.buckets, self.max_batch_for)
            return self.on_time_batch(reqs, lambda r: bucket, self.max_batch_for(bucket) * bucket), bucket
        return self.on_time_batch(cands, self._uncached, self.max_num_batched_tokens), None

    def on_time_batch(self, cands: list[Request], tokens: Callable[[Request], int], max_tokens: int) -> list[Request]:
        """``cands[0]`` and, in order, each later candidate that fits in ``max_tokens`` (counting
        ``tokens(r)`` per request) and keeps the batch's predicted finish, if it ran now, within the
        deadline of every member that does not :meth:`yield <yields>`."""
        c0 = self.cost.c0
        batch: list[Request] = []
        # tokens, predicted seconds (decodes riding along included), earliest on-time deadline
        used, work, due = 0, c0 + self.rider_time(), float("inf")
        for r in cands:
            n = tokens(r)
            w = self.cost.prefill_time(n) - c0
            d = due if self.yields(r) else min(due, self.deadline(r))
            if batch and (used + n > max_tokens or self._now + work + w > d):
                continue
            batch.append(r)
            used, work, due = used + n, work + w, d
        return batch

    def _plan_target(self, plan: tuple[list[Request], int | None]) -> int:
        """How many requests make the planned batch full."""
        reqs, bucket = plan
        if bucket is not None:
            return self.max_batch_for(bucket)
        # Varlen: as many requests of the batch's mean length as the token cap holds.
        mean = max(1.0, sum(self._uncached(r) for r in reqs) / len(reqs))
        return max(len(reqs), int(self.max_num_batched_tokens // mean))

    def short_ready_at(self, plan: tuple[list[Request], int | None]) -> float:
        """Time at which the forming short batch must leave: window end, or earlier on low slack."""
        reqs, bucket = plan
        target = self._plan_target(plan)
        arrivals = [r.metrics.arrival_time for r in reqs]
        oldest = min(arrivals)
        if len(reqs) >= target:
            # Full since its last member arrived; the members are in priority order, not arrival order,
            # so that may be later than the longest window would have let the oldest wait.
            return min(max(arrivals[:target]), oldest + self.window.w_max)
        window_end = oldest + self.window.width(target, len(reqs))
        # Deadline slack: leave when waiting longer would leave less than one long chunk of margin
        # between the predicted finish and the tightest TTFT deadline.
        exec_time = self.cost.batch_time([(bucket or self._uncached(r), 0) for r in reqs]) + self.rider_time()
        slack_end = min(self.deadline(r) for r in reqs) - exec_time - self.long_chunk_time
        return min(window_end, slack_end)

    def at(self, now: float) -> None:
        """Set the time the next decision is made at (the deadline checks read it); the late set is
        computed afresh for it."""
        self._now, self._late, self._rider_time = now, None, None

    def next_wakeup(self, now: float) -> float | None:
        self.at(now)
        if self.running or self.long_pending():
            return now
        plan = self.short_batch_plan()
        return None if plan is None else max(now, self.short_ready_at(plan))

    # --- the step -------------------------------------------------------------------------
    def schedule(self, now: float) -> ScheduledBatch:
        c = self.config
        self.at(now)
        decodes = self.decoding()
        long_pending = self.long_pending()
        plan = self.short_batch_plan()
        ready_at = self.short_ready_at(plan) if plan is not None else None
        short_ready = ready_at is not None and ready_at <= now
        if short_ready:
            # Ready = window closed and at the head of the short queue (ready requests keep their place
            # there, see short_candidates): the moment the head-of-line guarantee starts to count.
            for r in plan[0]:
                if r.metrics.ready_time is None:
                    r.metrics.ready_time = max(ready_at, self.last_short_dispatch, r.metrics.arrival_time)
        decode_due = bool(decodes) and self.prefill_steps_since_decode >= c.max_prefill_steps_between_decodes
        long_due = long_pending and self.consecutive_short >= c.max_consecutive_short
        # Decodes ride a varlen step unless shorts are backed up (then only when due); with static batches
        # they ride every long chunk, as a padded short batch cannot carry them.
        backlog = not c.static_short_batches and self.short_backlog(plan, long_pending)
        riders = decodes if decode_due or not backlog else []

        batch = ScheduledBatch([])
        if decode_due and c.static_short_batches:  # a padded short batch cannot carry decodes
            batch = self.schedule_decode(decodes)
        if not batch and short_ready and not long_due:
            batch = self.schedule_short(plan, riders)
        if not batch and long_pending:
            batch = self.schedule_long(riders)
        if not batch and decodes:
            batch = self.schedule_decode(decodes)

        if batch.kind == "short":
            self.last_short_dispatch = now
        if any(it.num_tokens == 1 and it.request.output_token_ids for it in batch.items):
            self.prefill_steps_since_decode = 0  # a decode step, or decodes rode along
        elif batch:
            self.prefill_steps_since_decode += 1
        if batch:
            self.consecutive_short = self.consecutive_short + 1 if batch.kind == "short" else 0 if batch.kind == "long" \
                else self.consecutive_short
        return batch

    def short_backlog(self, plan: tuple[list[Request], int | None] | None, long_pending: bool) -> bool:
        """Whether short requests are backed up: some are waiting, and either more of them than the
        planned batch takes or a long prefill competes with them.

        Decodes ride along every varlen prefill step, except during a backlog, where they ride only when
        the decode cadence makes them due. On a CPU a decode token costs about as much as a prompt
        token, so decodes riding every step of a backlog that is worked off one short batch at a time
        take a share of the machine that fcfs's fewer, larger steps do not give them, and the backlog's
        TTFT pays for it. The cadence still bounds their gaps."""
        if plan is None:
            return False
        return long_pending or sum(1 for r in self.waiting if r.length_class == "short") > len(plan[0])

    def schedule_decode(self, decodes: list[Request]) -> ScheduledBatch:
        items: list[BatchItem] = []
        preempted: list[Request] = []
        for req in decodes:
            if req in self.running and self.reserve_or_preempt(req, 1, items, preempted):
                items.append(BatchItem(req, 1))
        return ScheduledBatch(items, kind="decode", preempted=preempted)

    def start_shorts(self, reqs: list[Request], max_tokens: int, budget: int | None = None) -> list[BatchItem]:
        """Start short requests of ``reqs`` in order, each whole (at most ``max_tokens``), until one does
        not start or the next would exceed ``budget`` tokens in all."""
        items: list[BatchItem] = []
        for req in reqs:
            if len(self.running) >= self.max_num_seqs:
                break
            if budget is not None and self._uncached(req) > budget:
                break
            n = self.try_start(req, max_tokens)
            if n == 0:
                break
            if n < req.num_pending_tokens:
                # Its cached prefix was evicted since arrival: it is long now. Back to the queue.
                self.finish_partial(req)
                req.length_class, req.uncached_estimate = "long", req.num_tokens
                continue
            items.append(BatchItem(req, n))
            if budget is not None:
                budget -= n
        return items

    def schedule_short(self, plan: tuple[list[Request], int | None], decodes: list[Request]) -> ScheduledBatch:
        """The planned bucket batch: right-padded to its static shape, or, without static batches,
        varlen with the decodes riding along (as on long chunks)."""
        reqs, bucket = plan
        items = self.start_shorts(reqs, bucket or self.config.short_threshold)
        if not self.config.static_short_batches:
            return self.with_decodes(ScheduledBatch(items, kind="short"), decodes)
        # A request that hit the prefix cache after all cannot run padded from position 0: the batch
        # then takes the varlen eager path (a grid fallback).
        static = all(it.request.num_computed_tokens == 0 for it in items)
        return ScheduledBatch(items, kind="short", bucket=bucket if static else None)

    def with_decodes(self, batch: ScheduledBatch, decodes: list[Request]) -> ScheduledBatch:
        """Add one token for every decoding request to a varlen prefill step."""
        if batch.items:
            for req in decodes:
                if req in self.running and self.reserve_or_preempt(req, 1, batch.items, batch.preempted):
                    batch.items.append(BatchItem(req, 1))
        return batch

    def finish_partial(self, req: Request) -> None:
        """Undo :meth:`try_start` for ``req`` (back to the head of the queue, blocks freed)."""
        self.running.remove(req)
        self.free(req)
        self.waiting.appendleft(req)

    def long_queue(self) -> list[Request]:
        """Long prefills in the order they advance: running ones first, then waiting ones by
        :meth:`_long_priority`, those the fewest-late order gives up after the rest (:meth:`yields`)."""
        running = [r for r in self.running if r.length_class == "long" and r.in_prefill]
        waiting = [r for r in self.waiting if r.length_class == "long"]
        return running + sorted(waiting, key=lambda r: (self.yields(r), self._long_priority(r)))

    def _long_priority(self, req: Request) -> float:
        """Shortest predicted prefill first, aged: each second of waiting counts as ``long_aging``
        seconds less work, so a long request waits behind shorter ones only for a bounded time."""
        waited = self._now - req.metrics.arrival_time
        return self.cost.prefill_time(req.uncached_estimate) - self.config.long_aging * waited

    def long_chunk_budget(self, queue: list[Request]) -> int:
        """Prefill tokens of the next long chunk: ``long_chunk_size``, stretched by up to half a chunk
        (and never beyond the per-step token budget) to finish the head of the long ``queue``. A stub of
        less than half a chunk left over would wait behind up to ``K`` more short batches for a step of
        its own, which adds their time to the long request's TTFT for little work."""
        size = self.config.long_chunk_size
        if not queue:
            return size
        left, _ = self._tokens_left(queue[0])  # a waiting request's cached prefix is not computed again
        stretched = min(size + size // 2, self.max_num_batched_tokens)
        return left if size < left <= stretched else size

    def schedule_long(self, decodes: list[Request]) -> ScheduledBatch:
        """One chunk of prefill tokens (:meth:`long_chunk_budget`), packed from the head of the long
        queue (a request's last, partial chunk is topped up from the next), with ``decodes`` riding
        along: the step is varlen and eager anyway, and a decode token costs little beside a chunk.

        Without static short batches, the waiting short requests ride along too, whole, up to another
        ``long_chunk_size`` tokens: they start now instead of after their window and the chunk, and one
        larger step costs less than two (a fixed cost per step; matmuls over few rows run slower per
        token). A step with riders runs at most 2.5 chunks' tokens. With static batches (CUDA graphs)
        shorts keep to their padded runners."""
        c = self.config
        items: list[BatchItem] = []
        preempted: list[Request] = []
        queue = self.long_queue()
        self.pack(queue, self.long_chunk_budget(queue), items, preempted)
        if items and not preempted and not c.static_short_batches:
            riders = self.start_shorts(self.short_candidates(), c.short_threshold, budget=c.long_chunk_size)
            for it in riders:  # dispatched at once: ready now for the head-of-line accounting
                if it.request.metrics.ready_time is None:
                    it.request.metrics.ready_time = self._now
            items += riders
        return self.with_decodes(ScheduledBatch(items, kind="long", preempted=preempted), decodes)


POLICIES: dict[str, type[Scheduler]] = {cls.name: cls for cls in (PlaScheduler, FcfsScheduler, SpfScheduler)}

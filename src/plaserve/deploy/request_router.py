"""plaserve's pla routing policy as a Ray Serve request router (``ray.serve.request_router``).

Ray calls :meth:`PlaRequestRouter.choose_replicas` for every request sent through a handle to the
worker deployment, in the process that holds the handle (the ingress). The router ranks the
replicas by **predicted finish**: ``B_k + cost_k(request)``, the replica's virtual backlog of
predicted prefill seconds (quadratic in prompt length, by plaserve's cost model) plus the request's
own, exactly as ``plaserve route``'s ``pla`` policy does: the same
:class:`~plaserve.router.policies.PlaPolicy` makes the decision, over one
:class:`~plaserve.router.workers.Worker` per replica, so the short/long pools (a floating short pool
kept clear of long work, sized by the pressure controller), the spill budget and the hold horizon
are the router's. Each rank holds one replica, so Ray sends the request to the best replica with
room (``max_ongoing_requests``), else the next.

**What the backlog is built from**, as in ``plaserve route``:

* the replicas' reports: each replica's ``record_routing_stats`` (its server's ``/load``) reaches
  the router with the replica's info every ``request_routing_stats_period_s``; the report, dated
  by its ``as_of`` wall-clock time, drains at one second per second;
* the router's own accounting: a request's cost is added when the router chooses its replica
  (moved if Ray sends it to another) and removed at its first token (the ingress's notice) or when
  it completes (``on_request_completed``); requests routed after a report's ``as_of`` are added to
  it.

**Holding long requests.** When ``PlaPolicy`` would hold a long request (every replica has more
than the hold horizon queued, or taking it would leave the short pool without a clear replica) the
router returns no replica and Ray retries after its back-off (25 ms, doubling), up to
``max_hold_s``; then the request goes to its earliest finish regardless, so no request waits in
the router for ever.

**What the ingress passes.** The handle call's keyword arguments ``tokens`` (prompt lengths) and
``length_class`` price the request (:mod:`plaserve.deploy.ingress` estimates them before sending);
``job_id`` names it in the ingress's first-token notice (:mod:`plaserve.deploy.notices`), on which
its prefill leaves the backlog, as at a first token in ``plaserve route`` (Ray itself reports only
completion). A call without them is priced as one token and leaves the backlog at completion.
``response_id`` (a Response that continues a kept one, or a read of one) sends the call to the
replica whose server keeps that Response, known by the id's prefix in its routing stats.

The decisions are counted in the process's registry (:func:`plaserve.deploy.metrics.deploy_metrics`),
which the ingress serves on its ``/metrics``. Ray pickles this module *by value* into the process
that holds the handle, so nothing unpicklable (a registry, a lock) may live in it at module level:
the registry lives in :mod:`plaserve.deploy.metrics`, imported there by reference.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from plaserve.deploy import notices
from plaserve.deploy.metrics import deploy_metrics
from plaserve.router.config import RouterConfig
from plaserve.router.costs import DEFAULT_SHORT_THRESHOLD, cost_model_from_dict, default_cost_model
from plaserve.router.policies import Job, PlaPolicy
from plaserve.router.pools import LONG, SHORT
from plaserve.router.prefixes import PromptKey
from plaserve.router.workers import LoadReport, Worker


def report_from_stats(stats: dict[str, Any], now_wall: float, now: float) -> LoadReport | None:
    """A :class:`LoadReport` on the router's monotonic clock from a replica's routing stats (None when
    they have no backlog): the report's wall-clock ``as_of`` moved onto the monotonic clock."""
    try:
        backlog = float(stats["backlog_s"])
        as_of = float(stats["as_of"])
    except (KeyError, TypeError, ValueError):
        return None
    t = now - max(0.0, now_wall - as_of)
    return LoadReport(backlog_s=backlog, sent=t, received=t)


class PlaRequestRouter(RequestRouter):
    """Routes by plaserve's ``pla`` policy (module docstring). Options, through
    ``request_router_kwargs``: ``max_hold_s`` (5), ``load_stale_s`` (how old a report may be before
    only the router's own accounting counts; 3), ``short_spill_budget_s``, ``long_hold_horizon_s``,
    ``short_threshold`` (else the replicas' own)."""

    # Ray asks the chosen replica for its queue length before sending and moves on to the next rank
    # when the answer is late. Its 0.1 s default is missed on a loaded machine (an engine step holds
    # the replica's CPU), which would quietly turn the ranking into "whoever answers first".
    queue_len_response_deadline_s = 0.5
    max_queue_len_response_deadline_s = 5.0

    def initialize_state(
        self,
        max_hold_s: float = 5.0,
        load_stale_s: float = 3.0,
        short_spill_budget_s: float | None = None,
        long_hold_horizon_s: float | None = None,
        short_threshold: int | None = None,
    ) -> None:
        base = RouterConfig()
        pools = base.pools
        if short_spill_budget_s is not None:
            pools = replace(pools, short_spill_budget_s=short_spill_budget_s)
        if long_hold_horizon_s is not None:
            pools = replace(pools, long_hold_horizon_s=long_hold_horizon_s)
        self.config = replace(
            base, pools=pools, health=replace(base.health, load_stale_s=load_stale_s)
        )
        self.policy = PlaPolicy(self.config)
        self.max_hold_s = max_hold_s
        self.fixed_threshold = short_threshold
        self.workers: dict[ReplicaID, Worker] = {}
        self._jobs: dict[str, _Routed] = {}  # by Ray's internal request id
        self._by_job: dict[str, str] = {}  # the ingress's job id -> Ray's internal request id
        self._fallback_cost = default_cost_model()
        self.metrics = deploy_metrics().router
        self._loop: asyncio.AbstractEventLoop | None = None  # Ray's router loop, once seen
        notices.listen(self._notice)

    def _notice(self, job_id: str) -> None:
        # From the ingress's thread: handled on the router's loop, where its state is only touched.
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.first_token, job_id)

    def first_token(self, job_id: str) -> None:
        """A request routed here got its first token: its prefill leaves the backlog, and its TTFT
        feeds the pool controller (as ``plaserve route`` does)."""
        rid = self._by_job.get(job_id)
        entry = self._jobs.get(rid) if rid is not None else None
        w = self.workers.get(entry.replica) if entry is not None else None
        if w is None or rid not in w.inflight or w.inflight[rid].prefill_done:
            return
        w.first_token(rid)
        now = time.monotonic()
        self.policy.on_first_token(entry.job, w, w.inflight[rid].cost, now)

    # --- the replicas as plaserve Workers --------------------------------------------------------
    def _worker(self, replica: RunningReplica, now: float) -> Worker:
        rid = replica.replica_id
        w = self.workers.get(rid)
        if w is None:
            w = Worker(
                rid.unique_id,
                self._fallback_cost,
                self.config.breaker,
                prefix_cache_tokens=self.config.prefix_cache_tokens,
            )
            self.workers[rid] = w
        stats = replica.routing_stats or {}
        model = cost_model_from_dict(stats.get("cost_model"), source="replica")
        if model is not None:
            w.cost_model, w.reports_cost = model, True
        prefix = stats.get("response_prefix")
        w.response_prefix = prefix if isinstance(prefix, str) else None
        if isinstance(stats.get("cache_tokens"), int):
            w.prefixes.resize(stats["cache_tokens"])
        report = report_from_stats(stats, time.time(), now)
        if report is not None and (w.load is None or report.received > w.load.received + 1e-6):
            w.load = report
        return w

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for rid in [r for r in self.workers if r not in live]:
            del self.workers[rid]
            for gauge in (self.metrics.backlog, self.metrics.report_age):
                try:
                    gauge.remove(rid.unique_id)
                except KeyError:  # never routed to
                    pass
        self.metrics.replicas.set(len(live))

    def _threshold(self, replicas: list[RunningReplica]) -> int:
        if self.fixed_threshold is not None:
            return self.fixed_threshold
        for r in replicas:
            t = (r.routing_stats or {}).get("short_threshold")
            if isinstance(t, int) and t > 0:
                return t
        return DEFAULT_SHORT_THRESHOLD

    def _job(
        self,
        pending: Optional[PendingRequest],
        replicas: list[RunningReplica],
        workers: Sequence[Worker] = (),
    ) -> Job:
        """The request's job from the ingress's keywords: classed by what it would prefill on the
        replica that likely caches most of its prompt, where the ingress sent the prompt's key."""
        kwargs = pending.kwargs if pending is not None else {}
        tokens = kwargs.get("tokens") or (1,)
        tokens = tuple(int(t) for t in tokens)
        arrival = time.monotonic() - (time.time() - pending.created_at) if pending else 0.0
        chunks, size = kwargs.get("prompt_chunks"), kwargs.get("prompt_bytes")
        if self.config.prefix_aware and isinstance(chunks, list) and isinstance(size, int):
            prompt = PromptKey(tuple(chunks), size)
            return Job.of(tokens, prompt, arrival, self._threshold(replicas), workers)
        cls = kwargs.get("length_class")
        if cls not in (SHORT, LONG):
            cls = SHORT if sum(tokens) < self._threshold(replicas) else LONG
        return Job(tokens, cls, arrival)

    # --- the decision ----------------------------------------------------------------------------
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> list[list[RunningReplica]]:
        """The replicas ranked by predicted finish, one a rank; none while a long request is held."""
        start = time.perf_counter()
        now = time.monotonic()
        self._loop = self._loop or asyncio.get_running_loop()
        if pending_request is not None:
            # Ray retries a round that placed nothing (all full, or held) at once unless told to
            # back off; the back-off is what spaces out the rounds of a held request.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        self._forget_abandoned(now)
        workers = [self._worker(r, now) for r in candidate_replicas]
        by_worker = {id(w): r for w, r in zip(workers, candidate_replicas)}
        job = self._job(pending_request, candidate_replicas, workers)
        rid = pending_request.metadata.internal_request_id if pending_request else None
        self._unreserve(rid)  # a request chosen for before and not sent: choose afresh
        self.policy.tick(workers, now)
        holder = _holder(pending_request, workers)
        chosen = holder or self.policy.choose(job, workers, now)
        if chosen is None:
            if now - job.arrival < self.max_hold_s:
                self.metrics.held.inc()
                self.metrics.decision.observe(time.perf_counter() - start)
                return []
            self.metrics.hold_expired.inc()
            chosen = self.policy.choose_now(job, workers, now)
        rest = sorted(
            (w for w in workers if w is not chosen),
            key=lambda w: (
                self.policy.backlog(w, now) + w.cost(job.tokens, job.prompt),
                w.work_total,
            ),
        )
        if rid is not None:
            # The cost joins the chosen replica's backlog now, not when Ray has sent the request
            # (after probing the replica's queue): requests routed meanwhile must see it.
            replica = by_worker[id(chosen)]
            cost = chosen.cost(job.tokens, job.prompt)
            chosen.start(rid, cost, job.total_tokens, job.length_class, now, job.prompt)
            self._jobs[rid] = _Routed(replica.replica_id, replica.replica_id, job, now)
        for w in workers:
            self.metrics.backlog.labels(w.url).set(self.policy.backlog(w, now))
            if w.load is not None:
                self.metrics.report_age.labels(w.url).set(now - w.load.received)
        self.metrics.short_pool.set(self.policy.pools.reserved(now))
        self.metrics.decision.observe(time.perf_counter() - start)
        ranks = [chosen] if holder is not None else [chosen, *rest]
        return [[by_worker[id(w)]] for w in ranks]

    def _unreserve(self, rid: str | None) -> None:
        entry = self._jobs.get(rid) if rid is not None else None
        if entry is not None and not entry.sent:
            del self._jobs[rid]
            w = self.workers.get(entry.replica)
            reserved = w.inflight.pop(rid, None) if w is not None else None
            if reserved is not None:  # as if Worker.start had not run
                w.requests_total -= 1
                w.work_total -= reserved.cost

    def _forget_abandoned(self, now: float) -> None:
        # A request chosen for but never sent (its client went away while Ray probed): Ray tells the
        # router nothing more of it, so its reservation ends after the longest a hold may last.
        if len(self._jobs) < 64:
            return
        for rid in [
            r
            for r, e in self._jobs.items()
            if not e.sent and now - e.chosen_at > self.max_hold_s + 30.0
        ]:
            self._unreserve(rid)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """Ray sent the request to ``replica_id`` (the first choice, or a later one when the first
        had no room): its reservation moves there if need be."""
        now = time.monotonic()
        rid = pending_request.metadata.internal_request_id
        entry = self._jobs.get(rid)
        job = entry.job if entry is not None else self._job(pending_request, [])
        if entry is None or entry.replica != replica_id:
            self._unreserve(rid)
            w = self.workers.get(replica_id)
            if w is None:
                return
            cost = w.cost(job.tokens, job.prompt)
            w.start(rid, cost, job.total_tokens, job.length_class, now, job.prompt)
            entry = _Routed(replica_id, entry.first if entry else replica_id, job, now)
            self._jobs[rid] = entry
        entry.sent = True
        job_id = pending_request.kwargs.get("job_id")
        if isinstance(job_id, str):
            entry.job_id, self._by_job[job_id] = job_id, rid
        w = self.workers[replica_id]
        # priced when it was reserved: its prompt counts as cached there since
        sent = w.inflight.get(rid)
        self.policy.on_dispatch(job, w, sent.cost if sent else w.cost(job.tokens), now)
        self.metrics.routed.labels(replica_id.unique_id, job.length_class).inc()
        self.metrics.first_choice.labels(entry.first.unique_id, job.length_class).inc()

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The request finished (or failed): its cost leaves the backlog."""
        entry = self._jobs.pop(internal_request_id, None)
        if entry is not None and entry.job_id is not None:
            self._by_job.pop(entry.job_id, None)
        self.metrics.completed.inc()
        w = self.workers.get(replica_id)
        if w is not None:
            w.finish(internal_request_id, ok=True, now=time.monotonic())


def _holder(pending: Optional[PendingRequest], workers: list[Worker]) -> Worker | None:
    """The replica that keeps the Response the request names (the ``response_id`` keyword: a
    follow-up's ``previous_response_id``, or a read of a kept Response), by the id's prefix its
    server reports; None where no replica's prefix matches."""
    rid = pending.kwargs.get("response_id") if pending is not None else None
    if not isinstance(rid, str):
        return None
    return next(
        (w for w in workers if w.response_prefix and rid.startswith(w.response_prefix)), None
    )


@dataclass
class _Routed:
    """A request the router chose a replica for: where it is reserved, the first choice, the job."""

    replica: ReplicaID
    first: ReplicaID
    job: Job
    chosen_at: float
    sent: bool = False
    job_id: str | None = None  # the ingress's, for its first-token notice

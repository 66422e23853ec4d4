"""The cluster simulator: N engines behind the router, on one simulated clock.

Nothing here decides anything a real deployment decides: every instance is a real
:class:`~plaserve.engine.engine.LLMEngine` whose scheduler picks each step (model-free: a step advances
the instance's own :class:`~plaserve.sim.runner.SimClock` by the cost model's time for that batch), and
requests are placed by the real routing policy (:func:`plaserve.router.policies.make_policy`), reading
the same :class:`~plaserve.router.workers.Worker` state the proxy keeps: the router's own accounting
(dispatch, first token, finish) reconciled with periodic ``load_report()`` polls, as ``GET /load``.

**The event loop** always handles the earliest event next. Events at the same instant go in this
order, so that what happens at ``t`` is visible to every decision made at ``t``:

1. *deliver*: the outputs of a step that ended at ``t`` reach the router (first tokens, finishes);
2. *poll*: every worker's load report is refreshed (every ``load_interval_s``);
3. *arrival*: a request reaches the router and is placed, or held (the ``pla`` policy may hold long
   requests; they wait in a FIFO exactly as in :class:`plaserve.router.dispatch.Dispatcher`);
4. *tick*: the pool controller's periodic decision (every ``period_s``);
5. *release*: held requests are offered to the policy again (after deliveries, polls, ticks, and
   when the policy predicts a backlog will have drained far enough);
6. *step*: an instance takes the requests dispatched to it since its last step and runs one step.

An instance's step runs whole at its start time (it decides the batch from what has arrived by then,
as the real engine thread does between steps) and its outputs are delivered at its end; a request
dispatched to it meanwhile waits in its inbox for the next step, as in the server's engine loop. A
load poll reads what a plaserve worker publishes: its state as its current step started (inbox taken
in), dated back to that start (``age_s``), so the router drains the backlog from then.

Model-free also means text-free: the simulated requests carry no detokenizer (no stop strings, no
output text), which is a fifth of an engine step's cost in Python.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from plaserve.cost import CostModel
from plaserve.engine.engine import LLMEngine, prefill_left
from plaserve.request import RequestOutput, SamplingParams
from plaserve.router.config import RouterConfig
from plaserve.router.dispatch import DispatchCore
from plaserve.router.policies import Job, Policy, make_policy
from plaserve.router.pools import LONG, SHORT
from plaserve.router.workers import LoadReport, Worker
from plaserve.sim.profiles import SimProfile
from plaserve.sim.runner import CostRunner, SimClock
from plaserve.slo import DEFAULT_FACTOR, DEFAULT_FLOOR_S
from plaserve.workload.report import RequestRecord, summarize
from plaserve.workload.slo import TtftSlo, cost_from_load
from plaserve.workload.trace import TraceRequest, fit_to_context

# Event priorities at equal times (module docstring).
DELIVER, POLL, ARRIVAL, TICK, RELEASE, STEP = range(6)

UNFINISHED = "unfinished when the simulation stopped"


@dataclass(frozen=True)
class ClusterConfig:
    """How to simulate: instance count, the router's settings, the SLO, and when to stop.

    ``drain_s``: stop this long after the last arrival even if work is left (requests not finished
    then count as failed, as a client's timeout would); None runs until every request finishes.
    ``report_threshold``: prompts shorter than this are ``short`` in the report (None: the profile's
    short threshold, the one the engines and the router use). ``frontend_delay_s``: how long a request
    takes from the client to the router's decision (HTTP, tokenizing; in a real deployment also the
    network); it counts in TTFT, and the engines see the request that much later.
    """

    instances: int = 1
    scheduler: str = "pla"  # the engines' step policy
    router: RouterConfig = field(default_factory=RouterConfig)
    slo_factor: float = (
        DEFAULT_FACTOR  # TTFT SLO = max(floor, factor x predicted isolated prefill): plaserve.slo
    )
    slo_floor_s: float = DEFAULT_FLOOR_S
    drain_s: float | None = None
    report_threshold: int | None = None
    seed: int = 0  # prompt token ids
    frontend_delay_s: float = 0.0
    # EngineConfig fields on top of the profile's
    engine_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ValueError("instances must be at least 1")
        if self.frontend_delay_s < 0:
            raise ValueError("frontend_delay_s must not be negative")


@dataclass(frozen=True)
class InstanceStats:
    """What one instance did."""

    index: int
    busy_s: float  # simulated seconds spent in steps
    steps: int
    requests: int  # dispatched to it
    prompt_tokens: int
    predicted_work_s: float  # the router's predicted prefill seconds of everything it sent here
    preemptions: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class SimResult:
    """The outcome of one simulation."""

    records: list[RequestRecord]
    duration_s: float  # simulated: from the first arrival to the last finish (or the stop)
    instances: list[InstanceStats]
    profile: SimProfile
    config: ClusterConfig
    slo: TtftSlo
    wall_s: float  # real seconds the simulation took
    events: int
    pool_resizes: int = 0

    @property
    def load_skew(self) -> float:
        """Busy time of the busiest instance over the mean, minus one (0: perfectly even)."""
        busy = [s.busy_s for s in self.instances]
        mean = sum(busy) / len(busy)
        return max(busy) / mean - 1 if mean > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """``plaserve bench``'s summary.json dict, plus the instances, the skew and the profile."""
        out = summarize(self.records, self.duration_s)
        out["instances"] = [s.as_dict() for s in self.instances]
        out["load_skew"] = self.load_skew
        out["simulation"] = {
            "profile": self.profile.describe(),
            "analytic": self.profile.analytic,
            "instances": self.config.instances,
            "scheduler": self.config.scheduler,
            "router": self.config.router.policy,
            "duration_s": self.duration_s,
            "wall_s": self.wall_s,
            "events": self.events,
            "pool_resizes": self.pool_resizes,
            "frontend_delay_s": self.config.frontend_delay_s,
            "slo": self.slo.describe(),
        }
        return out


class _Runner(CostRunner):
    """:class:`CostRunner` without its batch log (a cluster-hour is millions of steps)."""

    def execute(self, batch):  # type: ignore[override]
        self.clock.advance(self.batch_time(batch))
        token = self.token
        return {i: token for i, item in enumerate(batch.items) if item.samples}


@dataclass
class _Pending:
    """A request between the router and an engine."""

    rid: int
    job: Job
    request: TraceRequest
    prompt: list[int] | None = None  # token ids, made when the request reaches the router
    worker_cost: float = 0.0  # its predicted cost on the worker it went to
    first_seen: bool = False


class _Instance:
    """One simulated worker: its engine, clock, inbox, and the router's view of it."""

    def __init__(self, index: int, profile: SimProfile, config: ClusterConfig) -> None:
        self.index = index
        self.clock = SimClock()
        self.engine = LLMEngine(
            profile.engine_config(config.scheduler, **config.engine_overrides),
            runner=_Runner(profile.cost, self.clock),
            cost=profile.cost,
            clock=self.clock,
        )
        self.worker = Worker(f"sim://instance-{index}", profile.cost, config.router.breaker)
        self.worker.supports_load = True
        self.inbox: list[_Pending] = []
        self.tracked: dict[str, _Pending] = {}  # engine request id -> request
        self.busy_s = 0.0
        self.busy_until = 0.0
        self.next_step: float | None = None  # time of its valid scheduled step
        self.version = 0  # scheduled steps with an older version are stale
        self.prompt_tokens = 0
        self.poll_state: tuple[int, int] | None = None  # (steps, requests added) at the last poll
        self.poll_value: tuple[float, int] = (0.0, 0)
        self.added = 0
        self.step_start = 0.0  # start of its last step
        self.step_work = 0.0  # prefill backlog (as load_report prices it) that step worked off


def _prefill_done(engine: LLMEngine) -> float:
    """The prefill backlog, priced as ``load_report`` prices it, that the engine's last step worked off."""
    if engine.last_batch.kind == "decode":
        return 0.0
    cost, done = engine.cost, 0.0
    for it in engine.last_batch.items:
        req = it.request
        prompt, after = req.num_prompt_tokens, req.num_computed_tokens
        if after - it.num_tokens < prompt:  # a prefill item (decodes have nothing left to price)
            done += prefill_left(cost, prompt, after - it.num_tokens) - prefill_left(
                cost, prompt, after
            )
    return done


class ClusterSim:
    """One simulation run (module docstring). Build it, then :meth:`run` once."""

    def __init__(self, profile: SimProfile, config: ClusterConfig = ClusterConfig()) -> None:
        self.profile = profile
        self.config = config
        self.cost: CostModel = profile.cost
        self.threshold = profile.profile.short_threshold
        self.report_threshold = config.report_threshold or self.threshold
        self.slo = TtftSlo(
            factor=config.slo_factor,
            floor_s=config.slo_floor_s,
            short_threshold=self.report_threshold,
            cost=cost_from_load({"cost_model": self.cost.as_dict()}),
        )
        self.instances = [_Instance(i, profile, config) for i in range(config.instances)]
        self.workers = [inst.worker for inst in self.instances]
        self._by_worker = {id(inst.worker): inst for inst in self.instances}
        self.policy: Policy = make_policy(config.router)
        self.now = 0.0
        # The router's dispatching rules and books, run on the simulated clock.
        self.dispatcher: DispatchCore[_Pending] = DispatchCore(self.policy, lambda: self.workers)
        self.max_model_len = self.instances[0].engine.max_model_len
        self._vocab = self.instances[0].engine.model_config.vocab_size
        self._tokens: torch.Tensor | None = (
            None  # every prompt's random ids, drawn at once in run()
        )
        self._offsets: list[int] = []
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._release_at: float | None = None
        self._next_poll = 0.0  # time of the next load poll
        self.records: list[RequestRecord] = []
        self.outstanding = 0
        self.events = 0

    # --- the event queue -------------------------------------------------------------------------
    def _push(self, t: float, prio: int, data: Any) -> None:
        heapq.heappush(self._heap, (t, prio, next(self._seq), data))

    def _schedule_step(self, inst: _Instance, t: float) -> None:
        inst.version += 1
        inst.next_step = t
        self._push(t, STEP, (inst, inst.version))

    def _wake(self, inst: _Instance, t: float) -> None:
        """Work arrived for ``inst`` at ``t``: make sure it steps by then."""
        if inst.busy_until > t or (inst.next_step is not None and inst.next_step <= t):
            return  # mid-step (its next step follows the delivery) or already due
        self._schedule_step(inst, t)

    def _schedule_release(self, t: float) -> None:
        if self._release_at is None or t < self._release_at:
            self._release_at = t
            self._push(t, RELEASE, None)

    # --- the router ------------------------------------------------------------------------------
    def _arrive(self, rid: int, req: TraceRequest, t: float) -> None:
        cls = SHORT if req.prompt_tokens < self.threshold else LONG
        p = _Pending(
            rid,
            Job((req.prompt_tokens,), cls, t),
            req,
            prompt=self._tokens[
                self._offsets[rid] : self._offsets[rid] + req.prompt_tokens
            ].tolist(),
        )
        self.outstanding += 1
        placed = self.dispatcher.place(p, t)
        if placed is None:
            self._schedule_release(t)
        else:
            self._dispatch(p, *placed, t)

    def _dispatch(self, p: _Pending, worker: Worker, cost: float, t: float) -> None:
        p.worker_cost = cost
        inst = self._by_worker[id(worker)]
        inst.inbox.append(p)
        inst.prompt_tokens += p.request.prompt_tokens
        self._wake(inst, t)

    def _release(self, t: float) -> None:
        """Dispatcher.release on the simulated clock: place every held request that may go now."""
        self._release_at = None
        placed, eta = self.dispatcher.release(t)
        for p, worker, cost in placed:
            self._dispatch(p, worker, cost, t)
        if self.dispatcher.held:
            fallback = self.config.router.health.load_interval_s
            self._schedule_release(t + (fallback if eta is None else min(eta, fallback)))

    def _poll(self, t: float) -> None:
        """Every worker's ``/load`` answer, as the router's monitor records it."""
        for inst in self.instances:
            state = (inst.engine.num_steps, inst.added)
            # an engine that has not stepped or taken work reports the same
            if state != inst.poll_state:
                load = inst.engine.load_report()
                inst.poll_state, inst.poll_value = (
                    state,
                    (sum(load["backlog_s"].values()), load["num_requests"]),
                )
            backlog, n = inst.poll_value
            as_of = t
            if inst.busy_until > t:  # mid-step: the worker reports its state as the step started
                backlog, as_of = backlog + inst.step_work, inst.step_start
            inst.worker.load = LoadReport(backlog, as_of, as_of, n)

    # --- the instances ---------------------------------------------------------------------------
    def _step(self, inst: _Instance, t: float) -> float | None:
        """Run one step of ``inst`` at ``t``. Returns its end when the instance should simply step again
        then (nothing to deliver; the caller schedules it), else None (whatever follows is scheduled)."""
        inst.next_step = None
        engine = inst.engine
        inst.clock.advance_to(t)
        for p in inst.inbox:
            params = SamplingParams(
                max_tokens=p.request.output_tokens, temperature=0, ignore_eos=True
            )
            req = engine.add_request(
                p.prompt, params, arrival_time=p.request.arrival + self.config.frontend_delay_s
            )
            req.detokenizer = None  # no text in a simulation (module docstring)
            p.prompt = None
            inst.tracked[req.request_id] = p
            inst.added += 1
        inst.inbox.clear()
        sampled = engine.step_requests()
        if engine.last_batch is None:
            wake = engine.next_wakeup()
            if wake is not None:
                if wake <= t:
                    raise RuntimeError(
                        f"instance {inst.index}: the scheduler ran nothing at t={t:.6f} although it "
                        f"has work now ({len(engine.scheduler.waiting)} waiting, "
                        f"{len(engine.scheduler.running)} running)"
                    )
                self._schedule_step(inst, wake)
            return None
        end = inst.clock.now
        inst.busy_s += end - t
        inst.busy_until = end
        # What a poll during this step would add back (only worked out when one will land in it).
        inst.step_start, inst.step_work = t, _prefill_done(engine) if self._next_poll < end else 0.0
        notes = [RequestOutput.of(r) for r in sampled if r.finished or len(r.output_token_ids) == 1]
        if notes:
            inst.next_step = end  # the delivery schedules it; arrivals meanwhile must not
            self._push(end, DELIVER, (inst, notes))
            return None
        return end

    def _deliver(self, inst: _Instance, outputs: list[RequestOutput], t: float) -> None:
        worker = inst.worker
        for out in outputs:
            p = inst.tracked[out.request_id]
            if not p.first_seen:
                p.first_seen = True
                worker.first_token(p.rid)
                self.policy.on_first_token(p.job, worker, p.worker_cost, t)
            if out.finished:
                del inst.tracked[out.request_id]
                worker.finish(p.rid, ok=True, now=t)
                self.records.append(self._record(p, out))
                self.outstanding -= 1
        self._schedule_step(inst, t)
        if self.dispatcher.held:
            self._release(t)

    def _record(
        self, p: _Pending, out: RequestOutput | None, error: str | None = None
    ) -> RequestRecord:
        req = p.request
        rec = RequestRecord(
            length_class="short" if req.prompt_tokens < self.report_threshold else "long",
            prompt_tokens=req.prompt_tokens,
            output_tokens=0,
            arrival=req.arrival,
            ttft=None,
            e2e=None,
            slo_ttft=self.slo.for_prompt(req.prompt_tokens),
            error=error,
        )
        if out is not None:
            m = out.metrics
            times = m.token_times
            rec.output_tokens = len(out.outputs[0].token_ids)
            # From when the client sent it (the engine saw it frontend_delay_s later).
            rec.ttft = None if m.first_token_time is None else m.first_token_time - req.arrival
            rec.tbts = [b - a for a, b in zip(times, times[1:])]
            if out.finished and m.finish_time is not None:
                rec.e2e = m.finish_time - req.arrival
        return rec

    # --- the run ---------------------------------------------------------------------------------
    def run(self, requests: Sequence[TraceRequest]) -> SimResult:
        """Simulate ``requests`` (arrival times from 0, any order); returns the records and stats."""
        start_wall = time.perf_counter()
        arrivals = sorted(
            (fit_to_context(r, self.max_model_len) for r in requests), key=lambda r: r.arrival
        )
        if not arrivals:
            raise ValueError("no requests to simulate")
        last_arrival = arrivals[-1].arrival
        # Random prompt ids (no two prompts share a cached block, as with plaserve bench's), drawn in one
        # call: per-request draws cost more than a tenth of an hour-long simulation.
        self._offsets = list(itertools.accumulate((r.prompt_tokens for r in arrivals), initial=0))
        gen = torch.Generator().manual_seed(self.config.seed)
        self._tokens = torch.randint(
            0, self._vocab, (self._offsets[-1],), generator=gen, dtype=torch.int16
        )
        stop_at = (
            None
            if self.config.drain_s is None
            else last_arrival + self.config.frontend_delay_s + self.config.drain_s
        )
        hc = self.config.router
        self._push(0.0, POLL, None)
        self._push(0.0, TICK, None)
        heap, i, n = self._heap, 0, len(arrivals)
        # each request reaches the router this long after it was sent
        delay = self.config.frontend_delay_s
        t = 0.0
        limit = float("inf") if stop_at is None else stop_at
        while i < n or self.outstanding:
            ta = arrivals[i].arrival + delay if i < n else float("inf")
            top = heap[0] if heap else None
            if top is not None and (top[0] < ta or (top[0] == ta and top[1] < ARRIVAL)):
                t, prio, _, data = heapq.heappop(heap)
            else:
                t, prio, data = ta, ARRIVAL, None
            if t > limit:
                break
            self.now = t
            self.events += 1
            if prio == STEP:
                inst, version = data
                if version == inst.version:
                    nxt = self._step(inst, t)
                    # Fast path: while this instance's next step comes strictly before every other
                    # event, run it at once instead of through the queue (same order, fewer heap moves).
                    while nxt is not None:
                        if nxt < ta and nxt <= limit and (not heap or nxt < heap[0][0]):
                            t = self.now = nxt
                            self.events += 1
                            nxt = self._step(inst, t)
                        else:
                            self._schedule_step(inst, nxt)
                            break
            elif prio == DELIVER:
                self._deliver(data[0], data[1], t)
            elif prio == ARRIVAL:
                self._arrive(i, arrivals[i], t)
                i += 1
            elif prio == POLL:
                self._poll(t)
                if self.dispatcher.held:
                    self._release(t)
                self._next_poll = t + hc.health.load_interval_s
                self._push(self._next_poll, POLL, None)
            elif prio == TICK:
                self.policy.tick(self.dispatcher.available(t), t)
                if self.dispatcher.held:
                    self._release(t)
                self._push(t + hc.pools.period_s, TICK, None)
            elif prio == RELEASE:
                if self._release_at == t:
                    self._release(t)
        cut = stop_at is not None and bool(i < n or self.outstanding)
        end = (
            stop_at
            if cut
            else max(
                [r.arrival + r.e2e for r in self.records if r.e2e is not None] + [last_arrival]
            )
        )
        self._fail_leftovers(arrivals[i:])
        stats = [
            InstanceStats(
                inst.index,
                inst.busy_s,
                inst.engine.num_steps,
                inst.worker.requests_total,
                inst.prompt_tokens,
                inst.worker.work_total,
                inst.engine.num_preemptions,
            )
            for inst in self.instances
        ]
        resizes = sum(
            r.reason == "pressure"
            for r in getattr(getattr(self.policy, "pools", None), "history", [])
        )
        self.records.sort(key=lambda r: r.arrival)
        return SimResult(
            self.records,
            max(end, 1e-9),
            stats,
            self.profile,
            self.config,
            self.slo,
            time.perf_counter() - start_wall,
            self.events,
            resizes,
        )

    def _fail_leftovers(self, never_arrived: Sequence[TraceRequest]) -> None:
        """Records for requests cut off by ``drain_s``: in flight, held, or not yet arrived."""
        for inst in self.instances:
            for p in inst.inbox:
                self.records.append(self._record(p, None, UNFINISHED))
            for rid, p in inst.tracked.items():
                req = inst.engine.requests.get(rid)
                self.records.append(
                    self._record(p, RequestOutput.of(req) if req is not None else None, UNFINISHED)
                )
        for p in self.dispatcher.held:
            self.records.append(self._record(p, None, UNFINISHED))
        for r in never_arrived:
            self.records.append(
                self._record(
                    _Pending(-1, Job((r.prompt_tokens,), SHORT, r.arrival), r), None, UNFINISHED
                )
            )


def simulate(
    requests: Sequence[TraceRequest], profile: SimProfile, config: ClusterConfig = ClusterConfig()
) -> SimResult:
    """Simulate ``requests`` on ``config.instances`` instances of ``profile`` (module docstring)."""
    return ClusterSim(profile, config).run(requests)

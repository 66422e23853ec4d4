"""Lower bounds: what no scheduler can beat on a workload, under a cost model.

The policy benchmark's targets are ratios against fcfs on one trace slice; some of them can lie beyond
what any scheduler could reach on that slice. These bounds say so. Each one solves a *relaxation* of
the real problem exactly, so every real schedule does at least as badly:

* a prompt of ``n`` tokens costs only its marginal time ``E(n) - c0`` (no per-step constant, no
  decode work, no padding; a batch finishes all its members at once, which only delays them);
* a prompt may be interrupted and resumed at any moment at no cost (chunked prefill costs the cost
  model's sum over chunks, which is no less than the whole prompt's time);
* where stated, requests are left out, which only helps the others.

The bounds hold for the cost model, not for the machine: on real hardware they are as good as the fit.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_array

from plaserve.cost import CostModel
from plaserve.scheduler.deadlines import moore_hodgson_late


@dataclass(frozen=True)
class Job:
    """One request, reduced to what the bounds need (seconds)."""

    arrival: float
    work: float  # marginal prefill time under the cost model
    deadline: float  # arrival + TTFT SLO


def jobs_for(arrivals: Sequence[tuple[float, int]], cost: CostModel, slo_of) -> list[Job]:
    """Jobs for ``(arrival, prompt_tokens)`` pairs; ``slo_of(prompt_tokens)`` is the TTFT SLO (seconds)."""
    return [Job(t, cost.prefill_time(n) - cost.c0, t + slo_of(n)) for t, n in sorted(arrivals)]


def busy_periods(jobs: Sequence[Job]) -> list[list[Job]]:
    """Split ``jobs`` (sorted by arrival) where a machine that serves every job as soon as it can
    would fall idle."""
    periods: list[list[Job]] = []
    free_at = -math.inf
    for job in jobs:
        if job.arrival >= free_at:
            periods.append([])
        periods[-1].append(job)
        free_at = max(free_at, job.arrival) + job.work
    return periods


# Slack on every time comparison of the bounds: float ties count as on time, which can only lower a
# lower bound.
EPS = 1e-9


def fewest_late(jobs: Sequence[Job], time_limit: float = 30.0) -> int:
    """The fewest of ``jobs`` that must finish after their deadline on one machine that may interrupt a
    job and resume it later at no cost (each job no earlier than its arrival).

    Exact: a set of jobs can all finish on time that way if and only if, for every interval from an
    arrival ``a`` to a deadline ``b``, the jobs that arrive at or after ``a`` and are due by ``b`` need no
    more than ``b - a`` (Horn, 1974). The largest such set is an integer program over those intervals,
    solved by HiGHS to optimality; where it runs past ``time_limit`` seconds, the solver's bound on the
    largest set is used (or, without one, only the jobs that miss even alone count), which keeps the
    result a lower bound.
    """
    n = len(jobs)
    arrival = np.array([j.arrival for j in jobs])
    deadline = np.array([j.deadline for j in jobs])
    work = np.array([j.work for j in jobs])
    # a job that misses even alone is late in every schedule
    possible = work <= deadline - arrival + EPS
    always_late = int(n - possible.sum())
    data, cols, starts, room = [], [], [0], []  # the constraint matrix, row by row (CSR)
    for a in np.unique(arrival):
        after = possible & (arrival >= a)
        for b in np.unique(deadline[after]):
            inside = np.flatnonzero(after & (deadline <= b))
            # only intervals that could be overfull constrain the choice
            if work[inside].sum() > b - a + EPS:
                data.append(work[inside])
                cols.append(inside)
                starts.append(starts[-1] + len(inside))
                room.append(b - a + EPS)
    if not room:
        return always_late
    matrix = csr_array(
        (np.concatenate(data), np.concatenate(cols), np.array(starts)), shape=(len(room), n)
    )
    res = milp(
        -np.ones(n),
        integrality=np.ones(n),
        bounds=Bounds(0, possible.astype(float)),
        constraints=LinearConstraint(matrix, -np.inf, np.array(room)),
        options={"time_limit": time_limit, "mip_rel_gap": 0.0},
    )
    if res.status == 0:
        return n - round(-res.fun)
    dual = getattr(res, "mip_dual_bound", None)  # a bound on -(the largest on-time set)
    if dual is None or not math.isfinite(dual):
        return always_late
    return max(always_late, n - math.floor(-dual + 1e-6))


# Orders for :func:`online_late`: each ranks a ready job (lowest first) by the job, the work it has
# left, and whether the fewest-late order of the ready jobs gives it up.
ONLINE_ORDERS: dict[str, Callable[[Job, float, bool], tuple]] = {
    "earliest deadline": lambda job, left, given_up: (job.deadline,),
    "earliest deadline, given-up last": lambda job, left, given_up: (given_up, job.deadline),
    "least work left, given-up last": lambda job, left, given_up: (given_up, left),
}


def online_late(jobs: Sequence[Job], order: str, short_work: float | None = None) -> int:
    """Late jobs when one machine serves ``jobs`` as they arrive, preempting at no cost, always running
    the ready job first in ``order`` (:data:`ONLINE_ORDERS`): what a scheduler that knows only the past
    can do in the bounds' relaxation, to set beside :func:`min_slo_violations`, which knows the future.
    ``short_work``: jobs needing at most this much go before all others (a short queue first).

    The machine re-ranks the ready jobs whenever one arrives or finishes (not in between: a waiting
    job that runs out of slack between two events joins the given-up set at the next)."""
    jobs = sorted(jobs, key=lambda j: j.arrival)
    left = [j.work for j in jobs]  # by index: equal jobs are still different requests
    rank = ONLINE_ORDERS[order]
    ready: list[int] = []
    t, nxt, late = -math.inf, 0, 0
    while nxt < len(jobs) or ready:
        if not ready:
            t = max(t, jobs[nxt].arrival)
        while nxt < len(jobs) and jobs[nxt].arrival <= t:
            ready.append(nxt)
            nxt += 1
        given_up = moore_hodgson_late(ready, t, left.__getitem__, lambda k: jobs[k].deadline)
        k = min(
            ready,
            key=lambda k: (
                short_work is not None and jobs[k].work > short_work,
                *rank(jobs[k], left[k], k in given_up),
            ),
        )
        run = min(left[k], jobs[nxt].arrival - t if nxt < len(jobs) else math.inf)
        t += run
        left[k] -= run
        if left[k] <= 1e-12:
            ready.remove(k)
            late += t > jobs[k].deadline + EPS
    return late


def min_slo_violations(jobs: Sequence[Job], time_limit: float = 30.0) -> int:
    """Fewest requests that any scheduler must serve after their deadline: :func:`fewest_late` over
    each busy period (``time_limit`` seconds of solver each). A machine that serves every job as soon
    as it can falls idle between two periods, and an on-time subset of a period's jobs finishes before
    the period would end, so no period can lend time to another: solving them apart is exact, and much
    faster."""
    periods = busy_periods(sorted(jobs, key=lambda j: j.arrival))
    return sum(fewest_late(p, time_limit) for p in periods)


def max_flow_fifo(jobs: Sequence[Job]) -> float:
    """Longest time from arrival to finish on one machine serving in arrival order: the least possible
    largest such time of any schedule, preemptive or not."""
    t, worst = -math.inf, 0.0
    for job in jobs:
        t = max(t, job.arrival) + job.work
        worst = max(worst, t - job.arrival)
    return worst


def min_ttft_percentile(
    jobs: Sequence[Job], q: float, c0: float = 0.0, max_dropped: int = 2
) -> float:
    """A lower bound on the ``q``-th percentile (numpy's linear interpolation) of TTFT over ``jobs``.

    Percentile ``q`` of ``n`` values is at least the value of rank ``r = floor(q/100 * (n-1))``, which
    ``n-1-r`` values exceed. When those are at most ``max_dropped``, the bound is exact for the
    relaxation: leave out every choice of that many jobs (which only helps the others) and serve the
    rest in arrival order (:func:`max_flow_fifo`). Otherwise each TTFT is at least the request's own
    time ``c0 + work``, and so is each percentile of them.
    """
    n = len(jobs)
    if n == 0:
        raise ValueError("no jobs")
    rank = math.floor(q / 100 * (n - 1))
    dropped = n - 1 - rank
    own = sorted(c0 + j.work for j in jobs)[rank]
    if dropped > max_dropped:
        return own
    ordered = sorted(jobs, key=lambda j: j.arrival)
    best = min(
        max_flow_fifo([j for i, j in enumerate(ordered) if i not in out])
        for out in itertools.combinations(range(n), dropped)
    )
    return max(best, own)


def slice_bounds(
    arrivals: Sequence[tuple[float, int]],
    cost: CostModel,
    slo_of,
    short_threshold: int,
    time_limit: float = 30.0,
) -> dict:
    """The policy benchmark's bounds for one slice of ``(arrival, prompt_tokens)``: the fewest SLO
    violations (count and rate; ``time_limit``: seconds of solver per busy period, past which the
    solver's own bound stands in), and the least short-request TTFT p50 and p99 (ms) of any scheduler."""
    jobs = jobs_for(arrivals, cost, slo_of)
    shorts = jobs_for([a for a in arrivals if a[1] < short_threshold], cost, slo_of)
    least = min_slo_violations(jobs, time_limit)
    out: dict = {
        "slo_violations": least,
        "slo_violation_rate": least / len(jobs),
        "short_ttft_ms": {},
    }
    if shorts:
        out["short_ttft_ms"] = {
            f"p{q}": 1000 * min_ttft_percentile(shorts, q, cost.c0) for q in (50, 99)
        }
    return out

"""Lower bounds: what no scheduler can beat on a workload, under a cost model.

The policy benchmark's targets are ratios against fcfs on one trace slice; some of them can lie beyond
what any scheduler could reach on that slice. These bounds say so. Each one solves a *relaxation* of
the real problem exactly, so every real schedule does at least as badly:

* a prompt of ``n`` tokens costs only its marginal time ``E(n) - c0`` (no per-step constant, no
  decode work, no padding; a batch finishes all its members at once, which only delays them);
* where stated, requests are released earlier than they arrived, or given a machine of their own.

The bounds hold for the cost model, not for the machine: on real hardware they are as good as the fit.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from plaserve.cost import CostModel


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


def fewest_late(jobs: Sequence[Job], release: float) -> int:
    """The fewest jobs that must finish after their deadline when all are released at ``release`` on
    one machine (Moore-Hodgson: earliest deadline first, dropping the longest job whenever one would
    be late; exact for a common release time)."""
    t, taken, late = release, [], 0
    for job in sorted(jobs, key=lambda j: j.deadline):
        heapq.heappush(taken, -job.work)
        t += job.work
        if t > job.deadline:
            t += heapq.heappop(taken)  # drop the longest so far: it runs late, after everything
            late += 1
    return late


def min_slo_violations(jobs: Sequence[Job]) -> int:
    """Fewest requests that any scheduler must serve after their deadline.

    Relaxation: each busy period gets a machine of its own, and all its jobs are released at its first
    arrival; both only help. Each period is then solved exactly by :func:`fewest_late`.
    """
    return sum(fewest_late(p, p[0].arrival) for p in busy_periods(sorted(jobs, key=lambda j: j.arrival)))


def max_flow_fifo(jobs: Sequence[Job]) -> float:
    """Longest time from arrival to finish on one machine serving in arrival order: the least possible
    largest such time of any schedule, preemptive or not."""
    t, worst = -math.inf, 0.0
    for job in jobs:
        t = max(t, job.arrival) + job.work
        worst = max(worst, t - job.arrival)
    return worst


def min_ttft_percentile(jobs: Sequence[Job], q: float, c0: float = 0.0, max_dropped: int = 2) -> float:
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
    best = min(max_flow_fifo([j for i, j in enumerate(ordered) if i not in out])
               for out in itertools.combinations(range(n), dropped))
    return max(best, own)


def slice_bounds(arrivals: Sequence[tuple[float, int]], cost: CostModel, slo_of, short_threshold: int) -> dict:
    """The policy benchmark's bounds for one slice of ``(arrival, prompt_tokens)``: the least SLO
    violation rate, and the least short-request TTFT p50 and p99 (ms) of any scheduler."""
    jobs = jobs_for(arrivals, cost, slo_of)
    shorts = jobs_for([a for a in arrivals if a[1] < short_threshold], cost, slo_of)
    out: dict = {"slo_violation_rate": min_slo_violations(jobs) / len(jobs), "short_ttft_ms": {}}
    if shorts:
        out["short_ttft_ms"] = {f"p{q}": 1000 * min_ttft_percentile(shorts, q, cost.c0) for q in (50, 99)}
    return out

"""Lower bounds of the policy benchmark: exact on small cases, never above a real schedule's result."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from plaserve import EngineConfig, LLMEngine
from plaserve.cost import CostModel
from plaserve.sim.replay import replay
from plaserve.sim.runner import CostRunner, SimClock
from policy_study import bounds
from policy_study.bounds import (
    ONLINE_ORDERS,
    Job,
    fewest_late,
    jobs_for,
    max_flow_fifo,
    min_slo_violations,
    min_ttft_percentile,
    online_late,
)
from policy_study.policies import ratio_lines

COST = CostModel(g1=1e-4, g2=2e-8, c0=2e-3)


def edf_on_time(jobs: tuple[Job, ...]) -> bool:
    """Whether preemptive earliest-deadline-first, which meets every deadline whenever any schedule
    does, finishes all of ``jobs`` on time (each from its arrival)."""
    left = {i: j.work for i, j in enumerate(jobs)}
    t = min((j.arrival for j in jobs), default=0.0)
    while left:
        ready = [i for i in left if jobs[i].arrival <= t + 1e-12]
        if not ready:
            t = min(jobs[i].arrival for i in left)
            continue
        i = min(ready, key=lambda i: jobs[i].deadline)
        next_arrival = min(
            (jobs[k].arrival for k in left if jobs[k].arrival > t + 1e-12), default=math.inf
        )
        run = min(left[i], next_arrival - t)
        t += run
        left[i] -= run
        if left[i] <= 1e-12:
            del left[i]
            if t > jobs[i].deadline + 1e-9:
                return False
    return True


def random_jobs(rng: random.Random, n: int, spread: float, slack: float = 3.0) -> list[Job]:
    """``n`` jobs arriving within ``spread`` seconds, each 0.1-1 s of work, due 0.2 s to ``slack`` s after
    its arrival."""
    arrivals = [rng.uniform(0, spread) for _ in range(n)]
    return [Job(t, rng.uniform(0.1, 1.0), t + rng.uniform(0.2, slack)) for t in arrivals]


def brute_fewest_late(jobs: list[Job]) -> int:
    """Fewest late jobs by trying every subset to serve on time."""
    return min(
        len(jobs) - k
        for k in range(len(jobs) + 1)
        for on_time in itertools.combinations(jobs, k)
        if edf_on_time(on_time)
    )


@pytest.mark.parametrize("spread", [0.0, 2.0])  # all released at once; arrivals over two seconds
def test_fewest_late_is_exact(spread):
    rng = random.Random(0)
    for _ in range(150):
        jobs = random_jobs(rng, rng.randint(1, 7), spread)
        assert fewest_late(jobs) == brute_fewest_late(jobs)


def test_fifo_has_the_least_largest_flow_time():
    rng = random.Random(1)
    for _ in range(100):
        jobs = sorted(
            (Job(rng.uniform(0, 2), rng.uniform(0.1, 1), 0.0) for _ in range(rng.randint(1, 6))),
            key=lambda j: j.arrival,
        )

        def largest(order):
            t, worst = 0.0, 0.0
            for j in order:
                t = max(t, j.arrival) + j.work
                worst = max(worst, t - j.arrival)
            return worst

        assert max_flow_fifo(jobs) == pytest.approx(
            min(largest(p) for p in itertools.permutations(jobs))
        )


def sim_run(policy: str, arrivals: list[tuple[float, int]]) -> list:
    clock = SimClock()
    cfg = EngineConfig.from_kwargs(
        kv_cache_memory="2GiB",
        enable_prefix_caching=False,
        policy=policy,
        ttft_slo_floor=0.25,
        ttft_slo_factor=5.0,
    )
    engine = LLMEngine(cfg, runner=CostRunner(COST, clock), cost=COST, clock=clock)

    class A:
        def __init__(self, t, n):
            self.arrival, self.prompt_tokens, self.output_tokens = t, n, 2

    return replay(engine, clock, [A(t, n) for t, n in arrivals])


@pytest.mark.parametrize("policy", ["fcfs", "spf", "pla"])
def test_no_schedule_beats_the_bounds(policy):
    rng = random.Random(2)
    # Two bursts far above capacity with a quiet gap: many requests must be late.
    arrivals = sorted(
        [(rng.uniform(0, 0.5), rng.choice([60, 200, 400, 1500, 3000])) for _ in range(40)]
        + [(rng.uniform(3, 3.5), rng.choice([60, 200, 400, 1500])) for _ in range(40)]
    )
    slo = lambda n: max(0.25, 5 * COST.prefill_time(n))  # noqa: E731
    jobs = jobs_for(arrivals, COST, slo)
    bound = min_slo_violations(jobs)
    assert bound >= 10  # the bursts really force lateness: the bound is not trivially zero
    reqs = sim_run(policy, arrivals)
    ttft = {id(r): r.metrics.first_token_time - r.metrics.arrival_time for r in reqs}
    assert sum(ttft[id(r)] > slo(r.num_prompt_tokens) for r in reqs) >= bound
    short_jobs = jobs_for([a for a in arrivals if a[1] < 512], COST, slo)
    short_ttfts = [ttft[id(r)] for r in reqs if r.num_prompt_tokens < 512]
    for q in (50, 90, 99):
        assert np.percentile(short_ttfts, q) >= min_ttft_percentile(short_jobs, q, COST.c0) - 1e-9


def test_percentile_bound_drops_the_worst_jobs_exactly():
    # Three jobs at once: the largest TTFT is at least their total work; the second largest (rank 1
    # of 3, the 50th percentile) is at least the two smallest served back to back.
    jobs = [Job(0.0, w, 0.0) for w in (1.0, 2.0, 4.0)]
    assert min_ttft_percentile(jobs, 100) == pytest.approx(7.0)
    assert min_ttft_percentile(jobs, 50) == pytest.approx(3.0)
    assert min_ttft_percentile(jobs, 0) == pytest.approx(1.0)  # rank 0: the smallest job alone
    # falls back to own time
    assert min_ttft_percentile(jobs, 50, max_dropped=0) == pytest.approx(2.0)


def results(short_p50: float, short_p99: float, viol: float) -> dict:
    cls = {
        "short": {"ttft_ms": {"p50": short_p50, "p99": short_p99}},
        "long": {"ttft_ms": {"p50": 100.0, "p99": 200.0}},
    }
    return {"summary": cls | {"all": {"slo_violation_rate": viol}}}


def test_checks_say_when_a_target_is_beyond_the_bound():
    res = {"fcfs": results(100.0, 1000.0, 0.5), "pla": results(90.0, 500.0, 0.2)}
    bounds = {"slo_violation_rate": 0.1, "short_ttft_ms": {"p50": 50.0, "p99": 100.0}}
    lines = {line.split(" | ")[0]: line for line in ratio_lines(res, bounds)}
    # p50: -10 %, the bound allows -50 %, the target -60 % is beyond it.
    assert lines["| pla short TTFT p50 vs fcfs"].endswith("| -50% | MISSED (beyond the bound) |")
    # p99: -50 %, the bound allows -90 %: missed, but reachable in principle.
    assert lines["| pla short TTFT p99 vs fcfs"].endswith("| -90% | MISSED |")
    # SLO violations: -60 % against a -70 % target, the bound allows -80 %.
    assert lines["| pla SLO violations vs fcfs"].endswith("| -80% | MISSED |")
    assert lines["| pla long TTFT p50 vs fcfs"].endswith("| +0% | <= +10% | - | met |")


def test_a_bound_next_to_its_target_shows_which_side_it_is_on():
    res = {"fcfs": results(100.0, 1000.0, 0.898), "pla": results(5.0, 100.0, 0.389)}
    lines = {
        line.split(" | ")[0]: line
        for line in ratio_lines(res, {"slo_violation_rate": 0.273, "short_ttft_ms": {}})
    }
    # The bound, 27.3 % against 89.8 %, is -69.6 %: "-70%" would hide that the target is beyond it.
    assert lines["| pla SLO violations vs fcfs"].endswith(
        "| -57% | <= -70% | -69.6% | MISSED (beyond the bound) |"
    )


def test_online_schedules_never_beat_the_bound_and_edf_is_exact_when_all_fit():
    rng = random.Random(3)
    for _ in range(100):
        jobs = random_jobs(rng, rng.randint(1, 7), spread=2.0)
        best = fewest_late(jobs)
        for order in ONLINE_ORDERS:
            assert online_late(jobs, order) >= best
            assert online_late(jobs, order, short_work=0.5) >= best
        # preemptive earliest deadline first meets every deadline when any schedule can
        if best == 0:
            assert online_late(jobs, "earliest deadline") == 0


def test_giving_up_the_longest_saves_the_rest_online():
    # A long job and three short ones, all due at 1.0: served by deadline alone (ties by arrival) the
    # long one goes first and every short one is late; given up, it alone is late.
    jobs = [Job(0.0, 0.9, 1.0)] + [Job(0.01, 0.2, 1.0)] * 3
    assert online_late(jobs, "earliest deadline") == 3
    assert online_late(jobs, "earliest deadline, given-up last") == 1 == fewest_late(jobs)


def test_busy_periods_can_be_solved_apart():
    rng = random.Random(4)
    for _ in range(50):
        jobs = random_jobs(rng, rng.randint(2, 12), spread=6.0, slack=2.0)
        assert min_slo_violations(jobs) == fewest_late(jobs)


@pytest.mark.parametrize("dual, expected", [(-float("inf"), 1), (None, 1), (-2.5, 2)])
def test_a_solver_stopped_early_still_gives_a_lower_bound(monkeypatch, dual, expected):
    # Four jobs due together that cannot all fit (one of them cannot make it even alone). Stopped
    # before optimality, the solver's bound on the on-time set is all there is to go by.
    jobs = [Job(0.0, 1.0, 2.0)] * 3 + [Job(0.0, 3.0, 2.0)]
    assert fewest_late(jobs) == 2

    class Stopped:
        status, fun, mip_dual_bound = 1, -1.0, dual

    monkeypatch.setattr(bounds, "milp", lambda *args, **kwargs: Stopped())
    assert bounds.fewest_late(jobs) == expected  # never above the true answer, 2

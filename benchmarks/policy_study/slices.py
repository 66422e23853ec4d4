"""The policy comparison over many trace slices, on the simulated clock.

``benchmarks/policies.py`` measures one slice of each trace on the wall clock: about eight minutes, and
one slice is one draw (a burst more or less moves its percentiles). This module replays many slices,
scaled the same way, through the real schedulers on a :class:`~plaserve.sim.runner.CostRunner`, whose
steps take what the cost model predicts: seconds for all of them. It reports, for each slice, the
issue's checks (:func:`~policy_study.policies.target_checks`), and over all slices how many meet each
target, the median of each measured change, and the SLO violations summed.

The simulated clock is exact for the cost model and blind to what it leaves out (the real machine's
noise; a decode costs what the model says). ``benchmarks/sim_validation.py`` measures how close the
simulator comes to real runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from plaserve.config import EngineConfig
from plaserve.cost import CostModel
from plaserve.engine.engine import LLMEngine
from plaserve.sim.replay import replay
from plaserve.sim.runner import CostRunner, SimClock
from plaserve.workload.report import RequestRecord, summarize
from plaserve.workload.trace import TraceRequest
from policy_study.bounds import ONLINE_ORDERS, jobs_for, online_late, slice_bounds
from policy_study.offline import SloRule, to_record, with_policy
from policy_study.policies import POLICIES, Check, Slice, scaled_slice, target_checks


@dataclass(frozen=True)
class SliceResult:
    """One slice: its first row, load, size, the fcfs utilization, the violations per policy, the fewest
    any scheduler could have (:func:`slice_bounds`), those of idealised online schedules in the same
    relaxation (:func:`ideal_online`) and pla's checks."""

    start: int
    load: float
    requests: int
    long_share: float
    fcfs_utilization: float
    violations: dict[str, int]
    least_violations: int | None  # None: bounds not computed (``run_slice(bounds=False)``)
    online_violations: dict[str, int]
    checks: list[Check]
    # policy -> class -> p50/p99
    ttft_ms: dict[str, dict[str, dict[str, float | None]]] = field(default_factory=dict)


def _simulate(
    arrivals: Sequence[TraceRequest],
    config: EngineConfig,
    policy: str,
    cost: CostModel,
    step_cost: CostModel,
    slo: SloRule,
) -> tuple[list[RequestRecord], float, float]:
    """One policy on the simulated clock: the records, the utilization of the arrival window, the end."""
    clock = SimClock()
    engine = LLMEngine(
        with_policy(config, policy), runner=CostRunner(step_cost, clock), cost=cost, clock=clock
    )
    records = [to_record(r, slo, cost) for r in replay(engine, clock, arrivals)]
    busy = sum(end - start for start, end, _ in engine.runner.batches)
    return records, busy / arrivals[-1].arrival, clock.now


def fcfs_load(
    s: Slice,
    config: EngineConfig,
    cost: CostModel,
    slo: SloRule,
    utilization: float,
    *,
    step_cost: CostModel | None = None,
    length_scale: float = 0.25,
    seconds: float = 60.0,
    steps: int = 7,
) -> float:
    """The load (predicted prefill work / window) at which fcfs keeps the simulated machine busy
    ``utilization`` of the slice's window, by bisection: the issue sets the load by fcfs's utilization,
    and slices differ in how much decode work comes with their prefill work."""
    lo, hi = 0.05, 1.5
    for _ in range(steps):
        mid = (lo + hi) / 2
        arrivals, _ = scaled_slice(s, cost, length_scale, mid, seconds)
        _, busy, _ = _simulate(arrivals, config, "fcfs", cost, step_cost or cost, slo)
        lo, hi = (mid, hi) if busy < utilization else (lo, mid)
    return round((lo + hi) / 2, 3)


def run_slice(
    s: Slice,
    config: EngineConfig,
    cost: CostModel,
    slo: SloRule,
    *,
    step_cost: CostModel | None = None,
    length_scale: float = 0.25,
    seconds: float = 60.0,
    policies: Sequence[str] = POLICIES,
    bounds: bool = True,
    bound_seconds: float = 30.0,
) -> SliceResult:
    """Replay one slice under each policy on the simulated clock (fresh engine each, identical inputs).

    ``cost`` sizes the slice, sets the SLOs and is the schedulers' cost model, as the fitted isolated
    prefill model is in ``benchmarks/policies.py``; ``step_cost`` (default: ``cost``) times the steps,
    standing in for the machine. ``bounds=False`` skips the bounds and the idealised online schedules
    (the load sweep reads only the policies' own figures); ``bound_seconds`` caps the solver of the
    fewest-violations bound per busy period (past it the bound is the solver's, still a lower bound)."""
    arrivals, _ = scaled_slice(s, cost, length_scale, s.load, seconds)
    results: dict[str, dict] = {}
    violations: dict[str, int] = {}
    for pol in policies:
        records, busy, end = _simulate(arrivals, config, pol, cost, step_cost or cost, slo)
        results[pol] = {"summary": summarize(records, end), "utilization": busy}
        violations[pol] = sum(r.ttft is None or r.ttft > r.slo_ttft for r in records)
    longs = sum(r.length_class == "long" for r in records)
    ttft = {
        pol: {cls: dict(r["summary"][cls]["ttft_ms"]) for cls in ("short", "long")}
        for pol, r in results.items()
    }
    least, online, limits = None, {}, None
    if bounds:
        # The bounds price the work as the simulated machine runs it (the step model); SLOs stay the slice's.
        prompts = [(a.arrival, a.prompt_tokens) for a in arrivals]
        threshold = config.scheduler.short_threshold
        limits = slice_bounds(
            prompts, step_cost or cost, lambda n: slo.ttft(cost, n), threshold, bound_seconds
        )
        online = ideal_online(prompts, step_cost or cost, lambda n: slo.ttft(cost, n), threshold)
        least = limits["slo_violations"]
    return SliceResult(
        s.start,
        s.load,
        len(arrivals),
        longs / len(arrivals),
        results.get("fcfs", {}).get("utilization", 0.0),
        violations,
        least,
        online,
        target_checks(results, limits),
        ttft,
    )


def ideal_online(
    prompts: Sequence[tuple[float, int]], cost: CostModel, slo_of, short_threshold: int
) -> dict[str, int]:
    """SLO violations of idealised online schedules of ``(arrival, prompt_tokens)`` in the bounds'
    relaxation (:func:`~policy_study.bounds.online_late`: preemptive, no decode work, no per-step
    cost, knowing only what has arrived): each order of ``ONLINE_ORDERS``, and shorts first with the
    given-up ones last. Beside the bound, which knows the future, they show how much of the gap
    between a real scheduler and the bound is foresight."""
    jobs = jobs_for(prompts, cost, slo_of)
    out = {order: online_late(jobs, order) for order in ONLINE_ORDERS}
    out["shorts first, given-up last"] = online_late(
        jobs,
        "earliest deadline, given-up last",
        short_work=cost.prefill_time(short_threshold - 1) - cost.c0,
    )
    return out


def slices_table(rows: Sequence[SliceResult]) -> str:
    """Markdown: one row per slice with the violations and each check's measured value, marked ``x`` where
    it misses its target and ``b`` where that is beyond the bound (no scheduler could meet it)."""
    names = [c.name for c in rows[0].checks]
    pols = list(rows[0].violations)
    head = (
        f"| first row | load | requests | long | fcfs util | {' | '.join(f'{p} viol.' for p in pols)} | "
        f"{' | '.join(names)} |\n|{'---|' * (5 + len(pols) + len(names))}"
    )
    lines = [head]
    for r in rows:
        marks = " | ".join(c.fmt(c.measured) + _mark(c) for c in r.checks)
        lines.append(
            f"| {r.start} | {r.load:.3g} | {r.requests} | {r.long_share * 100:.0f}% | {r.fcfs_utilization * 100:.0f}% | "
            f"{' | '.join(str(r.violations[p]) for p in pols)} | {marks} |"
        )
    return "\n".join(lines)


def _mark(c: Check) -> str:
    return "" if c.met is not False else " b" if c.beyond_bound else " x"


def pooled_lines(rows: Sequence[SliceResult]) -> list[str]:
    """Markdown: for each check, the slices meeting its target, those where no scheduler could, and the
    median measured value; and the SLO violations of all slices together."""
    out = ["| check | target | slices met | beyond the bound | median |", "|---|---|---|---|---|"]
    for i, first in enumerate(rows[0].checks):
        values = [r.checks[i].measured for r in rows if r.checks[i].measured is not None]
        met = sum(1 for r in rows if r.checks[i].met)
        beyond = sum(1 for r in rows if r.checks[i].beyond_bound)
        median = first.fmt(statistics.median(values)) if values else "-"
        out.append(
            f"| pla {first.name} | {first.target_text} | {met} of {len(rows)} | {beyond} | {median} |"
        )
    totals = {p: sum(r.violations[p] for r in rows) for p in rows[0].violations}
    requests = sum(r.requests for r in rows)
    pooled = ", ".join(f"{p} {n} ({n / requests * 100:.1f}%)" for p, n in totals.items())
    least = sum(r.least_violations for r in rows)
    out += [
        "",
        f"SLO violations over all {len(rows)} slices ({requests} requests): {pooled}; "
        f"no scheduler fewer than {least} ({least / requests * 100:.1f}%)",
    ]
    if totals.get("fcfs"):
        out[-1] += f"; pla vs fcfs {(totals['pla'] - totals['fcfs']) / totals['fcfs'] * 100:+.0f}%"
    out[-1] += "."
    online = ", ".join(
        f"{order} {sum(r.online_violations[order] for r in rows)}"
        for order in rows[0].online_violations
    )
    out += [
        "",
        f"Idealised online schedules in the bound's relaxation (preemptive, no decode work, no per-step "
        f"cost, knowing only what has arrived), SLO violations over all slices: {online}.",
    ]
    return out


# The load sweep: the no-harm rule says pla may be at most this much worse than fcfs on TTFT p50 where
# there is little to reorder (the 20 % and 40 % utilisation).
NO_HARM = 0.05


def ttft_change(r: SliceResult, cls: str, q: str, base: str = "fcfs") -> float | None:
    """pla's TTFT percentile ``q`` ("p50", "p99") of class ``cls`` relative to ``base``'s on one slice
    (``pla / base - 1``; None where the slice has no such request)."""
    pla, ref = r.ttft_ms["pla"][cls][q], r.ttft_ms[base][cls][q]
    return None if pla is None or not ref else pla / ref - 1


def sweep_table(levels: dict[float, Sequence[SliceResult]]) -> str:
    """Markdown: one row per fcfs utilisation level with pla's TTFT p50 and p99 against fcfs (the
    median over slices and the worst slice), how many slices stay within :data:`NO_HARM` on the p50s,
    and the SLO violations of all slices together."""
    head = (
        "| fcfs util | slices | short p50 vs fcfs: median, worst | within +5 % | long p50 vs fcfs: median, worst "
        "| within +5 % | short p99 vs fcfs (median) | long p99 vs fcfs (median) | SLO viol. fcfs -> pla |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x * 100:+.0f}%"

    for util, rows in levels.items():
        cells = []
        for cls in ("short", "long"):
            values = [v for v in (ttft_change(r, cls, "p50") for r in rows) if v is not None]
            within = sum(v <= NO_HARM for v in values)
            cells += [
                f"{pct(statistics.median(values)) if values else '-'}, {pct(max(values)) if values else '-'}",
                f"{within} of {len(values)}",
            ]
        for cls in ("short", "long"):
            values = [v for v in (ttft_change(r, cls, "p99") for r in rows) if v is not None]
            cells.append(pct(statistics.median(values)) if values else "-")
        fcfs, pla = (sum(r.violations[p] for r in rows) for p in ("fcfs", "pla"))
        cells.append(f"{fcfs} -> {pla}")
        lines.append(f"| {util * 100:.0f}% | {len(rows)} | {' | '.join(cells)} |")
    return "\n".join(lines)

"""Load sweeps and goodput capacity: the highest request rate at which a policy keeps its SLO.

A sweep replays the same requests at several arrival rates, by rescaling their arrival times (the
``time_scale`` convention of :mod:`plaserve.workload.trace`: ``time_scale = 2`` is half the rate), and
simulates each. The **goodput capacity** for an SLO-violation target is the highest rate ``r`` such
that the run at ``r`` and the runs at every lower swept rate violate the SLO for at most the target
share of requests; a violation rate is not always monotone in the load (a lucky burst alignment), and
requiring every lower rate to pass keeps one lucky point from overstating the capacity. Between the
last passing and the first failing rate, bisection refines the answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from plaserve.sim.cluster import ClusterConfig, SimResult, simulate
from plaserve.sim.profiles import SimProfile
from plaserve.workload.trace import TraceRequest, scale_requests


def mean_rate(requests: Sequence[TraceRequest]) -> float:
    """Arrivals per second over the span of ``requests`` (first to last arrival)."""
    if len(requests) < 2:
        raise ValueError("a rate needs at least two requests")
    span = max(r.arrival for r in requests) - min(r.arrival for r in requests)
    if span <= 0:
        raise ValueError("all requests arrive at the same time: no rate")
    return (len(requests) - 1) / span


def at_rate(requests: Sequence[TraceRequest], rate: float) -> tuple[list[TraceRequest], float]:
    """``requests`` with arrivals rescaled to a mean of ``rate`` per second, and the time scale used."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    scale = mean_rate(requests) / rate
    return scale_requests(requests, time_scale=scale), scale


@dataclass(frozen=True)
class SweepPoint:
    """One simulated load level."""

    rate: float  # requests per second
    time_scale: float  # relative to the requests as given
    slo_violation_rate: float
    summary: dict[str, Any] = field(repr=False)
    load_skew: float = 0.0

    @property
    def short_ttft_ms(self) -> dict[str, float | None]:
        return self.summary["short"]["ttft_ms"]


def run_point(
    requests: Sequence[TraceRequest], profile: SimProfile, config: ClusterConfig, rate: float
) -> tuple[SweepPoint, SimResult]:
    """Simulate ``requests`` rescaled to ``rate``."""
    scaled, scale = at_rate(requests, rate)
    result = simulate(scaled, profile, config)
    summary = result.summary()
    return SweepPoint(
        rate, scale, summary["all"]["slo_violation_rate"], summary, result.load_skew
    ), result


@dataclass(frozen=True)
class Capacity:
    """The outcome of a capacity search."""

    target: float  # allowed SLO-violation share
    capacity: float | None  # req/s; None: even the lowest rate tried misses the target
    points: list[SweepPoint]  # every simulated rate, ascending
    bounded: bool  # False: the highest swept rate still met the target (capacity is at least that)

    def describe(self) -> str:
        if self.capacity is None:
            return f"below {self.points[0].rate:.3g} req/s (the lowest rate tried misses {self.target:.0%})"
        return f"{self.capacity:.3g} req/s" + (
            "" if self.bounded else " or more (the highest rate tried)"
        )


def capacity(
    requests: Sequence[TraceRequest],
    profile: SimProfile,
    config: ClusterConfig,
    rates: Sequence[float],
    *,
    target: float = 0.05,
    refine: int = 3,
    on_point: Callable[[SweepPoint], None] | None = None,
) -> Capacity:
    """Goodput capacity (module docstring): sweep ``rates`` (ascending), stop at the first that
    misses ``target``, then bisect ``refine`` times between it and the last that met it."""
    rates = sorted(rates)
    if not rates:
        raise ValueError("no rates to sweep")
    points: list[SweepPoint] = []

    def measure(rate: float) -> SweepPoint:
        point, _ = run_point(requests, profile, config, rate)
        points.append(point)
        if on_point is not None:
            on_point(point)
        return point

    good: float | None = None
    bad: float | None = None
    for rate in rates:
        if measure(rate).slo_violation_rate <= target:
            good = rate
        else:
            bad = rate
            break
    if good is not None and bad is not None:
        for _ in range(refine):
            mid = math.sqrt(good * bad)  # rates span orders of magnitude: bisect on a log scale
            if measure(mid).slo_violation_rate <= target:
                good = mid
            else:
                bad = mid
    points.sort(key=lambda p: p.rate)
    return Capacity(target, good, points, bounded=bad is not None)

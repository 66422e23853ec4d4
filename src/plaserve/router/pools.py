"""Short and long pools, and the controller that sizes them.

With two or more workers in rotation, ``R`` of them form the *short pool* and the rest the *long
pool* (spatial disaggregation: a short prompt should not queue behind a long one). Membership is
*floating*: the short pool is whichever ``R`` workers are kept clear of long work, i.e. at every
decision at least ``R`` workers must have a backlog within ``short_spill_budget_s`` (the routing rule
is in :mod:`plaserve.router.policies`). A fixed membership strands capacity: the short pool's workers
idle while long work queues on the others, since short prompts are a small part of the work (a
quarter of the Azure code trace's requests, 4 % of its predicted prefill seconds on a 32B model).
Floating membership keeps the same protection and lets every worker share the long work.

The controller sets ``R``.

**Pressure.** For each length class, over the requests of the last ``window_s``: the
``percentile`` of their predicted TTFT at dispatch (time already waited in the router, plus the chosen
worker's backlog, plus the request's own prefill) divided by their TTFT SLO, and the same percentile
of their observed TTFT (first token seen by the router; streamed requests only) divided by their SLO.
The class's pressure is the larger of the two: 1.0 means its bad case just meets the SLO. The
predicted part reacts at once to a burst; the observed part corrects a cost model that is off. A class
with fewer than ``min_samples`` requests in the window has pressure 0.

**Rule.** At most once per ``period_s``, and never within ``cooldown_s`` of the last change: if one
class's pressure exceeds the other's by the factor ``1 + hysteresis`` *and* by ``dead_band`` in
absolute terms, one worker moves to the pressed pool (``R`` goes up or down by one), unless that would
leave the other pool below ``min_size``. Hysteresis and dead band keep noise from flapping a worker
back and forth; the cool-down lets a move show its effect before the next.

**Workers coming and going** keep ``R`` but clamp it to ``[min_size, n - min_size]``; below two
workers there are no pools (``R = 0``). The first ``R`` is ``initial_short_fraction`` of the workers.

**No short traffic, no reservation.** While no short request has come for ``window_s``, no worker is
kept clear (:meth:`PoolController.reserved` is 0): a reservation nobody uses would only cost long
requests capacity. The first short request restores it at once.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from plaserve.router.config import PoolConfig

SHORT, LONG = "short", "long"


@dataclass(frozen=True)
class Resize:
    """One change of the short pool's size."""

    time: float
    old: int
    new: int
    pressure_short: float
    pressure_long: float
    reason: str  # "pressure" (the controller) or "workers" (a worker came or went)


class PoolController:
    """The short pool's size and the resizing rule (module docstring). Times are passed in."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.num_workers = 0
        self.short_size = 0  # R; 0: no pools
        self._predicted: dict[str, deque[tuple[float, float]]] = {SHORT: deque(), LONG: deque()}
        self._observed: dict[str, deque[tuple[float, float]]] = {SHORT: deque(), LONG: deque()}
        self.last_change = -math.inf
        self.last_tick = -math.inf
        self.last_short = -math.inf  # when the last short request was dispatched
        self.history: list[Resize] = []

    @property
    def active(self) -> bool:
        """Whether there are pools (two or more workers)."""
        return self.short_size > 0

    def reserved(self, now: float) -> int:
        """How many workers must be kept clear now: ``R``, or 0 after ``window_s`` without a short request."""
        return self.short_size if now - self.last_short <= self.config.window_s else 0

    def _bounds(self, n: int) -> tuple[int, int]:
        low = max(1, self.config.min_size)
        return low, n - low

    def set_workers(self, n: int, now: float) -> None:
        """The number of workers in rotation is ``n``."""
        if n == self.num_workers:
            return
        old, first = self.short_size, self.num_workers < 2
        self.num_workers = n
        if n < 2:
            self.short_size = 0
        else:
            low, high = self._bounds(n)
            want = round(n * self.config.initial_short_fraction) if first else old
            self.short_size = min(max(want, low), high) if low <= high else n // 2
        if self.short_size != old:
            self.history.append(
                Resize(
                    now,
                    old,
                    self.short_size,
                    self.pressure(SHORT, now),
                    self.pressure(LONG, now),
                    "workers",
                )
            )

    # --- pressure --------------------------------------------------------------------------------
    def observe_dispatch(
        self, length_class: str, predicted_ttft: float, slo: float, now: float
    ) -> None:
        """A request of ``length_class`` was sent, predicted to see its first token ``predicted_ttft``
        seconds after it reached the router."""
        if length_class == SHORT:
            self.last_short = now
        self._predicted[length_class].append((now, predicted_ttft / slo))

    def observe_first_token(self, length_class: str, ttft: float, slo: float, now: float) -> None:
        """A streamed request of ``length_class`` got its first token ``ttft`` seconds after it
        reached the router."""
        self._observed[length_class].append((now, ttft / slo))

    def pressure(self, length_class: str, now: float) -> float:
        """The class's pressure (module docstring)."""
        cutoff = now - self.config.window_s
        out = 0.0
        for samples in (self._predicted[length_class], self._observed[length_class]):
            while samples and samples[0][0] < cutoff:
                samples.popleft()
            if len(samples) >= self.config.min_samples:
                out = max(
                    out, float(np.percentile([r for _, r in samples], self.config.percentile))
                )
        return out

    # --- the rule --------------------------------------------------------------------------------
    def tick(self, now: float) -> Resize | None:
        """Apply the resizing rule once; returns the change made, if any."""
        cfg = self.config
        if (
            not self.active
            or now - self.last_tick < cfg.period_s
            or now - self.last_change < cfg.cooldown_s
        ):
            return None
        self.last_tick = now
        ps, pl = self.pressure(SHORT, now), self.pressure(LONG, now)
        low, high = self._bounds(self.num_workers)
        new = self.short_size
        if ps > pl * (1 + cfg.hysteresis) and ps - pl > cfg.dead_band:
            new = min(self.short_size + 1, high)
        elif pl > ps * (1 + cfg.hysteresis) and pl - ps > cfg.dead_band:
            new = max(self.short_size - 1, low)
        if new == self.short_size:
            return None
        change = Resize(now, self.short_size, new, ps, pl, "pressure")
        self.short_size, self.last_change = new, now
        self.history.append(change)
        return change

    def describe(self, now: float) -> dict:
        """Sizes and pressures as JSON."""
        return {
            "active": self.active,
            "short_size": self.short_size,
            "reserved": self.reserved(now),
            "long_size": self.num_workers - self.short_size if self.active else 0,
            "pressure": {SHORT: self.pressure(SHORT, now), LONG: self.pressure(LONG, now)},
            "resizes": sum(r.reason == "pressure" for r in self.history),
        }

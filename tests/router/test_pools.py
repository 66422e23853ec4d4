"""The pool controller on deterministic inputs: pressures, hysteresis, cool-down, sizes."""

from __future__ import annotations

import pytest

from plaserve.router.config import PoolConfig
from plaserve.router.pools import LONG, SHORT, PoolController

CFG = PoolConfig(
    period_s=1.0,
    cooldown_s=5.0,
    window_s=10.0,
    percentile=90.0,
    min_size=1,
    hysteresis=0.25,
    dead_band=0.1,
    min_samples=5,
    initial_short_fraction=0.25,
)


def feed(c: PoolController, cls: str, ratio: float, now: float, n: int = 10) -> None:
    """``n`` dispatches of ``cls`` at ``now`` whose predicted TTFT is ``ratio`` times their SLO."""
    for _ in range(n):
        c.observe_dispatch(cls, predicted_ttft=ratio, slo=1.0, now=now)


def test_sizes_follow_the_workers():
    c = PoolController(CFG)
    c.set_workers(1, 0.0)
    assert not c.active and c.short_size == 0
    c.set_workers(8, 0.0)
    assert c.short_size == 2  # a quarter of 8
    c.set_workers(2, 1.0)
    assert c.short_size == 1  # clamped: the long pool keeps min_size
    c.set_workers(1, 2.0)
    assert c.short_size == 0  # below two workers there are no pools
    assert [(r.old, r.new, r.reason) for r in c.history] == [
        (0, 2, "workers"),
        (2, 1, "workers"),
        (1, 0, "workers"),
    ]


def test_pressure_is_the_worse_of_predicted_and_observed_percentiles():
    c = PoolController(CFG)
    for i in range(10):
        c.observe_dispatch(SHORT, predicted_ttft=0.1 * (i + 1), slo=1.0, now=0.0)  # 0.1 .. 1.0
    assert c.pressure(SHORT, 0.0) == pytest.approx(0.91)  # numpy's p90 of 0.1..1.0
    for _ in range(5):
        c.observe_first_token(SHORT, ttft=3.0, slo=2.0, now=1.0)
    assert c.pressure(SHORT, 1.0) == pytest.approx(1.5)
    assert c.pressure(SHORT, 10.5) == pytest.approx(1.5)  # the dispatches of t=0 left the window
    assert c.pressure(SHORT, 11.5) == 0.0  # everything left the window
    c.observe_dispatch(LONG, 5.0, 1.0, 12.0)
    assert c.pressure(LONG, 12.0) == 0.0  # fewer than min_samples


def test_moves_one_worker_per_period_with_cooldown_and_min_size():
    c = PoolController(CFG)
    c.set_workers(4, 0.0)
    assert c.short_size == 1
    feed(c, LONG, 2.0, 0.0)
    feed(c, SHORT, 0.2, 0.0)
    assert c.tick(0.0) is None  # the short pool is at its minimum already
    feed(c, SHORT, 3.0, 1.0)  # now the short requests suffer
    change = c.tick(1.0)
    assert change is not None and (change.old, change.new) == (1, 2)
    assert c.tick(2.0) is None and c.tick(5.9) is None  # cool-down
    change = c.tick(6.0)
    assert change is not None and (change.old, change.new) == (2, 3)
    assert c.tick(11.0) is None  # 3 of 4: the long pool is at its minimum


def test_hysteresis_and_dead_band_hold_still():
    c = PoolController(CFG)
    c.set_workers(4, 0.0)
    feed(c, SHORT, 1.2, 0.0)
    feed(c, LONG, 1.0, 0.0)
    assert c.tick(0.0) is None  # 1.2 < 1.0 * 1.25: within the hysteresis
    c2 = PoolController(CFG)
    c2.set_workers(4, 0.0)
    feed(c2, SHORT, 0.08, 0.0)
    feed(c2, LONG, 0.01, 0.0)
    assert c2.tick(0.0) is None  # 8x larger, but both nearly idle: inside the dead band


def test_shrinks_the_short_pool_under_long_pressure():
    c = PoolController(CFG)
    c.set_workers(8, 0.0)
    feed(c, SHORT, 0.3, 0.0)
    feed(c, LONG, 4.0, 0.0)
    change = c.tick(0.0)
    assert change is not None and (change.old, change.new) == (2, 1)
    assert c.tick(5.0) is None and c.short_size == 1  # min_size


def test_period_limits_decisions():
    c = PoolController(PoolConfig(period_s=2.0, cooldown_s=0.0, min_samples=1))
    c.set_workers(6, 0.0)
    feed(c, SHORT, 5.0, 0.0)
    assert c.tick(0.0) is not None
    assert c.tick(1.0) is None  # within the period, even without a cool-down
    assert c.tick(2.0) is not None


def test_no_reservation_without_short_traffic():
    c = PoolController(CFG)
    c.set_workers(4, 0.0)
    assert c.reserved(0.0) == 0  # no short request yet
    c.observe_dispatch(SHORT, 0.1, 1.0, 1.0)
    assert c.reserved(1.0) == 1 and c.reserved(11.0) == 1
    assert c.reserved(11.1) == 0  # a window without short requests

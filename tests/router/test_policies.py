"""Routing decisions on deterministic worker states."""

from __future__ import annotations

import pytest

from plaserve.cost import CostModel
from plaserve.router.config import BreakerConfig, PoolConfig, RouterConfig
from plaserve.router.policies import (
    Job,
    LeastRequests,
    LeastTokens,
    PlaPolicy,
    PowerOfTwo,
    RoundRobin,
    make_policy,
)
from plaserve.router.pools import LONG, SHORT
from plaserve.router.workers import LoadReport, Worker

LINEAR = CostModel(g1=1e-3, g2=0.0)  # 1 ms per token
QUADRATIC = CostModel(g1=1e-5, g2=1e-8)
CONFIG = RouterConfig(pools=PoolConfig(short_spill_budget_s=0.1, long_hold_horizon_s=1.0))


def workers(n: int, cost: CostModel = LINEAR) -> list[Worker]:
    return [Worker(f"http://w{i}", cost, BreakerConfig()) for i in range(n)]


_rid = iter(range(10**9))


def load(w: Worker, *costs: float, tokens: int = 100, now: float = 0.0) -> None:
    """Put requests with these predicted costs in flight on ``w``."""
    for c in costs:
        w.start(next(_rid), c, tokens, LONG, now)


def short(n: int = 100, t: float = 0.0) -> Job:
    return Job((n,), SHORT, t)


def long_(n: int = 2000, t: float = 0.0) -> Job:
    return Job((n,), LONG, t)


def test_round_robin_cycles():
    ws = workers(3)
    p = RoundRobin()
    assert [p.choose(short(), ws, 0.0).url for _ in range(4)] == [
        "http://w0",
        "http://w1",
        "http://w2",
        "http://w0",
    ]


def test_least_requests_and_least_tokens_disagree_on_one_big_prompt():
    ws = workers(2)
    ws[0].start(1, 5.0, 5000, LONG, 0.0)  # one huge prompt
    for i in range(3):
        ws[1].start(10 + i, 0.1, 100, SHORT, 0.0)  # three small ones
    assert LeastRequests().choose(short(), ws, 0.0) is ws[0]
    assert LeastTokens().choose(short(), ws, 0.0) is ws[1]


def test_power_of_two_never_picks_the_busiest_of_three():
    ws = workers(3)
    load(ws[0], 0.1)
    load(ws[1], 0.1, 0.1)
    load(ws[2], 0.1, 0.1, 0.1)
    p = PowerOfTwo(seed=7)
    picks = {p.choose(short(), ws, 0.0).url for _ in range(200)}
    assert picks == {"http://w0", "http://w1"}


def test_pla_sees_the_quadratic_cost_that_token_counts_miss():
    ws = workers(2, QUADRATIC)
    ws[0].start(1, ws[0].cost((8000,)), 8000, LONG, 0.0)  # 0.4 s
    for i in range(4):
        # 4 x 0.04 s: as many tokens, 40 % of the work
        ws[1].start(10 + i, ws[1].cost((2000,)), 2000, LONG, 0.0)
    assert ws[0].inflight_tokens == ws[1].inflight_tokens
    assert LeastTokens().choose(short(), ws, 0.0) is ws[0]  # a tie, broken by order
    assert PlaPolicy(CONFIG).choose(short(), ws, 0.0) is ws[1]


def test_pla_short_goes_to_the_earliest_finish_then_to_the_least_worked():
    ws = workers(3)
    load(ws[0], 0.3)
    load(ws[1], 0.2)
    load(ws[2], 0.2)
    ws[1].work_total = 10.0  # w1 has been given more work so far than w2
    p = PlaPolicy(CONFIG)
    assert p.choose(short(), ws, 0.0) is ws[2]


def test_pla_long_keeps_the_short_pool_clear():
    ws = workers(4)
    p = PlaPolicy(CONFIG)
    p.on_dispatch(short(), ws[0], 0.01, 0.0)  # short traffic: one worker is to be kept clear
    load(ws[1], 0.5)
    load(ws[2], 0.6)
    load(ws[3], 0.7)
    # w0 is the only clear worker: a 0.3 s request may not land there, and goes where it finishes first.
    assert p.choose(long_(300), ws, 0.0) is ws[1]
    # A request that fits the budget may use the clear worker: it stays clear.
    assert p.choose(long_(50), ws, 0.0) is ws[0]
    # With no short traffic for a window, nothing is reserved.
    assert p.choose(long_(300), ws, 100.0) is ws[0]


def test_pla_holds_long_requests_while_every_worker_is_busy_enough():
    ws = workers(2)
    p = PlaPolicy(CONFIG)
    load(ws[0], 1.5)
    load(ws[1], 1.2)
    assert p.choose(long_(300), ws, 0.0) is None  # both at or over the 1 s horizon
    assert p.choose(short(), ws, 0.0) is ws[1]  # short requests are never held
    # a retry is placed anyway, at the earliest finish
    assert p.choose_now(long_(300), ws, 0.0) is ws[1]


def test_pla_releases_in_order_and_lets_a_small_one_use_the_clear_worker():
    ws = workers(3)
    p = PlaPolicy(CONFIG)
    p.on_dispatch(short(), ws[0], 0.01, 0.0)
    load(ws[1], 1.5)
    load(ws[2], 1.5)
    held = [long_(3000), long_(80), long_(60)]
    # The oldest fits nowhere (w0 must stay clear, w1 and w2 are over the horizon); the next one fits
    # w0's budget.
    assert p.next_held(held, ws, 0.0) == (1, ws[0])
    ws[1].inflight.clear()  # w1's work is done: two clear workers, one may take the oldest
    i, w = p.next_held(held, ws, 0.0)
    assert i == 0 and w is ws[0]  # equally early: the one given less work so far


def test_pla_without_pools_on_one_worker():
    ws = workers(1)
    p = PlaPolicy(CONFIG)
    p.on_dispatch(short(), ws[0], 0.01, 0.0)
    assert not p.pools.active
    assert p.choose(long_(500), ws, 0.0) is ws[0]  # nothing to keep clear with a single worker
    load(ws[0], 2.0)
    assert p.choose(long_(500), ws, 0.0) is None  # the horizon still applies


def test_pla_wakes_up_when_a_reported_backlog_drains_to_the_horizon():
    ws = workers(2)
    p = PlaPolicy(CONFIG)
    for w, b in zip(ws, (1.5, 3.0)):
        w.load = LoadReport(b, 0.0, 0.0)
    assert p.choose(long_(300), ws, 0.0) is None
    # w0: 1.5 s reported, horizon 1 s, plus 1 ms
    assert p.next_wakeup(ws, 0.0) == pytest.approx(0.501)
    assert p.choose(long_(300), ws, 0.5 + 1e-6) is ws[0]


def test_make_policy_names():
    for name in ("pla", "round_robin", "least_requests", "least_tokens", "power_of_two"):
        assert make_policy(RouterConfig(policy=name)).name == name
    with pytest.raises(ValueError, match="unknown policy"):
        RouterConfig(policy="random")

"""Held requests: released when capacity frees, in order, and never left hanging."""

from __future__ import annotations

import asyncio

import pytest

from plaserve.cost import CostModel
from plaserve.router.config import BreakerConfig, PoolConfig, RouterConfig
from plaserve.router.dispatch import Dispatcher, NoWorkerError
from plaserve.router.policies import Job, make_policy
from plaserve.router.pools import LONG
from plaserve.router.workers import Worker

CONFIG = RouterConfig(pools=PoolConfig(long_hold_horizon_s=0.5))


def setup(n: int = 1):
    clock = [0.0]
    ws = [Worker(f"http://w{i}", CostModel(g1=1e-3, g2=0.0), BreakerConfig()) for i in range(n)]
    d = Dispatcher(make_policy(CONFIG), lambda: ws, fallback_wakeup_s=0.05, clock=lambda: clock[0])
    return d, ws, clock


def test_held_requests_go_in_order_when_the_worker_frees_up():
    async def main():
        d, (w,), clock = setup()
        d.start()
        w0, _ = await d.acquire(Job((1000,), LONG), rid=0)  # 1 s of work: over the horizon
        assert w0 is w
        a = asyncio.ensure_future(d.acquire(Job((100,), LONG), rid=1))
        b = asyncio.ensure_future(d.acquire(Job((100,), LONG), rid=2))
        await asyncio.sleep(0.05)
        assert not a.done() and not b.done() and d.num_held == 2
        w.first_token(0)  # the first request's prefill is done
        d.wake()
        await asyncio.wait_for(a, 1.0)
        await asyncio.wait_for(b, 1.0)
        assert sorted(w.inflight) == [0, 1, 2] and d.num_held == 0
        await d.stop()

    asyncio.run(main())


def test_a_client_that_leaves_while_held_is_dropped_and_counted_nowhere():
    async def main():
        d, (w,), clock = setup()
        d.start()
        await d.acquire(Job((1000,), LONG), rid=0)
        t = asyncio.ensure_future(d.acquire(Job((100,), LONG), rid=1))
        await asyncio.sleep(0.02)
        t.cancel()
        await asyncio.sleep(0.02)
        assert d.num_held == 0 and list(w.inflight) == [0]
        await d.stop()

    asyncio.run(main())


def test_held_requests_fail_cleanly_when_no_worker_is_left():
    async def main():
        d, (w,), clock = setup()
        d.start()
        await d.acquire(Job((1000,), LONG), rid=0)
        t = asyncio.ensure_future(d.acquire(Job((100,), LONG), rid=1))
        await asyncio.sleep(0.02)
        w.set_healthy(False)
        d.wake()
        with pytest.raises(NoWorkerError):
            await asyncio.wait_for(t, 1.0)
        with pytest.raises(NoWorkerError):
            await d.acquire(Job((10,), LONG), rid=2)
        await d.stop()

    asyncio.run(main())


def test_retries_skip_the_workers_already_tried_and_are_not_held():
    async def main():
        d, ws, clock = setup(2)
        d.start()
        await d.acquire(Job((1000,), LONG), rid=0)
        await d.acquire(Job((1000,), LONG), rid=1)
        # Both workers are over the horizon; a retry goes at once, to a worker it has not tried.
        w, _ = await asyncio.wait_for(
            d.acquire(Job((100,), LONG), rid=2, exclude=frozenset({ws[0].url})), 0.5
        )
        assert w is ws[1]
        with pytest.raises(NoWorkerError):
            await d.acquire(Job((100,), LONG), rid=3, exclude=frozenset({ws[0].url, ws[1].url}))
        await d.stop()

    asyncio.run(main())

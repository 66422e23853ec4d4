"""Fake GPUs and a router on loopback, in the test's event loop."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp

from plaserve.cost import CostModel
from plaserve.launcher import free_port
from plaserve.router.config import HealthConfig, RouterConfig
from plaserve.router.proxy import Router, serve
from plaserve.testing.fake_gpu import FakeGpuConfig, FakeGpuServer

# 0.1 ms per token: a 1,000-token prompt takes 0.1 s, a 100-token one 10 ms.
TEST_COST = CostModel(g1=1e-4, g2=0.0, source="test")
# Health checks every 0.2 s so that failures show within a test's patience.
FAST_HEALTH = HealthConfig(
    interval_s=0.2,
    timeout_s=1.0,
    failure_threshold=1,
    success_threshold=1,
    load_interval_s=0.1,
    load_stale_s=1.0,
)


@dataclass
class Cluster:
    router: Router
    url: str
    gpus: list[FakeGpuServer]
    session: aiohttp.ClientSession


@contextlib.asynccontextmanager
async def cluster(
    gpu_configs: list[FakeGpuConfig],
    config: RouterConfig | None = None,
    extra_urls: tuple[str, ...] = (),
) -> AsyncIterator[Cluster]:
    """Start one fake GPU per config and a router in front of them (plus ``extra_urls``)."""
    gpus = [await FakeGpuServer(c).start() for c in gpu_configs]
    router = Router(
        [g.url for g in gpus] + list(extra_urls), config or RouterConfig(health=FAST_HEALTH)
    )
    port = free_port()
    runner = await serve(router, "127.0.0.1", port)
    try:
        async with aiohttp.ClientSession() as session:
            yield Cluster(router, f"http://127.0.0.1:{port}", gpus, session)
    finally:
        await runner.cleanup()
        for g in gpus:
            await g.stop()


def gpu(**kw) -> FakeGpuConfig:
    """A fake GPU at TEST_COST streaming 3 tokens 10 ms apart, unless told otherwise."""
    return FakeGpuConfig(**{"cost_model": TEST_COST, "tbt_s": 0.01, "max_output_tokens": 3, **kw})

"""A real ``plaserve serve`` worker SIGKILLed behind the router under load: every request either completes
(retried on the other worker when it had no byte yet) or ends with a clean error event; none is lost or
hangs, and the surviving worker holds no KV block afterwards."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import httpx

from plaserve.launcher import ServerProcess, free_port, running
from plaserve.router.config import RouterConfig
from plaserve.router.proxy import Router, serve

from .conftest import FAST_HEALTH
from .test_failover import outcome
from .test_proxy import metric

PROMPT = [3 + i % 200 for i in range(1500)]  # token ids inside the tiny checkpoint's vocabulary
WORKER_ARGS = [
    "--kv-cache-memory",
    "32MiB",
    "--max-model-len",
    "2048",
    "--policy",
    "fcfs",
    "--no-compile",
]


def test_a_killed_plaserve_worker_loses_no_request(qwen2_ckpt: str) -> None:
    with running(
        ServerProcess([qwen2_ckpt, *WORKER_ARGS]), ServerProcess([qwen2_ckpt, *WORKER_ARGS])
    ) as (victim, survivor):

        async def main() -> None:
            router = Router(
                [victim.url, survivor.url], RouterConfig(policy="round_robin", health=FAST_HEALTH)
            )
            port = free_port()
            runner = await serve(router, "127.0.0.1", port)
            url = f"http://127.0.0.1:{port}"
            try:
                async with aiohttp.ClientSession() as s:
                    tasks = [asyncio.ensure_future(outcome(s, url, PROMPT)) for _ in range(24)]
                    # requests queued, prefilling and streaming on both workers
                    await asyncio.sleep(0.4)
                    os.kill(victim.proc.pid, signal.SIGKILL)
                    results = await asyncio.wait_for(asyncio.gather(*tasks), 120)  # none hangs
                    assert set(results) <= {"ok", "stream_error"}, results
                    assert results.count("ok") >= 12, results
                    async with s.get(url + "/metrics") as r:
                        retried = metric(await r.text(), "plaserve_router_retries_total")
                    # Every request after the kill is served by the survivor.
                    after = await asyncio.wait_for(
                        asyncio.gather(*(outcome(s, url, PROMPT) for _ in range(4))), 60
                    )
                    assert after == ["ok"] * 4, after
                    print(
                        f"outcomes {results.count('ok')} ok, {results.count('stream_error')} clean errors; "
                        f"{retried:.0f} retried"
                    )
            finally:
                await runner.cleanup()

        asyncio.run(main())
        deadline = time.monotonic() + 30
        while True:
            load = httpx.get(f"{survivor.url}/load").json()
            if load["num_requests"] == 0 and load["kv"]["used_blocks"] == 0:
                break
            assert time.monotonic() < deadline, load
            time.sleep(0.1)

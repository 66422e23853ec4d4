"""A worker killed during a run: every request is retried or cleanly failed, none hangs; the worker
comes back when it is healthy again."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp

from plaserve.launcher import free_port
from plaserve.router.config import RouterConfig
from plaserve.router.proxy import Router, serve
from plaserve.testing.fake_gpu import FakeGpuServer, spawn

from .conftest import FAST_HEALTH, gpu
from .test_proxy import metric

# 2,000-token prompts: 0.2 s prefill, then 0.45 s of tokens
GPU = gpu(tbt_s=0.05, max_output_tokens=10)


async def outcome(session: aiohttp.ClientSession, url: str, prompt: list[int] | None = None) -> str:
    """'ok' (10 tokens and [DONE]), 'stream_error' (an error event, then [DONE]) or 'http_<status>'.
    Tokens are counted from the final usage: a plaserve worker merges the tokens a slow reader has not
    taken yet into one chunk."""
    body = {
        "prompt": prompt or list(range(2000)),
        "max_tokens": 10,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return f"http_{resp.status}"
        tokens, error, done = 0, False, False
        async for line in resp.content:
            data = line.strip()[5:].strip() if line.startswith(b"data:") else b""
            if data == b"[DONE]":
                done = True
            elif data:
                event = json.loads(data)
                error |= "error" in event
                tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
        assert done, "every stream ends with [DONE]"
        return "stream_error" if error else ("ok" if tokens == 10 else f"short_{tokens}")


def test_killed_worker_requests_are_retried_or_cleanly_failed_and_it_comes_back():
    victim_port = free_port()
    victim = spawn([victim_port], GPU)  # a real process, killed for real
    victim_url = f"http://127.0.0.1:{victim_port}"

    async def main():
        survivor = await FakeGpuServer(GPU).start()
        router = Router(
            [victim_url, survivor.url], RouterConfig(policy="round_robin", health=FAST_HEALTH)
        )
        port = free_port()
        runner = await serve(router, "127.0.0.1", port)
        url = f"http://127.0.0.1:{port}"
        restarted = None
        try:
            async with aiohttp.ClientSession() as s:
                # Requests in all stages on both workers: queued, prefilling, streaming.
                tasks = [asyncio.ensure_future(outcome(s, url)) for _ in range(12)]
                await asyncio.sleep(0.5)
                os.kill(victim.pid, signal.SIGKILL)
                results = await asyncio.wait_for(asyncio.gather(*tasks), 30)  # none hangs
                assert set(results) <= {"ok", "stream_error"}, results
                # Those that had tokens from the dead worker end with an error event; the rest
                # were retried on the live worker or never touched the dead one.
                assert results.count("ok") >= 6 and results.count("stream_error") >= 1, results
                async with s.get(url + "/metrics") as r:
                    # the queued ones
                    assert metric(await r.text(), "plaserve_router_retries_total") >= 1
                # After the kill, everything goes to the live worker.
                assert (
                    await asyncio.wait_for(asyncio.gather(*(outcome(s, url) for _ in range(4))), 30)
                    == ["ok"] * 4
                )
                await asyncio.sleep(0.5)
                assert not router.workers[victim_url].healthy
                # The worker restarts on its port: it is back in rotation and gets requests again.
                restarted = await FakeGpuServer(GPU, victim_port).start()
                for _ in range(40):
                    if router.workers[victim_url].healthy:
                        break
                    await asyncio.sleep(0.1)
                assert router.workers[victim_url].healthy
                assert await asyncio.gather(*(outcome(s, url) for _ in range(4))) == ["ok"] * 4
                assert restarted.gpu.stats.requests > 0
        finally:
            await runner.cleanup()
            for server in (survivor, restarted):
                if server is not None:
                    await server.stop()

    try:
        asyncio.run(main())
    finally:
        victim.kill()
        victim.wait()

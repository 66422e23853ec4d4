"""Router overhead: latency and throughput through ``plaserve route`` against calling a backend directly.

Setup, all on loopback: one instant backend (a fake GPU with a zero cost model and one output token,
:mod:`plaserve.testing.fake_gpu`) in a child process; the router (``plaserve route --policy P``, one
worker) in another child process; the client (aiohttp, one connection pool) in this process.

* **latency**: requests one at a time (after a warm-up), alternating between the backend directly and
  the router, so both see the same background load; the p50/p90/p99 of the client's request time each
  way; the router's added p50 is the difference of the p50s.
* **throughput**: ``--concurrency`` requests in flight for ``--seconds``; requests per second.

Both for a non-streamed and a streamed ``/v1/completions`` (100 prompt token ids, ``max_tokens`` 1).
Target (issue 6): under 1 ms added at p50. Client, router and backend share the machine's CPUs, so
other work on it shows in the numbers; the run prints the 1-minute load average before and after.

    python benchmarks/router_overhead.py [--policy pla] [--requests 2000] [--out docs/router_overhead.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import aiohttp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from plaserve.cost import CostModel  # noqa: E402
from plaserve.launcher import (
    RouterProcess,  # noqa: E402
    free_port,  # noqa: E402
)
from plaserve.testing.fake_gpu import FakeGpuConfig, spawn  # noqa: E402

BODY = {"prompt": list(range(10, 110)), "max_tokens": 1, "temperature": 0.0}


async def one(session: aiohttp.ClientSession, url: str, stream: bool) -> float:
    body = dict(BODY, stream=stream)
    t = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as resp:
        data = await resp.read()
        if resp.status != 200 or (stream and not data.rstrip().endswith(b"[DONE]")):
            raise RuntimeError(f"HTTP {resp.status}: {data[:200]!r}")
    return time.perf_counter() - t


async def latency(
    direct: str, routed: str, n: int, stream: bool, warmup: int
) -> tuple[list[float], list[float]]:
    """Request times directly and through the router, interleaved (alternating which goes first) so
    that both see the same background load on the machine."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for _ in range(warmup):
            await one(session, direct, stream)
            await one(session, routed, stream)
        d, r = [], []
        for i in range(n):
            if i % 2:
                d.append(await one(session, direct, stream))
                r.append(await one(session, routed, stream))
            else:
                r.append(await one(session, routed, stream))
                d.append(await one(session, direct, stream))
        return d, r


async def throughput(url: str, concurrency: int, seconds: float, stream: bool) -> float:
    done = 0
    stop = time.perf_counter() + seconds

    async def loop(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await one(session, url, stream)
            done += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(loop(session) for _ in range(concurrency)))
        return done / (time.perf_counter() - start)


def pct(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1000
    return {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policy", default="pla")
    p.add_argument("--requests", type=int, default=2000, help="sequential requests per measurement")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seconds", type=float, default=5.0, help="per throughput measurement")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()

    backend_port = free_port()
    backend = spawn(
        [backend_port],
        FakeGpuConfig(CostModel(0.0, 0.0, source="instant"), tbt_s=0.0, max_output_tokens=1),
    )
    router = RouterProcess([f"http://127.0.0.1:{backend_port}"], ["--policy", args.policy]).start()
    direct, routed = f"http://127.0.0.1:{backend_port}", router.url
    results: dict[str, dict] = {}
    load_before = os.getloadavg()[0]
    try:
        for stream in (False, True):
            mode = "stream" if stream else "no-stream"
            lat_d, lat_r = asyncio.run(latency(direct, routed, args.requests, stream, args.warmup))
            rps_d = asyncio.run(throughput(direct, args.concurrency, args.seconds, stream))
            rps_r = asyncio.run(throughput(routed, args.concurrency, args.seconds, stream))
            d, r = pct(lat_d), pct(lat_r)
            results[mode] = {
                "direct_ms": d,
                "router_ms": r,
                "added_p50_ms": r["p50"] - d["p50"],
                "direct_rps": rps_d,
                "router_rps": rps_r,
            }
    finally:
        router.stop()
        backend.terminate()
        backend.wait(10)

    load_after = os.getloadavg()[0]
    print(
        f"policy {args.policy}; {args.requests} sequential requests after {args.warmup} warm-up; "
        f"throughput with {args.concurrency} in flight for {args.seconds:g} s; machine load (1 min) "
        f"{load_before:.1f} -> {load_after:.1f}"
    )
    print(
        "| mode | direct p50 / p99 (ms) | via router p50 / p99 (ms) | added p50 (ms) | direct req/s | router req/s |"
    )
    print("|---|---|---|---|---|---|")
    for mode, r in results.items():
        print(
            f"| {mode} | {r['direct_ms']['p50']:.2f} / {r['direct_ms']['p99']:.2f} | "
            f"{r['router_ms']['p50']:.2f} / {r['router_ms']['p99']:.2f} | {r['added_p50_ms']:.2f} | "
            f"{r['direct_rps']:.0f} | {r['router_rps']:.0f} |"
        )
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(
                {
                    "policy": args.policy,
                    "requests": args.requests,
                    "concurrency": args.concurrency,
                    "seconds": args.seconds,
                    "loadavg_1min": [load_before, load_after],
                    "results": results,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

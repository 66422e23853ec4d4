"""What serving over HTTP costs the engine: the same requests offline (``LLMEngine`` stepped in this
process, nothing else running) and through ``plaserve serve`` (streamed and whole responses, one
aiohttp client in this process).

Two servers, both idle while the other is measured: ``--engine-mode process``, whose engine runs in
a process of its own, and ``--engine-mode thread``, whose engine runs on a thread of the HTTP process, where whatever
Python the event loop runs (parsing, SSE chunks, JSON) holds the GIL the engine thread needs between
its torch calls. This measures what each costs: decode tokens/s at a few batch sizes, a burst of
mixed prompts, and lone short prompts sent one at a time (one output token each: what a short
prompt's TTFT pays on an idle server), as HTTP / offline ratios (1.0 = no cost).

    PYTHONPATH=src .venv/bin/python benchmarks/http_overhead.py [--dtype bfloat16] [--out out/http.json]
        [--stream-interval N]

``--stream-interval N`` adds a column: the thread-mode server streaming every N tokens (the request's
``stream_interval``), for the cases with more than one output token.

Same engine settings on both sides (``--policy fcfs``: no batch window, so the two see the same
batches; no prefix caching, since each case runs several times); the run prints the load average
before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass

import aiohttp

from plaserve import EngineConfig, LLMEngine, SamplingParams
from plaserve.launcher import ServerProcess


@dataclass(frozen=True)
class Case:
    name: str
    prompts: list[list[int]]
    max_tokens: int
    one_at_a_time: bool = False  # each prompt sent (stepped) once the one before has finished


# Lone prompts: around the short prompts of engine_vs_vllm.py's trace (median ~230 tokens).
LONE_LENGTHS = (64, 232, 400)
LONE_REQUESTS = 8


def cases(seed: int = 0) -> list[Case]:
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(10, 500) for _ in range(n)]  # noqa: E731
    out = [Case(f"decode batch {b}", [ids(32) for _ in range(b)], 128) for b in (1, 16, 64)]
    out.append(
        Case("burst of 48 mixed", [ids(rng.choice([64, 256, 1024, 2048])) for _ in range(48)], 32)
    )
    out += [
        Case(
            f"{LONE_REQUESTS} lone prompts of {n}", [ids(n) for _ in range(LONE_REQUESTS)], 1, True
        )
        for n in LONE_LENGTHS
    ]
    return out


def engine_args(dtype: str) -> dict:
    # No prefix caching: every case runs several times on each side, and a prompt computed before
    # would be served from the cache the second time.
    return dict(
        kv_cache_memory="1GiB",
        max_model_len=4096,
        policy="fcfs",
        dtype=dtype,
        enable_prefix_caching=False,
    )


def offline(engine: LLMEngine, case: Case) -> float:
    """Wall seconds to run ``case`` to completion in ``engine``, stepped from this thread."""
    params = SamplingParams(max_tokens=case.max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for group in [[p] for p in case.prompts] if case.one_at_a_time else [case.prompts]:
        for p in group:
            engine.add_request(p, params)
        while engine.has_unfinished():
            engine.step()
    return time.perf_counter() - start


async def over_http(url: str, case: Case, stream: bool, interval: int | None = None) -> float:
    async def one(session: aiohttp.ClientSession, prompt: list[int]) -> None:
        body = {
            "prompt": prompt,
            "max_tokens": case.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
            **({} if interval is None else {"stream_interval": interval}),
        }
        async with session.post(f"{url}/v1/completions", json=body) as r:
            data = await r.read()
            assert r.status == 200, data[:300]

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        if case.one_at_a_time:
            for p in case.prompts:
                await one(session, p)
        else:
            await asyncio.gather(*(one(session, p) for p in case.prompts))
        return time.perf_counter() - start


def rate(row: dict, seconds: float) -> str:
    """Output tokens a second; for lone prompts (one token each) milliseconds a request instead: an
    idle server's TTFT, request included."""
    if row["one_at_a_time"]:
        return f"{1000 * seconds / row['output_tokens']:.1f} ms a request"
    return f"{row['output_tokens'] / seconds:.0f}"


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dtype", default="auto")
    p.add_argument("--reps", type=int, default=3, help="best of this many runs per case and side")
    p.add_argument("--out", default=None)
    p.add_argument("--stream-interval", type=int, default=None, help="also stream every N tokens")
    args = p.parse_args()
    every = args.stream_interval
    load_before = os.getloadavg()[0]
    engine = LLMEngine(EngineConfig.from_kwargs(**engine_args(args.dtype)))
    engine.warm_up()
    flags = [
        "--kv-cache-memory",
        "1GiB",
        "--max-model-len",
        "4096",
        "--policy",
        "fcfs",
        "--dtype",
        args.dtype,
        "--no-enable-prefix-caching",
    ]
    rows = []
    with (
        ServerProcess([*flags, "--engine-mode", "process"]) as server,
        ServerProcess([*flags, "--engine-mode", "thread"]) as threaded,
    ):
        for case in cases():
            tokens = len(case.prompts) * case.max_tokens
            for url in (server.url, threaded.url):  # warm-up of the shapes on every side
                asyncio.run(over_http(url, case, True))
            offline(engine, case)
            best = {"offline": 1e9, "stream": 1e9, "whole": 1e9, "thread_stream": 1e9}
            if every is not None and case.max_tokens > 1:
                best["thread_every"] = 1e9
            for _ in range(args.reps):  # interleaved, so every side sees the same background load
                best["offline"] = min(best["offline"], offline(engine, case))
                best["stream"] = min(best["stream"], asyncio.run(over_http(server.url, case, True)))
                best["whole"] = min(best["whole"], asyncio.run(over_http(server.url, case, False)))
                best["thread_stream"] = min(
                    best["thread_stream"], asyncio.run(over_http(threaded.url, case, True))
                )
                if "thread_every" in best:
                    best["thread_every"] = min(
                        best["thread_every"],
                        asyncio.run(over_http(threaded.url, case, True, every)),
                    )
            rows.append(
                {
                    "case": case.name,
                    "output_tokens": tokens,
                    "one_at_a_time": case.one_at_a_time,
                    **{k: round(v, 3) for k, v in best.items()},
                }
            )
            print(f"{case.name}: {best}", file=sys.stderr, flush=True)
    print(f"dtype {engine.dtype}, load average {load_before:.2f} -> {os.getloadavg()[0]:.2f}\n")
    extra = "" if every is None else f" engine thread, every {every} tokens / offline |"
    print(
        "| case | offline s | HTTP streamed s | HTTP whole s | streamed / offline | whole / offline | "
        f"engine thread: streamed / offline |{extra} offline tok/s | streamed tok/s |"
    )
    print("|---" * (9 + (every is not None)) + "|")
    for r in rows:
        cell = ""  # the every-N column: its ratio, or "-" for one-token cases
        if every is not None:
            cell = f" {r['thread_every'] / r['offline']:.2f} |" if "thread_every" in r else " - |"
        print(
            f"| {r['case']} | {r['offline']:.3f} | {r['stream']:.3f} | {r['whole']:.3f} | "
            f"{r['stream'] / r['offline']:.2f} | {r['whole'] / r['offline']:.2f} | "
            f"{r['thread_stream'] / r['offline']:.2f} |{cell} "
            f"{rate(r, r['offline'])} | {rate(r, r['stream'])} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"dtype": str(engine.dtype), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

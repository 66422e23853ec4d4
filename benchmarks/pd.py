"""Prefill/decode disaggregation against colocated workers, real engines on the CPU (docs/PD.md).

Setup, all on loopback, the same machine and the same trace slice for both:

* **colocated**: two ``plaserve serve`` workers (one CPU thread each) behind ``plaserve route``
  (pla);
* **pd**: one ``plaserve serve --pd-role prefill`` and one ``--pd-role decode`` worker (one thread
  each) behind ``plaserve route --prefill-urls --decode-urls``.

Model: the embedded default (random weights; 8 layers, hidden 512, 2 KV heads of 64: 8 KiB of KV per
token in float32, 4 KiB in bfloat16). Load: rows ``[start, start + count)`` of ``azure_code_2023.csv``,
prompts capped at ``--max-prompt`` tokens, outputs at ``--max-output``, replayed open-loop by
:func:`plaserve.bench.client.run_requests` (streamed, ``ignore_eos``) with inter-arrival times scaled so
that the workers' own cost model predicts ``--load`` of one worker's time in prefills.

Reported per setup: time between tokens p50/p99 (what PD is for: long prefills stop stalling decodes),
TTFT p50/p99 by class, output tokens per second, and the KV blocks each worker holds once the run is
over (must be 0). For PD also the transfer cost (the decode worker's ``plaserve_kv_transfer_*``
metrics: ms and MB per 1,000 prompt tokens pulled) against the loopback bandwidth measured in the same
run (one asyncio stream between two processes, 256 MiB, best of three), and, after the trace, the TTFT of one 4,096-token prompt on the idle
PD pair (after ``--probe-idle`` seconds without work) against the transfer time of its KV
(``--probe`` repetitions, median). Targets (issue 19): TBT
p99 with PD at most 1/3 of colocated; the transfer at most 10 % of a 4,096-token prompt's TTFT; no
block left.

The client, the router and the workers share the machine's CPUs with whatever else runs on it: the
run records the 1-minute load average before and after each setup.

    python benchmarks/pd.py [--count 40] [--load 0.5] [--out docs/pd.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import os
import signal
import statistics
import sys
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from plaserve.bench.client import ClientConfig, run_requests  # noqa: E402
from plaserve.launcher import RouterProcess, ServerProcess, start_together  # noqa: E402
from plaserve.router.costs import cost_model_from_dict  # noqa: E402
from plaserve.workload.slo import TtftSlo  # noqa: E402
from plaserve.workload.trace import TraceRequest, load_trace  # noqa: E402
from policy_study.policies import find_trace  # noqa: E402

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def start_workers(roles: list[str | None], args: argparse.Namespace) -> list[ServerProcess]:
    base = ["--kv-cache-memory", args.kv_cache_memory, "--max-model-len", str(args.max_model_len)]
    procs = [
        ServerProcess(
            base + (["--pd-role", r] if r else []),
            env={**os.environ, **ONE_THREAD},
            startup_timeout=600,
        )
        for r in roles
    ]
    start_together(procs)
    return procs


def metric(url: str, name: str, labels: str = "") -> float:
    """The sum of a Prometheus sample ``name{labels}`` in ``url``'s /metrics (0 when absent)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    key = f"{name}{{{labels}}}" if labels else name
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(key + " ") or (not labels and line.startswith(name + "{"))
    )


def used_blocks(urls: list[str], wait_s: float = 30.0) -> list[int]:
    """Each worker's used KV blocks, once they are all 0 or after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        used = [httpx.get(u + "/load", timeout=10).json()["kv"]["used_blocks"] for u in urls]
        if not any(used) or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


def _sink(port_queue, size: int, chunk: int) -> None:
    """The receiving end of :func:`loopback_bandwidth`, in a process of its own."""

    async def main() -> None:
        done = asyncio.Event()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            left = size
            while left:
                left -= len(await reader.readexactly(min(chunk, left)))
            writer.write(b"ok\n")
            await writer.drain()
            writer.close()
            done.set()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port_queue.put(server.sockets[0].getsockname()[1])
        await done.wait()
        server.close()

    asyncio.run(main())


def loopback_bandwidth(size: int = 256 * 2**20, chunk: int = 4 * 2**20) -> float:
    """Bytes per second through one asyncio TCP stream on 127.0.0.1 between two processes (the
    transfer's own mechanism: asyncio streams, whole buffers)."""
    ports: multiprocessing.Queue = multiprocessing.Queue()
    sink = multiprocessing.Process(target=_sink, args=(ports, size, chunk))
    sink.start()
    port = ports.get(timeout=60)

    async def send() -> float:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        block = b"\0" * chunk
        start = time.perf_counter()
        for _ in range(size // chunk):
            writer.write(block)
            await writer.drain()
        await reader.readline()
        seconds = time.perf_counter() - start
        writer.close()
        return seconds

    seconds = asyncio.run(send())
    sink.join(60)
    return size / seconds


def scaled_trace(
    args: argparse.Namespace, cost, scale: float | None
) -> tuple[list[TraceRequest], float]:
    """The trace slice, arrivals scaled by ``scale`` or else so that ``cost`` predicts ``--load``
    of one worker's time in prefills (the second setup reuses the first's scale)."""
    reqs = load_trace(
        find_trace("azure_code_2023.csv"),
        start=args.start,
        limit=args.count,
        max_prompt_tokens=args.max_prompt,
        max_output_tokens=args.max_output,
    )
    if scale is None:
        work = sum(cost.prefill_time(r.prompt_tokens) for r in reqs)
        scale = work / args.load / reqs[-1].arrival
    return [dataclasses.replace(r, arrival=r.arrival * scale) for r in reqs], scale


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1000 if values else None


def summarize(records: list, duration: float) -> dict:
    ok = [r for r in records if r.ok]
    tbts = [g for r in ok for g in r.tbts]
    out = {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if not r.ok})[:5],
        "tbt_ms": {"p50": pct(tbts, 50), "p99": pct(tbts, 99)},
        "output_tok_s": sum(r.output_tokens for r in ok) / duration,
        "duration_s": duration,
        "ttft_ms": {},
    }
    for cls in ("short", "long"):
        ttfts = [r.ttft for r in ok if r.length_class == cls and r.ttft is not None]
        out["ttft_ms"][cls] = {"n": len(ttfts), "p50": pct(ttfts, 50), "p99": pct(ttfts, 99)}
    return out


def ttft_probe(url: str, tokens: int) -> float:
    """TTFT of one streamed ``tokens``-token prompt (fresh ids: no prefix-cache hit), seconds."""
    prompt = [10 + (i * 7919 + int(time.time() * 1e6)) % 480 for i in range(tokens)]
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                return time.perf_counter() - start
    raise RuntimeError(f"no token from {url}")


def run_setup(label: str, args: argparse.Namespace, scale: float | None) -> dict:
    pd = label == "pd"
    procs = start_workers(["prefill", "decode"] if pd else [None, None], args)
    urls = [p.url for p in procs]
    try:
        route = (
            ["--prefill-urls", urls[0], "--decode-urls", urls[1]]
            if pd
            else ["--worker-urls", *urls]
        )
        cost = cost_model_from_dict(httpx.get(urls[0] + "/load").json()["cost_model"], "worker")
        requests, scale = scaled_trace(args, cost, scale)
        with RouterProcess([], route) as router:
            time.sleep(1.0)  # a few /load polls
            load_before = os.getloadavg()[0]
            cfg = ClientConfig(url=router.url, seed=args.seed)
            result = asyncio.run(run_requests(requests, cfg, TtftSlo()))
            load_after = os.getloadavg()[0]
            out = {
                "label": label,
                "time_scale": scale,
                **summarize(result.records, result.duration_s),
            }
            out["loadavg_1min"] = [load_before, load_after]
            out["used_blocks_after"] = used_blocks(urls)
            prompt_tokens = sum(r.prompt_tokens for r in result.records if r.ok)
            if pd:
                dec = urls[1]
                seconds = metric(dec, "plaserve_kv_transfer_seconds_sum", 'direction="received"')
                nbytes = metric(dec, "plaserve_kv_transfer_bytes_total", 'direction="received"')
                hits = metric(dec, "plaserve_kv_transfer_prefix_hit_blocks_total")
                out["transfer"] = {
                    "seconds": seconds,
                    "bytes": nbytes,
                    "prefix_hit_blocks": hits,
                    "prompt_tokens": prompt_tokens,
                    "ms_per_1k_prompt_tokens": 1000 * seconds / prompt_tokens * 1000,
                    "mb_per_1k_prompt_tokens": nbytes / 1e6 / prompt_tokens * 1000,
                    "achieved_mb_s": nbytes / 1e6 / seconds if seconds else None,
                }
            # Idle first: pla runs a long prompt whole only once its busy meter (10 s) says light load.
            time.sleep(args.probe_idle)
            probes = []
            for _ in range(args.probe):
                before = metric(urls[1], "plaserve_kv_transfer_seconds_sum", 'direction="received"')
                ttft = ttft_probe(router.url, 4096)
                after = metric(urls[1], "plaserve_kv_transfer_seconds_sum", 'direction="received"')
                probes.append((ttft, after - before))
            out["probe_4096"] = {
                "ttft_ms": statistics.median(t for t, _ in probes) * 1000,
                "transfer_ms": statistics.median(x for _, x in probes) * 1000 if pd else None,
                "transfer_share": statistics.median(x / t for t, x in probes) if pd else None,
            }
            out["used_blocks_after_probe"] = used_blocks(urls)
        return out
    finally:
        for p in procs:
            p.stop()


def table(results: dict) -> str:
    def f(v: float | None, d: int = 0) -> str:
        return "-" if v is None else f"{v:.{d}f}"

    rows = [
        "| setup | TBT p50 ms | TBT p99 ms | TTFT short p50/p99 ms | TTFT long p50/p99 ms | "
        "output tok/s | 4k-prompt TTFT ms | failed | blocks left |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label in ("colocated", "pd"):
        r = results[label]
        t = r["ttft_ms"]
        rows.append(
            f"| {label} | {f(r['tbt_ms']['p50'], 1)} | {f(r['tbt_ms']['p99'], 1)} | "
            f"{f(t['short']['p50'])} / {f(t['short']['p99'])} | "
            f"{f(t['long']['p50'])} / {f(t['long']['p99'])} | {f(r['output_tok_s'], 1)} | "
            f"{f(r['probe_4096']['ttft_ms'])} | {r['failed']} | "
            f"{sum(r['used_blocks_after']) + sum(r['used_blocks_after_probe'])} |"
        )
    pd = results["pd"]
    tr = pd["transfer"]
    rows += [
        "",
        f"TBT p99 PD / colocated: {pd['tbt_ms']['p99'] / results['colocated']['tbt_ms']['p99']:.2f} "
        f"(target <= 0.33)",
        f"transfer: {tr['ms_per_1k_prompt_tokens']:.2f} ms and {tr['mb_per_1k_prompt_tokens']:.2f} MB "
        f"per 1k prompt tokens ({f(tr['achieved_mb_s'])} MB/s achieved; loopback "
        f"{results['loopback_mb_s']:.0f} MB/s in the same run); "
        f"{tr['prefix_hit_blocks']:.0f} blocks not pulled (decode-side prefix cache)",
        f"4,096-token prompt: transfer {pd['probe_4096']['transfer_ms']:.1f} ms of "
        f"{pd['probe_4096']['ttft_ms']:.0f} ms TTFT = {100 * pd['probe_4096']['transfer_share']:.1f} % "
        f"(target <= 10 %)",
    ]
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--start", type=int, default=3000, help="first trace row")
    p.add_argument("--count", type=int, default=40, help="trace rows to replay")
    p.add_argument("--load", type=float, default=0.5, help="predicted prefill share of one worker")
    p.add_argument("--max-prompt", type=int, default=4096)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--probe", type=int, default=3, help="4,096-token TTFT probes per setup")
    p.add_argument("--probe-idle", type=float, default=12.0, help="idle seconds before the probes")
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="inter-arrival multiplier (default: from --load and the first setup's cost model)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    results: dict = {
        "args": vars(args),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    # Best of three: the machine is shared, and the capacity is what the best run shows.
    results["loopback_mb_s"] = max(loopback_bandwidth() for _ in range(3)) / 1e6
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the workers on the way out
    scale = args.time_scale
    for label in ("colocated", "pd"):
        print(f"running {label} ...", file=sys.stderr, flush=True)
        results[label] = run_setup(label, args, scale)
        scale = results[label]["time_scale"]
        print(json.dumps(results[label], indent=1), file=sys.stderr, flush=True)
    print(table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

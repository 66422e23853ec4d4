"""engine_vs_vllm.py's burst served by ``plaserve serve``, once per ``--engine-mode``: the wall time,
the engine steps it took (``/metrics``; the offline burst of ``burst_profile.py`` prints its own), and
the CPU seconds of each process (the HTTP server, its engine process where it has one, and this
client), to tell time lost to HTTP's share of the GIL from CPU taken from the engine's threads.

The Azure conversation trace rows 840-899, lengths x 0.25, outputs <= 32, all at once; streamed
``/v1/completions`` with token-id prompts (:mod:`plaserve.bench.client`, as engine_vs_vllm.py).

    PYTHONPATH=src .venv/bin/python benchmarks/served_burst.py --model DIR [--policy fcfs] [--runs 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import resource
import sys
import urllib.request
from dataclasses import replace
from pathlib import Path

from plaserve.bench.client import ClientConfig, run_requests
from plaserve.launcher import ServerProcess
from plaserve.workload.slo import TtftSlo
from plaserve.workload.trace import load_trace


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_steps(url: str) -> int:
    """The server's engine steps so far (the counter ``plaserve_engine_steps_total`` of ``/metrics``)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.search(r"^plaserve_engine_steps_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    if found is None:
        raise RuntimeError("no plaserve_engine_steps in /metrics")
    return int(float(found.group(1)))


def engine_child(pid: int) -> int | None:
    """The engine process of server ``pid`` (multiprocessing's spawned child), if it has one."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            if b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                return int(stat.parent.name)
        except (OSError, ValueError):
            continue
    return None


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="checkpoint dir (engine_vs_vllm.py builds them)")
    p.add_argument("--policy", default="fcfs")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--runs", type=int, default=4, help="bursts per mode (the first warms up)")
    p.add_argument("--modes", default="process,thread")
    p.add_argument("--trace", default="/work/shared/traces/azure_conv_2023.csv")
    args = p.parse_args()
    reqs = load_trace(args.trace, start=840, limit=60, length_scale=0.25, max_output_tokens=32)
    burst = [replace(r, arrival=0.0) for r in reqs]
    flags = [
        *("--dtype", args.dtype, "--policy", args.policy, "--kv-cache-memory", "2GiB"),
        *("--max-model-len", "4608", "--max-num-seqs", "64", "--max-num-batched-tokens", "2048"),
    ]
    print(f"load average {os.getloadavg()[0]:.2f}; policy {args.policy}, {args.dtype}\n")
    print(
        "| engine mode | run | wall s | engine steps | server CPU s | engine process CPU s | "
        "client CPU s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode in args.modes.split(","):
        with ServerProcess([args.model, *flags, "--engine-mode", mode], startup_timeout=300) as s:
            assert s.proc is not None
            pids = [s.proc.pid] + [c for c in [engine_child(s.proc.pid)] if c is not None]
            for run in range(args.runs):
                steps = engine_steps(s.url)
                before, mine = [cpu_seconds(pid) for pid in pids], own_cpu_seconds()
                cfg = ClientConfig(url=s.url, short_threshold=512, seed=4000 + run)
                result = asyncio.run(run_requests(burst, cfg, TtftSlo()))
                used = [cpu_seconds(pid) - b for pid, b in zip(pids, before)]
                steps = engine_steps(s.url) - steps
                failed = sum(not r.ok for r in result.records)
                if failed:
                    raise RuntimeError(f"{failed} of {len(burst)} requests failed")
                engine = f"{used[1]:.2f}" if len(used) > 1 else "-"
                print(
                    f"| {mode} | {run} | {result.duration_s:.2f} | {steps} | {used[0]:.2f} | {engine} | "
                    f"{own_cpu_seconds() - mine:.2f} |",
                    flush=True,
                )
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""OpenMP's spin count against decode speed: how long torch's OpenMP threads (GNU libgomp) spin at a
barrier before they sleep, and what that does to a decode step (docs/BENCHMARKS.md, "OpenMP's spin
waits").

For each setting, a child process (libgomp reads ``GOMP_SPINCOUNT`` once, at load) measures:

* the spin's length: the team thread's CPU time while the main thread sleeps 100 ms right after a
  parallel region (median of 3; per-thread nanoseconds from /proc);
* the median step time of an offline engine (the embedded model) decoding batches of 1, 16 and 64,
  stepped from the main thread.

``parked`` is no ``GOMP_SPINCOUNT`` with torch imported before plaserve, so the engine parks an extra
OpenMP team (``engine/omp_spin.py``) and libgomp throttles every wait to 100 spins; the counts set
``GOMP_SPINCOUNT``. ``--load N`` runs N CPU-bound processes beside it.

    PYTHONPATH=src .venv/bin/python benchmarks/omp_spin.py [--dtype bfloat16] [--counts 1000,30000,...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, os, sys, threading, time
import torch  # first: no spin count from plaserve; GOMP_SPINCOUNT (if any) comes from the parent
from plaserve import EngineConfig, LLMEngine, SamplingParams

def cpu_ns():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        out[int(tid)] = int(open(f"/proc/self/task/{tid}/schedstat").read().split()[0])
    return out

me = threading.get_native_id()
x = torch.ones(1 << 22)
x.mul_(2)
spins = []
for _ in range(3):
    x.mul_(1.0001)
    before = cpu_ns(); time.sleep(0.1); after = cpu_ns()
    spins.append(sum(after[t] - before.get(t, 0) for t in after if t != me) / 1e6)
engine = LLMEngine(EngineConfig.from_kwargs(
    kv_cache_memory="1GiB", max_model_len=4096, policy="fcfs", dtype=sys.argv[1]))
engine.warm_up()
def step_ms(batch, tokens=64):
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([10 + (i * 7 + j) % 400 for j in range(16)], params)
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished():
        start = time.perf_counter(); engine.step(); times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3
steps = {}
for b in (1, 16, 64):
    step_ms(b, 8)
    steps[b] = step_ms(b)
print(json.dumps({"spin_ms": sorted(spins)[1], "step_ms": steps}))
"""


def measure(count: str, dtype: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    if count != "parked":
        env["GOMP_SPINCOUNT"] = count
    out = subprocess.run(
        [sys.executable, "-c", CHILD, dtype], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--counts", default="parked,1000,10000,30000,50000,100000,300000")
    p.add_argument("--load", type=int, default=0, help="CPU-bound processes running beside it")
    args = p.parse_args()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        load = os.getloadavg()[0]
        print(f"dtype {args.dtype}, {args.load} CPU-bound processes beside, load {load:.2f}")
        print(f"({time.strftime('%H:%M')})\n")
        print("| spin count | ms a wait spins | step ms, batch 1 | batch 16 | batch 64 |")
        print("|---|---:|---:|---:|---:|")
        for count in args.counts.split(","):
            r = measure(count, args.dtype)
            s = r["step_ms"]
            print(
                f"| {count} | {r['spin_ms']:.1f} | {s['1']:.2f} | {s['16']:.2f} | {s['64']:.2f} |",
                flush=True,
            )
    finally:
        for h in hogs:
            h.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())

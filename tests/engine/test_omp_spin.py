"""An engine stepped from the main thread does not leave torch's OpenMP threads spinning between
parallel regions (engine/omp_spin.py). Spinning shows as CPU time: a spinning team thread burns about
as much as the stepping thread itself, a sleeping one only what its share of the parallel work takes.
Measured per thread from /proc (nanoseconds), so the machine's other load (which inflates wall time) does not enter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

PROBE = """
import os, threading
from plaserve import EngineConfig, LLMEngine, SamplingParams
engine = LLMEngine(EngineConfig.from_kwargs(
    kv_cache_memory="64MiB", max_model_len=256, max_num_seqs=4, policy="fcfs", dtype="float32"))
def cpu_ticks():
    # Nanoseconds on the CPU from schedstat where the kernel keeps it; the 10 ms ticks of utime +
    # stime are too coarse for a few steps' worth.
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            ticks[int(tid)] = int(open(f"/proc/self/task/{tid}/schedstat").read().split()[0])
        except (OSError, ValueError, IndexError):
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            ticks[int(tid)] = (int(fields[11]) + int(fields[12])) * 10_000_000
    return ticks
def decode(n):
    engine.add_request(list(range(1, 17)), SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
decode(4)  # first calls
before = cpu_ticks()
decode(int(os.environ["STEPS"]))
after = cpu_ticks()
spent = {t: after[t] - before.get(t, 0) for t in after}
main = spent.pop(threading.get_native_id())
print(sum(spent.values()) / max(main, 1))
"""


def others_per_main(steps: int, **env: str) -> float:
    """CPU time of every other thread over the stepping (main) thread's, for ``steps`` batch-1 decode
    steps."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "STEPS": str(steps), **env},
    )
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or "OpenMP" not in torch.__config__.parallel_info()
    or (os.cpu_count() or 1) < 2
    or any(os.environ.get(v) for v in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")),
    reason="libgomp's spin waits, on Linux with 2+ CPUs and no user setting",
)
def test_main_thread_stepping_does_not_leave_openmp_threads_spinning():
    throttled = others_per_main(30)
    # A wait policy of the user's, which the engine leaves alone: the same probe sees the team thread
    # spin through the steps. "active" rather than libgomp's default count of 300,000 pauses, whose
    # length in time differs between CPUs (~20 ms on the AMX Xeons, a few ms on an EPYC).
    spinning = others_per_main(16, OMP_WAIT_POLICY="active")  # slow on a busy machine: few steps
    assert throttled < 0.8, throttled
    assert spinning > 1.5 * throttled, (spinning, throttled)

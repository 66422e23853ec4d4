"""Torch's OpenMP threads neither spin for long once idle nor fall asleep between a step's parallel
regions (``OPENMP_SPIN_COUNT`` in plaserve/__init__.py, engine/omp_spin.py). Spinning shows as CPU
time, measured per thread from /proc (nanoseconds), so the machine's other load (which inflates wall
time) does not enter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import plaserve

CPU_TIME = """
import os, threading
def cpu_ns():
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
def others_and_main(fn):
    before = cpu_ns()
    fn()
    after = cpu_ns()
    spent = {t: after[t] - before.get(t, 0) for t in after}
    return sum(spent.values()) - spent[threading.get_native_id()], spent[threading.get_native_id()]
"""

IDLE_SPIN = (
    """
import os, time
if os.environ["FIRST"] == "torch":
    import torch, plaserve
else:
    import plaserve, torch
"""
    + CPU_TIME
    + """
x = torch.ones(1 << 22)
x.mul_(2)  # a parallel region: the team exists
spins = []
for _ in range(3):
    x.mul_(1.0001)
    spins.append(others_and_main(lambda: time.sleep(0.1))[0] / 1e6)
print(os.environ.get("GOMP_SPINCOUNT"), plaserve.OPENMP_SPIN_COUNT_SET, sorted(spins)[1])
"""
)

STEPPING = (
    """
import os
import torch  # before plaserve: the spin count is libgomp's default, the parked team's doing
from plaserve import EngineConfig, LLMEngine, SamplingParams
"""
    + CPU_TIME
    + """
engine = LLMEngine(EngineConfig.from_kwargs(
    kv_cache_memory="64MiB", max_model_len=256, max_num_seqs=4, policy="fcfs", dtype="float32"))
def decode(n):
    engine.add_request(list(range(1, 17)), SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
decode(4)  # first calls
others, main = others_and_main(lambda: decode(int(os.environ["STEPS"])))
print(others / max(main, 1))
"""
)

# The environment as the user set it: without the spin count ``import plaserve`` set in this process.
USER_ENV = {
    k: v
    for k, v in os.environ.items()
    if not (k == "GOMP_SPINCOUNT" and plaserve.OPENMP_SPIN_COUNT_SET)
}

openmp_on_linux = pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or "OpenMP" not in torch.__config__.parallel_info()
    or (os.cpu_count() or 1) < 2
    or any(USER_ENV.get(v) for v in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")),
    reason="libgomp's spin waits, on Linux with 2+ CPUs and no user setting",
)


def probe(script: str, **env: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={**USER_ENV, **env},
    )
    return out.stdout.split()


@openmp_on_linux
def test_import_plaserve_before_torch_bounds_the_idle_spin():
    count, set_here, spin_ms = probe(IDLE_SPIN, FIRST="plaserve")
    assert (count, set_here) == ("150000", "True")
    # ~2 ms on the AMX Xeon, of the 100 ms the main thread slept
    assert float(spin_ms) < 30, spin_ms
    # A wait policy of the user's stands, and the same probe sees the team thread spin through.
    count, set_here, spin_ms = probe(IDLE_SPIN, FIRST="plaserve", OMP_WAIT_POLICY="active")
    assert (count, set_here) == ("None", "False")
    assert float(spin_ms) > 60, spin_ms
    # With torch first it would come too late: not set (engine/omp_spin.py parks a team instead).
    count, set_here, _ = probe(IDLE_SPIN, FIRST="torch")
    assert (count, set_here) == ("None", "False")


@openmp_on_linux
def test_with_torch_first_stepping_does_not_leave_openmp_threads_spinning():
    """The fallback: a parked team makes libgomp throttle, so the team thread of an engine stepped
    from the main thread sleeps instead of spinning through the step's Python."""
    throttled = float(probe(STEPPING, STEPS="30")[-1])
    # "active" rather than libgomp's default count of 300,000 pauses, whose length in time differs
    # between CPUs (~4 ms on the AMX Xeon, benchmarks/omp_spin.py).
    spinning = float(probe(STEPPING, STEPS="16", OMP_WAIT_POLICY="active")[-1])
    assert throttled < 0.8, throttled
    assert spinning > 1.5 * throttled, (spinning, throttled)

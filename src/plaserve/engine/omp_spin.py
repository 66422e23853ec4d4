"""Keep torch's OpenMP threads from spin-waiting for milliseconds between parallel regions (GNU libgomp).

The CPU build of torch runs its intra-op parallelism on libgomp. After a parallel region (and at its
closing barrier) a libgomp thread busy-waits ``GOMP_SPINCOUNT`` iterations before it sleeps: 300,000
by default, each a ``pause`` instruction, which costs ~140 cycles on Sapphire Rapids and later (the AMX
CPUs): ~20 ms of spinning every time a thread waits. A decode step runs hundreds of small parallel
regions with Python in between, so each waiting thread spins through nearly the whole step. On a
machine with a core to spare that only burns it; on a shared or busy one the spinning threads take the
cores that the thread with the work needs, and a decode step measured 10-20x slower (2026-12-01, 2 cores,
load 3-6: 128 bfloat16 decode steps of the embedded model 15-40 s instead of 1.5-2.5 s; ``perf`` put
~75 % of the process's samples in libgomp's spin loop).

libgomp spins only 1,000 iterations (its "throttled" count, ~70 us) while it manages more threads than
there are CPUs. That is why an engine stepped on a second thread (as the server steps its engine) ran
fast: that thread's OpenMP team came on top of the main thread's, so libgomp counted more threads than
CPUs and throttled. :func:`throttle_spin_waits` makes this hold for every engine, whichever thread
steps it: it parks one more thread that owns an OpenMP team of torch's size and then sleeps. Its team
threads sleep too (after their one throttled spin); they cost memory for their stacks, no CPU.

libgomp reads the spin count once, at load, from the environment, and exports no call to change it, so
this is the only way to get there from inside a process that already imported torch. Where the user
set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` themselves, their choice stands and nothing is done.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

log = logging.getLogger(__name__)

_USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_parked: threading.Thread | None = None
_lock = threading.Lock()


def _forget_in_child() -> None:
    # A forked child has no copy of the parked thread (nor of its team): it parks its own if it builds
    # an engine.
    global _parked
    _parked = None


os.register_at_fork(after_in_child=_forget_in_child)


def _own_a_team(ready: threading.Event) -> None:
    # Large enough for at::parallel_for to split it across every thread (its grain is 32,768
    # elements): the team that runs it is this thread's, and stays with it while the thread lives.
    torch.ones(torch.get_num_threads() << 16).mul_(2)
    ready.set()
    threading.Event().wait()  # for the life of the process


def throttle_spin_waits() -> bool:
    """Park a thread that holds an extra OpenMP team, so that libgomp throttles its spin waits
    (process-wide, once). Returns whether that is in force: False where the user chose a wait policy,
    torch runs one thread (nothing waits) or its parallel backend is not OpenMP."""
    global _parked
    with _lock:
        if _parked is not None:
            return True
        if any(os.environ.get(v) for v in _USER_SETTINGS) or torch.get_num_threads() < 2:
            return False
        if "OpenMP" not in torch.__config__.parallel_info():
            return False
        ready = threading.Event()
        # A daemon thread that never finishes: its team must outlive every engine of the process.
        _parked = threading.Thread(
            target=_own_a_team, args=(ready,), name="plaserve-omp-team", daemon=True
        )
        _parked.start()
        ready.wait()
        log.debug(
            "parked an OpenMP team of %d threads: libgomp throttles its spin waits",
            torch.get_num_threads(),
        )
        return True

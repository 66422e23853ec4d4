"""Torch's OpenMP threads (GNU libgomp) and their spin waits, where torch was loaded before plaserve.

After a parallel region (and at its closing barrier) a libgomp thread busy-waits ``GOMP_SPINCOUNT``
iterations of ``pause`` before it sleeps on a futex. Too long and idle threads burn cores: libgomp's
default, 300,000, is ~4 ms on the AMX Xeon (more where a pause is slower), and on a shared or busy machine the
spinning threads took the cores the stepping thread needed (2026-12-01, 2 cores, load 3-6: 128
bfloat16 decode steps 15-40 s instead of 1.5-2.5 s; ``perf`` put ~75 % of the samples in the spin
loop). Too short and every parallel region of a step waits for its threads to wake (~100 us each on
the EPYC; decode 2-2.6x slower). ``import plaserve`` sets a bounded count (``OPENMP_SPIN_COUNT`` in
``plaserve/__init__.py``) before torch loads libgomp, which reads it only then.

When torch came first that is too late: libgomp exports no call to change the count. What it does
do is throttle its spins to 100 iterations while it manages more threads than there are CPUs, and
:func:`throttle_spin_waits` gets there by parking one more thread that owns an OpenMP team of torch's
size and then sleeps (its team threads sleep too: they cost stack memory, no CPU). That trades the
wake-ups for safety on a busy machine. Where the count is set (by ``import plaserve`` or the user, as
``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY``) nothing is done.

The same throttling catches a process where two threads run parallel regions (each gets a team):
the server therefore builds, warms up and steps its engine on one thread
(``server/engine_loop.py: EngineLoop.on_own_thread``).
"""

from __future__ import annotations

import logging
import os
import threading

import torch

import plaserve

log = logging.getLogger(__name__)

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
    (process-wide, once). Returns whether that is in force: False where the spin count was set
    (``import plaserve`` before torch, or the user), torch runs one thread (nothing waits) or its
    parallel backend is not OpenMP."""
    global _parked
    with _lock:
        if _parked is not None:
            return True
        if (
            any(os.environ.get(v) for v in plaserve.OPENMP_SPIN_SETTINGS)
            or torch.get_num_threads() < 2
        ):
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
        log.info(
            "torch was imported before plaserve, so OpenMP's spin count is libgomp's default: parked "
            "an OpenMP team of %d threads to throttle its spin waits (safe on a busy machine; on an "
            "idle one decode runs up to 2x faster with plaserve imported first, or GOMP_SPINCOUNT=%d)",
            torch.get_num_threads(),
            plaserve.OPENMP_SPIN_COUNT,
        )
        return True

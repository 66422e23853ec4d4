"""plaserve: a prefill-length-aware LLM serving system.

The public names are imported lazily, so tools that need no model (the router, the load generator,
the simulator) start without loading torch.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
from typing import Any

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SchedulerConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

_WHERE = {
    "LLM": "plaserve.engine.llm",
    "LLMEngine": "plaserve.engine.engine",
    "EngineConfig": "plaserve.config",
    "SchedulerConfig": "plaserve.config",
    "RequestOutput": "plaserve.request",
    "SamplingParams": "plaserve.request",
}


# How long torch's OpenMP threads (GNU libgomp) spin at a barrier before they sleep, in ``pause``
# iterations: ~2 ms on the AMX Xeon (measured by benchmarks/omp_spin.py; a pause's length differs
# between CPUs, so elsewhere it differs too). Long enough that a step's parallel regions, with Python between them,
# find the threads awake (asleep, each region waits ~100 us for a futex wake: decode ran 2-2.6x
# slower), and that through the server, where the HTTP side and the clients stretch those gaps, a
# burst still finds them awake (50,000, ~1 ms, made the served burst ~6 % slower); short enough that
# idle threads stop burning cores within a few ms. libgomp reads it once, as torch loads it, which
# is why it is set here, on ``import plaserve``, where torch is not loaded yet; the user's
# ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` stands. Where torch came first, ``engine/omp_spin.py``
# does what it can. docs/ARCHITECTURE.md, "CPU specifics".
OPENMP_SPIN_COUNT = 150_000
OPENMP_SPIN_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")  # either one decides the spin
OPENMP_SPIN_COUNT_SET = "torch" not in sys.modules and not any(
    os.environ.get(v) for v in OPENMP_SPIN_SETTINGS
)
if OPENMP_SPIN_COUNT_SET:
    os.environ["GOMP_SPINCOUNT"] = str(OPENMP_SPIN_COUNT)


# glibc's malloc gives each thread that allocates an arena of its own (up to 8 per core), and a thread
# arena hands its freed heap back to the kernel, so a large tensor freed and allocated again on a
# thread other than the main one is fresh memory each time: page faults and zeroed pages in every
# layer. The server's engine steps on a thread of its own, where a 0.5 B model's long prefills paid a
# quarter of their time for it (docs/BENCHMARKS.md, "One malloc arena"). So plaserve asks for one
# arena, before torch or any thread allocates much; the user's ``MALLOC_ARENA_MAX`` stands. Python's
# small objects do not go through malloc.
MALLOC_ARENA_MAX = 1
_M_ARENA_MAX = -8  # mallopt's parameter number (glibc's malloc.h)


def _limit_malloc_arenas() -> bool:
    """Ask glibc for at most ``MALLOC_ARENA_MAX`` malloc arenas; False where it is not glibc (or the user
    set the limit)."""
    if sys.platform != "linux" or os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.gnu_get_libc_version and libc.mallopt(_M_ARENA_MAX, MALLOC_ARENA_MAX))
    except (OSError, AttributeError):  # not glibc: musl has neither
        return False


MALLOC_ARENAS_LIMITED = _limit_malloc_arenas()


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'plaserve' has no attribute {name!r}")

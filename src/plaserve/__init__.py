"""plaserve: a prefill-length-aware LLM serving system.

The public names are imported lazily, so tools that need no model (the router, the load generator,
the simulator) start without loading torch.
"""

from __future__ import annotations

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
# iterations: ~1.5 ms on the AVX512-BF16 EPYC (~30 ns each, measured), ~3.5 ms on the AMX Xeons
# (estimated from their ~140-cycle pause). Long
# enough that a step's parallel regions, with Python between them, find the threads awake (asleep, each
# region waits ~100 us for a futex wake: decode ran 2-2.6x slower), short enough that idle threads stop
# burning cores within a few ms (libgomp's default, 300,000, spun ~20 ms on the Xeons and, on a busy
# machine, took the cores the stepping thread needed). libgomp reads it once, as torch loads it, which
# is why it is set here, on ``import plaserve``, where torch is not loaded yet; the user's
# ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` stands. Where torch came first, ``engine/omp_spin.py``
# does what it can. docs/ARCHITECTURE.md, "CPU specifics".
OPENMP_SPIN_COUNT = 50_000
OPENMP_SPIN_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")  # either one decides the spin
OPENMP_SPIN_COUNT_SET = "torch" not in sys.modules and not any(
    os.environ.get(v) for v in OPENMP_SPIN_SETTINGS
)
if OPENMP_SPIN_COUNT_SET:
    os.environ["GOMP_SPINCOUNT"] = str(OPENMP_SPIN_COUNT)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'plaserve' has no attribute {name!r}")

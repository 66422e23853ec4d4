"""Keep freed activation memory in the process on CPU (glibc's malloc).

A prefill's activations are large: the MLP's ``[tokens, 2 x intermediate]`` is 25 MB at 2,048 tokens
for the embedded model. glibc serves blocks that large with ``mmap`` and gives them back to the OS on
``free``, so every layer's new activations page-fault in again, zero-filled: 20-30 thousand faults and
about 4 % of a 2,048-token prefill on this project's CPU machine. Raising glibc's mmap and trim
thresholds keeps such blocks in the heap for the next layer, which is what jemalloc and tcmalloc (the
allocators usually recommended for PyTorch CPU inference) do anyway. The price: the process keeps up
to ``trim_threshold`` bytes of freed memory instead of returning them.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3

_applied = False


def keep_freed_memory(mmap_threshold: int = 256 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Serve blocks below ``mmap_threshold`` bytes from the heap and return freed heap memory to the
    OS only beyond ``trim_threshold`` (process-wide, once). Returns whether the settings are in force:
    False where the C library is not glibc."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = (
        mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1
        and mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
    )
    return _applied

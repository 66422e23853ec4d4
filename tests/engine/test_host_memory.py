"""Freed activation memory is reused instead of page-faulting in anew (glibc only)."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

try:
    ctypes.CDLL("libc.so.6").gnu_get_libc_version
    GLIBC = sys.platform.startswith("linux")
except (OSError, AttributeError):
    GLIBC = False

# Page faults of a layer-like pattern in its steady state: the 40 MB activation is above glibc's largest dynamic
# mmap threshold (32 MB), so by default it is mmapped (and faulted in, 10,240 pages) afresh every time.
PROBE = """
import resource, sys, torch
from plaserve.engine.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def layer():
    x = torch.empty(4 << 20).fill_(1.0)
    wide = torch.empty(10 << 20).fill_(1.0)
    y = torch.empty(4 << 20).fill_(1.0)
    del wide
    return x.add_(y)
counts = []
for _ in range(6):  # the fewest faults of any round: the steady state, whatever the heap's history
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        layer()
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(counts))
"""


def faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not GLIBC, reason="mallopt thresholds are glibc's")
def test_freed_blocks_are_reused_without_page_faults():
    assert faults("default") > 10_000
    assert faults("keep") < 500

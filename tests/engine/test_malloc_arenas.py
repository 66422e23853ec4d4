"""``import plaserve`` limits glibc's malloc to one arena (``MALLOC_ARENA_MAX`` in plaserve/__init__.py),
so that the server's engine thread reuses the main arena's memory instead of faulting in fresh pages
for every large tensor; a limit the user set stands. Checked in fresh processes by glibc's own
per-arena report (``malloc_stats``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ARENAS = """
import ctypes, os, sys, threading
import plaserve
def allocate():
    # above Python's small-object allocator and below malloc's mmap threshold: the thread's arena
    blocks = [bytearray(100_000) for _ in range(8)]
    del blocks
thread = threading.Thread(target=allocate)
thread.start()
thread.join()
libc = ctypes.CDLL(None)
sys.stderr.flush()
libc.malloc_stats()  # one "Arena N:" block per arena, on stderr
print(plaserve.MALLOC_ARENAS_LIMITED)
"""

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
    reason="glibc's malloc only",
)


def _arenas(limit: str | None) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    if limit is not None:
        env["MALLOC_ARENA_MAX"] = limit
    done = subprocess.run(
        [sys.executable, "-c", ARENAS],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip(), done.stderr.count("Arena ")


@glibc
def test_a_thread_allocates_from_the_one_arena():
    limited, arenas = _arenas(None)
    assert (limited, arenas) == ("True", 1)


@glibc
def test_the_users_arena_limit_stands():
    limited, arenas = _arenas("4")
    assert (limited, arenas) == ("False", 2)  # the main arena and the thread's own

"""Native CPU kernels: C++ compiled on first use, with torch's operators as the fallback everywhere.

``varlen_attention()`` is the causal varlen attention of ``varlen_attention.cpp`` (bfloat16, CPUs with
AVX512-BF16; see that file for the algorithm), or None where it cannot or should not run. It is built
with the C++ compiler against the installed torch's headers and its bundled libgomp (so the kernel
runs on torch's own OpenMP threads) into ``$PLASERVE_CACHE`` (default ``~/.cache/plaserve``)
``/kernels``, named by a hash of the source, the flags and the torch version: later processes load it
in milliseconds. Before it is used, once a process, it is checked against SDPA on a small batch and
timed against SDPA on one 512-token prompt; it is used only if it agrees and is faster. No compiler, a
CPU without AVX512-BF16, a failed build or check: one log line, and attention stays on SDPA.
``PLASERVE_NATIVE_KERNELS=0`` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from plaserve.model.cpu_features import cpu_bf16_support

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("varlen_attention.cpp")
ISA_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma"]

# (q, k, v, out, q_starts, k_index, k_starts, scale) -> None; see varlen_attention.cpp
VarlenAttention = Callable[..., None]
NATIVE_HEAD_DIMS = (16, 32, 64, 128)  # the head sizes the kernel is instantiated for


def _compiler() -> str | None:
    for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _build(compiler: str) -> Path:
    """The shared library, compiled unless a build of this source, these flags and this torch exists."""
    from torch.utils.cpp_extension import include_paths  # imports setuptools: only when building

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    flags = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", abi, *ISA_FLAGS]
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join([compiler, *flags, torch.__version__]).encode()
    ).hexdigest()[:16]
    cache = Path(os.environ.get("PLASERVE_CACHE", Path.home() / ".cache" / "plaserve")) / "kernels"
    target = cache / f"varlen_attention-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    log.info("compiling the CPU attention kernel (%s; once, ~10-30 s) ...", target.name)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / target.name
        command = [compiler, *flags, *(f"-I{p}" for p in include_paths())]
        # libgomp.so.1 from torch's lib folder: the same OpenMP runtime (and threads) as torch's.
        command += [str(SOURCE), f"-L{torch_lib}", "-lc10", "-ltorch_cpu"]
        command += [f"-Wl,-rpath,{torch_lib}", "-o", str(built)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr else "failed")
        os.replace(built, target)  # atomic: concurrent processes build the same file
    return target


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_starts: list[int],
    k_starts: list[int],
    scale: float,
) -> torch.Tensor:
    """What the kernel computes, by SDPA per sequence (float32): queries aligned to the end of keys."""
    out = torch.empty_like(q)
    for s in range(len(q_starts) - 1):
        qs = q[q_starts[s] : q_starts[s + 1]].float().transpose(0, 1)
        ks = k[k_starts[s] : k_starts[s + 1]].float().transpose(0, 1)
        vs = v[k_starts[s] : k_starts[s + 1]].float().transpose(0, 1)
        tq, tk = qs.shape[1], ks.shape[1]
        seen = torch.arange(tk)[None, :] <= (tk - tq + torch.arange(tq))[:, None]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seen, scale=scale, enable_gqa=True)
        out[q_starts[s] : q_starts[s + 1]] = o.transpose(0, 1).to(q.dtype)
    return out


def _call(op: VarlenAttention, q, k, v, q_starts: list[int], k_starts: list[int], scale: float):
    out = torch.empty_like(q)
    index = torch.arange(k.shape[0])
    op(q, k, v, out, torch.tensor(q_starts), index, torch.tensor(k_starts), scale)
    return out


def _agrees(op: VarlenAttention) -> bool:
    gen = torch.Generator().manual_seed(0)
    q_starts, k_starts = [0, 1, 40, 140], [0, 1, 70, 170]  # a decode-like row, a chunk, a prompt
    q = torch.randn(140, 8, 64, generator=gen).bfloat16()
    k, v = torch.randn(2, 170, 2, 64, generator=gen).bfloat16()
    got = _call(op, q, k, v, q_starts, k_starts, 0.125)
    want = reference_attention(q, k, v, q_starts, k_starts, 0.125)
    return bool((got.float() - want.float()).abs().max() < 0.05)


def _faster(op: VarlenAttention) -> tuple[bool, float, float]:
    """Whether the kernel beats SDPA's flash kernel on one 512-token prompt (best of 5 each, ms)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(512, 8, 64, generator=gen).bfloat16()
    k, v = torch.randn(2, 512, 2, 64, generator=gen).bfloat16()
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    ways = {
        "kernel": lambda: _call(op, q, k, v, [0, 512], [0, 512], 0.125),
        "sdpa": lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True),
    }
    best = dict.fromkeys(ways, math.inf)
    for _ in range(6):  # alternating; the first round only warms up
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            best[name] = min(best[name], time.perf_counter() - start)
    return best["kernel"] < best["sdpa"], best["kernel"] * 1e3, best["sdpa"] * 1e3


@functools.cache
def varlen_attention() -> VarlenAttention | None:
    """The native varlen attention operator, or None where SDPA is to be used (see the module doc)."""
    if os.environ.get("PLASERVE_NATIVE_KERNELS", "1") == "0":
        return None
    if cpu_bf16_support() is None:
        log.info("CPU attention kernel: not used (no AVX512-BF16 on this CPU)")
        return None
    compiler = _compiler()
    if compiler is None:
        log.info("CPU attention kernel: not used (no C++ compiler found)")
        return None
    try:
        torch.ops.load_library(str(_build(compiler)))
        op = torch.ops.plaserve_cpu.varlen_attention
        with torch.inference_mode():
            if not _agrees(op):
                log.warning("CPU attention kernel: disagrees with SDPA here; not used")
                return None
            faster, ms, sdpa_ms = _faster(op)
    except Exception as e:  # noqa: BLE001 - any build or load failure leaves SDPA, which is always right
        log.warning("CPU attention kernel: not built (%s: %s); using SDPA", type(e).__name__, e)
        return None
    verdict = "used" if faster else "not used"
    log.info(
        "CPU attention kernel: %s (512-token prompt: %.2f ms, SDPA %.2f ms)", verdict, ms, sdpa_ms
    )
    return op if faster else None

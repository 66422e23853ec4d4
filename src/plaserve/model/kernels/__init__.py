"""Native CPU kernels: C++ compiled on first use, with torch's operators as the fallback everywhere.

* ``varlen_attention()``: the causal varlen attention of ``varlen_attention.cpp`` (bfloat16, CPUs
  with AVX512-BF16, its products on AMX tiles where the CPU has them; see that file for the
  algorithm), or None where it cannot or should not run.
* ``elementwise()``: the decoder layer's add + RMSNorm, rotary embedding and SwiGLU of
  ``elementwise.cpp`` in bfloat16 (CPUs with AVX512-BF16), or None; ``model/fused.py`` checks them
  against its torch forms.
* ``token_mask()``: structured outputs' token bitmasks applied to float32 logits in place
  (``token_mask.cpp``), or None.
* ``row_split_mm()``: a matmul with its rows split between the threads, one single-threaded oneDNN
  call each (``matmul.cpp``), or None; ``model/layers.py`` times it against the plain matmul.
* ``packed_linear()``: a bfloat16 linear layer over a weight in its own packed layout, on AMX tiles
  where the CPU has them, else in AVX512-BF16 (``packed_linear.cpp``), or None; ``model/layers.py``
  uses it for steps of up to a few hundred rows (on AMX) or a few thousand (without it).
* ``kv_writer()``: a step's new K and V rows into the paged cache in one call (``kv_write.cpp``), or
  None.

Each source is built with the C++ compiler against the installed torch's headers and its bundled
libgomp (so the kernels run on torch's own OpenMP threads) into ``$PLASERVE_CACHE`` (default
``~/.cache/plaserve``) ``/kernels``, named by a hash of the source, the flags and the torch version:
later processes load it in milliseconds. Before a library is used, once a process, it is checked
against torch's forms on small inputs (the elementwise kernels by ``model/fused.py``, whose forms they
are); the attention kernel is also timed against SDPA on a mixed
batch and used only if it is faster. No compiler, a CPU without AVX512-BF16, a failed build or
check: one log line, and the torch forms stay. ``PLASERVE_NATIVE_KERNELS=0`` turns them all off.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
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

HERE = Path(__file__).parent
ISA_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma"]
# The AMX tile multiplies of the attention kernel and the packed linear (used only where the CPU and the
# OS have them: checked at run time in the kernel).
AMX_FLAGS = ("-mamx-tile", "-mamx-bf16")

# (q, k, v, out, q_starts, k_index, k_starts, scale) -> None; see varlen_attention.cpp
VarlenAttention = Callable[..., None]
NATIVE_HEAD_DIMS = (16, 32, 64, 128)  # the head sizes the kernel is instantiated for


def _compiler() -> str | None:
    for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _build(compiler: str, source: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """The shared library of ``source``, compiled unless a build of this source, these flags and this
    torch exists."""
    torch_lib = Path(torch.__file__).parent / "lib"
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    flags = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", abi, *ISA_FLAGS, *extra_flags]
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(
        source.read_bytes() + headers + " ".join([compiler, *flags, torch.__version__]).encode()
    ).hexdigest()[:16]
    cache = Path(os.environ.get("PLASERVE_CACHE", Path.home() / ".cache" / "plaserve")) / "kernels"
    target = cache / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    from torch.utils.cpp_extension import include_paths  # imports setuptools: only when building

    cache.mkdir(parents=True, exist_ok=True)
    log.info("compiling the CPU kernels of %s (once, ~10-30 s) ...", target.name)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / target.name
        command = [compiler, *flags, *(f"-I{p}" for p in include_paths())]
        # libgomp.so.1 from torch's lib folder: the same OpenMP runtime (and threads) as torch's.
        command += [str(source), f"-L{torch_lib}", "-lc10", "-ltorch_cpu"]
        command += [f"-Wl,-rpath,{torch_lib}", "-o", str(built)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line]
            raise RuntimeError((errors or done.stderr.strip().splitlines() or ["failed"])[0])
        os.replace(built, target)  # atomic: concurrent processes build the same file
    return target


def _loaded(source: str, what: str, flag_sets: tuple[tuple[str, ...], ...] = ((),)) -> bool:
    """Whether ``source`` (a file beside this one) is built and loaded into torch.ops; logs why not.
    ``flag_sets``: extra compiler flags to try in turn (a compiler without AMX support builds the
    attention kernel without its AMX path)."""
    if os.environ.get("PLASERVE_NATIVE_KERNELS", "1") == "0":
        return False
    if cpu_bf16_support() is None:
        log.info("%s: not used (no AVX512-BF16 on this CPU)", what)
        return False
    compiler = _compiler()
    if compiler is None:
        log.info("%s: not used (no C++ compiler found)", what)
        return False
    for i, flags in enumerate(flag_sets):
        try:
            torch.ops.load_library(str(_build(compiler, HERE / source, flags)))
            return True
        except Exception as e:  # noqa: BLE001 - any build or load failure leaves torch's forms
            if i + 1 < len(flag_sets):
                log.info("%s: no build with %s (%s); trying without", what, " ".join(flags), e)
                continue
            log.warning(
                "%s: not built (%s: %s); using torch's operators", what, type(e).__name__, e
            )
    return False


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


# The speed check's batch: prompt lengths of a burst of short requests and a long one.
SPEED_CHECK_LENGTHS = (512, 300, 100, 50)


def _faster(op: VarlenAttention) -> tuple[bool, float, float]:
    """Whether one kernel call beats SDPA's flash kernel (a call per prompt) on prompts of
    ``SPEED_CHECK_LENGTHS`` tokens (best of 5 each, ms)."""
    gen = torch.Generator().manual_seed(0)
    total = sum(SPEED_CHECK_LENGTHS)
    q = torch.randn(total, 8, 64, generator=gen).bfloat16()
    k, v = torch.randn(2, total, 2, 64, generator=gen).bfloat16()
    starts = [0, *itertools.accumulate(SPEED_CHECK_LENGTHS)]
    parts = [
        [t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        for a, b in itertools.pairwise(starts)
    ]

    def sdpa() -> None:
        for q4, k4, v4 in parts:
            F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)

    ways = {"kernel": lambda: _call(op, q, k, v, starts, starts, 0.125), "sdpa": sdpa}
    best = dict.fromkeys(ways, math.inf)
    for _ in range(6):  # alternating; the first round only warms up
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            best[name] = min(best[name], time.perf_counter() - start)
    return best["kernel"] < best["sdpa"], best["kernel"] * 1e3, best["sdpa"] * 1e3


@functools.cache
def attention_kernel() -> VarlenAttention | None:
    """The native varlen attention operator where it is built and agrees with SDPA here, whether or
    not it is the faster (tests use it; the model takes :func:`varlen_attention`)."""
    if not _loaded("varlen_attention.cpp", "CPU attention kernel", (AMX_FLAGS, ())):
        return None
    op = torch.ops.plaserve_cpu.varlen_attention
    with torch.inference_mode():
        if not _agrees(op):
            log.warning("CPU attention kernel: disagrees with SDPA here; not used")
            return None
    return op


def uses_amx() -> bool:
    """Whether the attention kernel's products run on AMX tiles in this process."""
    return attention_kernel() is not None and torch.ops.plaserve_cpu.amx_in_use()


@functools.cache
def varlen_attention() -> VarlenAttention | None:
    """The native varlen attention operator, or None where SDPA is to be used (see the module doc)."""
    op = attention_kernel()
    if op is None:
        return None
    with torch.inference_mode():
        faster, ms, sdpa_ms = _faster(op)
    log.info(
        "CPU attention kernel%s: %s (prompts of %s tokens: %.2f ms, SDPA %.2f ms)",
        " (AMX)" if uses_amx() else "",
        "used" if faster else "not used",
        "/".join(map(str, SPEED_CHECK_LENGTHS)),
        ms,
        sdpa_ms,
    )
    return op if faster else None


@functools.cache
def elementwise() -> object | None:
    """The ``torch.ops.plaserve_elementwise`` namespace (``add_rms_norm``, ``rotary``, ``silu_mul``)
    where it is built, else None. :func:`plaserve.model.fused.native_kernels` checks it against the
    torch forms before the model uses it."""
    if not _loaded("elementwise.cpp", "CPU elementwise kernels"):
        return None
    return torch.ops.plaserve_elementwise


@functools.cache
def token_mask() -> Callable[..., None] | None:
    """``apply_token_bitmask(logits, bitmask, rows)`` where it is built and agrees here with the
    bitmask expanded bit by bit, else None: logits row ``rows[k]`` gets -inf wherever bit ``j`` of
    ``bitmask[k]`` is clear."""
    if not _loaded("token_mask.cpp", "CPU token-mask kernel"):
        return None
    op = torch.ops.plaserve_sampling.apply_token_bitmask
    gen = torch.Generator().manual_seed(0)
    vocab = 75  # not a multiple of 32: the last word's tail is outside the vocabulary
    logits = torch.randn(4, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 3), generator=gen, dtype=torch.int32)
    rows = torch.tensor([3, 1])
    want = logits.clone()
    for k, r in enumerate(rows.tolist()):
        allowed = (bitmask[k].long()[:, None] >> torch.arange(32)) & 1
        want[r][allowed.flatten()[:vocab] == 0] = float("-inf")
    got = logits.clone()
    op(got, bitmask, rows)
    if not torch.equal(got, want):
        log.warning("CPU token-mask kernel: disagrees with the unpacked masks here; not used")
        return None
    return op


class PackedLinear:
    """``pack(w)`` lays a bfloat16 weight ``[N, K]`` (N a multiple of 16, K of 32) out for
    ``linear(x, packed, bias, n)``: ``x @ w.T + bias``, rounded once (packed_linear.cpp), on the
    instructions ``isa`` names ("AMX" or "AVX512-BF16"). ``swiglu(x, packed, n)``: SwiGLU's
    ``silu(gate) * up`` ``[M, n / 2]`` straight from the products, ``packed`` the
    :meth:`interleaved` gate and up."""

    def __init__(self) -> None:
        ops = torch.ops.plaserve_linear
        self.isa: str = ops.isa()
        self.pack: Callable[[torch.Tensor], torch.Tensor] = ops.pack
        # the overloads themselves: a projection calls them for every step (no overload resolution)
        self.linear: Callable[..., torch.Tensor] = ops.linear.default
        self.swiglu: Callable[..., torch.Tensor] = ops.swiglu.default

    @staticmethod
    def interleaved(gate_up: torch.Tensor) -> torch.Tensor:
        """``[gate; up]`` (``[2 I, K]``, I a multiple of 16) with their 16-row blocks interleaved
        (gate's first, up's first, gate's second...): the layout ``swiglu`` multiplies by."""
        n, k = gate_up.shape
        return gate_up.view(2, n // 32, 16, k).transpose(0, 1).reshape(n, k)

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whether ``weight`` has a shape and dtype the kernel takes."""
        n, k = weight.shape
        return weight.dtype == torch.bfloat16 and n % 16 == 0 and k % 32 == 0


@functools.cache
def packed_linear() -> PackedLinear | None:
    """The packed linear layer where it is built (CPUs with AVX512-BF16) and agrees here with torch's
    ``F.linear`` (same float32 sums, rounded once: to the last bit or one rounding step), else None."""
    if not _loaded("packed_linear.cpp", "CPU packed linear", (AMX_FLAGS, ())):
        return None
    ops = PackedLinear()
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(112, 96, generator=gen).bfloat16()  # 7 output blocks: a group's tail
    bias = torch.randn(112, generator=gen).bfloat16()
    with torch.inference_mode():
        packed = ops.pack(w)
        for rows in (1, 17, 40):
            x = torch.randn(rows, 96, generator=gen).bfloat16()
            want = (x.float() @ w.float().T + bias.float()).bfloat16().float()
            got = ops.linear(x, packed, bias, 112).float()
            # SwiGLU: w's first 96 rows as gate and up of 48 each, rounded as a projection and then
            # silu_mul round them
            gate, up = (x.float() @ w[:96].float().T).bfloat16().float().chunk(2, dim=-1)
            want_act = (torch.nn.functional.silu(gate) * up).bfloat16().float()
            act = ops.swiglu(x, ops.pack(ops.interleaved(w[:96])), 96).float()
            if not (
                torch.allclose(got, want, rtol=2**-7, atol=1e-3)
                and torch.allclose(act, want_act, rtol=2**-7, atol=1e-3)
            ):
                log.warning("CPU packed linear (%s): disagrees with torch here; not used", ops.isa)
                return None
    log.info("CPU packed linear: used (%s)", ops.isa)
    return ops


@functools.cache
def row_split_mm() -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None:
    """``row_split_mm(x, w, parts)``, ``x @ w`` with the rows of ``x`` in ``parts`` blocks of whole
    32-row tiles, one thread each, where it is built and agrees here with ``x @ w``, else None."""
    if not _loaded("matmul.cpp", "CPU row-split matmul"):
        return None
    op = torch.ops.plaserve_matmul.row_split_mm
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(100, 48, generator=gen), torch.randn(48, 40, generator=gen)
    with torch.inference_mode():
        if not all(torch.allclose(op(x, w, parts), x @ w, atol=1e-4) for parts in (1, 2, 3)):
            log.warning("CPU row-split matmul: disagrees with torch.mm here; not used")
            return None
    return op


@functools.cache
def kv_writer() -> Callable[..., None] | None:
    """``write_kv(k, v, k_cache, v_cache, slots)``: rows ``k[t]``, ``v[t]`` (``[T, Hk, D]``) to rows
    ``slots[t]`` of the flat caches (``[S, Hk, D]``), as two ``index_copy_`` calls do, where it is
    built and agrees with them here, else None."""
    if not _loaded("kv_write.cpp", "CPU KV-cache writer"):
        return None
    op = torch.ops.plaserve_kv.write_kv
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 7, 2, 8, generator=gen)
    slots = torch.tensor([5, 0, 9, 3, 11, 2, 7])
    want = [torch.zeros(12, 2, 8).index_copy_(0, slots, x) for x in kv]
    got = [torch.zeros(12, 2, 8) for _ in kv]
    op(kv[0], kv[1], got[0], got[1], slots)
    if not all(torch.equal(g, w) for g, w in zip(got, want)):
        log.warning("CPU KV-cache writer: disagrees with index_copy_ here; not used")
        return None
    return op

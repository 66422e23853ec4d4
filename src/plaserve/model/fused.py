"""The decoder's per-token elementwise work, each piece one function: RMSNorm after the residual add,
rotary embedding, SwiGLU.

Run eagerly in bfloat16, each of these is several passes over ``[tokens, width]`` tensors (widen to
float32, reduce, scale, round back; multiply, subtract, concatenate...), which on a CPU prefill cost
about as much as the attention's matmuls. Three tiers, the first that applies:

* bfloat16 on CPUs where :func:`plaserve.model.kernels.elementwise` built its C++ kernels: one pass
  each, at every step size (decode steps too);
* half precision steps of at least ``min_tokens`` tokens: ``torch.compile`` (inductor's C++ backend)
  turns each function into one loop. Below that, checking its guards costs more than the passes it
  saves, and in float32 the eager forms work in place and are as fast. Compiling needs a C++ compiler
  and takes seconds (cached on disk by inductor for the next process); a machine without one, or any
  failure to compile, logs one warning and runs eagerly from then on;
* eager torch.

The pure functions below (``_add_rms_norm``, ``_rotary``, ``_silu_mul``) define the arithmetic and its
rounding for all three.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from typing import Callable

import torch
import torch.nn.functional as F

from plaserve.model.kernels import elementwise

log = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ``[T, hidden]``: normalised in float32, rounded to ``x``'s dtype, then scaled by
    ``weight`` in that dtype (the reference implementation's rounding)."""
    xf = x.float()
    # One reduction pass (vector_norm): on CPU 30 % faster than squaring into a temporary first.
    mean_square = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(x.shape[-1])
    return (xf * mean_square.add_(eps).rsqrt_()).to(x.dtype).mul_(weight)


def _add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # Pure (no input changed): the form torch.compile fuses into one pass. Eager, add_rms_norm below
    # adds in place instead.
    total = x + residual
    tf = total.float()
    normed = (tf * torch.rsqrt(tf.square().mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return normed, total


def _rotary(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = qk.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(qk.dtype)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


_COMPILED: dict[Callable, Callable] = {}


def _compiled(fn: Callable) -> Callable:
    """``fn`` compiled, once per process: every model shares the compiled code (and its guards)."""
    if fn not in _COMPILED:
        log.info(
            "torch.compile %s (seconds on first use; inductor caches it on disk for later processes)",
            fn.__name__.lstrip("_"),
        )
        # dynamic: one graph for every token count and width instead of one per shape.
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


class FusedKernels:
    """The elementwise pieces of a decoder layer: native C++ for bfloat16 on CPU where built,
    compiled for large half-precision steps where that works, eager otherwise (see the module doc).

    ``min_tokens=None`` compiles nothing; ``native=False`` leaves the C++ kernels out. Every function
    returns its result; the native and eager forms reuse their inputs' memory (in place) where the
    compiled ones allocate, so callers must use the returned tensors and no longer use the inputs.
    """

    def __init__(self, min_tokens: int | None = None, native: bool = True) -> None:
        self.min_tokens = min_tokens
        self.native = native

    def _native(self, first: torch.Tensor) -> object | None:
        """The C++ kernels, where they apply to a step whose first operand is ``first``."""
        if not self.native or first.dtype != torch.bfloat16 or first.device.type != "cpu":
            return None
        return native_kernels()

    def _run(self, pure: Callable, eager: Callable, *args: object) -> object:
        first = args[0]
        assert isinstance(first, torch.Tensor)
        if (
            self.min_tokens is not None
            and first.shape[0] >= self.min_tokens
            and first.dtype != torch.float32
        ):
            try:
                return _compiled(pure)(*args)
            except Exception as exc:  # noqa: BLE001 - no compiler, inductor bug: eager is always right
                log.warning(
                    "torch.compile failed (%s: %s); running the elementwise kernels eagerly",
                    type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "",
                )
                self.min_tokens = None
        return eager(*args)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)``: a layer's residual add and the next norm."""
        if (native := self._native(x)) is not None:
            return native.add_rms_norm(x, residual, weight, eps), x  # x now holds the sum
        out = self._run(_add_rms_norm, _add_rms_norm_eager, x, residual, weight, eps)
        return out  # type: ignore[return-value]

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``qk`` ``[T, heads, D]`` rotated by the ``(cos, sin)`` rows (half-split layout)."""
        if (native := self._native(qk)) is not None:
            native.rotary(qk, cos, sin)
            return qk
        return self._run(_rotary, _rotary_eager, qk, cos, sin)  # type: ignore[return-value]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's ``silu(gate) * up`` of the fused ``[T, 2 * intermediate]`` projection."""
        if (native := self._native(gate_up)) is not None:
            return native.silu_mul(gate_up)
        return self._run(_silu_mul, _silu_mul_eager, gate_up)  # type: ignore[return-value]


def _add_rms_norm_eager(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = x.add_(residual)  # x is a fresh sublayer output: no new [T, hidden] allocation
    return rms_norm(total, weight, eps), total


def _rotary_eager(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if qk.dtype != torch.float32:
        # Half precision: rotate in float32 and round once.
        qk.copy_(_rotary(qk, cos, sin))
        return qk
    # float32: in place, one temporary (about a third of the memory passes of the out-of-place form).
    x1, x2 = qk.chunk(2, dim=-1)
    x1_sin = x1 * sin
    x1.mul_(cos).addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
    x2.mul_(cos).add_(x1_sin)  # x2 cos + x1 sin
    return qk


def _silu_mul_eager(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    # In place: these [tokens, intermediate] tensors are the largest activations of the model.
    return F.silu(gate, inplace=True).mul_(up)


def compiled_min_tokens(requested: int | None) -> int | None:
    """``requested``, or None (all eager, logged) where inductor's C++ backend would find no compiler
    (``$CXX``, else ``g++``, ``c++``, ``clang++``): then there is nothing to try."""
    if requested is None:
        return None
    if not any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c):
        log.info("no C++ compiler found: the elementwise kernels run eagerly")
        return None
    return requested


@functools.cache
def native_kernels() -> object | None:
    """The C++ forms of this module's functions (:func:`plaserve.model.kernels.elementwise`), once a
    process checked to round as the pure functions above do (one bfloat16 step apart at most, where
    float32 sums run in another order); None where they are not built or disagree."""
    ops = elementwise()
    if ops is None:
        return None
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, 5, 80, generator=gen).bfloat16()
    weight = torch.rand(80, generator=gen).bfloat16()
    qk = torch.randn(5, 3, 16, generator=gen).bfloat16()
    cos, sin = torch.randn(2, 5, 1, 8, generator=gen)
    gate_up = (4 * torch.randn(5, 48, generator=gen)).bfloat16()
    with torch.inference_mode():
        total = x.clone()
        normed = ops.add_rms_norm(total, residual, weight, 1e-6)  # total becomes x + residual
        rotated = qk.clone()
        ops.rotary(rotated, cos, sin)
        want_normed, want_total = _add_rms_norm(x, residual, weight, 1e-6)
        pairs = [
            (normed, want_normed),
            (total, want_total),
            (rotated, _rotary(qk, cos, sin)),
            (ops.silu_mul(gate_up), _silu_mul(gate_up)),
        ]
    if not all(torch.allclose(a.float(), b.float(), rtol=1 / 128, atol=1e-2) for a, b in pairs):
        log.warning("CPU elementwise kernels: disagree with the torch forms here; not used")
        return None
    log.info("CPU elementwise kernels: used")
    return ops

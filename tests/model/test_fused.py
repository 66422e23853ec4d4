"""The decoder's elementwise kernels: the C++ kernels and the compiled forms equal eager (each within
bfloat16's rounding of a float64 reference), small and float32 steps stay eager, and a failure to
compile falls back to eager with one warning."""

from __future__ import annotations

import logging

import pytest
import torch

from plaserve.model import fused
from plaserve.model.fused import FusedKernels, compiled_min_tokens

needs_compiler = pytest.mark.skipif(
    compiled_min_tokens(1) is None, reason="no C++ compiler for inductor"
)
needs_native = pytest.mark.skipif(
    fused.native_kernels() is None, reason="the C++ elementwise kernels are not built here"
)


def inputs(tokens: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    # 8 query + 2 key heads rotated, 2 value heads beside them
    qkv = randn(tokens, 12 * 16).to(dtype)
    return {
        "x": randn(tokens, 64).to(dtype),
        "residual": randn(tokens, 64).to(dtype),
        "weight": (1 + 0.1 * randn(64)).to(dtype),
        "qk": qkv[:, : 10 * 16].view(tokens, 10, 16),
        "cos": randn(tokens, 1, 8).cos(),
        "sin": randn(tokens, 1, 8).sin(),
        "gate_up": randn(tokens, 96).to(dtype),
    }


def run_all(kernels: FusedKernels, t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    t = {k: v.clone() if k != "qk" else v for k, v in t.items()}
    normed, total = kernels.add_rms_norm(t["x"], t["residual"], t["weight"], 1e-5)
    return [
        normed,
        total,
        kernels.rotary(t["qk"].clone(), t["cos"], t["sin"]),
        kernels.silu_mul(t["gate_up"]),
    ]


def reference(t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The same arithmetic in float64."""
    x = {k: v.double() for k, v in t.items()}
    total = x["x"] + x["residual"]
    normed = total * torch.rsqrt(total.square().mean(-1, keepdim=True) + 1e-5) * x["weight"]
    x1, x2 = x["qk"].chunk(2, -1)
    rotated = torch.cat((x1 * x["cos"] - x2 * x["sin"], x2 * x["cos"] + x1 * x["sin"]), -1)
    gate, up = x["gate_up"].chunk(2, -1)
    return [normed, total, rotated, torch.nn.functional.silu(gate) * up]


@needs_compiler
def test_compiled_equals_eager_in_bfloat16():
    t = inputs(300, torch.bfloat16)
    with torch.inference_mode():
        eager = run_all(FusedKernels(None, native=False), t)
        compiled = run_all(FusedKernels(256, native=False), t)
    for e, c, r in zip(eager, compiled, reference(t)):
        assert c.dtype == e.dtype == torch.bfloat16 and c.shape == e.shape
        # Both round to bfloat16 (8 bits): within a few units of the last place of the float64 value.
        torch.testing.assert_close(c.double(), r, atol=0.05, rtol=0.02)
        torch.testing.assert_close(e.double(), r, atol=0.05, rtol=0.02)


@needs_native
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_native_equals_eager_in_bfloat16(tokens):
    """The C++ kernels (one pass each, every step size) round as the eager forms do: the results are
    equal, or one bfloat16 rounding step apart where float32 sums were taken in another order."""
    t = inputs(tokens, torch.bfloat16, seed=tokens)
    with torch.inference_mode():
        eager = run_all(FusedKernels(None, native=False), t)
        native = run_all(FusedKernels(None), t)
    for e, n, r in zip(eager, native, reference(t)):
        assert n.dtype == torch.bfloat16 and n.shape == e.shape
        torch.testing.assert_close(n.double(), r, atol=0.05, rtol=0.02)
        torch.testing.assert_close(n.float(), e.float(), atol=0, rtol=2**-7)


@needs_native
def test_native_silu_mul_at_the_extremes_is_torchs():
    """SwiGLU's short-cut exponential and reciprocal (bfloat16 results need no more) keep torch's
    values where 2^t overflows or the input is not finite: -0 far below 0, x far above (where 2^t
    is held at the smallest normal float rather than going subnormal), inf and NaN as torch gives
    them."""
    gate = torch.tensor(
        [-3e38, -1e30, -100.0, -87.0, -20.0, -1.0, 0.0, 1.0, 20.0, 86.0, 87.0, 88.0, 90.0, 100.0]
        + [1e30, 3e38]
        + [float("inf"), float("-inf"), float("nan")]
    ).to(torch.bfloat16)
    gate_up = torch.cat([gate, torch.ones_like(gate)])[None]
    with torch.inference_mode():
        native = FusedKernels(None).silu_mul(gate_up)
    expected = torch.nn.functional.silu(gate.float()).to(torch.bfloat16)[None]
    torch.testing.assert_close(native, expected, atol=0, rtol=2**-7, equal_nan=True)


@needs_native
def test_native_kernels_work_in_place_where_eager_does():
    """add_rms_norm leaves the sum in ``x`` and rotary rotates ``qk`` in place, through a strided view
    of the fused projection, as the eager forms do: callers rely on both."""
    t = inputs(33, torch.bfloat16, seed=3)
    x, qkv_base = t["x"].clone(), t["qk"]
    with torch.inference_mode():
        _, total = FusedKernels(None).add_rms_norm(x, t["residual"], t["weight"], 1e-5)
        rotated = FusedKernels(None).rotary(qkv_base, t["cos"], t["sin"])
    assert total.data_ptr() == x.data_ptr() and rotated.data_ptr() == qkv_base.data_ptr()
    assert not qkv_base.is_contiguous()  # each token's q/k heads are a slice of a wider row


def test_small_and_float32_steps_stay_eager(monkeypatch):
    def refuse(fn):
        raise AssertionError("compiled code was called")

    monkeypatch.setattr(fused, "_compiled", refuse)
    with torch.inference_mode():
        small = run_all(FusedKernels(256, native=False), inputs(255, torch.bfloat16))
        large = run_all(FusedKernels(256, native=False), t32 := inputs(300, torch.float32))
    assert small[0].shape == (255, 64)
    for got, want in zip(large, reference(t32)):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_a_failure_to_compile_falls_back_to_eager(monkeypatch, caplog):
    calls = []

    def broken(fn):
        def run(*args):
            calls.append(fn)
            raise RuntimeError("no compiler\ndetails")

        return run

    monkeypatch.setattr(fused, "_compiled", broken)
    failing = FusedKernels(16, native=False)
    t = inputs(32, torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="plaserve.model.fused"), torch.inference_mode():
        got = run_all(failing, t)
        run_all(failing, t)
    assert failing.min_tokens is None and len(calls) == 1  # one failure, then eager for good
    assert caplog.text.count("torch.compile failed (RuntimeError: no compiler)") == 1
    for g, e in zip(got, run_all(FusedKernels(None, native=False), t)):
        assert torch.equal(g, e)

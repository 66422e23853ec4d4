"""The decoder's elementwise kernels: compiled equals eager, small and float32 steps stay eager, and a
failure to compile falls back to eager with one warning."""

from __future__ import annotations

import logging

import pytest
import torch

from plaserve.model import fused
from plaserve.model.fused import FusedKernels, compiled_min_tokens

needs_compiler = pytest.mark.skipif(
    compiled_min_tokens(1) is None, reason="no C++ compiler for inductor"
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
        eager, compiled = run_all(FusedKernels(None), t), run_all(FusedKernels(256), t)
    for e, c, r in zip(eager, compiled, reference(t)):
        assert c.dtype == e.dtype == torch.bfloat16 and c.shape == e.shape
        # Both round to bfloat16 (8 bits): within a few units of the last place of the float64 value.
        torch.testing.assert_close(c.double(), r, atol=0.05, rtol=0.02)
        torch.testing.assert_close(e.double(), r, atol=0.05, rtol=0.02)


def test_small_and_float32_steps_stay_eager(monkeypatch):
    def refuse(fn):
        raise AssertionError("compiled code was called")

    monkeypatch.setattr(fused, "_compiled", refuse)
    with torch.inference_mode():
        small = run_all(FusedKernels(256), inputs(255, torch.bfloat16))
        large = run_all(FusedKernels(256), t32 := inputs(300, torch.float32))
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
    kernels = FusedKernels(16)
    t = inputs(32, torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="plaserve.model.fused"), torch.inference_mode():
        got = run_all(kernels, t)
        run_all(kernels, t)
    assert kernels.min_tokens is None and len(calls) == 1  # one failure, then eager for good
    assert caplog.text.count("torch.compile failed (RuntimeError: no compiler)") == 1
    for g, e in zip(got, run_all(FusedKernels(None), t)):
        assert torch.equal(g, e)

"""The native CPU attention kernel (``plaserve.model.kernels``) against torch's SDPA, bfloat16.

One causal prompt of L tokens (the embedded model's 8 query / 2 K/V heads, and Qwen2.5-0.5B's 14 / 2;
head dim 64), and a burst-like batch of 30 prompts of 300 tokens (SDPA: one call per prompt, as
plaserve called it; the kernel: one call). Best of 7 each, milliseconds and GFLOP/s (causal FLOPs:
4 x heads x head_dim x L^2 / 2), on every torch thread.

    PYTHONPATH=src .venv/bin/python benchmarks/cpu_attention.py
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from plaserve.model.kernels import varlen_attention


def best_of(fn: Callable[[], object], reps: int = 7) -> float:
    fn()
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    op = varlen_attention()
    if op is None:
        print(
            "the CPU attention kernel is not built on this machine (see the log): nothing to compare"
        )
        return 1
    print(f"{torch.get_num_threads()} threads, bfloat16, head dim 64\n")
    print(
        "| heads (q / kv) | L | kernel ms | SDPA ms | kernel GFLOP/s | SDPA GFLOP/s | SDPA / kernel |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for heads, kv_heads in ((8, 2), (14, 2)):
        for n in (128, 512, 1024, 2048, 4096):
            q = torch.randn(n, heads, 64).bfloat16()
            k, v = torch.randn(2, n, kv_heads, 64).bfloat16()
            out, starts, index = torch.empty_like(q), torch.tensor([0, n]), torch.arange(n)
            ours = best_of(lambda: op(q, k, v, out, starts, index, starts, 0.125))
            q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            sdpa = best_of(
                lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
            )
            flops = 4 * heads * 64 * n * n / 2
            print(
                f"| {heads} / {kv_heads} | {n} | {ours * 1e3:.2f} | {sdpa * 1e3:.2f} | "
                f"{flops / ours / 1e9:.0f} | {flops / sdpa / 1e9:.0f} | {sdpa / ours:.2f}x |"
            )
    lens = [300] * 30
    q = torch.randn(sum(lens), 8, 64).bfloat16()
    k, v = torch.randn(2, sum(lens), 2, 64).bfloat16()
    out, index = torch.empty_like(q), torch.arange(sum(lens))
    starts = torch.tensor([0, *lens]).cumsum(0)
    ours = best_of(lambda: op(q, k, v, out, starts, index, starts, 0.125))

    def per_prompt() -> None:
        for s, e in zip(starts[:-1].tolist(), starts[1:].tolist()):
            q4, k4, v4 = (t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)

    sdpa = best_of(per_prompt)
    print(
        f"\n30 prompts of 300 tokens: kernel {ours * 1e3:.2f} ms (one call), "
        f"SDPA {sdpa * 1e3:.2f} ms (30 calls): {sdpa / ours:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

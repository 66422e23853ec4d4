"""plaserve's native CPU kernels (``plaserve.model.kernels``) against the torch forms they replace,
bfloat16.

Attention (``varlen_attention.cpp``), with its products on AMX tiles and on AVX512-BF16 dot products
where the CPU has both:

* one causal prompt of L tokens (the embedded model's 8 query / 2 K/V heads, and Qwen2.5-0.5B's
  14 / 2; head dim 64): milliseconds and GFLOP/s (causal FLOPs: 4 x heads x head_dim x L^2 / 2);
* a burst-like batch of 30 prompts of 300 tokens (SDPA: one call per prompt, as plaserve would call
  it; the kernel: one call);
* decode rows: B requests of one new token each over contexts of C tokens in a paged cache (blocks of
  16 in shuffled order), as ``attention()`` runs them: SDPA's path gathers each group's blocks and masks
  the padding, the kernel reads the cache through the slots. Milliseconds and the K/V bytes read per
  second.

Elementwise (``elementwise.cpp``): add + RMSNorm, rotary, SwiGLU at 1-2,048 tokens of the embedded
model's widths, against the eager torch forms and (from 512 tokens, where plaserve compiled them) the
``torch.compile`` ones. Token masks (``token_mask.cpp``): 32 constrained rows of a 32,000-token
vocabulary, the kernel from the bitmask against unpacking it with numpy and adding it. Large
magnitudes: attention at 2,048 tokens with queries scaled (scores spread over ~100) and SwiGLU with
gates far above 0, against the same shapes at unit scale: the kernels' ``exp2_p`` results stay normal
floats, where subnormal ones cost a microcode assist each (10-16x slower before it did). Row-split
matmuls (``matmul.cpp``): the four projections of 8 layers of the engine_vs_vllm ``small`` model
(hidden 512, MLP 1,536, GQA 8/2) and of Qwen2.5-0.5B's shapes, each layer its own weights (so they are
not all in cache, as in a forward pass), at 256-2,048 rows, by one oneDNN call and with the rows split
between the threads; and the span ``row_split_span`` picks for each weight. The packed linear
(``packed_linear.cpp``: AMX tiles, or AVX512-BF16 without them) against oneDNN's packed linear at 1-512
rows, on the same shapes and Qwen2.5-0.5B's tied LM head; and its SwiGLU straight from the gate and up
products against that projection followed by the elementwise ``silu_mul`` (8 layers, 1-2,048 rows).

Best of 7 each, on every torch thread.

    PYTHONPATH=src .venv/bin/python benchmarks/cpu_kernels.py [--only attention,elementwise,...]
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Callable

import plaserve  # noqa: F401  # isort: skip  (before torch: it sets OpenMP's spin count)

import torch
import torch.nn.functional as F

from plaserve.engine.host_memory import keep_freed_memory
from plaserve.grammar.masks import additive_on_cpu
from plaserve.model import fused, kernels
from plaserve.model.attention import AttentionMetadata, attention
from plaserve.model.layers import _packed_linear, _reorder, row_split_span


def built(op: object, what: str) -> bool:
    """Whether ``op`` (a kernel loader's result) is there; says so where it is not."""
    if op is None:
        print(f"\n{what} not built on this machine")
    return op is not None


def best_of(fn: Callable[[], object], reps: int = 7) -> float:
    fn()
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def isas() -> list[str]:
    """The kernel's instruction sets on this CPU, each timed in turn (asked once, before any is
    switched off)."""
    return ["AMX", "AVX512-BF16"] if kernels.uses_amx() else ["AVX512-BF16"]


def use(isa: str) -> None:
    torch.ops.plaserve_cpu.use_amx(isa == "AMX")


def prompts(op: Callable[..., None]) -> None:
    names = isas()
    print(
        "| heads (q / kv) | L | " + " | ".join(f"{i} ms" for i in names) + " | SDPA ms | ", end=""
    )
    print(" | ".join(f"{i} GFLOP/s" for i in names) + " | SDPA GFLOP/s | SDPA / best kernel |")
    print("|---|---:|" + "---:|" * (2 * len(names) + 3))
    for heads, kv_heads in ((8, 2), (14, 2)):
        for n in (128, 300, 512, 1024, 2048, 4096):
            q = torch.randn(n, heads, 64).bfloat16()
            k, v = torch.randn(2, n, kv_heads, 64).bfloat16()
            out, starts, index = torch.empty_like(q), torch.tensor([0, n]), torch.arange(n)
            ours = []
            for isa in names:
                use(isa)
                ours.append(best_of(lambda: op(q, k, v, out, starts, index, starts, 0.125)))
            q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            sdpa = best_of(
                lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
            )
            flops = 4 * heads * 64 * n * n / 2
            times = " | ".join(f"{t * 1e3:.2f}" for t in ours)
            rates = " | ".join(f"{flops / t / 1e9:.0f}" for t in ours)
            print(
                f"| {heads} / {kv_heads} | {n} | {times} | {sdpa * 1e3:.2f} | {rates} | "
                f"{flops / sdpa / 1e9:.0f} | {sdpa / min(ours):.2f}x |"
            )


def burst(op: Callable[..., None]) -> None:
    lens = [300] * 30
    q = torch.randn(sum(lens), 8, 64).bfloat16()
    k, v = torch.randn(2, sum(lens), 2, 64).bfloat16()
    out, index = torch.empty_like(q), torch.arange(sum(lens))
    starts = torch.tensor([0, *lens]).cumsum(0)

    def per_prompt() -> None:
        for s, e in zip(starts[:-1].tolist(), starts[1:].tolist()):
            q4, k4, v4 = (t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)

    sdpa = best_of(per_prompt)
    print("\n| 30 prompts of 300 tokens | ms | SDPA / kernel |\n|---|---:|---:|")
    print(f"| SDPA, 30 calls | {sdpa * 1e3:.2f} | |")
    for isa in isas():
        use(isa)
        ours = best_of(lambda: op(q, k, v, out, starts, index, starts, 0.125))
        print(f"| kernel ({isa}), one call | {ours * 1e3:.2f} | {sdpa / ours:.2f}x |")


def decode_rows() -> None:
    """B decode rows over contexts of about C tokens, through ``attention()`` (cache write included)."""
    block, blocks, gen = 16, 8192, torch.Generator().manual_seed(0)
    kc, vc = torch.randn(2, blocks, block, 2, 64, generator=gen).bfloat16()
    names = isas()
    print(
        "\n| decode rows x context | SDPA path ms | "
        + " | ".join(f"kernel ({i}) ms" for i in names)
        + " | "
        + " | ".join(f"kernel ({i}) GB/s" for i in names)
        + " |"
    )
    print("|---|---:|" + "---:|" * (2 * len(names)))
    for rows, ctx in ((1, 300), (16, 300), (64, 300), (16, 2000), (64, 2000)):
        lens = (ctx + torch.randint(-ctx // 8, ctx // 8 + 1, (rows,), generator=gen)).tolist()
        perm = (torch.randperm(blocks - 1, generator=gen) + 1).tolist()
        tables, taken = [], 0
        for n in lens:
            tables.append(perm[taken : taken + -(-n // block)])
            taken += len(tables[-1])
        width = max(map(len, tables))
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        slots = torch.tensor(
            [t[(n - 1) // block] * block + (n - 1) % block for t, n in zip(tables, lens)]
        )
        q = torch.randn(rows, 8, 64, generator=gen).bfloat16()
        k, v = torch.randn(2, rows, 2, 64, generator=gen).bfloat16()

        def meta() -> AttentionMetadata:
            return AttentionMetadata(
                slot_mapping=slots,
                prefill=[],
                decode_block_tables=table,
                decode_context_lens=torch.tensor(lens),
            )

        def run(native: Callable[[], object]) -> float:
            import plaserve.model.attention as module

            saved, module.varlen_attention = module.varlen_attention, native
            try:
                return best_of(lambda: attention(q, k, v, (kc, vc), meta(), 0.125))
            finally:
                module.varlen_attention = saved

        sdpa = run(lambda: None)
        ours = []
        for isa in names:
            use(isa)
            ours.append(run(kernels.attention_kernel))
        kv_bytes = sum(lens) * 2 * 64 * 2 * 2  # K and V, 2 heads, bfloat16
        times = " | ".join(f"{t * 1e3:.3f}" for t in ours)
        rates = " | ".join(f"{kv_bytes / t / 1e9:.1f}" for t in ours)
        print(f"| {rows} x ~{ctx} | {sdpa * 1e3:.3f} | {times} | {rates} |")


def elementwise() -> None:
    ops = kernels.elementwise()
    if not built(ops, "the elementwise kernels are"):
        return
    print("\n| tokens | kernel | C++ ms | eager ms | compiled ms | eager / C++ |")
    print("|---:|---|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for n in (1, 16, 64, 512, 2048):
        x, residual = torch.randn(2, n, 512, generator=gen).bfloat16()
        weight = torch.rand(512, generator=gen).bfloat16()
        qk = torch.randn(n, 12, 64, generator=gen).bfloat16()[:, :10]  # a view, as the model's
        cos, sin = torch.randn(2, n, 1, 32, generator=gen)
        gate_up = torch.randn(n, 3072, generator=gen).bfloat16()
        cases = {
            "add + RMSNorm": (
                lambda: ops.add_rms_norm(x.clone(), residual, weight, 1e-6),
                lambda: fused._add_rms_norm_eager(x.clone(), residual, weight, 1e-6),
                lambda: fused._compiled(fused._add_rms_norm)(x, residual, weight, 1e-6),
            ),
            "rotary": (
                lambda: ops.rotary(qk, cos, sin),
                lambda: fused._rotary_eager(qk, cos, sin),
                lambda: fused._compiled(fused._rotary)(qk, cos, sin),
            ),
            "SwiGLU": (
                lambda: ops.silu_mul(gate_up),
                lambda: fused._silu_mul_eager(gate_up.clone()),
                lambda: fused._compiled(fused._silu_mul)(gate_up),
            ),
        }
        for name, (ours, eager, compiled) in cases.items():
            a, b = best_of(ours), best_of(eager)
            c = f"{best_of(compiled) * 1e3:.3f}" if n >= 512 else "-"
            print(f"| {n} | {name} | {a * 1e3:.3f} | {b * 1e3:.3f} | {c} | {b / a:.1f}x |")


def magnitudes(op: Callable[..., None]) -> None:
    """Inputs as real checkpoints have them (outlier activations): scores and gates whose 2^t falls
    below the smallest normal float."""
    gen = torch.Generator().manual_seed(0)
    n = 2048
    q = torch.randn(n, 8, 64, generator=gen)
    k, v = torch.randn(2, n, 2, 64, generator=gen).bfloat16()
    out, starts, index = torch.empty(n, 8, 64).bfloat16(), torch.tensor([0, n]), torch.arange(n)
    gate_up = torch.randn(n, 3072, generator=gen)
    print("\n| 2,048 tokens | unit scale ms | large ms | large / unit |\n|---|---:|---:|---:|")
    for scale in (10.0, 30.0, 100.0):
        unit, large = q.bfloat16(), (q * scale).bfloat16()
        a = best_of(lambda: op(unit, k, v, out, starts, index, starts, 0.125))
        b = best_of(lambda: op(large, k, v, out, starts, index, starts, 0.125))
        print(f"| attention, queries x {scale:g} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.2f}x |")
    ops = kernels.elementwise()
    if ops is None:
        return
    unit = gate_up.bfloat16()
    for gate in (50.0, 100.0):
        large = gate_up.clone()
        large[:, :1536] = gate  # silu(x) = x / (1 + 2^(-x log2 e)): 2^t far below 2^-126
        large = large.bfloat16()
        a, b = best_of(lambda: ops.silu_mul(unit)), best_of(lambda: ops.silu_mul(large))
        print(f"| SwiGLU, gates {gate:g} | {a * 1e3:.3f} | {b * 1e3:.3f} | {b / a:.2f}x |")


def token_masks() -> None:
    op = kernels.token_mask()
    if not built(op, "the token-mask kernel is"):
        return
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 32000, 32
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (rows, -(-vocab // 32)), dtype=torch.int32, generator=gen
    )
    logits = torch.randn(64, vocab, generator=gen)
    index = torch.arange(0, 64, 2)

    def unpacked() -> None:
        mask = additive_on_cpu(bitmask.numpy(), vocab)
        for k, r in enumerate(index.tolist()):
            logits[r].add_(mask[k])

    ours, theirs = best_of(lambda: op(logits, bitmask, index)), best_of(unpacked)
    print("\n| 32 of 64 rows, 32,000 tokens | ms |\n|---|---:|")
    print(
        f"| kernel, from the bitmask | {ours * 1e3:.3f} |\n| numpy unpack + add_ | {theirs * 1e3:.3f} |"
    )


# (hidden, [(in, out) of q|k|v, o, gate|up, down]) of the models engine_vs_vllm.py builds
PROJECTIONS = {
    "small": [(512, 768), (512, 512), (512, 3072), (1536, 512)],
    "qwen05": [(896, 1152), (896, 896), (896, 9728), (4864, 896)],
}


def row_split() -> None:
    op = kernels.row_split_mm()
    if not built(op, "the row-split matmul is"):
        return
    threads = torch.get_num_threads()
    print("\n| model | rows | one call (ms, 8 layers) | rows split (ms) | one call / split |")
    print("|---|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for model, shapes in PROJECTIONS.items():
        weights = [
            [torch.randn(k, n, generator=gen).bfloat16() for k, n in shapes] for _ in range(8)
        ]
        for rows in (256, 512, 560, 768, 1024, 1536, 2048):
            xs = [torch.randn(rows, k, generator=gen).bfloat16() for k, _ in shapes]

            def layers(split: bool) -> None:
                for layer in weights:
                    for x, w in zip(xs, layer):
                        op(x, w, threads) if split else x @ w

            one, two = best_of(lambda: layers(False), 5), best_of(lambda: layers(True), 5)
            print(f"| {model} | {rows} | {one * 1e3:.2f} | {two * 1e3:.2f} | {one / two:.2f}x |")
    print("\n| weight (in x out) | rows split in |\n|---|---|")
    for shapes in PROJECTIONS.values():
        for k, n in shapes:
            lo, hi = row_split_span(k, n, torch.bfloat16, threads)
            print(f"| {k} x {n} | {f'({lo}, {hi}]' if hi else 'never'} |")


def packed_linear() -> None:
    """The packed linear against oneDNN's packed linear (``mkldnn._linear_pointwise``, the layout it
    replaced) on decode-sized steps: a layer's four projections, 8 layers each with its own weights
    (so they stream from memory, as in a decode step), and the tied LM head of Qwen2.5-0.5B."""
    ops = kernels.packed_linear()
    if not built(ops, "the packed linear is"):
        return
    # As the engine runs it: freed activations stay in the heap. Without this, every call's output is
    # fresh pages, and the packed linear (on AMX), whose threads write it in column strips across all
    # rows, took 166 ms for 256 rows of the head (a 78 MB output) against oneDNN's 29 (2026-12-03 22:28).
    keep_freed_memory()
    print(
        f"\n| model | rows | oneDNN packed (ms, 8 layers) | packed linear ({ops.isa}, ms) | "
        "oneDNN / ours |"
    )
    print("|---|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    cases = {**PROJECTIONS, "qwen2.5-0.5b head": [(896, 151936)]}
    for model, shapes in cases.items():
        layers = 1 if "head" in model else 8
        weights = [
            [torch.randn(n, k, generator=gen).bfloat16() for k, n in shapes] for _ in range(layers)
        ]
        onednn = [[_reorder(w) for w in layer] for layer in weights]
        ours = [[ops.pack(w) for w in layer] for layer in weights]
        for rows in (1, 4, 16, 64, 256, 512):
            xs = [torch.randn(rows, k, generator=gen).bfloat16() for k, _ in shapes]

            def run(mine: bool) -> None:
                for layer in ours if mine else onednn:
                    for x, w, (_, n) in zip(xs, layer, shapes):
                        ops.linear(x, w, None, n) if mine else _packed_linear(x, w, None)

            theirs, mine = best_of(lambda: run(False), 5), best_of(lambda: run(True), 5)
            print(
                f"| {model} | {rows} | {theirs * 1e3:.2f} | {mine * 1e3:.2f} | {theirs / mine:.2f}x |"
            )


def swiglu() -> None:
    """SwiGLU from the products (the packed linear's ``swiglu``) against the gate-and-up projection by
    the packed linear, then the elementwise ``silu_mul``: 8 MLP layers' gate and up, each its own
    weights."""
    ops, elementwise = kernels.packed_linear(), kernels.elementwise()
    if not built(ops, "the packed linear is") or not built(
        elementwise, "the elementwise kernels are"
    ):
        return
    keep_freed_memory()
    print(f"\n| model | rows | projection + silu_mul ({ops.isa}, ms) | swiglu (ms) | ratio |")
    print("|---|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for model, shapes in PROJECTIONS.items():
        k, n = shapes[2]  # the fused gate and up: n = 2 x intermediate
        weights = [torch.randn(n, k, generator=gen).bfloat16() for _ in range(8)]
        plain = [ops.pack(w) for w in weights]
        interleaved = [ops.pack(ops.interleaved(w)) for w in weights]
        for rows in (1, 16, 64, 256, 512, 2048):
            x = torch.randn(rows, k, generator=gen).bfloat16()

            def separate() -> None:
                for w in plain:
                    elementwise.silu_mul(ops.linear(x, w, None, n))

            def fused() -> None:
                for w in interleaved:
                    ops.swiglu(x, w, n)

            theirs, mine = best_of(separate, 5), best_of(fused, 5)
            print(
                f"| {model} | {rows} | {theirs * 1e3:.2f} | {mine * 1e3:.2f} | {theirs / mine:.2f}x |"
            )


SECTIONS = (
    "attention",
    "magnitudes",
    "elementwise",
    "token_masks",
    "row_split",
    "packed_linear",
    "swiglu",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default: all)",
    )
    only = set(parser.parse_args(argv).only.split(","))
    if only - set(SECTIONS):
        parser.error(f"unknown sections: {', '.join(sorted(only - set(SECTIONS)))}")
    op = kernels.attention_kernel()
    if op is None:
        print(
            "the CPU attention kernel is not built on this machine (see the log): nothing to compare"
        )
        return 1
    print(f"{torch.get_num_threads()} threads, bfloat16, head dim 64, kernel ISAs: {isas()}\n")
    with torch.inference_mode():
        if "attention" in only:
            prompts(op)
            burst(op)
            decode_rows()
        use("AMX")
        if "magnitudes" in only:
            magnitudes(op)
        for name, section in (
            ("elementwise", elementwise),
            ("token_masks", token_masks),
            ("row_split", row_split),
            ("packed_linear", packed_linear),
            ("swiglu", swiglu),
        ):
            if name in only:
                section()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

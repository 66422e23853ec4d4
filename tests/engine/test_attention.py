"""Paged attention: decode grouping by context length and the GQA layout change nothing, and a prompt
computed in chunks, each after its cached prefix, gives the attention outputs of the whole prompt at once
(float32 and bfloat16), with a chunk's prefix mask, made by the first layer, serving every layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plaserve.model.attention import AttentionMetadata, PrefillSeq, attention
from plaserve.model.kernels import varlen_attention

BLOCKS, BLOCK, HEADS, KV_HEADS, DIM = 64, 4, 8, 2, 16


def reference(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: list[int], length: int
) -> torch.Tensor:
    """One request's decode attention, its K/V read block by block, heads repeated as in repeat_kv."""
    k = torch.cat([kc[b] for b in table])[:length].repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = torch.cat([vc[b] for b in table])[:length].repeat_interleave(HEADS // KV_HEADS, dim=1)
    return F.scaled_dot_product_attention(q[:, None], k.transpose(0, 1), v.transpose(0, 1))[:, 0]


def test_grouped_decode_equals_each_request_alone():
    gen = torch.Generator().manual_seed(0)
    kc = torch.randn(BLOCKS, BLOCK, KV_HEADS, DIM, generator=gen)
    vc = torch.randn(BLOCKS, BLOCK, KV_HEADS, DIM, generator=gen)
    lengths = [37, 30, 17, 9, 8, 2]  # longest first, as the runner packs them
    perm = torch.randperm(BLOCKS - 1, generator=gen) + 1  # scattered blocks, never the null block 0
    tables, used = [], 0
    for n in lengths:
        nb = -(-n // BLOCK)
        tables.append(perm[used : used + nb].tolist())
        used += nb
    width = len(tables[0])
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lengths), HEADS, DIM, generator=gen)
    empty = torch.empty(0, KV_HEADS, DIM)
    outs = []
    # one group of full width; three groups
    for groups in (
        None,
        [(0, 2, 10), (2, 3, 5), (3, 6, 3)],
    ):
        meta = AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.long),
            prefill=[],
            decode_block_tables=padded,
            decode_context_lens=torch.tensor(lengths),
            decode_groups=groups,
        )
        outs.append(attention(q, empty, empty, (kc, vc), meta, scale=DIM**-0.5))
    for i, (table, n) in enumerate(zip(tables, lengths)):
        want = reference(q[i], kc, vc, table, n)
        for out in outs:
            torch.testing.assert_close(out[i], want, atol=1e-5, rtol=1e-5)


def _cache(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.zeros(BLOCKS, BLOCK, KV_HEADS, DIM, dtype=dtype),
        torch.zeros(BLOCKS, BLOCK, KV_HEADS, DIM, dtype=dtype),
    )


@pytest.mark.parametrize(
    "dtype, native, split",
    [
        (torch.float32, False, False),
        (torch.bfloat16, False, False),
        (torch.bfloat16, True, False),
        (torch.float32, False, True),
        (torch.bfloat16, False, True),
    ],
    ids=["float32", "bfloat16-sdpa", "bfloat16-native", "float32-split", "bfloat16-split"],
)
def test_chunks_after_a_cached_prefix_equal_the_whole_prompt(dtype, native, split, monkeypatch):
    """(bfloat16 also through the native CPU kernel, where it is built: its inputs made once too;
    ``split``: every chunk after a prefix through the two merged flash calls, which need no mask.)"""
    if native and varlen_attention() is None:
        pytest.skip("the CPU attention kernel is not built here")
    if not native:
        monkeypatch.setattr("plaserve.model.attention.varlen_attention", lambda: None)
    monkeypatch.setattr("plaserve.model.attention.SPLIT_MIN_QUERIES", 1 if split else 10**9)
    gen = torch.Generator().manual_seed(0)
    n, cuts = 100, [0, 37, 64, 100]  # chunks that start mid-block and on a block boundary
    q = torch.randn(n, HEADS, DIM, generator=gen).to(dtype)
    k = torch.randn(n, KV_HEADS, DIM, generator=gen).to(dtype)
    v = torch.randn(n, KV_HEADS, DIM, generator=gen).to(dtype)
    # Blocks out of order, as the allocator hands them out (never the null block 0); two layers' caches.
    table = torch.randperm(BLOCKS - 1, generator=gen)[: -(-n // BLOCK)] + 1
    slots = table[torch.arange(n) // BLOCK] * BLOCK + torch.arange(n) % BLOCK
    whole_meta = AttentionMetadata(slot_mapping=slots, prefill=[PrefillSeq(0, n, 0, None)])
    whole = attention(q, k, v, _cache(dtype), whole_meta, DIM**-0.5)

    layers = [_cache(dtype), _cache(dtype)]
    for a, b in zip(cuts, cuts[1:]):
        seq = PrefillSeq(0, b - a, a, table if a else None)
        meta = AttentionMetadata(slot_mapping=slots[a:b], prefill=[seq])
        outs = [attention(q[a:b], k[a:b], v[a:b], cache, meta, DIM**-0.5) for cache in layers]
        # made once, by the first layer (and no mask at all for the split calls)
        if split:
            assert seq._mask is None
        else:
            assert a == 0 or (meta._native_inputs if native else seq._mask) is not None
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for out in outs:
            torch.testing.assert_close(out, whole[a:b], atol=tol, rtol=tol)

"""Attention over the paged cache: a prompt computed in chunks, each after its cached prefix, gives the
attention outputs of the whole prompt at once (float32 and bfloat16), and a chunk's prefix mask, made by
the first layer, serves every layer of the step."""

from __future__ import annotations

import pytest
import torch

from plaserve.model.attention import AttentionMetadata, PrefillSeq, attention

H, HK, D, BLOCK = 4, 2, 16, 16


def _cache(blocks: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.zeros(blocks, BLOCK, HK, D, dtype=dtype),
        torch.zeros(blocks, BLOCK, HK, D, dtype=dtype),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_after_a_cached_prefix_equal_the_whole_prompt(dtype):
    gen = torch.Generator().manual_seed(0)
    n, cuts = 100, [0, 37, 64, 100]  # chunks that start mid-block and on a block boundary
    q = torch.randn(n, H, D, generator=gen).to(dtype)
    k = torch.randn(n, HK, D, generator=gen).to(dtype)
    v = torch.randn(n, HK, D, generator=gen).to(dtype)
    # Blocks out of order, as the allocator hands them out; two layers' caches.
    table = torch.tensor([5, 2, 7, 1, 3, 6, 4])
    slots = table[torch.arange(n) // BLOCK] * BLOCK + torch.arange(n) % BLOCK
    whole_meta = AttentionMetadata(slot_mapping=slots, prefill=[PrefillSeq(0, n, 0, None)])
    whole = attention(q, k, v, _cache(8, dtype), whole_meta, D**-0.5)

    layers = [_cache(8, dtype), _cache(8, dtype)]
    for a, b in zip(cuts, cuts[1:]):
        seq = PrefillSeq(0, b - a, a, table if a else None)
        meta = AttentionMetadata(slot_mapping=slots[a:b], prefill=[seq])
        outs = [attention(q[a:b], k[a:b], v[a:b], cache, meta, D**-0.5) for cache in layers]
        assert a == 0 or seq._mask is not None  # made once, by the first layer
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for out in outs:
            torch.testing.assert_close(out, whole[a:b], atol=tol, rtol=tol)

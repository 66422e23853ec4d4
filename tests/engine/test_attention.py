"""Paged decode attention: grouping by context length and the GQA layout change nothing."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plaserve.model.attention import AttentionMetadata, attention

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
    for groups in (
        None,
        [(0, 2, 10), (2, 3, 5), (3, 6, 3)],
    ):  # one group of full width; three groups
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

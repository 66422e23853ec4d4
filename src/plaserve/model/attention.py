"""Attention over the paged KV cache.

One forward pass packs the tokens of several requests into a flat ``[T, ...]`` batch. Requests come in
three layouts, each with its own fast path:

* **varlen prefill** — a run of ``q_len > 1`` new tokens per request, causal within the request and
  attending to the request's cached prefix (read back from its KV blocks);
* **padded prefill** — a static ``(batch, bucket)`` block of right-padded prompts with no cached prefix,
  one 4-D SDPA call (the shape the graph runners capture);
* **decode** — one new token per request against its whole paged context, one batched SDPA call.

Packed order is always: varlen prefill tokens, then padded tokens, then decode tokens.
In bfloat16 on CPUs where :mod:`plaserve.model.kernels` built its native kernel, the whole batch is one
call of that kernel per layer instead (every part a sequence of its own, keys read from the cache).
flash-attn is used for varlen prefill when it is importable on CUDA; torch SDPA everywhere else. All
SDPA calls use 4-D inputs: on CPU the fused kernel is only taken for 4-D (3-D is ~8x slower).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from plaserve.model.kernels import NATIVE_HEAD_DIMS, kv_writer, varlen_attention

try:  # pragma: no cover - only on CUDA machines with flash-attn installed
    from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
except ImportError:  # the normal case on CPU
    flash_attn_varlen_func = None


@dataclass
class PrefillSeq:
    """One request's slice of the varlen prefill part."""

    start: int  # offset of its first new token in the packed batch
    q_len: int  # new tokens computed now
    num_cached: int  # tokens before them already in the KV cache
    block_table: torch.Tensor | None  # its KV blocks; needed only when num_cached > 0
    _mask: torch.Tensor | None = field(default=None, repr=False)

    def prefix_mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The additive mask ``[q_len, num_cached + q_len]`` of a chunk after a cached prefix: 0 where a
        new token sees a key (the whole prefix, and itself and the new tokens before it), -inf elsewhere.
        SDPA's ``is_causal`` would align the queries to the start of the keys, not the end. Made by the
        first layer, reused by the others: building it and SDPA's conversion of a boolean one cost ~1 ms
        a layer for a 512-token chunk."""
        if self._mask is None:
            total = self.num_cached + self.q_len
            qpos = torch.arange(self.num_cached, total, device=device)
            hidden = torch.arange(total, device=device)[None, :] > qpos[:, None]
            self._mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(
                hidden, float("-inf")
            )
        return self._mask


@dataclass
class AttentionMetadata:
    """Everything the attention layers need to know about one packed batch."""

    slot_mapping: torch.Tensor  # [T] flat KV slot each token's K/V is written to
    prefill: list[PrefillSeq]
    num_prefill_tokens: int = 0
    padded_shape: tuple[int, int] | None = None  # (batch, bucket) of the padded part
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks], padded with the null block
    decode_context_lens: torch.Tensor | None = None  # [B] tokens in context incl. the new one
    # Decode rows [start, end) whose contexts fit ``blocks`` blocks, attended as one group (None: all
    # rows, the tables' full width).
    decode_groups: list[tuple[int, int, int]] | None = None
    _decode_inputs: list[tuple[int, int, torch.Tensor, torch.Tensor]] | None = field(
        default=None, repr=False
    )
    _native_inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(
        default=None, repr=False
    )

    @property
    def num_padded_tokens(self) -> int:
        return 0 if self.padded_shape is None else self.padded_shape[0] * self.padded_shape[1]

    def decode_inputs(
        self, block_size: int, dtype: torch.dtype
    ) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """Per decode group: its rows ``[start, end)``, the blocks to gather (flat) and the additive mask
        ``[rows, 1, 1, blocks * block_size]`` (0, or -inf past each context). The same for every layer:
        made by the first, reused by the others."""
        if self._decode_inputs is None:
            assert self.decode_block_tables is not None and self.decode_context_lens is not None
            tables, lens = self.decode_block_tables, self.decode_context_lens
            self._decode_inputs = []
            for start, end, blocks in self.decode_groups or [(0, tables.shape[0], tables.shape[1])]:
                past = (
                    torch.arange(blocks * block_size, device=tables.device)[None, :]
                    >= lens[start:end, None]
                )
                mask = torch.zeros(past.shape, dtype=dtype, device=tables.device).masked_fill_(
                    past, float("-inf")
                )
                self._decode_inputs.append(
                    (start, end, tables[start:end, :blocks].reshape(-1), mask[:, None, None])
                )
        return self._decode_inputs

    def native_inputs(
        self, block_size: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The whole batch as the native kernel's sequences (:mod:`plaserve.model.kernels`):
        ``q_starts`` (every packed token belongs to one sequence: a prefill, a padded row, a decode),
        the flat cache slots of each sequence's keys (``k_index``) and their ``k_starts``.
        ``block_size`` None: there is no cache, and the keys are rows of the batch's own K/V (prompts
        without a cached prefix only). The same for every layer: made by the first, reused by the
        others."""
        if self._native_inputs is None:
            own = (
                torch.arange(self.slot_mapping.shape[0], device=self.slot_mapping.device)
                if block_size is None
                else self.slot_mapping
            )
            q_lens, k_lens, k_slots = [], [], []
            for seq in self.prefill:
                q_lens.append(seq.q_len)
                k_lens.append(seq.num_cached + seq.q_len)
                if seq.num_cached == 0:  # its keys are its own new tokens, just written
                    k_slots.append(own[seq.start : seq.start + seq.q_len])
                else:
                    assert seq.block_table is not None and block_size is not None
                    k_slots.append(
                        _slots(seq.block_table, block_size)[: seq.num_cached + seq.q_len]
                    )
            if self.padded_shape is not None:
                b, n = self.padded_shape
                p0 = self.num_prefill_tokens
                q_lens += [n] * b
                k_lens += [n] * b
                k_slots.append(own[p0 : p0 + b * n])
            if self.decode_block_tables is not None:
                assert self.decode_context_lens is not None and block_size is not None
                tables, lens = self.decode_block_tables, self.decode_context_lens
                slots = _slots(tables, block_size)  # [B, blocks * block_size]
                k_slots.append(slots[torch.arange(slots.shape[1]) < lens[:, None]])
                q_lens += [1] * tables.shape[0]
                k_lens += lens.tolist()
            device = self.slot_mapping.device
            self._native_inputs = (
                torch.tensor([0, *q_lens], device=device).cumsum_(0),
                torch.cat(k_slots).long(),
                torch.tensor([0, *k_lens], device=device).cumsum_(0),
            )
        return self._native_inputs


@dataclass
class QueryRows:
    """Some rows of a packed batch, each the last new token of its sequence, attended without the
    others: the queries of the final decoder layer when only the rows that sample are wanted
    (:meth:`~plaserve.model.llama.LlamaForCausalLM.forward`). Every row attends to its whole
    context, so ``meta`` lays them out as decode rows reading their keys from the cache."""

    rows: torch.Tensor  # [N] packed rows, in the order of meta's decode rows
    meta: AttentionMetadata  # decode rows only: their block tables and context lengths


def _slots(block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """The flat cache slots of a block table's tokens, in order: ``[..., blocks * block_size]``."""
    offsets = torch.arange(block_size, device=block_table.device)
    return (block_table[..., None] * block_size + offsets).flatten(-2)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new keys/values ``[T, Hk, D]`` into the paged cache ``[blocks, block_size, Hk, D]``."""
    kc, vc = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    if kc.device.type == "cpu" and (writer := kv_writer()) is not None:
        # one call: two index_copy_ dispatches cost a 16-row decode step ~4 %
        writer(k, v, kc, vc, slot_mapping)
        return
    kc.index_copy_(0, slot_mapping, k)
    vc.index_copy_(0, slot_mapping, v)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """A request's first ``length`` cached tokens as ``[Hk, length, D]``."""
    blocks = cache[block_table[: (length + cache.shape[1] - 1) // cache.shape[1]]]
    return blocks.reshape(-1, *cache.shape[2:])[:length].transpose(0, 1)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    gqa = q.shape[-3] != k.shape[-3]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
    )


def skip_cudnn_attention() -> None:
    """Keep torch SDPA on CUDA off its cuDNN backend (flash and memory-efficient kernels remain).

    cuDNN builds an execution plan for each new attention shape, and the varlen path calls SDPA once per
    prompt at that prompt's own length, so a burst of mixed prompts paid a plan for almost every prompt;
    the flash and memory-efficient kernels take any length as it comes (docs/BENCHMARKS.md, "The CUDA
    graph grids on a GPU"). The switch is process-wide, as the backends' flags are.
    """
    torch.backends.cuda.enable_cudnn_sdp(False)


# A chunk after a cached prefix with at least this many new tokens is attended in two unmasked calls
# of the CPU flash kernel (below); shorter chunks take one call with an additive mask, which is faster
# there (2,048 new tokens after 2,048 cached: 22 against 30 ms a layer; 512 after 512: 2.0 against 1.8).
SPLIT_MIN_QUERIES = 1024


def _prefix_then_causal(
    q: torch.Tensor, past: list[torch.Tensor], new: list[torch.Tensor], scale: float
) -> torch.Tensor:
    """Attention of a chunk's queries ``[1, H, T, D]`` over its cached prefix ``past`` (K, V ``[1, Hk,
    P, D]``: every key visible) and its own tokens ``new`` (``[1, Hk, T, D]``: causal), as two calls of
    torch's CPU flash kernel merged by their log-sum-exps: the kernel's fast unmasked and causal paths
    instead of its masked one, and no ``[T, P + T]`` mask to build."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o1, lse1 = flash(q, past[0], past[1], 0.0, False, scale=scale)
    o2, lse2 = flash(q, new[0], new[1], 0.0, True, scale=scale)
    lse = torch.logaddexp(lse1, lse2)
    w1, w2 = ((x - lse).exp_().unsqueeze(-1) for x in (lse1, lse2))
    return (o1 * w1).add_(o2 * w2).to(q.dtype)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
    meta: AttentionMetadata,
    scale: float,
    queries: AttentionMetadata | None = None,
) -> torch.Tensor:
    """Attention for a packed batch. ``q``: ``[T, H, D]``, ``k``/``v``: ``[T, Hk, D]``; returns ``[T, H, D]``.

    New K/V are written into ``kv_cache`` first (when given), so cached-prefix and decode requests
    read their whole context from the cache. ``queries``: ``q`` holds only some rows (a
    :class:`QueryRows`' ``[N, H, D]``), laid out by this metadata; ``k``/``v`` and ``meta`` are still
    the whole batch's, whose keys the cache needs.
    """
    if kv_cache is not None:
        write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
    if queries is not None:
        assert kv_cache is not None, "queries read their keys from the cache"
        meta = queries
    out = torch.empty_like(q)
    native = (
        varlen_attention()
        if q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.shape[-1] in NATIVE_HEAD_DIMS
        else None
    )
    if native is not None:
        # One call for the whole batch, every sequence's keys read from the cache (just written).
        if kv_cache is None:
            native(q, k, v, out, *meta.native_inputs(None), scale)
        else:
            kc, vc = (c.view(-1, *c.shape[2:]) for c in kv_cache)
            native(q, kc, vc, out, *meta.native_inputs(kv_cache[0].shape[1]), scale)
        return out
    for seq in meta.prefill:
        s, e = seq.start, seq.start + seq.q_len
        qs = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if seq.num_cached == 0:
            ks, vs = k[s:e].transpose(0, 1).unsqueeze(0), v[s:e].transpose(0, 1).unsqueeze(0)
            o = _sdpa(qs, ks, vs, scale, causal=True)
        elif q.device.type == "cpu" and seq.q_len >= SPLIT_MIN_QUERIES:
            assert kv_cache is not None and seq.block_table is not None
            past = [
                _gather_context(c, seq.block_table, seq.num_cached).unsqueeze(0) for c in kv_cache
            ]
            new = [x[s:e].transpose(0, 1).unsqueeze(0) for x in (k, v)]
            o = _prefix_then_causal(qs, past, new, scale)
        else:
            assert kv_cache is not None and seq.block_table is not None
            total = seq.num_cached + seq.q_len
            ks = _gather_context(kv_cache[0], seq.block_table, total).unsqueeze(0)
            vs = _gather_context(kv_cache[1], seq.block_table, total).unsqueeze(0)
            o = _sdpa(qs, ks, vs, scale, mask=seq.prefix_mask(q.dtype, q.device))
        out[s:e] = o[0].transpose(0, 1)
    p0 = meta.num_prefill_tokens
    p1 = p0 + meta.num_padded_tokens
    if meta.padded_shape is not None:
        b, n = meta.padded_shape
        # Right padding keeps every real token's causal window free of padding.
        shape_q, shape_kv = (b, n, q.shape[1], q.shape[2]), (b, n, k.shape[1], k.shape[2])
        o = _sdpa(
            q[p0:p1].view(shape_q).transpose(1, 2),
            k[p0:p1].view(shape_kv).transpose(1, 2),
            v[p0:p1].view(shape_kv).transpose(1, 2),
            scale,
            causal=True,
        )
        out[p0:p1] = o.transpose(1, 2).reshape(b * n, q.shape[1], q.shape[2])
    if meta.decode_block_tables is not None:
        assert kv_cache is not None
        kc, vc = kv_cache
        hk, d = k.shape[1], k.shape[2]
        assert out.shape[0] - p1 == meta.decode_block_tables.shape[0]
        # An additive mask in the model's dtype: SDPA would turn a boolean one into that in every layer.
        for start, end, group, mask in meta.decode_inputs(kc.shape[1], q.dtype):
            b = end - start
            # index_select copies whole blocks (rows of the flat cache): faster than advanced indexing.
            # [b * blocks, block, Hk, D] -> [b, Hk, S, D]
            ks = torch.index_select(kc, 0, group).view(b, -1, hk, d).transpose(1, 2)
            vs = torch.index_select(vc, 0, group).view(b, -1, hk, d).transpose(1, 2)
            # The query heads sharing a K/V head attend as that head's rows (query head h reads K/V head
            # h // group, as in repeat_kv): one pass over each head's K/V serves the whole group.
            qs = q[p1 + start : p1 + end].view(b, hk, -1, d)
            o = _sdpa(qs, ks, vs, scale, mask=mask)  # [b, Hk, H / Hk, D]
            out[p1 + start : p1 + end] = o.reshape(b, -1, d)
    return out

"""Runs one scheduled batch on the model: packs inputs, runs the forward pass, samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plaserve.engine.attention import AttentionMetadata, PrefillSeq
from plaserve.engine.kv_cache import NULL_BLOCK
from plaserve.engine.sampler import sample
from plaserve.model.llama import LlamaForCausalLM
from plaserve.scheduler.base import BatchItem, ScheduledBatch


@dataclass
class PackedBatch:
    """Model inputs for one step and where to read each sampled row."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # packed row of the last token of each sampling item
    sample_items: list[int]  # index into batch.items of each sampling item


def _slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def pack(batch: ScheduledBatch, block_size: int, device: torch.device) -> PackedBatch:
    """Lay out ``batch`` as varlen prefill items, then the padded bucket block, then decodes."""
    items = list(enumerate(batch.items))
    decodes = [(i, it) for i, it in items if it.num_tokens == 1 and it.request.num_computed_tokens > 0]
    rest = [(i, it) for i, it in items if not (it.num_tokens == 1 and it.request.num_computed_tokens > 0)]
    padded = rest if batch.bucket is not None else []
    varlen = [] if batch.bucket is not None else rest

    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    rows: list[int] = []
    row_items: list[int] = []
    prefill: list[PrefillSeq] = []

    def add(i: int, it: BatchItem, pad_to: int | None = None) -> None:
        req, start = it.request, it.request.num_computed_tokens
        end = start + it.num_tokens
        base = len(ids)
        ids.extend(req.token_ids[start:end])
        pos.extend(range(start, end))
        slots.extend(_slots(req.block_table, start, end, block_size))
        if pad_to is not None:  # right padding: token 0 at a harmless position, K/V to the null block
            extra = pad_to - it.num_tokens
            ids.extend([0] * extra)
            pos.extend([0] * extra)
            slots.extend([NULL_BLOCK * block_size] * extra)
        if it.samples:
            rows.append(base + it.num_tokens - 1)
            row_items.append(i)

    for i, it in varlen:
        table = None
        if it.request.num_computed_tokens > 0:
            table = torch.tensor(it.request.block_table, dtype=torch.long, device=device)
        prefill.append(PrefillSeq(len(ids), it.num_tokens, it.request.num_computed_tokens, table))
        add(i, it)
    num_prefill = len(ids)
    for i, it in padded:
        assert it.request.num_computed_tokens == 0 and it.num_tokens <= batch.bucket
        add(i, it, pad_to=batch.bucket)
    tables = lens = None
    if decodes:
        width = max(len(it.request.block_table) for _, it in decodes)
        tables = torch.tensor([it.request.block_table + [NULL_BLOCK] * (width - len(it.request.block_table))
                               for _, it in decodes], dtype=torch.long, device=device)
        lens = torch.tensor([it.request.num_computed_tokens + 1 for _, it in decodes], dtype=torch.long,
                            device=device)
        for i, it in decodes:
            add(i, it)

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    meta = AttentionMetadata(slot_mapping=t(slots), prefill=prefill, num_prefill_tokens=num_prefill,
                             padded_shape=(len(padded), batch.bucket) if padded else None,
                             decode_block_tables=tables, decode_context_lens=lens)
    return PackedBatch(t(ids), t(pos), meta, rows, row_items)


class ModelRunner:
    """Executes scheduled batches on a model with its paged KV cache."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device

    def execute(self, batch: ScheduledBatch) -> dict[int, int]:
        """Run ``batch``; returns the sampled token of each item that samples, by item index."""
        packed = pack(batch, self.block_size, self.device)
        hidden = self.model(packed.input_ids, packed.positions, packed.meta, self.kv_caches)
        if not packed.sample_rows:
            return {}
        logits = self.model.compute_logits(hidden[packed.sample_rows])
        reqs = [batch.items[i].request for i in packed.sample_items]
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        return dict(zip(packed.sample_items, tokens))

    def logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits of every computed token of ``batch`` in packed order (for tests and debugging)."""
        packed = pack(batch, self.block_size, self.device)
        hidden = self.model(packed.input_ids, packed.positions, packed.meta, self.kv_caches)
        return self.model.compute_logits(hidden)

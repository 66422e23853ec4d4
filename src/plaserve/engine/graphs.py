"""Grids of static-shape runners: ``(batch, bucket)`` for short prefills, ``(batch, blocks)`` for decodes.

Each entry owns static input, position and KV-slot buffers (a decode entry also its block tables and
context lengths) for ``batch`` rows: right-padded prompts of ``bucket`` tokens, or one decode token each
over contexts of up to ``blocks`` KV blocks. On CUDA the model's forward pass over those buffers is
captured once as a ``torch.cuda.CUDAGraph`` and replayed: one launch instead of hundreds, which is what
makes short prefills and decode steps cheap on a GPU. On CPU the same buffers run eagerly (there is no
launch overhead to save), so the path is the same everywhere and tested on CPU.

A replay always computes all ``batch`` rows; unused rows are padding whose K/V go to the null block
(a decode padding row attends to the null block's first slot). On CPU only the used rows run, since
padding rows would cost real compute there.
"""

from __future__ import annotations

import logging

import torch
from tqdm import tqdm

from plaserve.kv_blocks import NULL_BLOCK
from plaserve.model.attention import AttentionMetadata
from plaserve.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

# Decode grid batch sizes: a decode batch is padded to the next of these (CUDA graphs in vLLM and SGLang
# step similarly); larger batches run eagerly.
DECODE_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


class StaticRunner:
    """One prefill grid entry: static buffers for ``batch x bucket`` tokens, optionally a captured graph."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        batch: int,
        bucket: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.batch, self.bucket = batch, bucket
        n = batch * bucket
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.null_slot = NULL_BLOCK * block_size
        self.slot_mapping = torch.full((n,), self.null_slot, dtype=torch.long, device=device)
        self.hidden: torch.Tensor | None = None  # graph output buffer once captured
        self.graph: torch.cuda.CUDAGraph | None = None

    def _meta(self, rows: int) -> AttentionMetadata:
        """Attention metadata of the first ``rows`` rows of the buffers."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[: rows * self.bucket],
            prefill=[],
            padded_shape=(rows, self.bucket),
        )

    def _forward(self, rows: int) -> torch.Tensor:
        n = rows * self.bucket
        return self.model(self.input_ids[:n], self.positions[:n], self._meta(rows), self.kv_caches)

    def capture(self, pool: object | None = None) -> None:
        """Record the forward pass over the static buffers as a CUDA graph (CUDA only)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: lets kernels pick algorithms and allocate workspaces
                self._forward(self.batch)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.hidden = self._forward(self.batch)

    def _clear_rows(self, rows: int) -> None:
        """Reset the unused rows ``[rows, batch)`` to padding before a replay: they must not write stale
        slots of an earlier replay into live KV blocks."""
        n = rows * self.bucket
        self.input_ids[n:].zero_()
        self.positions[n:].zero_()
        self.slot_mapping[n:].fill_(self.null_slot)

    def _execute(self, rows: int) -> torch.Tensor:
        """Hidden states of the first ``rows`` rows, the buffers filled: a replay, or an eager pass."""
        if self.graph is None:
            return self._forward(rows)
        self._clear_rows(rows)
        self.graph.replay()
        assert self.hidden is not None
        return self.hidden[: rows * self.bucket]

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, rows: int
    ) -> torch.Tensor:
        """Hidden states ``[rows * bucket, hidden]`` for ``rows`` right-padded prompts (flat inputs)."""
        n = rows * self.bucket
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slots)
        return self._execute(rows)


class DecodeRunner(StaticRunner):
    """One decode grid entry: ``batch`` rows of one token each, over contexts of up to ``blocks`` KV
    blocks (block tables padded with the null block, attended as one group)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        batch: int,
        blocks: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        super().__init__(model, kv_caches, batch, 1, block_size, device)
        self.blocks = blocks
        self.block_tables = torch.full((batch, blocks), NULL_BLOCK, dtype=torch.long, device=device)
        self.context_lens = torch.ones(batch, dtype=torch.long, device=device)

    def _meta(self, rows: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:rows],
            prefill=[],
            decode_block_tables=self.block_tables[:rows],
            decode_context_lens=self.context_lens[:rows],
            decode_groups=[(0, rows, self.blocks)],
        )

    def _clear_rows(self, rows: int) -> None:
        super()._clear_rows(rows)
        self.block_tables[rows:].fill_(NULL_BLOCK)
        self.context_lens[rows:].fill_(1)

    def run_decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states ``[rows, hidden]`` of ``rows`` decode tokens; ``block_tables`` ``[rows, w]``
        with ``w <= blocks``, padded with the null block."""
        rows, width = block_tables.shape
        self.block_tables[:rows, :width].copy_(block_tables)
        self.block_tables[:rows, width:].fill_(NULL_BLOCK)
        self.context_lens[:rows].copy_(context_lens)
        return self.run(input_ids, positions, slots, rows)


class GraphGrid:
    """Static runners for every ``(batch, size)`` of one kind: prefill ``(batch, bucket)`` shapes, or
    with ``decode`` the ``(batch, blocks)`` shapes of decode steps."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        shapes: list[tuple[int, int]],
        block_size: int,
        device: torch.device,
        capture: bool,
        decode: bool = False,
    ) -> None:
        self.decode = decode
        self.runners: dict[tuple[int, int], StaticRunner] = {}
        self.captured = capture and device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if self.captured else None
        # Largest first, so smaller graphs reuse the memory pool the big ones reserved.
        ordered = sorted(shapes, key=lambda s: s[0] * s[1], reverse=True)
        kind = DecodeRunner if decode else StaticRunner
        desc = f"capturing {'decode' if decode else 'prefill'} CUDA graphs"
        for batch, size in tqdm(ordered, desc=desc, disable=not self.captured):
            runner = kind(model, kv_caches, batch, size, block_size, device)
            if self.captured:
                runner.capture(pool)
            self.runners[(batch, size)] = runner
        self.hits = 0
        self.fallbacks = 0

    def lookup(self, rows: int, size: int) -> StaticRunner | None:
        """The smallest entry that holds ``rows`` rows of ``size``: a prefill bucket exactly (its rows
        are padded to it), a decode width or more (block tables pad with the null block)."""
        fits = [
            (k, b)
            for (b, k) in self.runners
            if b >= rows and (k >= size if self.decode else k == size)
        ]
        if not fits:
            return None
        k, b = min(fits)
        return self.runners[(b, k)]


def decode_grid_shapes(
    max_batch: int, max_blocks: int, bytes_per_block: int, budget: int
) -> list[tuple[int, int]]:
    """The ``(batch, blocks)`` shapes of the decode grid: batch sizes of :data:`DECODE_BATCH_SIZES` up to
    ``max_batch``, widths of a power of two blocks (from 16) up to ``max_blocks`` (which is always one),
    whose gathered K/V of one layer (``bytes_per_block`` a block row, K and V) fit ``budget`` bytes: a
    captured graph keeps that memory reserved."""
    widths = sorted({min(max_blocks, 16 << i) for i in range(max(1, max_blocks.bit_length()))})
    return [
        (b, w)
        for b in DECODE_BATCH_SIZES
        if b <= max_batch
        for w in widths
        if b * w * bytes_per_block <= budget
    ]

"""The ``(batch, bucket)`` grid of static-shape prefill runners.

Each entry owns static input, position and KV-slot buffers for a right-padded batch of ``batch``
prompts of ``bucket`` tokens. On CUDA the model's forward pass over those buffers is captured once as a
``torch.cuda.CUDAGraph`` and replayed: one launch instead of hundreds, which is what makes short
prefills cheap on a GPU. On CPU the same buffers run eagerly (there is no launch overhead to save), so
the path is the same everywhere and tested on CPU.

A replay always computes all ``batch`` rows; unused rows hold padding whose K/V go to the null block.
On CPU only the used rows run, since padding rows would cost real compute there.
"""

from __future__ import annotations

import logging

import torch
from tqdm import tqdm

from plaserve.engine.attention import AttentionMetadata
from plaserve.kv_blocks import NULL_BLOCK
from plaserve.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


class StaticRunner:
    """One grid entry: static buffers for ``batch x bucket`` tokens, optionally a captured graph."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 batch: int, bucket: int, block_size: int, device: torch.device) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.batch, self.bucket = batch, bucket
        n = batch * bucket
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.null_slot = NULL_BLOCK * block_size
        self.slot_mapping = torch.full((n,), self.null_slot, dtype=torch.long, device=device)
        self.hidden: torch.Tensor | None = None  # graph output buffer once captured
        self.graph: torch.cuda.CUDAGraph | None = None

    def _forward(self, rows: int) -> torch.Tensor:
        n = rows * self.bucket
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:n], prefill=[], padded_shape=(rows, self.bucket))
        return self.model(self.input_ids[:n], self.positions[:n], meta, self.kv_caches)

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

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, rows: int) -> torch.Tensor:
        """Hidden states ``[rows * bucket, hidden]`` for ``rows`` right-padded prompts (flat inputs)."""
        n = rows * self.bucket
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slots)
        if self.graph is None:
            return self._forward(rows)
        # Unused rows must not write stale slots of an earlier replay into live KV blocks.
        self.input_ids[n:].zero_()
        self.positions[n:].zero_()
        self.slot_mapping[n:].fill_(self.null_slot)
        self.graph.replay()
        assert self.hidden is not None
        return self.hidden[:n]


class GraphGrid:
    """Static runners for every ``(batch, bucket)`` shape the short path uses."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 shapes: list[tuple[int, int]], block_size: int, device: torch.device, capture: bool) -> None:
        self.runners: dict[tuple[int, int], StaticRunner] = {}
        self.captured = capture and device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if self.captured else None
        # Largest first, so smaller graphs reuse the memory pool the big ones reserved.
        ordered = sorted(shapes, key=lambda s: s[0] * s[1], reverse=True)
        for batch, bucket in tqdm(ordered, desc="capturing CUDA graphs", disable=not self.captured):
            runner = StaticRunner(model, kv_caches, batch, bucket, block_size, device)
            if self.captured:
                runner.capture(pool)
            self.runners[(batch, bucket)] = runner
        self.hits = 0
        self.fallbacks = 0

    def lookup(self, rows: int, bucket: int) -> StaticRunner | None:
        """The smallest entry of ``bucket`` that holds ``rows`` prompts."""
        fits = [b for (b, k) in self.runners if k == bucket and b >= rows]
        return self.runners[(min(fits), bucket)] if fits else None

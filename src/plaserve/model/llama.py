"""The Llama-family causal LM (Llama 2/3, Mistral, Qwen2/2.5) over packed, paged batches."""

from __future__ import annotations

import torch
from torch import nn

from plaserve.model.attention import AttentionMetadata, QueryRows
from plaserve.model.config import ModelConfig
from plaserve.model.fused import FusedKernels
from plaserve.model.layers import DecoderLayer, Projection, RMSNorm, RotaryEmbedding


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm (HF's ``model.`` prefix)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # Left uninitialised (the loader fills it): nn.Embedding's own normal_ init on the meta device,
        # where the loader builds the model, would import torch._dynamo, as rope's arithmetic would.
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder with an LM head. ``forward`` returns hidden states; ``compute_logits`` projects the
    few rows that are sampled, so prefill never builds a ``[T, vocab]`` tensor."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.head: Projection | None = None
        self.kernels = FusedKernels()  # eager until compile_kernels()

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up into single matmuls and lay every projection out for speed
        (:class:`~plaserve.model.layers.Projection`); after loading, on the final device and dtype."""
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            # The final layer's q apart: its queries may be only the rows that sample (forward).
            layer.self_attn.fuse(split_q=i == last)
            layer.mlp.fuse()
        # A tied head keeps the embedding table's layout and gains a packed copy for decode steps: by the
        # plain layout a decode batch's logits cost up to twice as much (152k x 896: 27 against 14 ms
        # for 16 rows; it is a 272 MB copy for Qwen2.5-0.5B).
        self.head = Projection(
            [self.lm_head], shared=self.config.tie_word_embeddings, split_rows=False
        )

    def shape_free_rows(self) -> int:
        """The most rows a step may have for every decoder projection to run in plaserve's packed
        linear, which builds no kernel per row count (0: some projection never does; see
        :class:`~plaserve.model.layers.Projection`). The LM head, which multiplies only the sampled
        rows, does not count."""
        projections = [
            p
            for layer in self.model.layers
            for p in (layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up, layer.mlp.down)
        ]
        return min((0 if p is None else p.shape_free_rows for p in projections), default=0)

    def compile_kernels(self, min_tokens: int | None) -> None:
        """Run the elementwise work of steps of at least ``min_tokens`` tokens compiled (None: all
        eager); see :mod:`plaserve.model.fused`."""
        self.kernels = FusedKernels(min_tokens)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        queries: QueryRows | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of a packed batch; writes its K/V into ``kv_caches`` when given.

        ``queries``: only these rows' hidden states, ``[N, hidden]`` in their order (the rows that
        sample; needs ``kv_caches``). Every other row's final hidden state would only make logits
        nobody reads, and the final layer reads nothing of it but its keys and values: so that layer
        computes those for every row (the cache keeps them) and its queries, attention, output
        projection and MLP only for these rows: a prefill step skips most of one layer's work for
        every row but the last of each prompt."""
        x, residual = self.model.embed_tokens(input_ids), None
        rope = self.rotary(positions)
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(
                x,
                residual,
                rope,
                None if kv_caches is None else kv_caches[i],
                meta,
                self.kernels,
                queries if i == last else None,
            )
        if queries is not None and not len(queries.rows):
            return x  # [0, hidden]: no row samples
        norm = self.model.norm
        return self.kernels.add_rms_norm(x, residual, norm.weight, norm.eps)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[N, vocab]`` for selected hidden rows."""
        return (self.lm_head(hidden) if self.head is None else self.head(hidden)).float()

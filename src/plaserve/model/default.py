"""The embedded default model: a fixed small Llama with deterministic random weights.

It lets every command run with no checkpoint and no download. Its weights are random, so its text is
gibberish; everything that reports from it says so (see :data:`DEFAULT_MODEL_NAME`).
"""

from __future__ import annotations

import torch

from plaserve.model.config import ModelConfig

DEFAULT_MODEL_NAME = "plaserve-default-random-weights"

DEFAULT_CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=512,  # byte-level tokenizer: 256 bytes, a few specials, the rest reserved
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,  # grouped-query attention, 4 query heads per KV head
    head_dim=64,
    max_position_embeddings=16384,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    bos_token_id=256,
    eos_token_ids=(257,),
)


def init_random_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Fill every parameter deterministically (normal(0, 0.02); norms at 1), independent of device."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)

"""Model configuration parsed from a Hugging Face ``config.json``.

Only the fields a Llama-family decoder needs are kept. Llama, Mistral and Qwen2 share one
architecture up to three switches: q/k/v bias (Qwen2), tied embeddings, and rope scaling.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


class UnsupportedModelError(ValueError):
    """The checkpoint is not a Llama-family decoder plaserve can run."""


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    qkv_bias: bool = False
    o_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_params(self) -> int:
        """Parameter count (embedding and lm_head counted once each unless tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_attention_heads * 2 + self.num_key_value_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_attention_heads + 2 * self.num_key_value_heads)
        if self.o_bias:
            attn += h
        layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + emb + h

    def activation_bytes_per_token(self, element_size: int) -> int:
        """Estimated peak activation bytes one token takes in a forward pass: one layer's working set
        (hidden, residual and norm, fused q/k/v and their rotated copies, attention output, the MLP's
        gate/up and activation) plus the output. Layers run one after another, so this does not grow
        with depth; it is what a captured CUDA graph keeps reserved per token of its shape."""
        h, d = self.hidden_size, self.head_dim
        qkv = (self.num_attention_heads + 2 * self.num_key_value_heads) * d
        return element_size * (
            4 * h + 2 * qkv + self.num_attention_heads * d + 3 * self.intermediate_size
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies across all layers, per byte of element size."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed ``config.json``; refuses architectures other than Llama-family."""
        archs = cfg.get("architectures") or [cfg.get("model_type", "<unknown>")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported; plaserve runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("sliding_window") and cfg.get(
            "use_sliding_window", arch == "MistralForCausalLM"
        ):
            # Sliding-window attention would need a different mask; refuse rather than be wrong.
            if cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
                raise UnsupportedModelError(
                    f"{arch} with sliding_window={cfg['sliding_window']} is not supported"
                )
        heads = cfg["num_attention_heads"]
        # transformers 5 folds rope_theta and rope_scaling into one `rope_parameters` dict.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if rope_type in (None, "default") else {**rope, "rope_type": rope_type}
        if scaling is not None and rope_type not in ("llama3", "linear"):
            raise UnsupportedModelError(
                f"rope_scaling type {rope_type!r} is not supported (llama3, linear are)"
            )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            # Qwen2 always has q/k/v bias and never o_proj bias; Llama's flag covers all four.
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            o_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        """Read ``config.json`` from a model directory."""
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_dict(json.load(f))

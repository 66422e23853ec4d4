"""Analytic cost models: a model shape on a described GPU, for the simulator at cluster scale.

These are estimates from FLOP and byte counts, not measurements; every report built on one says so
(the cost model's ``source`` is ``"analytic:<model>@<gpu>"``).

    c0 = max(kernel launches of one eager forward, time to read the weights once)
    g1 = linear FLOPs per token / (peak * linear efficiency)
    g2 = attention FLOPs per query-key pair / (peak * attention efficiency)
    g3 = KV bytes per cached token / memory bandwidth

Reading the weights once per forward is what makes small prefills and decode steps memory-bound, so
it is the floor ``c0`` of every call.
"""

from __future__ import annotations

from dataclasses import dataclass

from plaserve.cost import CostModel
from plaserve.model.config import ModelConfig


@dataclass(frozen=True)
class Hardware:
    """The numbers of one accelerator that the analytic model needs."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    mem_bandwidth: float  # bytes/s
    launch_overhead: float = 5e-6  # seconds per kernel launch
    linear_efficiency: float = 0.6  # achieved fraction of peak on projections and MLP
    attention_efficiency: float = 0.45  # achieved fraction of peak in attention


HARDWARE = {
    "H100": Hardware("H100-SXM", peak_flops=989e12, mem_bandwidth=3.35e12),
    "H200": Hardware("H200", peak_flops=989e12, mem_bandwidth=4.8e12),
    "A100": Hardware("A100-SXM-80GB", peak_flops=312e12, mem_bandwidth=2.04e12),
}


def _llama(arch: str, hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int) -> ModelConfig:
    return ModelConfig(architecture=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                       head_dim=hidden // heads, max_position_embeddings=32768,
                       qkv_bias=arch == "Qwen2ForCausalLM")


MODELS = {
    "llama2-7b": _llama("LlamaForCausalLM", 4096, 11008, 32, 32, 32, 32000),
    "llama3-8b": _llama("LlamaForCausalLM", 4096, 14336, 32, 32, 8, 128256),
    "qwen2.5-7b": _llama("Qwen2ForCausalLM", 3584, 18944, 28, 28, 4, 152064),
    "qwen2.5-32b": _llama("Qwen2ForCausalLM", 5120, 27648, 64, 40, 8, 152064),
}

KERNELS_PER_LAYER = 14  # norms, projections, rope, attention, activation, residuals (eager)


def analytic_cost(model: str | ModelConfig, hardware: str | Hardware, dtype_bytes: int = 2) -> CostModel:
    """The cost model of ``model`` (a name from :data:`MODELS` or a config) on ``hardware``."""
    cfg = MODELS[model] if isinstance(model, str) else model
    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    linear_flops = 2 * (cfg.num_params - embed)
    pair_flops = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    weights = (cfg.num_params - cfg.vocab_size * cfg.hidden_size) * dtype_bytes  # embedding rows are gathered
    launches = KERNELS_PER_LAYER * cfg.num_hidden_layers * hw.launch_overhead
    name = model if isinstance(model, str) else cfg.architecture
    return CostModel(g1=linear_flops / (hw.peak_flops * hw.linear_efficiency),
                     g2=pair_flops / (hw.peak_flops * hw.attention_efficiency),
                     g3=cfg.kv_bytes_per_token * dtype_bytes / hw.mem_bandwidth,
                     c0=max(launches, weights / hw.mem_bandwidth),
                     source=f"analytic:{name}@{hw.name}")

"""Engine settings, with every default in one place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """How to build and run one engine instance.

    ``model`` is a local Hugging Face model directory, or None for the embedded default model (random
    weights, byte-level tokenizer). ``kv_cache_memory`` is bytes, a size string (``"2GiB"``) or a
    fraction of the device's free memory (``"0.5"``).
    """

    model: str | None = None
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA; or float32 / bfloat16 / float16
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped at 16384
    block_size: int = 16
    kv_cache_memory: str = "auto"  # auto: 2GiB on CPU, 0.8 of free memory on CUDA
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    short_threshold: int = 512  # prompts with fewer uncached tokens than this are "short"
    seed: int = 0

"""Builds a ready-to-run model and tokenizer from a local checkpoint or the embedded default."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from plaserve.model.config import ModelConfig
from plaserve.model.cpu_features import cpu_bf16_support
from plaserve.model.default import DEFAULT_CONFIG, DEFAULT_MODEL_NAME, init_random_weights
from plaserve.model.hub import resolve_model
from plaserve.model.layers import RotaryEmbedding
from plaserve.model.llama import LlamaForCausalLM
from plaserve.model.tokenizer import Tokenizer, load_tokenizer
from plaserve.model.weights import load_into, load_safetensors_state_dict

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model on its device, its config and tokenizer, and the name it is served under."""

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    name: str
    path: str | None
    random_weights: bool


def resolve_device(device: str) -> torch.device:
    """``"auto"``: CUDA when available, else the CPU; any other name as torch spells it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def auto_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype ``--dtype auto`` picks on ``device``, and why: bfloat16 on CUDA and on CPUs with native
    bfloat16 matmuls, float32 on other CPUs."""
    if device.type == "cuda":
        return torch.bfloat16, "CUDA device"
    isa = cpu_bf16_support()
    if isa is not None:
        return torch.bfloat16, f"this CPU multiplies bfloat16 natively ({isa})"
    return torch.float32, "this CPU has no native bfloat16 matmul (no AMX, no AVX512-BF16)"


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The torch dtype named ``dtype`` (``auto``: see :func:`auto_dtype`; the choice is logged)."""
    if dtype == "auto":
        chosen, why = auto_dtype(device)
        log.info("dtype auto: %s (%s)", str(chosen).removeprefix("torch."), why)
        return chosen
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _with_float32_rope(model: LlamaForCausalLM, device: torch.device) -> LlamaForCausalLM:
    """(Re)build the rotary table in float32 on ``device``: ``Module.to(dtype)`` would round it to
    half precision, and :func:`load_model` allocates every tensor empty."""
    cfg = model.config
    model.rotary = RotaryEmbedding(
        cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
    ).to(device)
    return model


def random_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    name: str = DEFAULT_MODEL_NAME,
) -> LoadedModel:
    """A model of shape ``cfg`` with deterministic random weights (see :func:`init_random_weights`) and the
    byte-level tokenizer: the embedded default, or any shape a benchmark needs without a checkpoint."""
    model = LlamaForCausalLM(cfg)
    init_random_weights(model, seed)
    model = _with_float32_rope(model.to(device=device, dtype=dtype), device).eval()
    model.fuse_projections()
    return LoadedModel(model, cfg, load_tokenizer(None), name, None, True)


def load_model(
    path: str | None,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    revision: str | None = None,
) -> LoadedModel:
    """Load ``path`` (a Hugging Face model directory, or a hub repository id resolved through the
    hub's cache at ``revision``: :func:`plaserve.model.hub.resolve_model`) or, when None, build the
    embedded default. A hub id is the model's name; a directory's name is its last component."""
    if path is None:
        log.warning(
            "no model given: using the embedded default model %s (RANDOM WEIGHTS, output is gibberish)",
            DEFAULT_MODEL_NAME,
        )
        return random_model(DEFAULT_CONFIG, dtype, device, seed)
    name = path if not os.path.isdir(path) else os.path.basename(os.path.normpath(path))
    path = resolve_model(path, revision)
    cfg = ModelConfig.from_pretrained(path)
    tokenizer = load_tokenizer(path)
    if not cfg.eos_token_ids and tokenizer.eos_token_ids:
        cfg = dataclasses.replace(cfg, eos_token_ids=tuple(tokenizer.eos_token_ids))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    # Materialise empty on the target device, then copy the checkpoint in: no random init, no CPU copy.
    # torch.empty rather than Module.to_empty: empty_like of a meta tensor runs through torch's Python
    # references, which import sympy (a third of a second), and to_empty(...).to(dtype) would allocate
    # every weight twice.
    model = model._apply(
        lambda t: torch.empty(
            t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device
        )
    )
    model = _with_float32_rope(model, device)
    load_into(model, load_safetensors_state_dict(path, dtype), cfg.tie_word_embeddings)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.fuse_projections()
    return LoadedModel(model.eval(), cfg, tokenizer, name, path, False)

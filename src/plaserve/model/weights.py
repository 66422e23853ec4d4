"""Loading Hugging Face safetensors checkpoints into plaserve modules.

plaserve's model uses Hugging Face parameter names (``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.q_proj.weight``, ..., ``lm_head.weight``), so a checkpoint's
state dict maps onto the module one to one; the only special cases are tied embeddings and
the ``rotary_emb.inv_freq`` buffers some older checkpoints carry.
"""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors.torch import load_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Checkpoint keys that are derived data, not weights: we recompute rope frequencies.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoadError(ValueError):
    """A checkpoint's tensors do not match the module's parameters."""


def _checkpoint_files(path: str) -> list[str]:
    """The safetensors files making up the checkpoint at ``path`` (a directory or one file)."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint path {path!r} does not exist")
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        # Many tensors share a shard; keep first-seen order for reproducible loading.
        shards = list(dict.fromkeys(weight_map.values()))
        files = [os.path.join(path, shard) for shard in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} in {path!r} lists missing shards: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}")
    return files


def load_safetensors_state_dict(
    path: str, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Read every tensor of a safetensors checkpoint into CPU memory.

    ``path`` is a checkpoint directory holding ``model.safetensors``, or shards listed in
    ``model.safetensors.index.json``, or (failing both) any ``*.safetensors`` files; a path
    to a single ``.safetensors`` file also works. Floating-point tensors are cast to
    ``dtype`` when given; integer tensors are left alone.
    """
    state: dict[str, torch.Tensor] = {}
    for file in _checkpoint_files(path):
        for name, tensor in load_file(file, device="cpu").items():
            if name in state:
                raise WeightLoadError(f"tensor {name!r} appears in more than one shard ({file})")
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            state[name] = tensor
    return state


def load_into(
    module: torch.nn.Module, state: dict[str, torch.Tensor], tie_word_embeddings: bool
) -> None:
    """Copy ``state`` into ``module``'s parameters, in place, checking names and shapes.

    The module's parameters keep their device and dtype (``copy_`` converts). With
    ``tie_word_embeddings``, a missing ``lm_head.weight`` is filled from
    ``model.embed_tokens.weight``, and a checkpoint ``lm_head.weight`` the module does not
    have (because it shares the embedding) is ignored. Raises :class:`WeightLoadError`
    listing every missing key, unexpected key and shape mismatch at once.
    """
    state = {k: v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)}
    # remove_duplicate=False so a module that ties lm_head to the embedding by sharing the
    # Parameter still lists both names; both copies then write the same storage.
    params = dict(module.named_parameters(remove_duplicate=False))

    if tie_word_embeddings:
        if "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        if "lm_head.weight" not in params:
            state.pop("lm_head.weight", None)

    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    mismatched = [
        f"{name}: checkpoint {tuple(state[name].shape)} vs model {tuple(param.shape)}"
        for name, param in params.items()
        if name in state and state[name].shape != param.shape
    ]
    if missing or unexpected or mismatched:
        problems = []
        if missing:
            problems.append(f"missing keys ({len(missing)}): {missing}")
        if unexpected:
            problems.append(f"unexpected keys ({len(unexpected)}): {unexpected}")
        if mismatched:
            problems.append(f"shape mismatches ({len(mismatched)}): {mismatched}")
        raise WeightLoadError("checkpoint does not match model: " + "; ".join(problems))

    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name])

"""Safetensors loading matches what transformers saved; load_into checks names and shapes."""

from __future__ import annotations

import json
import os

import pytest
import torch

from plaserve.model.weights import WeightLoadError, load_into, load_safetensors_state_dict


def _reference_state(path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.state_dict()


class _Mirror(torch.nn.Module):
    """A module whose parameter names mirror a Hugging Face state dict (stand-in for our model)."""

    def __init__(self, shapes: dict[str, torch.Size], tie: bool) -> None:
        super().__init__()
        for name, shape in shapes.items():
            if tie and name == "lm_head.weight":
                continue
            self._register(name, torch.nn.Parameter(torch.zeros(shape)))
        if tie:
            self._register("lm_head.weight", self.get_parameter("model.embed_tokens.weight"))

    def _register(self, dotted: str, param: torch.nn.Parameter) -> None:
        # Parameter names cannot contain dots, so build the submodule path they imply.
        *path, leaf = dotted.split(".")
        mod: torch.nn.Module = self
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, param)


def test_sharded_checkpoint_matches_transformers(llama_ckpt: str) -> None:
    assert os.path.isfile(os.path.join(llama_ckpt, "model.safetensors.index.json"))
    assert not os.path.isfile(os.path.join(llama_ckpt, "model.safetensors"))
    state = load_safetensors_state_dict(llama_ckpt)
    ref = _reference_state(llama_ckpt)
    assert set(state) == set(ref)
    for name, tensor in ref.items():
        assert state[name].dtype == torch.float32
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)


def test_single_file_tied_checkpoint(qwen2_ckpt: str) -> None:
    state = load_safetensors_state_dict(qwen2_ckpt, dtype=torch.bfloat16)
    ref = _reference_state(qwen2_ckpt)
    # Tied: the file has no lm_head.weight, transformers' state_dict does.
    assert set(ref) - set(state) == {"lm_head.weight"}
    assert state["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0
    for name, tensor in state.items():
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(tensor, ref[name].to(torch.bfloat16), rtol=0, atol=0, msg=name)

    module = _Mirror({k: v.shape for k, v in ref.items()}, tie=True)
    load_into(module, state, tie_word_embeddings=True)
    params = dict(module.named_parameters(remove_duplicate=False))
    assert params["lm_head.weight"] is params["model.embed_tokens.weight"]
    for name, param in params.items():
        assert param.dtype == torch.float32  # the module's dtype wins
        torch.testing.assert_close(param, ref[name].to(torch.bfloat16).float(), rtol=0, atol=0)


def test_tied_checkpoint_into_untied_module(qwen2_ckpt: str) -> None:
    state = load_safetensors_state_dict(qwen2_ckpt)
    shapes = {k: v.shape for k, v in state.items()}
    shapes["lm_head.weight"] = state["model.embed_tokens.weight"].shape
    module = _Mirror(shapes, tie=False)  # separate lm_head parameter
    load_into(module, state, tie_word_embeddings=True)
    torch.testing.assert_close(
        module.get_parameter("lm_head.weight"), state["model.embed_tokens.weight"]
    )
    # Without tying, the absent lm_head is an error.
    with pytest.raises(WeightLoadError, match=r"missing keys \(1\): \['lm_head.weight'\]"):
        load_into(module, state, tie_word_embeddings=False)


def test_load_into_reports_missing_unexpected_and_shape(mistral_ckpt: str) -> None:
    state = load_safetensors_state_dict(mistral_ckpt)
    module = _Mirror({k: v.shape for k, v in state.items()}, tie=False)
    load_into(
        module, {**state, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}, False
    )
    torch.testing.assert_close(
        module.get_parameter("model.norm.weight"), state["model.norm.weight"]
    )

    broken = dict(state)
    del broken["model.layers.1.mlp.up_proj.weight"]
    broken["model.layers.2.mlp.up_proj.weight"] = torch.zeros(1)
    broken["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(WeightLoadError) as err:
        load_into(module, broken, tie_word_embeddings=False)
    message = str(err.value)
    assert "missing keys (1): ['model.layers.1.mlp.up_proj.weight']" in message
    assert "unexpected keys (1): ['model.layers.2.mlp.up_proj.weight']" in message
    assert "model.norm.weight: checkpoint (3,) vs model (64,)" in message


def test_glob_fallback_and_missing_dir(tmp_path) -> None:
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2), "ids": torch.arange(3)}, str(tmp_path / "part-b.safetensors"))
    save_file({"b": torch.zeros(2, dtype=torch.float16)}, str(tmp_path / "part-a.safetensors"))
    state = load_safetensors_state_dict(str(tmp_path), dtype=torch.float64)
    assert set(state) == {"a", "b", "ids"}
    assert state["a"].dtype == state["b"].dtype == torch.float64
    assert state["ids"].dtype == torch.int64  # integers are never cast
    with pytest.raises(FileNotFoundError):
        load_safetensors_state_dict(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_safetensors_state_dict(str(tmp_path / "empty"))


def test_fixture_configs_are_what_transformers_reads(
    llama_ckpt: str, qwen2_ckpt: str, mistral_ckpt: str
) -> None:
    from transformers import AutoConfig

    with open(os.path.join(llama_ckpt, "config.json")) as f:
        raw = json.load(f)
    # Hub (Llama-3.1) form on disk...
    assert "rope_parameters" not in raw
    assert raw["rope_theta"] == 500000.0
    assert raw["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    # ...which transformers reads back as the same rope parameters.
    assert AutoConfig.from_pretrained(llama_ckpt).rope_parameters == {
        **raw["rope_scaling"],
        "rope_theta": 500000.0,
    }

    with open(os.path.join(qwen2_ckpt, "config.json")) as f:
        raw = json.load(f)
    assert raw["rope_parameters"] == {"rope_theta": 1000000.0, "rope_type": "default"}
    assert raw["tie_word_embeddings"] is True

    with open(os.path.join(mistral_ckpt, "config.json")) as f:
        raw = json.load(f)
    assert raw["rope_theta"] == 1000000.0 and raw["rope_scaling"] is None
    assert raw["sliding_window"] is None
    assert AutoConfig.from_pretrained(mistral_ckpt).rope_parameters["rope_theta"] == 1000000.0

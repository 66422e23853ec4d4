"""``--dtype auto``: bfloat16 where the device multiplies it natively, float32 elsewhere, and why."""

from __future__ import annotations

import logging

import pytest
import torch

from plaserve.model import cpu_features, loader


def probes(
    monkeypatch: pytest.MonkeyPatch, amx: bool | None, avx512_bf16: bool | None, flags: str = ""
) -> None:
    """Make torch's CPU probes answer ``amx`` / ``avx512_bf16`` (None: the probe does not exist) and
    ``/proc/cpuinfo`` list ``flags``."""
    for name, value in (
        ("_is_amx_tile_supported", amx),
        ("_is_avx512_bf16_supported", avx512_bf16),
    ):
        if value is None:
            monkeypatch.delattr(torch.cpu, name, raising=False)
        else:
            monkeypatch.setattr(torch.cpu, name, lambda v=value: v)
    monkeypatch.setattr(cpu_features, "_cpuinfo_flags", lambda: set(flags.split()))


@pytest.mark.parametrize(
    "amx, avx512_bf16, flags, isa",
    [
        (True, True, "", "AMX"),
        (False, True, "", "AVX512-BF16"),
        (
            False,
            False,
            "amx_bf16 avx512_bf16",
            None,
        ),  # torch's probes win over the flags where they exist
        (None, None, "avx512f amx_tile amx_bf16", "AMX"),  # no probes: the kernel's flags decide
        (None, None, "avx512f avx512_bf16", "AVX512-BF16"),
        (None, None, "avx2 avx512f", None),
    ],
)
def test_cpu_bf16_support(monkeypatch, amx, avx512_bf16, flags, isa):
    probes(monkeypatch, amx, avx512_bf16, flags)
    assert cpu_features.cpu_bf16_support() == isa
    dtype, why = loader.auto_dtype(torch.device("cpu"))
    assert dtype == (torch.float32 if isa is None else torch.bfloat16)
    assert (isa or "no native bfloat16") in why


def test_auto_is_bfloat16_on_cuda_and_logs_why(monkeypatch, caplog):
    probes(monkeypatch, False, False)
    assert loader.auto_dtype(torch.device("cuda")) == (torch.bfloat16, "CUDA device")
    with caplog.at_level(logging.INFO, logger="plaserve.model.loader"):
        assert loader.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert "dtype auto: float32 (this CPU has no native bfloat16 matmul" in caplog.text
    assert loader.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        loader.resolve_dtype("int8", torch.device("cpu"))


def test_load_report_shows_the_dtype(llama_ckpt):
    from plaserve import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=llama_ckpt, kv_cache_memory="16MiB", max_model_len=256))
    assert engine.load_report()["dtype"] == str(engine.dtype).removeprefix("torch.")
    assert engine.dtype == loader.auto_dtype(torch.device("cpu"))[0]

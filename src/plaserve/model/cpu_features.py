"""What this CPU can do that the model's fast paths depend on: native bfloat16 arithmetic."""

from __future__ import annotations

import torch


def _cpuinfo_flags() -> set[str]:
    """The feature flags of the first CPU in ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_bf16_support() -> str | None:
    """The instruction set this CPU multiplies bfloat16 with natively, ``"AMX"`` or ``"AVX512-BF16"``,
    or None. Without either, oneDNN widens bfloat16 to float32 element by element and a bfloat16 matmul
    runs slower than a float32 one; with AMX it runs several times faster."""
    # torch's own probes also check that the OS enabled AMX's tile state; they are private, so fall
    # back to the kernel's flags (which it lists only for features it supports) where they are missing.
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    avx512_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    if amx is not None and avx512_bf16 is not None:
        if amx():
            return "AMX"
        return "AVX512-BF16" if avx512_bf16() else None
    flags = _cpuinfo_flags()
    if "amx_bf16" in flags:
        return "AMX"
    return "AVX512-BF16" if "avx512_bf16" in flags else None

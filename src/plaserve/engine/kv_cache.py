"""The paged KV cache's tensors, and the memory sizes that decide how many blocks there are.

The blocks' bookkeeping (allocation, reference counts, the prefix cache) is :mod:`plaserve.kv_blocks`;
slot ``p`` of a request lives at ``table[p // block_size] * block_size + p % block_size`` in every
layer's ``[num_blocks, block_size, num_kv_heads, head_dim]`` K and V tensors.
"""

from __future__ import annotations

import re

import torch


def parse_memory(spec: str | int | float, available: int) -> int:
    """Bytes from ``"4GiB"``, ``"512MB"``, ``1073741824`` or a fraction of ``available`` like ``"0.3"``."""
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return int(spec * available) if 0 < spec <= 1 and isinstance(spec, float) else int(spec)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B?|B)?\s*", str(spec), re.IGNORECASE)
    if not m:
        raise ValueError(
            f"cannot parse memory size {spec!r} (use e.g. 4GiB, 512MB, or a fraction like 0.5)"
        )
    value, unit = float(m.group(1)), (m.group(2) or "").upper()
    if not unit:
        return int(value * available) if value <= 1 else int(value)
    power = "BKMGT".index(unit[0])
    base = 1024 if "I" in unit or unit == "B" else 1000
    return int(value * base**power)


def available_memory(device: torch.device) -> int:
    """Free bytes on ``device`` now (GPU memory, or host MemAvailable on CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def allocate_kv_tensors(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(k, v)`` caches shaped ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]

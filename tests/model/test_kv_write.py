"""The native KV-cache writer (``kernels.kv_writer``): the same cache as two ``index_copy_`` calls, for
decode-sized and prefill-sized steps (the latter over the OpenMP threads), K/V as the strided views of
the fused projection they are in the model, in half and full precision; slots outside the cache are
refused; ``attention.write_kv`` falls back to ``index_copy_`` where it is not built."""

from __future__ import annotations

import pytest
import torch

from plaserve.model import attention as attention_module
from plaserve.model import kernels

WRITER = kernels.kv_writer()
needs_writer = pytest.mark.skipif(
    WRITER is None, reason="the CPU KV-cache writer is not built here"
)


def _step(tokens: int, dtype: torch.dtype, seed: int = 0):
    """New K and V rows as views of one fused ``[T, (2 + 2) * 2 * 16]`` projection output, distinct
    slots scattered over a cache of 512 blocks of 16, and that cache (garbage-filled)."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(tokens, 4 * 2 * 16, generator=gen).to(dtype)  # q (2 heads), k, v, extra
    k = fused[:, 32:64].view(tokens, 2, 16)
    v = fused[:, 64:96].view(tokens, 2, 16)
    slots = torch.randperm(512 * 16, generator=gen)[:tokens]
    cache = torch.randn(2, 512, 16, 2, 16, generator=gen).to(dtype)
    return k, v, slots, cache


@needs_writer
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 3, 5000])  # 5,000: several threads' share
def test_the_writer_equals_index_copy(dtype, tokens):
    k, v, slots, cache = _step(tokens, dtype, seed=tokens)
    want = cache.clone()
    want[0].view(-1, 2, 16).index_copy_(0, slots, k)
    want[1].view(-1, 2, 16).index_copy_(0, slots, v)
    got = cache.clone()
    with torch.inference_mode():
        WRITER(k, v, got[0].view(-1, 2, 16), got[1].view(-1, 2, 16), slots)
    assert torch.equal(got, want)


@needs_writer
def test_a_slot_outside_the_cache_is_refused():
    k, v, slots, cache = _step(4, torch.bfloat16)
    slots[2] = 512 * 16
    with pytest.raises(RuntimeError, match="out of range"):
        WRITER(k, v, cache[0].view(-1, 2, 16), cache[1].view(-1, 2, 16), slots)


@pytest.mark.parametrize("native", [True, False])
def test_write_kv_stores_the_rows_with_or_without_the_writer(monkeypatch, native):
    if native and WRITER is None:
        pytest.skip("the CPU KV-cache writer is not built here")
    if not native:
        monkeypatch.setattr(attention_module, "kv_writer", lambda: None)
    k, v, slots, cache = _step(37, torch.bfloat16, seed=5)
    with torch.inference_mode():
        attention_module.write_kv(cache[0], cache[1], k, v, slots)
    assert torch.equal(cache[0].view(-1, 2, 16)[slots], k)
    assert torch.equal(cache[1].view(-1, 2, 16)[slots], v)

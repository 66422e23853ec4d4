"""Fused projections: every layout multiplies as ``nn.Linear`` does, and the parameters stay views."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plaserve.model import layers
from plaserve.model.layers import Projection, prepacked_pays


@pytest.fixture(params=["probed", "packed", "plain"])
def packing(request, monkeypatch):
    """Each float32 layout whatever this CPU's probe finds: as probed, forced packed, forced plain."""
    if request.param != "probed":
        forced = request.param == "packed"
        monkeypatch.setattr(
            layers,
            "prepacked_pays",
            lambda dtype: forced if dtype == torch.float32 else prepacked_pays(dtype),
        )
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_projection_equals_its_linears(dtype, bias, packing):
    gen = torch.Generator().manual_seed(0)
    linears = [nn.Linear(48, n, bias=bias).to(dtype) for n in (32, 16, 16)]
    with torch.no_grad():
        for lin in linears:
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen))
            if bias:
                lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen))
    expected = [lin.weight.float().clone() for lin in linears]
    proj = Projection(linears)
    assert proj.transposed  # on CPU
    assert (proj.packed is not None) == layers.prepacked_pays(dtype)
    for lin, w in zip(linears, expected):  # still the same weights, now views of the fused one
        assert (
            torch.equal(lin.weight.float(), w)
            and lin.weight.untyped_storage().data_ptr() == proj.weight.untyped_storage().data_ptr()
        )
    # the last by the plain transposed weight
    for rows in (
        1,
        5,
        64,
        proj.max_packed_rows + 1,
    ):
        x = torch.randn(rows, 48, generator=gen).to(dtype)
        want = torch.cat(
            [
                nn.functional.linear(
                    x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float()
                )
                for lin in linears
            ],
            -1,
        )
        got = proj(x)
        assert got.dtype == dtype and got.shape == (rows, 64)
        # bfloat16 rounds the output once (values up to ~30 here: 8 bits of mantissa)
        torch.testing.assert_close(
            got.float(), want, atol=1e-4 if dtype == torch.float32 else 0.25, rtol=1e-2
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_projection_keeps_the_tied_weight_and_multiplies_as_linear(dtype, packing):
    """A head tied to the embedding table: the table keeps its layout and storage (the embedding reads
    it), a packed copy serves decode-sized steps, and every size multiplies as nn.Linear does."""
    gen = torch.Generator().manual_seed(1)
    emb = nn.Embedding(300, 48).to(dtype)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(emb.weight.shape, generator=gen))
    head = nn.Linear(48, 300, bias=False).to(dtype)
    head.weight = emb.weight
    before = emb.weight.detach().clone()
    proj = Projection([head], shared=True)
    assert not proj.transposed and head.weight is emb.weight and emb.weight.is_contiguous()
    assert torch.equal(emb.weight.detach(), before)
    assert proj.weight.data_ptr() == emb.weight.data_ptr()
    assert (proj.packed is not None) == layers.prepacked_pays(dtype)
    for rows in (1, 16, proj.max_packed_rows + 1):
        x = torch.randn(rows, 48, generator=gen).to(dtype)
        want = nn.functional.linear(x.float(), before.float())
        torch.testing.assert_close(
            proj(x).float(), want, atol=1e-4 if dtype == torch.float32 else 0.25, rtol=1e-2
        )


def test_prepacked_pays_in_half_precision_and_decides_float32_once():
    # half precision wherever oneDNN can pack it: every AVX512 CPU, not an AVX2-only one without
    # bf16 conversions (where the probe's reorder is refused and the layout stays plain)
    if layers._can_prepack() and torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert layers.prepacked_pays(torch.bfloat16)
    first = layers.prepacked_pays(torch.float32)  # the probe, once a process
    assert layers.prepacked_pays(torch.float32) is first
    assert layers.prepacked_pays.cache_info().hits >= 1

"""Fused projections: every layout multiplies as ``nn.Linear`` does, and the parameters stay views."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from plaserve.model import kernels, layers
from plaserve.model.fused import FusedKernels
from plaserve.model.layers import Projection, prepacked_rows, row_split_span

SPLIT = kernels.row_split_mm()
PACKED = kernels.packed_linear()
needs_packed = pytest.mark.skipif(
    PACKED is None, reason="no packed linear here (no AVX512-BF16 or no g++)"
)
needs_split = pytest.mark.skipif(
    SPLIT is None, reason="the row-split matmul is not built here (no AVX512-BF16 or no g++)"
)


FLOAT32_PACKED_ROWS = {
    "packed": Projection.PACKED_MAX_ROWS,
    "packed-every-step": Projection.PACKED_EVERY_STEP,
    "plain": 0,
}


@pytest.fixture(params=["probed", *FLOAT32_PACKED_ROWS])
def packing(request, monkeypatch):
    """Each float32 layout whatever this CPU's probe finds: as probed, forced packed (decode-sized
    steps or every step), forced plain."""
    if request.param != "probed":
        forced = FLOAT32_PACKED_ROWS[request.param]
        monkeypatch.setattr(
            layers,
            "prepacked_rows",
            lambda dtype: forced if dtype == torch.float32 else prepacked_rows(dtype),
        )
    return request.param


def beyond_packed(proj: Projection) -> int:
    """A step of more rows than ``proj``'s packed copy takes (the plain weight's), or of 300 where it
    takes every step."""
    return min(proj.max_packed_rows, 299) + 1


def _packs(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a projection of ``weight`` (``[out, in]``) gets a packed copy: the packed linear's
    where it takes the shape, else oneDNN's where that pays."""
    own = PACKED is not None and dtype == torch.bfloat16 and PACKED.fits(weight.to(dtype))
    return own or layers.prepacked_rows(dtype) > 0


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
    fused = torch.cat([lin.weight.detach() for lin in linears])
    proj = Projection(linears)
    assert (proj.packed is not None) == _packs(fused, dtype)
    if proj.weight is None:  # the packed copy takes every step: no plain weight kept beside it
        assert proj.packed is not None and proj.max_packed_rows == Projection.PACKED_EVERY_STEP
        assert all(
            lin.weight.is_meta and lin.weight.shape == w.shape for lin, w in zip(linears, expected)
        )
    else:
        assert proj.transposed  # on CPU
        for lin, w in zip(linears, expected):  # still the same weights, now views of the fused one
            assert (
                torch.equal(lin.weight.float(), w)
                and lin.weight.untyped_storage().data_ptr()
                == proj.weight.untyped_storage().data_ptr()
            )
    # the last by the plain transposed weight, where the packed copy does not take every step
    for rows in (1, 5, 64, beyond_packed(proj)):
        x = torch.randn(rows, 48, generator=gen).to(dtype)
        want = torch.cat(
            [
                nn.functional.linear(x.float(), w, None if lin.bias is None else lin.bias.float())
                for lin, w in zip(linears, expected)
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
    assert (proj.packed is not None) == _packs(proj.weight, dtype)
    for rows in (1, 16, beyond_packed(proj)):
        x = torch.randn(rows, 48, generator=gen).to(dtype)
        want = nn.functional.linear(x.float(), before.float())
        torch.testing.assert_close(
            proj(x).float(), want, atol=1e-4 if dtype == torch.float32 else 0.25, rtol=1e-2
        )


def test_prepacked_rows_in_half_precision_and_float32_decided_once():
    # half precision wherever oneDNN can pack it: every AVX512 CPU, not an AVX2-only one without
    # bf16 conversions (where the probe's reorder is refused and the layout stays plain)
    if layers._can_prepack() and torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert layers.prepacked_rows(torch.bfloat16) == Projection.PACKED_MAX_ROWS_HALF
    first = layers.prepacked_rows(torch.float32)  # the probes, once a process
    assert first in (0, Projection.PACKED_MAX_ROWS, Projection.PACKED_EVERY_STEP)
    assert layers.prepacked_rows(torch.float32) is first
    assert layers.prepacked_rows.cache_info().hits >= 1


@pytest.mark.skipif(not layers._can_prepack(), reason="no oneDNN packed linear in this torch build")
@pytest.mark.parametrize("forced", ["packed", "packed-every-step"])
def test_float32_steps_take_the_packed_copy_up_to_its_rows(forced, monkeypatch):
    """Where the float32 probe finds oneDNN's packed layout faster at prefill sizes too (as on an
    AVX-512 AMD EPYC), prefill-sized steps multiply by it as well; else only decode-sized ones."""
    rows_limit = FLOAT32_PACKED_ROWS[forced]
    monkeypatch.setattr(layers, "prepacked_rows", lambda dtype: rows_limit)
    calls = []

    def counting(x, packed, bias):
        calls.append(x.shape[0])
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    monkeypatch.setattr(layers, "_packed_linear", counting)
    gen = torch.Generator().manual_seed(3)
    lin = nn.Linear(64, 96)
    reference = copy.deepcopy(lin)  # lin's weight goes where the packed copy takes every step
    proj = Projection([lin])
    assert proj.max_packed_rows == rows_limit
    assert (proj.weight is None) == (rows_limit == Projection.PACKED_EVERY_STEP)
    sizes = (1, 16, 300, 1500)
    for rows in sizes:
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(proj(x), reference(x), atol=1e-4, rtol=1e-4)
    assert calls == [rows for rows in sizes if rows <= rows_limit]


@needs_split
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 31, 32, 33, 100, 517])
@pytest.mark.parametrize("parts", [1, 2, 3, 8])
def test_row_split_matmul_equals_the_plain_one(dtype, rows, parts):
    """Every row count, including fewer rows than parts and blocks cut mid-tile, on inference tensors
    (the worker threads must run in inference mode too)."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    w = torch.randn(96, 40, generator=gen).to(dtype)
    with torch.inference_mode():
        got = SPLIT(x, w, parts)
    assert got.dtype == dtype and got.shape == (rows, 40)
    torch.testing.assert_close(
        got.float(),
        x.float() @ w.float(),
        atol=1e-4 if dtype == torch.float32 else 0.25,
        rtol=1e-2,
    )


@needs_split
@pytest.mark.parametrize("bias", [False, True])
def test_a_projection_splits_rows_in_its_span_and_multiplies_as_its_linears(bias, monkeypatch):
    # without plaserve's packed linear, which takes every step where the CPU lacks AMX: oneDNN's
    # packed copy for decode-sized steps, the plain weight (split or not) for the rest
    monkeypatch.setattr(kernels, "packed_linear", lambda: None)
    gen = torch.Generator().manual_seed(2)
    linears = [nn.Linear(64, n, bias=bias).to(torch.bfloat16) for n in (48, 16)]
    weight = torch.cat([lin.weight.detach().float() for lin in linears])
    bias_ = torch.cat([lin.bias.detach().float() for lin in linears]) if bias else None
    proj = Projection(linears)
    # forced, whatever this CPU's probe found; above the packed copy's rows, which come first
    proj.split_span = (proj.max_packed_rows + 8, proj.max_packed_rows + 100)
    lo, hi = proj.split_span
    calls = []

    def counting(x, w, parts):
        calls.append(x.shape[0])
        return SPLIT(x, w, parts)

    monkeypatch.setattr(kernels, "row_split_mm", lambda: counting)
    for rows in (lo, lo + 1, hi, hi + 1):
        x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
        with torch.inference_mode():
            got = proj(x)
        want = nn.functional.linear(x.float(), weight, bias_)
        torch.testing.assert_close(got.float(), want, atol=0.25, rtol=1e-2)
    assert calls == [lo + 1, hi]  # (lo, hi]: the rest by the plain matmul
    # an LM head asks for no timing and never splits
    assert Projection([nn.Linear(64, 48).to(torch.bfloat16)], split_rows=False).split_span == (0, 0)


def test_row_split_span_is_a_run_of_probe_points_or_never():
    lo, hi = row_split_span(64, 48, torch.bfloat16, 2)  # whatever this CPU's timing finds
    assert (lo, hi) == (0, 0) or (
        hi in layers.SPLIT_PROBE_ROWS and (lo == 0 or lo in layers.SPLIT_PROBE_ROWS) and lo < hi
    )
    assert row_split_span(64, 48, torch.bfloat16, 1) == (0, 0)  # one thread: nothing to split


@pytest.mark.parametrize(
    "wins, span",
    [
        ((), (0, 0)),
        ((384,), (0, 384)),
        ((512, 768, 1024), (384, 1024)),
        ((512, 1536, 2048), (384, 512)),  # the first run of wins only
        ((2048,), (1536, 2048)),
    ],
)
def test_row_split_span_follows_the_timings(wins, span, monkeypatch):
    """On a fake clock every timed call takes 1 s, except a split one at a row count of ``wins``: 0.5 s."""
    now = [0.0]

    def perf_counter():
        now[0] += 0.5  # read twice a call: 1 s a call
        return now[0]

    def split(x, w, parts):
        if x.shape[0] in wins:
            now[0] -= 0.5
        return x @ w

    monkeypatch.setattr(kernels, "row_split_mm", lambda: split)
    monkeypatch.setattr(layers.time, "perf_counter", perf_counter)
    monkeypatch.setattr(layers, "SPLIT_PROBE_MAX_SECONDS", 10.0)
    row_split_span.cache_clear()
    try:
        assert row_split_span(8, 4, torch.float32, 2) == span
    finally:
        row_split_span.cache_clear()


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T + bias`` in float32, rounded to bfloat16 once."""
    out = x.float() @ w.float().T
    return (out if bias is None else out + bias.float()).bfloat16()


@needs_packed
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 40, 130])
@pytest.mark.parametrize("shape", [(80, 96), (768, 512), (112, 3104)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_one_rounding_of_the_float32_product(rows, shape, bias):
    """Every row count (a partial last tile of rows, several tiles), outputs in groups of 64 and a
    partial last group, with and without bias, x's rows read at a stride (a slice of a wider tensor):
    the float32 sums rounded once, as torch's linear gives them (at most one bfloat16 step apart where
    the sums run in another order)."""
    n, k = shape
    gen = torch.Generator().manual_seed(rows + n)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    wide = torch.randn(rows, k + 32, generator=gen).bfloat16()
    x = wide[:, 16 : 16 + k]  # each row contiguous, rows k + 32 apart
    with torch.inference_mode():
        got = PACKED.linear(x, PACKED.pack(w), b, n)
    want = _reference(x, w, b)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)


@needs_packed
def test_bfloat16_projections_use_the_packed_linear_up_to_their_packed_rows(monkeypatch):
    """A bfloat16 projection whose shape the kernel takes multiplies steps of up to
    ``max_packed_rows`` rows by the kernel's layout (one flat copy: decode-sized steps on AMX, every
    step without it, in calls of up to ``VNNI_CALL_ROWS`` rows, and then no plain weight is kept),
    larger ones by the plain weight, and a row that is not contiguous goes the plain way too where
    there is one; all as ``nn.Linear`` does."""
    monkeypatch.setattr(Projection, "VNNI_CALL_ROWS", 256)
    gen = torch.Generator().manual_seed(5)
    lin = nn.Linear(64, 48, bias=True).bfloat16()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen))
        lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen))
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    proj = Projection([lin])
    assert proj.packed is not None and proj.packed.shape == (48 * 64,)
    amx = PACKED.isa == "AMX"
    assert proj.max_packed_rows == (
        Projection.PACKED_MAX_ROWS_HALF if amx else Projection.PACKED_EVERY_STEP
    )
    assert (proj.weight is None) == (not amx) and lin.weight.is_meta == (not amx)
    if not amx:
        assert proj.split_span == (0, 0)  # no row count left for a split: none timed
    calls = []
    real = PACKED.linear
    sizes = (1, 16, 600, min(proj.max_packed_rows, 999) + 1)
    try:
        PACKED.linear = lambda *args: calls.append(args[0].shape[0]) or real(*args)
        for rows in sizes:
            x = torch.randn(rows, 64, generator=gen).bfloat16()
            torch.testing.assert_close(
                proj(x).float(), _reference(x, w, b).float(), rtol=2**-7, atol=0.05
            )
        strided = torch.randn(64, 3, generator=gen).bfloat16()[:, 0].expand(4, 64)
        torch.testing.assert_close(
            proj(strided).float(), _reference(strided, w, b).float(), rtol=2**-7, atol=0.05
        )
    finally:
        PACKED.linear = real
    if amx:
        assert calls == [rows for rows in sizes if rows <= proj.max_packed_rows]
    else:  # 600 and 1,000 rows in calls of 256; the strided rows copied first
        assert calls == [1, 16, 256, 256, 88, 256, 256, 256, 232, 4]


@needs_packed
# 6 or 8 blocks of gate and up: with a tile pair's tail, without
@pytest.mark.parametrize("inter", [48, 64])
def test_swiglu_from_the_products_equals_the_projection_then_silu_mul(inter, monkeypatch):
    """An MLP's gate and up built with ``swiglu`` give ``silu(gate) * up`` straight from the packed
    products, bit for bit what the separate packed projection and the elementwise kernel give (gate and
    up rounded to bfloat16 first), for steps up to ``max_packed_rows`` (every step without AMX, in
    calls of up to ``VNNI_CALL_ROWS`` rows); past that, ``swiglu`` declines and the projection
    multiplies by the plain weight in gate-then-up order."""
    monkeypatch.setattr(Projection, "VNNI_CALL_ROWS", 256)
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(2 * inter, 64, generator=gen).bfloat16()  # gate, then up
    fused = Projection([_linear_of(w[:inter]), _linear_of(w[inter:])], swiglu=True)
    separate = Projection([_linear_of(w)])
    silu_mul = FusedKernels().silu_mul
    for rows in (1, 7, 17, 300, min(600, fused.max_packed_rows)):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        got = fused.swiglu(x)
        assert got is not None and got.shape == (rows, inter)
        assert torch.equal(got, silu_mul(separate(x)))
    if fused.weight is None:  # the packed copy takes every step
        return
    x = torch.randn(fused.max_packed_rows + 1, 64, generator=gen).bfloat16()
    assert fused.swiglu(x) is None
    torch.testing.assert_close(
        fused(x).float(), _reference(x, w, None).float(), rtol=2**-7, atol=0.05
    )


def _linear_of(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False).to(weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
    return lin

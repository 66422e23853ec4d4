"""The native CPU attention kernel (``plaserve.model.kernels``): against SDPA on every layout it is given
(varlen prompts, chunks after a cached prefix, single decode rows and batches of them, GQA groups of
1-32, head sizes 16 to 128, K/V as strided views and as scattered cache slots), with its products on
AMX tiles and on AVX512-BF16 dot products (both of that path's forms) where the CPU has both, inside ``attention()`` on a mixed batch against the
SDPA path, and its fallbacks (no compiler, a failing build, switched off)."""

from __future__ import annotations

import logging

import pytest
import torch

from plaserve.model import kernels
from plaserve.model.attention import AttentionMetadata, PrefillSeq, attention

NATIVE = kernels.attention_kernel()  # built and checked here, whether or not faster than SDPA
needs_kernel = pytest.mark.skipif(
    NATIVE is None, reason="the CPU attention kernel is not built here (no AVX512-BF16 or no g++)"
)
HAS_AMX = NATIVE is not None and kernels.uses_amx()


@pytest.fixture(params=["amx", "avx512-bf16"])
def isa(request):
    """Each instruction set the kernel can multiply with here, in turn (AMX only where present)."""
    if request.param == "amx" and not HAS_AMX:
        pytest.skip("no AMX on this CPU")
    torch.ops.plaserve_cpu.use_amx(request.param == "amx")
    yield request.param
    torch.ops.plaserve_cpu.use_amx(True)


def _run(q, k, v, q_lens, k_lens, scale, index=None):
    q_starts = torch.tensor([0, *q_lens]).cumsum(0)
    k_starts = torch.tensor([0, *k_lens]).cumsum(0)
    out = torch.full_like(q, float("nan"))
    index = torch.arange(k.shape[0]) if index is None else index
    NATIVE(q, k, v, out, q_starts, index, k_starts, scale)
    return out


def _assert_equals_reference(q, k, v, q_lens, k_lens, scale):
    got = _run(q, k, v, q_lens, k_lens, scale)
    q_starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    k_starts = [0, *torch.tensor(k_lens).cumsum(0).tolist()]
    want = kernels.reference_attention(q, k, v, q_starts, k_starts, scale)
    # bfloat16 output: one rounding step of values of magnitude ~1 is 2^-7
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)


@needs_kernel
@pytest.mark.parametrize(
    "heads, kv_heads, dim",
    # GQA groups of 1-32: decode rows of groups up to 16 read K/V in place on AMX, larger ones pack;
    # without AMX, decode rows of groups 5-7 end in value tiles of 5-7 rows
    [
        *[(4, 2, 16), (8, 2, 32), (8, 2, 64), (14, 2, 64), (4, 4, 128), (8, 1, 128), (32, 1, 64)],
        *[(10, 2, 16), (12, 2, 64), (14, 2, 32)],
    ],
)
@pytest.mark.parametrize(
    "lens",
    [
        [(1, 1)],
        [(5, 5), (33, 33), (200, 200)],  # fresh prompts: partial and several key blocks
        [(7, 300), (1, 17), (64, 64), (1, 1)],  # a chunk after a prefix, decode rows
        [(129, 257)],  # a query block boundary and a key block boundary
        [(1, 40)] * 6 + [(1, 300)] * 3,  # decode rows enough to take all K/V heads an item
    ],
)
def test_kernel_equals_sdpa(heads, kv_heads, dim, lens, isa):
    gen = torch.Generator().manual_seed(0)
    q_lens, k_lens = [a for a, _ in lens], [b for _, b in lens]
    q = torch.randn(sum(q_lens), heads, dim, generator=gen).bfloat16()
    # K and V as strided views of one tensor, as the fused qkv projection leaves them.
    kv = torch.randn(sum(k_lens), 2 * kv_heads, dim, generator=gen).bfloat16()
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]
    _assert_equals_reference(q, k, v, q_lens, k_lens, dim**-0.5)


@needs_kernel
@pytest.mark.parametrize("spread", [30.0, 300.0])
def test_kernel_equals_sdpa_on_scores_far_apart(spread, isa):
    """Scores hundreds apart, as outlier activations make them: most keys' probabilities fall below
    the smallest normal float (the kernel flushes them to zero rather than computing with subnormals,
    which is slow), and the row maximum rises block after block (the lazy rescale)."""
    gen = torch.Generator().manual_seed(1)
    q_lens, k_lens = [129, 1, 40], [257, 300, 40]
    q = (torch.randn(sum(q_lens), 8, 64, generator=gen) * spread).bfloat16()
    kv = torch.randn(sum(k_lens), 4, 64, generator=gen).bfloat16()
    k, v = kv[:, :2], kv[:, 2:]
    _assert_equals_reference(q, k, v, q_lens, k_lens, 0.125)


@needs_kernel
def test_the_callers_subnormals_survive_a_call(isa):
    """The kernel flushes subnormals on its threads while it runs, and gives them back as it found
    them: float arithmetic after a call still makes subnormal numbers."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(40, 8, 64, generator=gen).bfloat16()
    kv = torch.randn(40, 4, 64, generator=gen).bfloat16()
    _run(q, kv[:, :2], kv[:, 2:], [40], [40], 0.125)
    tiny = torch.tensor([1e-40], dtype=torch.float32)  # below 2^-126: subnormal
    assert (tiny * 0.5).item() != 0.0 and (tiny + 0.0).item() != 0.0


@needs_kernel
@pytest.mark.parametrize(
    "lens",
    [
        [(1, 64)] * 16,  # a small decode batch: below the work that is shared between threads
        [(129, 257), (1, 300), (40, 40)],  # enough work for every thread
    ],
)
def test_the_result_does_not_depend_on_the_threads(lens, isa):
    """A call gives the same bits on one thread as on two, whether its work is small enough to stay on
    the calling thread or is shared: every (sequence, K/V head, query block) is one thread's alone."""
    gen = torch.Generator().manual_seed(3)
    q_lens, k_lens = [a for a, _ in lens], [b for _, b in lens]
    q = torch.randn(sum(q_lens), 14, 64, generator=gen).bfloat16()
    kv = torch.randn(sum(k_lens), 4, 64, generator=gen).bfloat16()
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(_run(q, kv[:, :2], kv[:, 2:], q_lens, k_lens, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1])


@needs_kernel
def test_kernel_reads_keys_through_the_index(isa):
    """Keys gathered through ``k_index`` (cache slots in any order) equal the same keys in place."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(10, 8, 64, generator=gen).bfloat16()
    k, v = torch.randn(2, 90, 2, 64, generator=gen).bfloat16()
    perm = torch.randperm(90, generator=gen)
    scattered_k, scattered_v = torch.empty_like(k), torch.empty_like(v)
    scattered_k[perm], scattered_v[perm] = k, v
    in_place = _run(q, k, v, [10], [90], 0.125)
    through = _run(q, scattered_k, scattered_v, [10], [90], 0.125, index=perm)
    assert torch.equal(in_place, through)


@needs_kernel
def test_decode_rows_read_through_a_scattered_index(isa):
    """Decode rows (one query token each) whose keys sit in cache blocks of 16 slots in any order, as
    the paged cache holds them (runs of 16 contiguous slots), one run broken by two swapped slots,
    with short and long contexts: equal to the same keys in place, and to SDPA."""
    gen = torch.Generator().manual_seed(3)
    k_lens = [1, 15, 16, 17, 300, 1000]
    q = torch.randn(len(k_lens), 14, 64, generator=gen).bfloat16()
    k, v = torch.randn(2, sum(k_lens), 2, 64, generator=gen).bfloat16()
    blocks = torch.randperm(sum(-(-n // 16) for n in k_lens) + 8, generator=gen).tolist()
    index = []
    for n in k_lens:
        table, blocks = blocks[: -(-n // 16)], blocks[-(-n // 16) :]
        index.append((torch.tensor(table)[:, None] * 16 + torch.arange(16)).flatten()[:n])
    index = torch.cat(index)
    index[[400, 410]] = index[[410, 400]]
    cache_k, cache_v = (torch.zeros(int(index.max()) + 1, 2, 64).bfloat16() for _ in range(2))
    cache_k[index], cache_v[index] = k, v
    q_lens = [1] * len(k_lens)
    in_place = _run(q, k, v, q_lens, k_lens, 0.125)
    through = _run(q, cache_k, cache_v, q_lens, k_lens, 0.125, index=index)
    torch.testing.assert_close(through.float(), in_place.float(), atol=0, rtol=0)
    q_starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    k_starts = [0, *torch.tensor(k_lens).cumsum(0).tolist()]
    want = kernels.reference_attention(q, k, v, q_starts, k_starts, 0.125)
    torch.testing.assert_close(through.float(), want.float(), atol=2e-2, rtol=0)


@needs_kernel
def test_calls_of_growing_contexts_equal_sdpa(isa):
    """Calls one after another whose keys outgrow what the calls before them needed (each thread keeps
    its scratch from call to call, and grows it): decode rows and a short chunk over 64, then 3,000,
    then 700 keys, each call equal to SDPA."""
    gen = torch.Generator().manual_seed(4)
    for k_len in (64, 3000, 700):
        q_lens, k_lens = [1, 1, 20], [k_len, k_len // 2, k_len]
        q = torch.randn(sum(q_lens), 14, 64, generator=gen).bfloat16()
        kv = torch.randn(sum(k_lens), 4, 64, generator=gen).bfloat16()
        k, v = kv[:, :2], kv[:, 2:]
        _assert_equals_reference(q, k, v, q_lens, k_lens, 0.125)


BLOCKS, BLOCK, HEADS, KV_HEADS, DIM = 96, 16, 8, 2, 64


@needs_kernel
def test_attention_uses_the_kernel_on_a_mixed_batch(monkeypatch, isa):
    """A batch of a fresh prompt, a chunk after its cached prefix, a padded block and decode rows: the
    kernel's one call per layer gives SDPA's outputs, and writes the same cache."""
    monkeypatch.setattr("plaserve.model.attention.varlen_attention", lambda: NATIVE)
    gen = torch.Generator().manual_seed(2)
    perm = (torch.randperm(BLOCKS - 1, generator=gen) + 1).tolist()
    taken = 0

    def blocks(n: int) -> list[int]:
        nonlocal taken
        taken += -(-n // BLOCK)
        return perm[taken - -(-n // BLOCK) : taken]

    def slots(table: list[int], first: int, last: int) -> torch.Tensor:
        pos = torch.arange(first, last)
        return torch.tensor(table)[pos // BLOCK] * BLOCK + pos % BLOCK

    kc = torch.randn(BLOCKS, BLOCK, KV_HEADS, DIM, generator=gen).bfloat16()
    vc = torch.randn(BLOCKS, BLOCK, KV_HEADS, DIM, generator=gen).bfloat16()
    fresh, (cached, chunk) = 45, (70, 30)
    t_fresh, t_chunk = blocks(fresh), blocks(cached + chunk)
    padded_b, padded_n = 2, 16
    t_pad = [blocks(padded_n) for _ in range(padded_b)]
    decode_lens = [33, 5, 1]
    t_dec = [blocks(n) for n in decode_lens]
    width = max(len(t) for t in t_dec)
    slot_mapping = torch.cat(
        [
            slots(t_fresh, 0, fresh),
            slots(t_chunk, cached, cached + chunk),
            *(slots(t, 0, padded_n) for t in t_pad),
            *(slots(t, n - 1, n) for t, n in zip(t_dec, decode_lens)),
        ]
    )
    total = slot_mapping.shape[0]

    def meta() -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            prefill=[
                PrefillSeq(0, fresh, 0, None),
                PrefillSeq(fresh, chunk, cached, torch.tensor(t_chunk)),
            ],
            num_prefill_tokens=fresh + chunk,
            padded_shape=(padded_b, padded_n),
            decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in t_dec]),
            decode_context_lens=torch.tensor(decode_lens),
        )

    q = torch.randn(total, HEADS, DIM, generator=gen).bfloat16()
    k, v = torch.randn(2, total, KV_HEADS, DIM, generator=gen).bfloat16()
    caches = [(kc.clone(), vc.clone()) for _ in range(2)]
    got = attention(q, k, v, caches[0], meta(), DIM**-0.5)
    monkeypatch.setattr("plaserve.model.attention.varlen_attention", lambda: None)
    want = attention(q, k, v, caches[1], meta(), DIM**-0.5)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)


def _clear_caches() -> None:
    kernels.attention_kernel.cache_clear()
    kernels.varlen_attention.cache_clear()
    kernels.elementwise.cache_clear()
    kernels.token_mask.cache_clear()
    kernels.row_split_mm.cache_clear()


def test_no_compiler_no_kernel(monkeypatch, caplog):
    _clear_caches()
    try:
        monkeypatch.setattr(kernels, "cpu_bf16_support", lambda: "AVX512-BF16")
        monkeypatch.setattr(kernels, "_compiler", lambda: None)
        with caplog.at_level(logging.INFO, logger="plaserve.model.kernels"):
            assert kernels.varlen_attention() is None
            assert kernels.elementwise() is None
            assert kernels.row_split_mm() is None
        assert "no C++ compiler" in caplog.text
        _clear_caches()
        monkeypatch.setattr(kernels, "cpu_bf16_support", lambda: None)
        assert kernels.varlen_attention() is None and kernels.elementwise() is None
        _clear_caches()
        monkeypatch.setenv("PLASERVE_NATIVE_KERNELS", "0")
        assert kernels.varlen_attention() is None and kernels.elementwise() is None
    finally:
        _clear_caches()


def test_a_failing_build_falls_back_to_sdpa(monkeypatch, tmp_path, caplog):
    """A compiler that fails (here: not a C++ compiler at all) leaves SDPA, with one warning."""
    _clear_caches()
    try:
        monkeypatch.setenv("PLASERVE_CACHE", str(tmp_path))
        monkeypatch.setattr(kernels, "cpu_bf16_support", lambda: "AVX512-BF16")
        monkeypatch.setattr(kernels, "_compiler", lambda: "false")
        with caplog.at_level(logging.WARNING, logger="plaserve.model.kernels"):
            assert kernels.varlen_attention() is None
            assert kernels.elementwise() is None
        assert caplog.text.count("not built") == 2
        assert not list((tmp_path / "kernels").glob("*.so"))
    finally:
        _clear_caches()


@needs_kernel
def test_a_compiler_without_amx_builds_the_kernel_without_it(monkeypatch, caplog):
    """Where the AMX flags fail to build, the attention kernel is built again without them."""
    real_build, tried = kernels._build, []

    def build(compiler, source, flags=()):
        tried.append(flags)
        if flags:
            raise RuntimeError("unrecognized command-line option '-mamx-tile'")
        return real_build(compiler, source, kernels.AMX_FLAGS)  # the library already built here

    _clear_caches()
    try:
        monkeypatch.setattr(kernels, "_build", build)
        with caplog.at_level(logging.INFO, logger="plaserve.model.kernels"):
            assert kernels.attention_kernel() is not None
        assert tried == [kernels.AMX_FLAGS, ()]
        assert (
            "no build with -mamx-tile -mamx-bf16" in caplog.text and "not built" not in caplog.text
        )
    finally:
        _clear_caches()


@needs_kernel
def test_the_kernel_source_builds_without_the_amx_flags(monkeypatch, tmp_path):
    """The fallback build (a compiler without AMX support) compiles for real: the AVX512-BF16 paths
    must not depend on the AMX section. Built into a scratch cache, not loaded (the namespace is
    registered already), at -O0: whether it compiles and links is the question, in half -O3's time."""
    monkeypatch.setenv("PLASERVE_CACHE", str(tmp_path))
    built = kernels._build(kernels._compiler(), kernels.HERE / "varlen_attention.cpp", ("-O0",))
    assert built.exists() and built.parent == tmp_path / "kernels"

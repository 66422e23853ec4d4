"""Building blocks of a Llama-family decoder: RMSNorm, rotary embeddings, SwiGLU MLP, GQA attention.

Parameter names match Hugging Face's so checkpoints load by name.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plaserve.model import kernels
from plaserve.model.attention import AttentionMetadata, QueryRows, attention, write_kv
from plaserve.model.config import ModelConfig
from plaserve.model.fused import FusedKernels, rms_norm

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 like the reference implementation (the
    arithmetic is :func:`plaserve.model.fused.rms_norm`; a decoder layer fuses it with the residual add
    before it)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with llama3 or linear scaling applied."""
    # float32 throughout, as the reference implementation computes it: positions times these
    # frequencies reach thousands of radians, so rounding differences would show in the logits.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, blended, out)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (half-split layout) with a precomputed cos/sin table."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        """The table is computed on the CPU (``Module.to`` moves it), also where the model is built
        on the meta device, as the loader builds it: arithmetic on meta tensors imports
        torch._dynamo, a second of every server's start-up."""
        super().__init__()
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(head_dim, theta, scaling)
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(cos, sin)`` rows of ``positions``, ``[T, 1, D/2]`` each: looked up once per forward
        pass and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def _can_prepack() -> bool:
    """Whether this torch build has oneDNN's prepacked linear (its CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def _packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# The float32 probes of :func:`prepacked_rows`: rows x ``[in, out]`` of a decode-sized multiply and of
# a prefill-sized one (~20 ms and ~80 ms, once a process).
F32_PROBE_DECODE = (16, 1024, 4096)
F32_PROBE_PREFILL = (1024, 1024, 1024)


def _best_times(ways: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Each of ``ways`` timed in turn, ``rounds`` times, the first round only a warm-up (alternating,
    so that a slow spell of the machine falls on all of them): the best seconds of each."""
    best = dict.fromkeys(ways, math.inf)
    for round_ in range(rounds):
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            if round_:
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def _packed_speedup(rows: int, k: int, n: int) -> float:
    """How many times faster a ``rows`` x ``[k, n]`` float32 multiply runs by oneDNN's packed copy of
    the weight than by the plain transposed one (MKL's): alternating, best of 5 after a warm-up."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    plain, packed = weight.t().contiguous(), _reorder(weight)
    best = _best_times(
        {"plain": lambda: x @ plain, "packed": lambda: _packed_linear(x, packed, None)}, rounds=6
    )
    return best["plain"] / best["packed"]


@functools.cache
def prepacked_rows(dtype: torch.dtype) -> int:
    """The largest step, in rows, that multiplies by a copy of each weight prepacked in oneDNN's
    blocked layout on this CPU, in ``dtype``; 0: no packed copy.

    In half precision wherever oneDNN can pack it (CPUs with AVX512-BF16 / AMX / AVX-NE-CONVERT;
    elsewhere these dtypes are emulated and slow anyway), steps of up to
    ``Projection.PACKED_MAX_ROWS_HALF`` rows: by any plain layout oneDNN repacks the whole weight on
    every call, which for a decode batch costs more than the multiplication. In float32 the plain
    transposed layout goes to MKL, whose speed depends on the CPU: on an AVX2 AMD EPYC oneDNN's packed
    layout was 1.2-2.5x faster at 16-64 rows, on an AVX-512 AMD EPYC (Zen 5) 2-3x at every size, on
    an Intel Xeon MKL ran long prefills faster (docs/BENCHMARKS.md). So both ways are timed once a
    process, a decode-sized multiply and, where the packed copy wins that by 10 %, a prefill-sized one:
    none, steps of up to ``Projection.PACKED_MAX_ROWS`` rows, or every step
    (``Projection.PACKED_EVERY_STEP``) take the packed copy.
    """
    if not _can_prepack():
        return 0
    if dtype != torch.float32:
        try:  # oneDNN packs half precision only on CPUs that convert it in hardware
            _reorder(torch.zeros(32, 32, dtype=dtype))
        except RuntimeError as e:
            log.info("no packed %s weights on this CPU: %s", dtype, e)
            return 0
        return Projection.PACKED_MAX_ROWS_HALF
    decode, prefill, rows, uses = _packed_speedup(*F32_PROBE_DECODE), None, 0, "no packed copies"
    if decode > 1 / 0.9:
        prefill = _packed_speedup(*F32_PROBE_PREFILL)
        if prefill > 1 / 0.9:
            rows, uses = Projection.PACKED_EVERY_STEP, "every step uses packed copies"
        else:
            rows, uses = Projection.PACKED_MAX_ROWS, "decode-sized steps use packed copies"
    log.info(
        "float32 weights: oneDNN's packed layout ran %.2fx MKL's plain one at %d rows%s: %s",
        decode,
        F32_PROBE_DECODE[0],
        "" if prefill is None else f", {prefill:.2f}x at {F32_PROBE_PREFILL[0]}",
        uses,
    )
    return rows


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[out, in]``) in oneDNN's blocked layout for steps of about ``PACK_ROWS_HINT``
    rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, Projection.PACK_ROWS_HINT)


# Row counts at which a weight's plain matmul is timed against the row-split one (each stands for the
# row counts above the one before it).
SPLIT_PROBE_ROWS = (384, 512, 768, 1024, 1536, 2048)
# Multiplies that take longer keep the threads busy by themselves; timing larger ones only costs
# start-up time (an untimed row count takes the plain matmul).
SPLIT_PROBE_MAX_SECONDS = 0.02


@functools.cache
def row_split_span(k: int, n: int, dtype: torch.dtype, threads: int) -> tuple[int, int]:
    """Row counts ``(lo, hi]`` at which an ``[M, k] x [k, n]`` matmul in ``dtype`` is faster with its
    rows split between the ``threads`` threads (:func:`plaserve.model.kernels.row_split_mm`) than as one
    oneDNN call; ``(0, 0)``: never.

    oneDNN's own split of a call between threads depends on the shape, and for some row counts it
    leaves threads idle (docs/BENCHMARKS.md, "Rows split between threads"), which no static rule
    predicts across CPUs and shapes. So each weight shape is timed once a process, both ways at each of
    ``SPLIT_PROBE_ROWS`` (alternating, best of 4; up to the first point where one plain call takes
    ``SPLIT_PROBE_MAX_SECONDS``), and the split is used over the first run of probe points where it
    wins by 10 %: a probe point stands for the row counts above the point before it.
    """
    op = kernels.row_split_mm()
    if op is None or threads < 2:
        return 0, 0
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(k, n, generator=gen).to(dtype)
    wins = []
    with torch.inference_mode():
        for rows in SPLIT_PROBE_ROWS:
            x = torch.randn(rows, k, generator=gen).to(dtype)
            best = _best_times(
                {"plain": lambda: x @ w, "split": lambda: op(x, w, threads)}, rounds=5
            )
            wins.append(best["split"] < 0.9 * best["plain"])
            if best["plain"] > SPLIT_PROBE_MAX_SECONDS:
                break  # a multiply this large keeps the threads busy: the larger ones are not timed
    if not any(wins):
        return 0, 0
    first = wins.index(True)
    last = first + (wins[first:] + [False]).index(False) - 1
    lo = SPLIT_PROBE_ROWS[first - 1] if first else 0
    log.debug(
        "%s [M, %d] x [%d, %d]: rows split between threads for %d < M <= %d",
        dtype,
        k,
        k,
        n,
        lo,
        SPLIT_PROBE_ROWS[last],
    )
    return lo, SPLIT_PROBE_ROWS[last]


class Projection:
    """One or more ``nn.Linear`` layers that read the same input, run as a single matmul (one wide GEMM
    is faster than several narrow ones); their parameters become views of the fused weight. Build it
    once the weights are final and on their device.

    On CPU the fused weight is stored transposed (``[in, out]``, contiguous): MKL multiplies a few rows
    (a float32 decode batch) by that layout up to twice as fast as by the ``[out, in]`` one ``F.linear``
    hands it, and long prefills as fast. Steps of up to ``max_packed_rows`` rows multiply by a second
    copy, packed once (these weights then take twice their size): in bfloat16 on CPUs with
    AVX512-BF16, in the layout of :func:`plaserve.model.kernels.packed_linear` (faster than oneDNN's
    on decode-sized steps, and without AMX faster than MKL's on prefills too, docs/BENCHMARKS.md);
    elsewhere, where :func:`prepacked_rows` finds it pays (bfloat16 / float16 wherever oneDNN can
    pack them; float32 where a probe finds it faster on this CPU, for every step where it wins at
    prefill sizes too), in oneDNN's blocked layout (``mkldnn._linear_pointwise``). Larger steps whose
    row count lies in :func:`row_split_span` multiply with their rows split between the threads.
    Elsewhere the weight stays as ``nn.Linear`` stores it, through ``F.linear``. Where the packed copy
    takes every step, the plain weight is not kept at all: the linears' parameters become meta tensors
    of their shapes (nothing multiplies by them), and the weights take their size once, not twice.

    ``shared``: one linear whose weight another module reads too (an LM head tied to the embedding
    table): its weight keeps its layout, and only the packed copy is added. ``split_rows``: whether to
    time the row split for this weight at all (an LM head multiplies only the rows that sample: few).
    ``swiglu``: the linears are an MLP's gate and up; where plaserve's packed linear takes the step,
    :meth:`swiglu` gives ``silu(gate) * up`` from the products themselves (the packed copy is laid out
    for that, so the plain product then always takes the weight as ``nn.Linear`` keeps it).
    """

    # Rows oneDNN is told to expect when it picks the packed layout: a decode batch.
    PACK_ROWS_HINT = 16
    # Larger steps use the plain transposed weight: by the packed one, a long prefill runs slower, in
    # float32 where MKL is fast (prepacked_rows). In half precision the packed one still wins up to 512
    # rows (docs/BENCHMARKS.md, "Native CPU kernels").
    PACKED_MAX_ROWS = 256
    PACKED_MAX_ROWS_HALF = 512
    # float32 where oneDNN's packed layout beats MKL at prefill sizes too (prepacked_rows): no limit.
    PACKED_EVERY_STEP = sys.maxsize
    # Without AMX, plaserve's packed linear beat MKL's matmul by the plain weight at every row count
    # measured, 128-4,096 (docs/BENCHMARKS.md, "The night of 2026-12-04 (21:56-)"), and ran level
    # with it at 8,192: it takes every step, in calls of at most this many rows. Larger calls ran
    # slower (16,384 rows of Qwen2.5-0.5B's q|k|v: 809 against 1,002 GFLOP/s at 8,192), each group of
    # outputs streaming every row of x again once x outgrows the cache. With AMX it keeps the
    # half-precision limit above.
    VNNI_CALL_ROWS = 4096

    def __init__(
        self,
        linears: list[nn.Linear],
        shared: bool = False,
        split_rows: bool = True,
        swiglu: bool = False,
    ) -> None:
        assert not shared or len(linears) == 1
        with torch.no_grad():
            if shared:
                lin = linears[0]
                weight, bias = lin.weight.detach(), None if lin.bias is None else lin.bias.detach()
            else:
                weight = torch.cat([lin.weight for lin in linears])
                bias = (
                    torch.cat([lin.bias for lin in linears])
                    if linears[0].bias is not None
                    else None
                )
            on_cpu = weight.device.type == "cpu"
            self.transposed = on_cpu and not shared
            own = kernels.packed_linear() if on_cpu and weight.dtype == torch.bfloat16 else None
            self.packed: torch.Tensor | None = None
            self._packed_call: Callable[[torch.Tensor], torch.Tensor] | None = None
            self._swiglu_call: Callable[[torch.Tensor], torch.Tensor] | None = None
            self.max_packed_rows = (
                self.PACKED_MAX_ROWS if weight.dtype == torch.float32 else self.PACKED_MAX_ROWS_HALF
            )
            # Steps of up to this many rows run in plaserve's packed linear, which, unlike oneDNN,
            # builds no kernel per row count (0: none do).
            self.shape_free_rows = 0
            # The most rows one call of the packed copy takes (VNNI_CALL_ROWS)
            self.call_rows = sys.maxsize
            if own is not None and own.fits(weight):
                n = weight.shape[0]
                if swiglu and bias is None and n % 32 == 0:
                    packed = own.pack(own.interleaved(weight.contiguous()))
                    self._swiglu_call = lambda x: own.swiglu(x, packed, n)
                else:
                    packed = own.pack(weight.contiguous())
                    self._packed_call = lambda x: own.linear(x, packed, bias, n)
                self.packed = packed
                if own.isa != "AMX":
                    self.max_packed_rows, self.call_rows = (
                        self.PACKED_EVERY_STEP,
                        self.VNNI_CALL_ROWS,
                    )
                self.shape_free_rows = self.max_packed_rows
            elif on_cpu and (rows := prepacked_rows(weight.dtype)):
                packed = _reorder(weight)
                self.packed, self._packed_call = packed, lambda x: _packed_linear(x, packed, bias)
                self.max_packed_rows = rows
            # The plain weight, unless the packed copy takes every step (a shared one is another
            # module's: it stays whatever this projection does).
            plain = shared or self.packed is None or self.max_packed_rows < self.PACKED_EVERY_STEP
            if not plain:
                self.transposed = False
                for lin in linears:
                    lin.weight = nn.Parameter(
                        torch.empty_like(lin.weight, device="meta"), requires_grad=False
                    )
                weight = None
            elif self.transposed:
                weight = weight.t().contiguous()
            # (0, 0): never. Not timed where the packed copy takes every row count the split could.
            split = split_rows and self.max_packed_rows < SPLIT_PROBE_ROWS[-1]
            self.split_span = (
                row_split_span(*weight.shape, weight.dtype, torch.get_num_threads())
                if weight is not None and self.transposed and split
                else (0, 0)
            )
            start = 0
            # A shared weight keeps its layout: no linear's weight to re-point at the fused one.
            for lin in [] if shared or weight is None else linears:
                rows = lin.weight.shape[0]
                lin.weight.data = (
                    weight[:, start : start + rows].t()
                    if self.transposed
                    else weight[start : start + rows]
                )
                if bias is not None:
                    lin.bias.data = bias[start : start + rows]
                start += rows
        # None where the packed copy takes every step
        self.weight: torch.Tensor | None = weight
        self.bias = bias

    def _packed_takes(self, x: torch.Tensor) -> bool:
        if self.weight is None:
            return True
        return x.shape[0] <= self.max_packed_rows and x.dim() == 2 and x.stride(-1) == 1

    def _packed(
        self, call: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        """``call`` (a product by the packed copy) on ``x``, in calls of at most ``call_rows`` rows;
        where no plain weight could take it instead, ``x`` as the packed copy takes it first:
        ``[rows, in]``, each row contiguous."""
        if x.dim() != 2 or x.stride(-1) != 1:
            return self._packed(call, x.reshape(-1, x.shape[-1]).contiguous()).view(
                *x.shape[:-1], -1
            )
        if x.shape[0] <= self.call_rows:
            return call(x)
        return torch.cat([call(part) for part in x.split(self.call_rows)])

    def swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of this gate-and-up projection (built with ``swiglu``) in one pass,
        where its packed copy takes ``x``; else None (multiply, then the elementwise SwiGLU)."""
        if self._swiglu_call is not None and self._packed_takes(x):
            return self._packed(self._swiglu_call, x)
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed_call is not None and self._packed_takes(x):
            return self._packed(self._packed_call, x)
        if not self.transposed:
            return nn.functional.linear(x, self.weight, self.bias)
        lo, hi = self.split_span
        if lo < x.shape[0] <= hi and x.dim() == 2:
            out = kernels.row_split_mm()(x, self.weight, torch.get_num_threads())
        else:
            out = x @ self.weight
        return out if self.bias is None else out.add_(self.bias)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

        self.gate_up: Projection | None = None  # gate and up as one matmul, see fuse()
        self.down: Projection | None = None

    def fuse(self) -> None:
        """Run gate and up as one matmul, and every projection in its fastest layout (:class:`Projection`)."""
        self.gate_up, self.down = (
            Projection([self.gate_proj, self.up_proj], swiglu=True),
            Projection([self.down_proj]),
        )

    def forward(self, x: torch.Tensor, kernels: FusedKernels) -> torch.Tensor:
        if self.gate_up is None or self.down is None:
            return self.down_proj(
                kernels.silu_mul(torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1))
            )
        act = self.gate_up.swiglu(x)
        if act is None:
            act = kernels.silu_mul(self.gate_up(x))
        return self.down(act)


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=cfg.o_bias)
        self.scale = self.head_dim**-0.5
        self.qkv: Projection | None = None  # q, k and v as one matmul, see fuse()
        self.q: Projection | None = None  # or q apart from k and v (fuse's split_q)
        self.kv: Projection | None = None
        self.o: Projection | None = None

    def fuse(self, split_q: bool = False) -> None:
        """Run the q, k and v projections as one matmul, and every projection in its fastest layout.
        ``split_q``: q as one matmul and k and v as another, for a layer whose queries may be fewer
        rows than its keys (the final layer's: see :meth:`forward`'s ``queries``)."""
        if split_q:
            self.q, self.kv = Projection([self.q_proj]), Projection([self.k_proj, self.v_proj])
        else:
            self.qkv = Projection([self.q_proj, self.k_proj, self.v_proj])
        self.o = Projection([self.o_proj])

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        meta: AttentionMetadata,
        kernels: FusedKernels,
        queries: QueryRows | None = None,
    ) -> torch.Tensor:
        """The attention block's output for ``x`` ``[T, hidden]``: ``[T, hidden]``, or with ``queries``
        only their rows' ``[N, hidden]`` (the keys and values, which the cache keeps, still of every
        row)."""
        t, h, hk, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if queries is None and self.qkv is not None:
            qkv = self.qkv(x)
            qk, v = qkv[:, : (h + hk) * d].view(t, h + hk, d), qkv[:, (h + hk) * d :].view(t, hk, d)
            # q and k sit side by side in the fused output: rotate them in one pass.
            q, k = kernels.rotary(qk, *rope).split([h, hk], dim=1)
            o = attention(q, k, v, kv_cache, meta, self.scale)
        else:
            k, v = self._keys_values(x, rope, kernels)
            if queries is not None:
                x = x.index_select(0, queries.rows)
                rope = (
                    rope[0].index_select(0, queries.rows),
                    rope[1].index_select(0, queries.rows),
                )
            q = (self.q(x) if self.q is not None else self.q_proj(x)).view(x.shape[0], h, d)
            q = kernels.rotary(q, *rope)
            o = attention(
                q, k, v, kv_cache, meta, self.scale, None if queries is None else queries.meta
            )
        o = o.view(o.shape[0], -1)
        return self.o(o) if self.o is not None else self.o_proj(o)

    def _keys_values(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kernels: FusedKernels
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``'s keys (rotated) and values, ``[T, Hk, D]`` each, without its queries."""
        t, hk, d = x.shape[0], self.num_kv_heads, self.head_dim
        kv = self.kv(x) if self.kv is not None else torch.cat([self.k_proj(x), self.v_proj(x)], 1)
        return kernels.rotary(kv[:, : hk * d].view(t, hk, d), *rope), kv[:, hk * d :].view(t, hk, d)

    def store_keys_values(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kernels: FusedKernels,
    ) -> None:
        """Only write ``x``'s keys and values into the cache: a final layer whose rows none sample."""
        write_kv(*kv_cache, *self._keys_values(x, rope, kernels), meta.slot_mapping)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block. It takes and returns the hidden states with the residual stream
    beside them, the residual add not yet done: each norm runs fused with the add before it."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        meta: AttentionMetadata,
        kernels: FusedKernels,
        queries: QueryRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sublayer output, residual)`` after this block, for ``x`` and ``residual`` before it
        (``residual`` None: ``x`` is the embedding, the first block's input). ``queries``: only their
        rows come out (the block's keys and values still go into the cache for every row)."""
        norm = self.input_layernorm
        if residual is None:
            h, residual = norm(x), x
        else:
            h, residual = kernels.add_rms_norm(x, residual, norm.weight, norm.eps)
        if queries is not None:
            residual = residual.index_select(0, queries.rows)
            if not len(queries.rows):
                assert kv_cache is not None, "queries read their keys from the cache"
                self.self_attn.store_keys_values(h, rope, kv_cache, meta, kernels)
                return residual, residual
        h = self.self_attn(h, rope, kv_cache, meta, kernels, queries)
        norm = self.post_attention_layernorm
        h, residual = kernels.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(h, kernels), residual

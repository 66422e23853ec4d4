"""The prefill cost model: predicted time to prefill ``n`` new tokens on top of ``h`` cached ones.

    E(n, h) = c0 + g1*n + g2*n*(h + n/2) + g3*h

``g1*n`` is the work linear in the tokens (projections, MLP, norms); ``g2*n*(h + n/2)`` is attention,
proportional to the query-key pairs a causal prefill visits; ``g3*h`` reads the cached K/V; ``c0`` is
a fixed per-call overhead (kernel launches, Python). With ``h = 0`` this is ``a*L + b*L^2``.

Until a measured profile exists the coefficients come from the model's FLOP counts and a matmul peak
measured on the device at start (:meth:`CostModel.from_flops`). For GPUs this machine does not have,
:func:`analytic_cost` estimates them from a described accelerator (the simulator's profiles).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from plaserve.model.config import ModelConfig

if TYPE_CHECKING:
    import numpy as np
    import torch


@dataclass(frozen=True)
class CostModel:
    """Predicts prefill seconds; every coefficient is in seconds per unit of work."""

    g1: float  # per new token
    g2: float  # per causal query-key pair
    g3: float = 0.0  # per cached token read
    c0: float = 0.0  # per call
    # "flops" (from FLOP counts), "warm-up" (those, with the per-step and per-token costs timed at
    # start-up: with_step_cost), "profile" (measured) or "online" (refitted)
    source: str = "flops"

    def prefill_time(self, n: int, h: int = 0) -> float:
        """Seconds to prefill ``n`` new tokens after ``h`` cached ones."""
        return self.c0 + self.g1 * n + self.g2 * n * (h + n / 2) + self.g3 * h

    def batch_time(self, work: list[tuple[int, int]]) -> float:
        """Seconds for one forward pass computing ``(n, h)`` (new, cached) tokens for each request.

        A decode is ``(1, context)``; a right-padded batch is its requests at the padded length.
        """
        return self.c0 + sum(self.prefill_time(n, h) - self.c0 for n, h in work)

    def as_dict(self) -> dict[str, float | str]:
        # Spelled out: ``dataclasses.asdict`` deep-copies, and load reports call this per poll.
        return {"g1": self.g1, "g2": self.g2, "g3": self.g3, "c0": self.c0, "source": self.source}

    @classmethod
    def from_flops(
        cls, cfg: ModelConfig, peak_flops: float, efficiency: float = 0.7
    ) -> "CostModel":
        """Coefficients from FLOP counts at ``efficiency`` times ``peak_flops`` (FLOP/s)."""
        rate = peak_flops * efficiency
        embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
        linear = 2 * (cfg.num_params - embed)  # FLOPs per token outside attention scores
        # QK^T and PV: 2 FLOPs per multiply-add each, over every head and layer.
        pair = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
        return cls(g1=linear / rate, g2=pair / rate, source="flops")


def with_step_cost(cost: CostModel, timings: dict[int, float]) -> CostModel:
    """``cost`` with its per-step cost ``c0`` and per-token cost ``g1`` fitted to ``timings`` (the
    seconds one forward pass took to prefill ``n`` tokens, by ``n``: the shortest and the longest are
    used), its attention and cache terms kept.

    The FLOP-count model has no per-step cost at all, yet on a CPU a step's fixed cost is worth ~100
    tokens of prefill (docs/POLICIES.md): until the online refit has its samples, pla would cut long
    prompts into smaller chunks than the refitted model picks and size its short batches by a step
    that seems free. Two timed forward passes at start-up give the first model both numbers.
    Where the longer pass was not slower (a noisy clock) ``g1`` stays the FLOP count's."""
    (n0, t0), (n1, t1) = min(timings.items()), max(timings.items())

    def linear(n: int, t: float) -> float:  # the time that is not attention
        return t - cost.g2 * n * n / 2

    g1 = (linear(n1, t1) - linear(n0, t0)) / (n1 - n0) if n1 > n0 else 0.0
    if g1 <= 0:
        g1 = cost.g1
    c0 = max(0.0, linear(n0, t0) - g1 * n0)
    return CostModel(g1=g1, g2=cost.g2, g3=cost.g3, c0=c0, source="warm-up")


# The most of a chunk's time its step's fixed cost (the cost model's ``c0``) may take.
CHUNK_OVERHEAD = 0.05


def chunk_size_for(
    cost: CostModel, short_threshold: int, max_tokens: int, max_seconds: float
) -> int:
    """Tokens per long-prefill chunk: from the short threshold, doubled while the step's fixed cost
    ``c0`` is over ``CHUNK_OVERHEAD`` of the chunk's predicted time and the doubled chunk is
    predicted within ``max_seconds`` (the tightest TTFT SLO, its floor: a short request that arrives
    as a chunk starts waits for all of it), at most ``max_tokens``. Smaller chunks let a short
    request in sooner, and the decodes riding each chunk get tokens more often; each chunk pays
    ``c0`` again. A model without a per-step cost (``c0`` = 0, as the FLOP-count model at start-up)
    gives the short threshold."""
    chunk = short_threshold
    while (
        chunk < max_tokens
        and cost.c0 > CHUNK_OVERHEAD * cost.prefill_time(chunk)
        and cost.prefill_time(min(2 * chunk, max_tokens)) <= max_seconds
    ):
        chunk *= 2
    return min(chunk, max_tokens)


def measure_peak_flops(
    device: "torch.device", dtype: "torch.dtype", size: int = 1024, seconds: float = 0.2
) -> float:
    """FLOP/s of a square matmul on ``device``: the peak that FLOP-based estimates are scaled by. On
    CPU the faster of torch's matmul and oneDNN's prepacked linear, which plaserve's projections use
    where it wins (in float32 on an AVX-512 AMD EPYC torch's matmul, MKL's, runs at under half its
    speed; model/layers.py: prepacked_rows)."""
    import torch  # here, so that the router and simulator import this module without torch

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    ways = peak_ways(a, b)
    return max(_flop_rate(way, device, 2 * size**3, seconds / len(ways)) for way in ways)


def peak_ways(a: "torch.Tensor", b: "torch.Tensor") -> list[Callable[[], object]]:
    """The ways to multiply the square ``a`` by ``b`` whose fastest is the peak: torch's matmul and,
    on CPU, oneDNN's prepacked linear where it packs ``b``'s dtype (benchmarks/engine_vs_hf.py times
    these too)."""
    ways: list[Callable[[], object]] = [lambda: a @ b]
    if a.device.type == "cpu":
        # here, not at the top: the router and simulator import this module without torch
        from plaserve.model.layers import _can_prepack, _packed_linear, _reorder

        try:
            packed = _reorder(b) if _can_prepack() else None
        except RuntimeError:  # a dtype oneDNN cannot pack on this CPU
            packed = None
        if packed is not None:
            ways.append(lambda: _packed_linear(a, packed, None))
    return ways


def _flop_rate(
    way: Callable[[], object], device: "torch.device", flops: float, seconds: float
) -> float:
    """FLOP/s of ``way`` (``flops`` a call), called for ``seconds`` after a warm-up call."""
    import torch

    way()  # warm-up
    n, start = 0, time.perf_counter()
    while True:
        way()
        n += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return flops * n / elapsed


# --- fitting ---------------------------------------------------------------------------------------

# (n new tokens, h cached tokens, measured seconds) of one prefill
Sample = tuple[float, float, float]
TERMS = ("c0", "g1", "g2", "g3")


def _features(n: float, h: float) -> list[float]:
    """The cost model's terms for one prefill, in ``TERMS`` order."""
    return [1.0, n, n * (h + n / 2), h]


def _nnls_relative(x: "np.ndarray", y: "np.ndarray") -> "np.ndarray | None":
    """Non-negative least squares minimising *relative* error (rows weighted by ``1/y``), so a 20 ms
    prefill counts as much as a 5 s one. With four unknowns at most, exact NNLS is cheap: solve ordinary
    least squares on every subset of the columns and keep the best all-non-negative solution."""
    import itertools

    import numpy as np

    w = 1.0 / np.maximum(y, 1e-9)
    xw, yw = x * w[:, None], y * w
    best, best_err = None, float("inf")
    cols = x.shape[1]
    for k in range(1, cols + 1):
        for subset in itertools.combinations(range(cols), k):
            coef, *_ = np.linalg.lstsq(xw[:, subset], yw, rcond=None)
            if (coef < 0).any():
                continue
            err = float(((xw[:, subset] @ coef - yw) ** 2).sum())
            if err < best_err:
                best_err, best = err, np.zeros(cols)
                best[list(subset)] = coef
    return best


def _model(coef: "np.ndarray", terms: tuple[str, ...], source: str) -> CostModel:
    values = dict.fromkeys(TERMS, 0.0) | {t: float(c) for t, c in zip(terms, coef)}
    return CostModel(
        g1=values["g1"], g2=values["g2"], g3=values["g3"], c0=values["c0"], source=source
    )


def fit(
    samples: list[Sample], terms: tuple[str, ...] = TERMS, source: str = "profile"
) -> CostModel:
    """Non-negative least-squares fit of the terms ``terms`` to ``(n, h, seconds)`` samples."""
    import numpy as np

    if not samples:
        raise ValueError("no samples to fit")
    cols = [TERMS.index(t) for t in terms]
    x = np.array([[_features(n, h)[c] for c in cols] for n, h, _ in samples])
    coef = _nnls_relative(x, np.array([t for _, _, t in samples]))
    if coef is None:
        raise ValueError("no non-negative fit exists for these samples")
    return _model(coef, terms, source)


def fit_quality(model: CostModel, samples: list[Sample]) -> dict[str, float]:
    """Mean absolute percentage error and R^2 of ``model`` on ``samples``."""
    import numpy as np

    y = np.array([t for _, _, t in samples])
    p = np.array([model.prefill_time(int(n), int(h)) for n, h, _ in samples])
    ss_res, ss_tot = float(((y - p) ** 2).sum()), float(((y - y.mean()) ** 2).sum())
    return {
        "mape": float(np.mean(np.abs(p - y) / y)),
        "r2": 1 - ss_res / ss_tot if ss_tot > 0 else 1.0,
        "n": len(samples),
    }


class StepTimeRatio:
    """Measured over predicted time of the engine's recent steps, every kind, over a sliding window.

    How well the cost model in use describes the machine now: 1.0 exactly, 1.2 when steps take 20 %
    longer than predicted (a noisy neighbour, a profile from another setting). Reported by ``/load``.
    """

    def __init__(self, window: int = 256) -> None:
        self.pairs: deque[tuple[float, float]] = deque()
        self.window = window
        self.predicted = self.measured = 0.0  # running sums over the window

    def observe(self, predicted: float, measured: float) -> None:
        if predicted <= 0:
            return
        self.pairs.append((predicted, measured))
        self.predicted += predicted
        self.measured += measured
        if len(self.pairs) > self.window:
            p, m = self.pairs.popleft()
            self.predicted -= p
            self.measured -= m

    @property
    def ratio(self) -> float | None:
        """Sum of measured over sum of predicted seconds in the window (None before any step)."""
        return self.measured / self.predicted if self.pairs else None


class OnlineCostModel:
    """Refits the cost model on the engine's own recent prefills (a sliding window).

    One observation is one engine step that prefilled ``(n, h)`` for each of its requests in some
    seconds; its features are the per-request terms summed (the step pays ``c0`` once). Every
    ``refit_every`` observations the model is refitted on the last ``window``; until enough exist, or
    when a fit is degenerate (e.g. every step the same size), the current model stays.
    """

    def __init__(
        self, initial: CostModel, window: int = 256, refit_every: int = 32, min_samples: int = 24
    ) -> None:
        self.model = initial
        self.window, self.refit_every, self.min_samples = window, refit_every, min_samples
        self.rows: list[tuple[list[float], float]] = []
        self.since_refit = 0
        self.num_refits = 0

    def observe(self, work: list[tuple[int, int]], seconds: float) -> None:
        """Record one step that computed ``(n, h)`` for each prefilled request in ``seconds``."""
        if not work or seconds <= 0:
            return
        feats = [1.0] + [sum(_features(n, h)[i] for n, h in work) for i in range(1, len(TERMS))]
        self.rows.append((feats, seconds))
        del self.rows[: -self.window]
        self.since_refit += 1
        if self.since_refit >= self.refit_every and len(self.rows) >= self.min_samples:
            self.refit()

    def refit(self) -> None:
        import numpy as np

        self.since_refit = 0
        coef = _nnls_relative(
            np.array([f for f, _ in self.rows]), np.array([t for _, t in self.rows])
        )
        if coef is None or coef[1] <= 0:
            return
        self.model = _model(coef, TERMS, "online")
        self.num_refits += 1


# --- analytic cost models ------------------------------------------------------------------------
# A model shape on a described GPU, for the simulator and the router at cluster scale. These are
# estimates from FLOP and byte counts, not measurements; every report built on one says so (the cost
# model's ``source`` is ``"analytic:<model>@<gpu>"``):
#
#     c0 = max(kernel launches of one eager forward, time to read the weights once)
#     g1 = linear FLOPs per token / (peak * linear efficiency)
#     g2 = attention FLOPs per query-key pair / (peak * attention efficiency)
#     g3 = KV bytes per cached token / memory bandwidth
#
# Reading the weights once per forward is what makes small prefills and decode steps memory-bound, so
# it is the floor ``c0`` of every call.


@dataclass(frozen=True)
class Hardware:
    """The numbers of one accelerator that the analytic model needs."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    mem_bandwidth: float  # bytes/s
    launch_overhead: float = 5e-6  # seconds per kernel launch
    linear_efficiency: float = 0.6  # achieved fraction of peak on projections and MLP
    attention_efficiency: float = 0.45  # achieved fraction of peak in attention


HARDWARE = {
    "H100": Hardware("H100-SXM", peak_flops=989e12, mem_bandwidth=3.35e12),
    "H200": Hardware("H200", peak_flops=989e12, mem_bandwidth=4.8e12),
    "A100": Hardware("A100-SXM-80GB", peak_flops=312e12, mem_bandwidth=2.04e12),
}


def _llama(
    arch: str, hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int
) -> ModelConfig:
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        max_position_embeddings=32768,
        qkv_bias=arch == "Qwen2ForCausalLM",
    )


MODELS = {
    "llama2-7b": _llama("LlamaForCausalLM", 4096, 11008, 32, 32, 32, 32000),
    "llama3-8b": _llama("LlamaForCausalLM", 4096, 14336, 32, 32, 8, 128256),
    "qwen2.5-7b": _llama("Qwen2ForCausalLM", 3584, 18944, 28, 28, 4, 152064),
    "qwen2.5-32b": _llama("Qwen2ForCausalLM", 5120, 27648, 64, 40, 8, 152064),
}

KERNELS_PER_LAYER = 14  # norms, projections, rope, attention, activation, residuals (eager)


def analytic_cost(
    model: str | ModelConfig, hardware: str | Hardware, dtype_bytes: int = 2
) -> CostModel:
    """The cost model of ``model`` (a name from :data:`MODELS` or a config) on ``hardware``."""
    cfg = MODELS[model] if isinstance(model, str) else model
    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    linear_flops = 2 * (cfg.num_params - embed)
    pair_flops = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    weights = (
        cfg.num_params - cfg.vocab_size * cfg.hidden_size
    ) * dtype_bytes  # embedding rows are gathered
    launches = KERNELS_PER_LAYER * cfg.num_hidden_layers * hw.launch_overhead
    name = model if isinstance(model, str) else cfg.architecture
    return CostModel(
        g1=linear_flops / (hw.peak_flops * hw.linear_efficiency),
        g2=pair_flops / (hw.peak_flops * hw.attention_efficiency),
        g3=cfg.kv_bytes_per_token * dtype_bytes / hw.mem_bandwidth,
        c0=max(launches, weights / hw.mem_bandwidth),
        source=f"analytic:{name}@{hw.name}",
    )

"""The prefill cost model: predicted time to prefill ``n`` new tokens on top of ``h`` cached ones.

    E(n, h) = c0 + g1*n + g2*n*(h + n/2) + g3*h

``g1*n`` is the work linear in the tokens (projections, MLP, norms); ``g2*n*(h + n/2)`` is attention,
proportional to the query-key pairs a causal prefill visits; ``g3*h`` reads the cached K/V; ``c0`` is
a fixed per-call overhead (kernel launches, Python). With ``h = 0`` this is ``a*L + b*L^2``.

Until a measured profile exists the coefficients come from the model's FLOP counts and a matmul peak
measured on the device at start (:meth:`CostModel.from_flops`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from plaserve.model.config import ModelConfig


@dataclass(frozen=True)
class CostModel:
    """Predicts prefill seconds; every coefficient is in seconds per unit of work."""

    g1: float  # per new token
    g2: float  # per causal query-key pair
    g3: float = 0.0  # per cached token read
    c0: float = 0.0  # per call
    source: str = "flops"  # "flops" (from FLOP counts), "profile" (measured) or "online" (refitted)

    def prefill_time(self, n: int, h: int = 0) -> float:
        """Seconds to prefill ``n`` new tokens after ``h`` cached ones."""
        return self.c0 + self.g1 * n + self.g2 * n * (h + n / 2) + self.g3 * h

    def batch_time(self, work: list[tuple[int, int]]) -> float:
        """Seconds for one forward pass computing ``(n, h)`` (new, cached) tokens for each request.

        A decode is ``(1, context)``; a right-padded batch is its requests at the padded length.
        """
        return self.c0 + sum(self.prefill_time(n, h) - self.c0 for n, h in work)

    def as_dict(self) -> dict[str, float | str]:
        return asdict(self)

    @classmethod
    def from_flops(cls, cfg: ModelConfig, peak_flops: float, efficiency: float = 0.7) -> "CostModel":
        """Coefficients from FLOP counts at ``efficiency`` times ``peak_flops`` (FLOP/s)."""
        rate = peak_flops * efficiency
        embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
        linear = 2 * (cfg.num_params - embed)  # FLOPs per token outside attention scores
        # QK^T and PV: 2 FLOPs per multiply-add each, over every head and layer.
        pair = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
        return cls(g1=linear / rate, g2=pair / rate, source="flops")


def measure_peak_flops(device: torch.device, dtype: torch.dtype, size: int = 1024, seconds: float = 0.2) -> float:
    """FLOP/s of a square matmul on ``device``: the peak that FLOP-based estimates are scaled by."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up
    n, start = 0, time.perf_counter()
    while True:
        a @ b
        n += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2 * size**3 * n / elapsed

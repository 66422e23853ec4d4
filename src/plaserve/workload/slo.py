"""Per-request TTFT SLOs for the load generator.

With the server's cost model (``/load`` → ``cost_model``, plaserve servers only) the SLO scales with the
work a prompt needs: ``max(floor, factor * t(n))`` where ``t(n) = c0 + g1*n + g2*n*n/2`` is the
predicted prefill time of ``n`` fresh tokens run alone. Without it (any other server), one fixed SLO per
length class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plaserve.slo import DEFAULT_FACTOR, DEFAULT_FLOOR_S, SloRule


@dataclass(frozen=True)
class TtftSlo:
    """How each request's TTFT SLO (seconds) is set."""

    factor: float = DEFAULT_FACTOR
    floor_s: float = DEFAULT_FLOOR_S
    short_s: float = 0.5  # fixed SLOs, used when there is no cost model
    long_s: float = 5.0
    short_threshold: int = 512
    cost: dict[str, Any] | None = None  # g1, g2, c0 (floats) and source of the server's cost model

    def predicted_prefill(self, prompt_tokens: int) -> float | None:
        """Isolated prefill seconds of a fresh prompt under the cost model (None without one)."""
        if self.cost is None:
            return None
        c, n = self.cost, prompt_tokens
        return c.get("c0", 0.0) + c["g1"] * n + c["g2"] * n * n / 2

    def for_prompt(self, prompt_tokens: int) -> float:
        """The TTFT SLO of a request with ``prompt_tokens`` fresh prompt tokens."""
        predicted = self.predicted_prefill(prompt_tokens)
        if predicted is not None:
            return SloRule(self.factor, self.floor_s).for_prefill(predicted)
        return self.short_s if prompt_tokens < self.short_threshold else self.long_s

    def describe(self) -> str:
        """One line saying which SLO is in force."""
        if self.cost is not None:
            c = self.cost
            return (
                f"TTFT SLO = max({self.floor_s * 1000:.0f} ms, {self.factor:g} x predicted isolated prefill), "
                f"prefill from the server's cost model (g1={c['g1']:.3g}, g2={c['g2']:.3g}, "
                f"c0={c.get('c0', 0.0):.3g}, source={c.get('source', '?')})"
            )
        return (
            f"TTFT SLO fixed by class: short (< {self.short_threshold} tokens) {self.short_s * 1000:.0f} ms, "
            f"long {self.long_s * 1000:.0f} ms (no cost model from the server)"
        )


def cost_from_load(load: Any) -> dict[str, Any] | None:
    """The cost coefficients in a ``/load`` response, or None if it has none usable."""
    cost = load.get("cost_model") if isinstance(load, dict) else None
    if not isinstance(cost, dict):
        return None
    try:
        out: dict[str, Any] = {k: float(cost[k]) for k in ("g1", "g2")}
    except (KeyError, TypeError, ValueError):
        return None
    try:
        out["c0"] = float(cost.get("c0") or 0.0)
    except (TypeError, ValueError):
        return None
    if isinstance(cost.get("source"), str):
        out["source"] = cost["source"]  # carried along for describe()
    return out

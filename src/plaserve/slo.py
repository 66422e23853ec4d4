"""The TTFT objective: one rule, one default floor, for the scheduler, the benchmarks and the router.

A request's TTFT SLO is ``max(floor, factor * t)``, where ``t`` is its predicted isolated prefill time
(the cost model's time to prefill its prompt alone). The floor keeps tiny prompts from getting SLOs
below what queueing behind one step costs anyway; the factor lets a long prompt wait in proportion
to its own work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plaserve.cost import CostModel

DEFAULT_FACTOR = 5.0
DEFAULT_FLOOR_S = 0.25


@dataclass(frozen=True)
class SloRule:
    """TTFT SLO = ``max(floor, factor * predicted isolated prefill time)`` (seconds)."""

    factor: float = DEFAULT_FACTOR
    floor: float = DEFAULT_FLOOR_S

    def for_prefill(self, seconds: float) -> float:
        """The SLO of a request whose isolated prefill is predicted to take ``seconds``."""
        return max(self.floor, self.factor * seconds)

    def ttft(self, cost: "CostModel", prompt_tokens: int) -> float:
        """The SLO of a prompt of ``prompt_tokens`` fresh tokens under ``cost``."""
        return self.for_prefill(cost.prefill_time(prompt_tokens))

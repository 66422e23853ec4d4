"""Cost models for routing: a calibrated profile, the workers' own, or a stated default.

Which cost model prices a request on a worker, first that applies:

1. ``--profile PATH``: a JSON file with at least
   ``{"cost_model": {"g1": .., "g2": .., "g3": .., "c0": ..}, "short_threshold": N}`` (other keys are
   ignored, so ``plaserve calibrate`` can write more), used for every worker;
2. the ``cost_model`` the worker reports in ``GET /load`` (plaserve workers), per worker, so workers
   on different GPUs are priced differently;
3. :func:`default_cost_model`: the analytic model of Llama-2-7B on an H100
   (:func:`plaserve.cost.analytic_cost`).

The short/long threshold comes from the profile, else the first worker that reports one in ``/load``,
else :data:`DEFAULT_SHORT_THRESHOLD`.
"""

from __future__ import annotations

import json
from typing import Any

from plaserve.cost import CostModel, analytic_cost

DEFAULT_SHORT_THRESHOLD = 512  # the engine's default (SchedulerConfig.short_threshold)

DEFAULT_MODEL, DEFAULT_GPU = "llama2-7b", "H100"


def default_cost_model() -> CostModel:
    """Llama-2-7B on an H100, from FLOP and byte counts: g1 = 2.2e-5 s/token, g2 = 1.2e-9 s/pair,
    c0 = 3.9 ms (a 512-token prompt 15 ms, 2,000 tokens 50 ms, 7,437 tokens 0.20 s).

    Only the ratio of costs between requests matters for picking the earliest finish; absolute values
    matter for the spill budget and the SLO-relative pool pressures, which is why a profile or the
    workers' own models win.
    """
    return analytic_cost(DEFAULT_MODEL, DEFAULT_GPU)


def cost_model_from_dict(d: Any, source: str) -> CostModel | None:
    """A :class:`CostModel` from ``{"g1", "g2", "g3"?, "c0"?}``, or None when ``d`` is not one.

    Coefficients must be finite and non-negative, and ``g1`` or ``g2`` positive: a model that predicts
    zero cost for every request would make every worker look idle.
    """
    if not isinstance(d, dict):
        return None
    try:
        coef = {k: float(d.get(k) or 0.0) for k in ("g1", "g2", "g3", "c0")}
    except (TypeError, ValueError):
        return None
    if any(v != v or v < 0 or v == float("inf") for v in coef.values()) or (
        coef["g1"] <= 0 and coef["g2"] <= 0
    ):
        return None
    return CostModel(**coef, source=source)


def load_cost_profile(path: str) -> tuple[CostModel, int | None]:
    """Read a cost profile: the cost model and the short threshold (None when the file has none).

    Raises ``ValueError`` with the file name when the file is not a usable profile.
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    model = cost_model_from_dict(
        data.get("cost_model") if isinstance(data, dict) else None, source="profile"
    )
    if model is None:
        raise ValueError(
            f"{path}: needs a 'cost_model' object with non-negative numbers g1, g2 (g3, c0 optional)"
        )
    threshold = data.get("short_threshold")
    if threshold is not None and (
        not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 1
    ):
        raise ValueError(f"{path}: 'short_threshold' must be a positive integer, got {threshold!r}")
    return model, threshold

"""TTFT SLOs from the server's cost model, or fixed by class."""

from __future__ import annotations

import pytest

from plaserve.workload.slo import TtftSlo, cost_from_load


def test_slo_from_the_cost_model() -> None:
    cost = cost_from_load(
        {"cost_model": {"g1": 1e-4, "g2": 2e-8, "g3": 0.0, "c0": 0.01, "source": "flops"}}
    )
    slo = TtftSlo(factor=5.0, floor_s=0.25, cost=cost)
    assert slo.predicted_prefill(1000) == pytest.approx(0.01 + 0.1 + 0.01)
    assert slo.for_prompt(1000) == pytest.approx(5 * 0.12)
    assert slo.for_prompt(10) == 0.25  # the floor
    assert "cost model" in slo.describe() and "source=flops" in slo.describe()


def test_fixed_slo_without_a_cost_model() -> None:
    slo = TtftSlo(
        short_s=0.5, long_s=4.0, short_threshold=512, cost=cost_from_load({"something": "else"})
    )
    assert slo.cost is None
    assert slo.for_prompt(511) == 0.5 and slo.for_prompt(512) == 4.0
    assert "fixed" in slo.describe()


@pytest.mark.parametrize(
    "load",
    [
        None,
        [],
        {"cost_model": "x"},
        {"cost_model": {"g1": 1.0}},
        {"cost_model": {"g1": "a", "g2": 1.0}},
    ],
)
def test_unusable_cost_models_are_ignored(load: object) -> None:
    assert cost_from_load(load) is None

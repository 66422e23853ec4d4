"""The many-slice policy comparison on the simulated clock (benchmarks/policy_study/slices.py)."""

from __future__ import annotations

import dataclasses

from plaserve.config import EngineConfig, SchedulerConfig
from plaserve.cost import CostModel
from policy_study.offline import SloRule
from policy_study.policies import Slice
from policy_study.slices import (
    fcfs_load,
    pooled_lines,
    run_slice,
    slices_table,
    sweep_table,
    ttft_change,
)

COST = CostModel(g1=3.8e-4, g2=1.4e-7, g3=2e-6, c0=5e-3)
SLO = SloRule(factor=5.0, floor=0.5)
CONFIG = EngineConfig(
    kv_cache_memory="1GiB",
    max_model_len=4096,
    enable_prefix_caching=False,
    scheduler=SchedulerConfig(ttft_slo_factor=SLO.factor, ttft_slo_floor=SLO.floor),
)


def test_slices_run_every_policy_and_pool_the_checks():
    rows = [
        run_slice(
            Slice("code", "azure_code_2023.csv", start, 4000, 0.68), CONFIG, COST, SLO, seconds=8.0
        )
        for start in (0, 1000)
    ]
    for r in rows:
        assert set(r.violations) == {"fcfs", "spf", "pla"} and 0 < r.requests
        assert 0.5 < r.fcfs_utilization < 1.5
        checks = {c.name: c for c in r.checks}
        assert len(checks) == 6
        # The code trace's long prompts hold fcfs's shorts back; pla serves them first.
        assert checks["short TTFT p50 vs fcfs"].measured < -0.5
        assert r.least_violations <= min(r.violations.values())
        assert set(r.online_violations) == {
            "earliest deadline",
            "earliest deadline, given-up last",
            "least work left, given-up last",
            "shorts first, given-up last",
        }
        assert all(r.least_violations <= v for v in r.online_violations.values())
        assert r.violations["pla"] < r.violations["fcfs"]
    table = slices_table(rows).splitlines()
    assert len(table) == 2 + len(rows) and table[2].startswith("| 0 | ")
    pooled = pooled_lines(rows)
    assert "| pla short TTFT p50 vs fcfs | <= -60% | 2 of 2 | 0 |" in "\n".join(pooled)
    total = sum(r.requests for r in rows)
    assert f"({total} requests)" in pooled[-3]
    assert f"no scheduler fewer than {sum(r.least_violations for r in rows)} " in pooled[-3]
    assert pooled[-1].startswith("Idealised online schedules")


def test_fcfs_load_sets_the_utilization_the_issue_asks_for():
    s = Slice("conv", "azure_conv_2023.csv", 0, 4000, 0.31)
    load = fcfs_load(s, CONFIG, COST, SLO, 0.75, seconds=8.0)
    row = run_slice(
        dataclasses.replace(s, load=load), CONFIG, COST, SLO, seconds=8.0, policies=("fcfs",)
    )
    assert row.load == load and abs(row.fcfs_utilization - 0.75) < 0.05
    busier = run_slice(
        dataclasses.replace(s, load=load * 1.3), CONFIG, COST, SLO, seconds=8.0, policies=("fcfs",)
    )
    assert busier.fcfs_utilization > row.fcfs_utilization


def test_the_load_sweep_table_has_a_row_per_level():
    s = Slice("code", "azure_code_2023.csv", 0, 4000, 0.68)
    levels = {}
    for util in (0.2, 0.75):
        load = fcfs_load(s, CONFIG, COST, SLO, util, seconds=8.0, steps=4)
        levels[util] = [
            run_slice(
                dataclasses.replace(s, load=load),
                CONFIG,
                COST,
                SLO,
                seconds=8.0,
                policies=("fcfs", "pla"),
                bounds=False,
            )
        ]
    row = levels[0.75][0]
    assert row.least_violations is None and row.online_violations == {}
    assert set(row.ttft_ms) == {"fcfs", "pla"} and row.ttft_ms["pla"]["short"]["p50"] > 0
    table = sweep_table(levels).splitlines()
    assert (
        len(table) == 4
        and table[2].startswith("| 20% | 1 | ")
        and table[3].startswith("| 75% | 1 | ")
    )
    change = ttft_change(row, "short", "p50")
    assert change is not None and change < 0  # the code trace's shorts gain at 75 %

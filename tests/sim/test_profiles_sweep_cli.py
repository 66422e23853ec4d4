"""Simulation profiles, the capacity search, and ``plaserve simulate`` end to end."""

from __future__ import annotations

import json
import os

import pytest

from plaserve.cli import main
from plaserve.cost import MODELS
from plaserve.profile import Profile
from plaserve.router.config import RouterConfig
from plaserve.sim.cli import parse_values
from plaserve.sim.cluster import ClusterConfig
from plaserve.sim.profiles import analytic_profile, kv_capacity_tokens, load_sim_profile
from plaserve.sim.sweep import at_rate, capacity, mean_rate
from plaserve.workload.trace import synthetic_bimodal

TRACE = "/work/shared/traces/azure_code_2023.csv"


def test_analytic_profile_is_labelled_and_sized_from_memory():
    p = load_sim_profile("analytic:qwen2.5-32b@H100")
    assert p.analytic and p.label == "analytic:qwen2.5-32b@H100"
    assert p.cost.source.startswith("analytic:")
    # 32B weights (65 GB in bf16) leave far less KV room on an 80 GiB H100 than on a 141 GB H200.
    h100, h200 = (
        kv_capacity_tokens("qwen2.5-32b", "H100"),
        kv_capacity_tokens("qwen2.5-32b", "H200"),
    )
    assert 16384 < h100 < h200 / 3
    per_token = MODELS["qwen2.5-32b"].kv_bytes_per_token * 2
    assert h100 * per_token == pytest.approx(
        0.9 * 80 * 2**30 - MODELS["qwen2.5-32b"].num_params * 2, rel=1e-4
    )
    # The engine it configures holds that many tokens.
    from plaserve import LLMEngine
    from plaserve.sim.runner import CostRunner, SimClock

    clock = SimClock()
    engine = LLMEngine(
        p.engine_config("pla"), runner=CostRunner(p.cost, clock), cost=p.cost, clock=clock
    )
    assert (engine.allocator.num_blocks - 1) * engine.allocator.block_size == pytest.approx(
        h100, abs=32
    )
    assert engine.config.scheduler.static_short_batches  # CUDA-graph padding, as on a GPU
    assert p.with_short_threshold(512).profile.short_threshold == 512


def test_bad_profiles_are_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="MODEL@GPU"):
        load_sim_profile("analytic:qwen2.5-32b")
    with pytest.raises(ValueError, match="unknown GPU"):
        load_sim_profile("analytic:qwen2.5-32b@TPU")
    with pytest.raises(ValueError, match="no such profile"):
        load_sim_profile(str(tmp_path / "missing.json"))


def test_calibrated_profile_is_not_analytic(tmp_path):
    prof = analytic_profile("llama3-8b", "H100").profile
    path = str(tmp_path / "p.json")
    Profile(prof.cost_model, 256, 4, 512, 0.002, 0.02).save(path)
    p = load_sim_profile(path)
    assert not p.analytic and p.label == f"calibrated:{path}"
    assert p.engine_config("pla").scheduler.short_threshold == 256


def test_parse_values():
    assert parse_values("1,2,4") == [1.0, 2.0, 4.0]
    assert parse_values("2:8:2") == [2.0, 4.0, 6.0, 8.0]
    for bad in ("a", "4:2:1", "0,1"):
        with pytest.raises(Exception):
            parse_values(bad)


def test_capacity_brackets_the_target():
    requests = synthetic_bimodal(
        200, 10.0, seed=4, short=(16, 400), long=(1000, 4000), long_share=0.2, output=(1, 16)
    )
    assert mean_rate(at_rate(requests, 40.0)[0]) == pytest.approx(40.0)
    profile = analytic_profile("qwen2.5-7b", "H100").with_short_threshold(512)
    config = ClusterConfig(instances=1, router=RouterConfig(policy="round_robin"), drain_s=60.0)
    found = capacity(requests, profile, config, [5, 20, 80, 320], target=0.1, refine=2)
    rates = [p.rate for p in found.points]
    assert rates == sorted(rates) and found.bounded and found.capacity is not None
    passing = [p for p in found.points if p.slo_violation_rate <= 0.1]
    failing = [p for p in found.points if p.slo_violation_rate > 0.1]
    assert found.capacity == max(p.rate for p in passing)
    assert failing and min(p.rate for p in failing) > found.capacity
    # Bisection ran between the grid points that straddle the target.
    assert (
        len(found.points)
        == len([r for r in (5, 20, 80, 320) if r <= min(p.rate for p in failing)]) + 2
    )


def test_simulate_command_writes_bench_outputs(tmp_path, capsys):
    out = str(tmp_path / "out")
    code = main(
        [
            "simulate",
            "--trace",
            TRACE,
            "--num-requests",
            "120",
            "--instances",
            "2",
            "--router",
            "pla",
            "--scheduler",
            "pla",
            "--profile",
            "analytic:llama3-8b@H200",
            "--out",
            out,
            "--time-scale",
            "0.5",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "ANALYTIC" in text and "load skew" in text and "TTFT p50" in text
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["all"]["count"] == 120 and len(summary["instances"]) == 2
    assert summary["simulation"]["analytic"] is True
    assert sum(i["requests"] for i in summary["instances"]) == 120
    for name in (
        "run.json",
        "requests.jsonl",
        "ttft_cdf.png",
        "latency_over_time.png",
        "instance_busy.png",
    ):
        assert os.path.exists(os.path.join(out, name))


def test_simulate_command_sweeps_to_a_capacity(tmp_path, capsys):
    code = main(
        [
            "simulate",
            "--trace",
            TRACE,
            "--num-requests",
            "80",
            "--instances",
            "1",
            "--router",
            "round_robin",
            "--scheduler",
            "fcfs",
            "--profile",
            "analytic:qwen2.5-7b@H100",
            "--rate",
            "0.1,50",
            "--refine",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "goodput capacity" in text and "[ANALYTIC profile]" in text
    data = json.load(open(tmp_path / "sweep.json"))
    assert len(data["points"]) >= 2 and data["profile"]["analytic"] is True


def test_simulate_command_refuses_bad_input(tmp_path, capsys):
    assert (
        main(
            [
                "simulate",
                "--trace",
                str(tmp_path / "none.csv"),
                "--profile",
                "analytic:qwen2.5-7b@H100",
                "--out",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert (
        main(
            [
                "simulate",
                "--trace",
                TRACE,
                "--profile",
                "analytic:nope@H100",
                "--out",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "unknown model" in capsys.readouterr().err

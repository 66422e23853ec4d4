"""Profiles: the setting rules on constructed measurements, the JSON round trip, fingerprints, and an
engine started with a profile."""

from __future__ import annotations

import logging

import pytest
import torch

from plaserve import EngineConfig, LLMEngine
from plaserve.cost import CostModel
from plaserve.model.default import DEFAULT_CONFIG
from plaserve.profile import (
    Profile,
    choose_long_chunk_size,
    choose_max_short_batch,
    choose_short_threshold,
    choose_window,
    fingerprint,
)
from plaserve.sim.runner import CostRunner, SimClock


def test_short_threshold_is_where_attention_reaches_a_fifth_of_a_tokens_cost():
    # g2*L/2 = 0.25*g1  <=>  L = 0.5*g1/g2 = 1000 -> nearest power of two 1024.
    assert choose_short_threshold(CostModel(g1=2e-4, g2=1e-7)) == 1024
    assert choose_short_threshold(CostModel(g1=2e-4, g2=4e-7)) == 256
    assert choose_short_threshold(CostModel(g1=2e-4, g2=1e-12)) == 4096  # clamped
    assert choose_short_threshold(CostModel(g1=2e-4, g2=0.0)) == 4096


def test_max_short_batch_stops_where_batching_stops_paying():
    # Per-request time: 10, 6, 4, 3.9, 3.9 ms -> 4 is the last size that still gained >= 5 %.
    times = {1: 0.010, 2: 0.012, 4: 0.016, 8: 0.0312, 16: 0.0624}
    assert choose_max_short_batch(times) == 4
    assert choose_max_short_batch({1: 0.01, 2: 0.02}) == 1  # no gain at all


def test_chunk_grows_until_the_call_overhead_is_small():
    cost = CostModel(g1=1e-4, g2=0.0, c0=0.01)  # chunk of c costs 0.01 + 1e-4*c
    # 5 % overhead needs 1e-4*c >= 0.19 -> c >= 1900 -> 2048 (0.21 s).
    assert choose_long_chunk_size(cost, 256, max_seconds=0.25) == 2048
    assert choose_long_chunk_size(CostModel(g1=1e-4, g2=0.0, c0=0.0), 512, 0.25) == 512
    # ... but not past the SLO floor: with a 0.15 s floor the chunk stops at 1,024 (0.11 s).
    assert choose_long_chunk_size(cost, 256, max_seconds=0.15) == 1024


def test_window_bounds():
    assert choose_window(CostModel(g1=1e-4, g2=0, c0=0.004), 0.03) == (0.004, 0.03)
    assert choose_window(CostModel(g1=1e-4, g2=0, c0=0.0), 0.0005) == (0.001, 0.001)


def make_profile(**kw) -> Profile:
    args = dict(
        cost_model=CostModel(g1=3e-4, g2=2e-7, c0=1e-3, source="profile"),
        short_threshold=256,
        max_short_batch=4,
        long_chunk_size=1024,
        w_min=0.002,
        w_max=0.03,
        fingerprint=fingerprint(DEFAULT_CONFIG, torch.float32, torch.device("cpu")),
        fit={"held_out": {"mape": 0.05}},
        measurements={"train": [[16, 0, 0.01]]},
    )
    return Profile(**(args | kw))


def test_profile_round_trip(tmp_path):
    p = make_profile()
    path = str(tmp_path / "p.json")
    p.save(path)
    q = Profile.load(path)
    assert q.cost_model == p.cost_model and q.scheduler_overrides() == p.scheduler_overrides()
    assert q.fingerprint == p.fingerprint


def test_fingerprint_mismatch_warns(tmp_path, caplog):
    p = make_profile(
        fingerprint={"model": "0" * 16, "dtype": "bfloat16", "device": "H200", "torch": "2.0"}
    )
    here = fingerprint(DEFAULT_CONFIG, torch.float32, torch.device("cpu"))
    with caplog.at_level(logging.WARNING):
        diffs = p.check(here)
    assert len(diffs) == 4 and "measured elsewhere" in caplog.text
    assert make_profile().check(here) == []


def test_wrong_version_is_refused(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"version": 99}')
    with pytest.raises(ValueError, match="version"):
        Profile.load(str(path))


def test_engine_started_with_a_profile_uses_its_threshold_grid_and_costs(tmp_path):
    path = str(tmp_path / "p.json")
    make_profile().save(path)
    clock = SimClock()
    cost = CostModel(g1=3e-4, g2=2e-7, c0=1e-3)
    engine = LLMEngine(
        EngineConfig.from_kwargs(profile=path, kv_cache_memory="256MiB", policy="pla"),
        runner=CostRunner(cost, clock),
        clock=clock,
    )
    sched = engine.scheduler
    assert engine.cost == make_profile().cost_model
    assert sched.config.short_threshold == 256 and sched.shorts.buckets[-1] == 256
    assert sched.shorts.batch_sizes[-1] == 4  # the deepest static batch the profile allows
    assert sched.config.long_chunk_size == 1024 and sched.shorts.window.w_max == 0.03
    assert engine.load_report()["cost_model"]["source"] == "profile"
    short = engine.add_request(list(range(200)))
    long = engine.add_request(list(range(300)))
    assert (short.length_class, long.length_class) == ("short", "long")

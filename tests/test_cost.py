"""Cost model: FLOP-based coefficients, NNLS fitting, fit quality, online refit."""

from __future__ import annotations

import random

import pytest

from plaserve.cost import (
    CostModel,
    OnlineCostModel,
    chunk_size_for,
    fit,
    fit_quality,
    with_step_cost,
)
from plaserve.model.default import DEFAULT_CONFIG


def noisy_samples(
    true: CostModel, n: int, noise: float, seed: int = 0
) -> list[tuple[int, int, float]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        new = rng.choice([16, 64, 256, 1024, 2048, 4096, 8192])
        hist = rng.choice([0, 0, 512, 2048, 8192])
        out.append((new, hist, true.prefill_time(new, hist) * (1 + rng.uniform(-noise, noise))))
    return out


def test_fit_recovers_known_coefficients_from_noisy_data():
    true = CostModel(g1=2e-4, g2=1e-7, g3=5e-6, c0=3e-3)
    model = fit(noisy_samples(true, 200, noise=0.05))
    assert model.g1 == pytest.approx(true.g1, rel=0.1)
    assert model.g2 == pytest.approx(true.g2, rel=0.1)
    assert model.c0 == pytest.approx(true.c0, rel=0.3)
    assert model.g3 == pytest.approx(true.g3, rel=0.5)
    q = fit_quality(model, noisy_samples(true, 100, noise=0.05, seed=1))
    assert q["mape"] < 0.05 and q["r2"] > 0.99


def test_fit_never_returns_negative_coefficients():
    # Pure linear data with noise: an unconstrained fit would put a small negative on some term.
    samples = [
        (n, 0, 1e-3 * n * (1.02 if i % 2 else 0.98))
        for i, n in enumerate([16, 32, 64, 128, 256, 512] * 3)
    ]
    model = fit(samples)
    assert min(model.g1, model.g2, model.g3, model.c0) >= 0
    assert model.g1 == pytest.approx(1e-3, rel=0.05)


def test_flop_model_has_linear_and_quadratic_terms():
    m = CostModel.from_flops(DEFAULT_CONFIG, peak_flops=1e11)
    assert m.g1 > 0 and m.g2 > 0
    # Doubling a long prompt more than doubles its cost.
    assert m.prefill_time(8192) > 2.2 * m.prefill_time(4096)
    # A cached history makes new tokens dearer.
    assert m.prefill_time(100, 4000) > m.prefill_time(100, 0)


def test_online_refit_converges_when_the_true_cost_changes():
    before, after = CostModel(g1=1e-4, g2=5e-8, c0=2e-3), CostModel(g1=3e-4, g2=1e-7, c0=2e-3)
    online = OnlineCostModel(before, window=128, refit_every=16)
    rng = random.Random(0)
    for _ in range(200):  # the hardware got slower: observations now follow `after`
        work = [
            (rng.choice([32, 128, 512, 2048]), rng.choice([0, 1024]))
            for _ in range(rng.randint(1, 3))
        ]
        t = after.batch_time(work) * (1 + rng.uniform(-0.03, 0.03))
        online.observe(work, t)
    assert online.num_refits > 0 and online.model.source == "online"
    assert online.model.g1 == pytest.approx(after.g1, rel=0.1)
    assert online.model.g2 == pytest.approx(after.g2, rel=0.15)


def test_step_time_ratio_reports_how_far_steps_run_from_the_prediction():
    from plaserve import EngineConfig, LLMEngine, SamplingParams
    from plaserve.cost import StepTimeRatio
    from plaserve.sim.runner import CostRunner, SimClock

    ratio = StepTimeRatio(window=2)
    assert ratio.ratio is None
    # the first falls out of the window
    for predicted, measured in (
        (1.0, 9.0),
        (1.0, 1.0),
        (2.0, 3.0),
    ):
        ratio.observe(predicted, measured)
    assert ratio.ratio == pytest.approx(4.0 / 3.0)

    # An engine whose steps really take 1.5x what its cost model predicts says so in its load report.
    model = CostModel(g1=1e-4, g2=1e-8, c0=1e-3)
    slow = CostModel(g1=1.5e-4, g2=1.5e-8, c0=1.5e-3)
    clock = SimClock()
    engine = LLMEngine(
        EngineConfig.from_kwargs(kv_cache_memory="256MiB", policy="fcfs"),
        runner=CostRunner(slow, clock),
        cost=model,
        clock=clock,
    )
    assert engine.load_report()["step_time_over_predicted"] is None
    for n in (50, 700, 3000):
        engine.add_request(
            [1 + i % 500 for i in range(n)], SamplingParams(max_tokens=3, ignore_eos=True)
        )
    while engine.has_unfinished():
        engine.step()
    assert engine.load_report()["step_time_over_predicted"] == pytest.approx(1.5)


def test_the_start_up_model_takes_its_step_and_token_costs_from_two_timed_passes():
    flops = CostModel(g1=1e-5, g2=2e-9, g3=3e-7)
    true = CostModel(g1=4e-5, g2=2e-9, g3=3e-7, c0=5e-3)
    timed = with_step_cost(flops, {n: true.prefill_time(n) for n in (16, 512)})
    assert timed.source == "warm-up" and (timed.g2, timed.g3) == (flops.g2, flops.g3)
    assert timed.g1 == pytest.approx(4e-5) and timed.c0 == pytest.approx(5e-3)
    # a step worth ~125 tokens: pla's long chunks grow from the short threshold, as once refitted
    assert chunk_size_for(flops, 512, 2048, 0.5) == 512
    assert chunk_size_for(timed, 512, 2048, 0.5) == 2048
    # a clock on which the longer pass was not slower: the FLOP count's g1, the rest as step cost
    noisy = with_step_cost(flops, {16: 0.01, 512: 0.009})
    assert noisy.g1 == flops.g1 and noisy.c0 == pytest.approx(0.01 - flops.prefill_time(16))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_measured_peak_is_the_faster_way_to_multiply(dtype, monkeypatch):
    """The peak on CPU is the faster of torch's matmul and, where oneDNN packs the dtype here, its
    prepacked linear: made to look slow, the matmul's rate is the peak; made to look fast, its own."""
    import torch

    from plaserve import cost

    dtype = getattr(torch, dtype)
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(32, 32, dtype=dtype), 32)
        ways = 2
    except (AttributeError, RuntimeError):  # no oneDNN, or it cannot pack the dtype on this CPU
        ways = 1
    real, rates = cost._flop_rate, []

    def scaled(factor):
        def rate(way, device, flops, seconds):
            rates.append(real(way, device, flops, seconds))
            return rates[-1] * (1 if len(rates) == 1 else factor)

        return rate

    for factor in (1e-3, 1e3):
        rates.clear()
        monkeypatch.setattr(cost, "_flop_rate", scaled(factor))
        peak = cost.measure_peak_flops(torch.device("cpu"), dtype, 64, 0.01)
        assert len(rates) == ways and rates[0] > 0
        assert peak == (rates[1] * factor if ways == 2 and factor > 1 else rates[0])

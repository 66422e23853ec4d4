"""Sampler filters and distributions."""

from __future__ import annotations

import torch

from plaserve.engine.request import SamplingParams
from plaserve.engine.sampler import _filter_top_k_top_p, sample


def test_greedy_picks_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    assert sample(logits, [SamplingParams(temperature=0)] * 2, [None, None]) == [1, 0]


def test_top_k_keeps_k_best():
    row = torch.tensor([1.0, 4.0, 3.0, 2.0])
    kept = torch.isfinite(_filter_top_k_top_p(row, 2, 1.0))
    assert kept.tolist() == [False, True, True, False]


def test_top_p_keeps_the_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = torch.isfinite(_filter_top_k_top_p(probs.log(), -1, 0.7))
    assert kept.tolist() == [True, True, False, False]  # 0.5 < 0.7, so 0.3 joins; then 0.8 >= 0.7
    kept = torch.isfinite(_filter_top_k_top_p(probs.log(), -1, 0.01))
    assert kept.tolist() == [True, False, False, False]  # always at least one


def test_sampling_frequencies_follow_temperature():
    logits = torch.tensor([[0.0, 1.0]])
    gen = torch.Generator().manual_seed(0)
    draws = [sample(logits, [SamplingParams(temperature=1.0)], [gen])[0] for _ in range(2000)]
    share = sum(draws) / len(draws)
    expected = torch.softmax(torch.tensor([0.0, 1.0]), -1)[1].item()  # 0.731
    assert abs(share - expected) < 0.04

"""Sampler filters, distributions and penalties."""

from __future__ import annotations

import pytest
import torch

from plaserve.engine.sampler import (
    _argmax,
    apply_penalties,
    ban_until_min_tokens,
    draw,
    draw_weights,
    sample,
    skip_draw,
    unusable_rows,
)
from plaserve.request import MIN_TEMPERATURE, ParamError, Request, SamplingParams
from plaserve.testing.plain_sampler import plain_probs


def test_greedy_picks_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    assert sample(logits, [SamplingParams(temperature=0)] * 2, [None, None]) == [1, 0]


def kept(row: torch.Tensor, **params) -> list[bool]:
    """Which tokens of ``row`` a draw may pick under these sampling parameters."""
    weights, ids = draw_weights(row, SamplingParams(**params))
    out = torch.zeros(row.shape[-1], dtype=torch.bool)
    out[ids if ids is not None else slice(None)] = weights > 0
    return out.tolist()


def test_top_k_keeps_k_best():
    assert kept(torch.tensor([1.0, 4.0, 3.0, 2.0]), top_k=2) == [False, True, True, False]


def test_top_p_keeps_the_nucleus():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    # 0.5 < 0.7, so 0.3 joins; then 0.8 >= 0.7
    assert kept(logits, top_p=0.7) == [True, True, False, False]
    assert kept(logits, top_p=0.01) == [True, False, False, False]  # always at least one


# Rows of 5000 tokens (a histogram finds the top-p cut), flat to peaked.
@pytest.mark.parametrize("scale", [0.03, 0.3, 3.0, 30.0])
@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.3, top_p=0.5),
        dict(top_p=0.999),
        dict(top_p=1 - 1e-7),
        dict(top_k=40),
        dict(top_k=40, top_p=0.8),
        dict(min_p=0.05),
        dict(min_p=1.0),  # the most likely token alone
        dict(min_p=0.02, top_p=0.9),
        dict(min_p=0.01, top_k=500, top_p=0.95),
    ],
)
def test_draw_weights_equal_the_plain_filters(params, scale):
    g = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(4, 5000, generator=g) * scale
    logits[1, ::3] = float("-inf")  # a grammar's mask
    p = SamplingParams(**params)
    for row in logits:
        weights, ids = draw_weights(row, p)
        probs = torch.zeros_like(row, dtype=torch.float64)
        probs[ids if ids is not None else slice(None)] = weights / weights.sum()
        assert torch.allclose(probs.float(), plain_probs(row, p), atol=1e-6)


def test_draws_follow_the_filtered_distribution():
    """A chi-square test of 20,000 seeded draws over 12 tokens, top-p cutting the tail."""
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -9.0]])
    p = SamplingParams(temperature=1.0, top_p=0.97)
    gen = torch.Generator().manual_seed(1)
    n = 20_000
    counts = torch.bincount(
        torch.tensor([sample(logits, [p], [gen])[0] for _ in range(n)]), minlength=12
    )
    expected = plain_probs(logits[0], p) * n
    inside = expected > 0
    assert counts[~inside].sum() == 0  # never a token the filters dropped
    chi2 = ((counts[inside] - expected[inside]) ** 2 / expected[inside]).sum().item()
    assert chi2 < 30  # 0.1 % of the chi-square with <= 10 degrees of freedom lies above 29.6


def test_a_draw_takes_one_number_whatever_the_weights():
    """A seeded request continued on a decode worker skips the prefill worker's draw without its
    logits: any draw must move the generator exactly as skip_draw does."""
    for weights in (torch.tensor([0.0, 1.0, 0.0]), torch.rand(7000), torch.ones(1)):
        a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        draw(weights, a)
        skip_draw(b, 151_936)
        assert torch.equal(a.get_state(), b.get_state())
    assert draw(torch.tensor([0.0, float("nan")]), None) is None
    assert draw(torch.zeros(3), None) is None


def test_sampling_frequencies_follow_temperature():
    logits = torch.tensor([[0.0, 1.0]])
    gen = torch.Generator().manual_seed(0)
    draws = [sample(logits, [SamplingParams(temperature=1.0)], [gen])[0] for _ in range(2000)]
    share = sum(draws) / len(draws)
    expected = torch.softmax(torch.tensor([0.0, 1.0]), -1)[1].item()  # 0.731
    assert abs(share - expected) < 0.04


def request(prompt: list[int], output: list[int], eos: tuple[int, ...] = (), **params) -> Request:
    req = Request(prompt, SamplingParams(**params), eos_token_ids=eos)
    req.output_token_ids = list(output)
    return req


def test_repetition_penalty_covers_prompt_and_output():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 2.0]])
    out = apply_penalties(logits.clone(), [request([0, 1], [3], repetition_penalty=2.0)])
    # Seen tokens 0, 1 (prompt) and 3 (output): positive logits halve, negative ones double.
    assert out.tolist() == [[1.0, -4.0, 2.0, -4.0, 2.0]]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 4)
    out = apply_penalties(
        logits, [request([2, 2, 2], [1, 1, 3], presence_penalty=0.5, frequency_penalty=0.25)]
    )
    # token 1: twice (0.5 + 2 * 0.25); token 3: once (0.5 + 0.25); prompt token 2: untouched.
    assert out.tolist() == [[0.0, -1.0, 0.0, -0.75]]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.zeros(2, 6)
    reqs = [
        request([1], [4], eos=(2,), min_tokens=2, stop_token_ids=[5]),
        request([1], [4, 4], eos=(2,), min_tokens=2, stop_token_ids=[5]),
    ]
    out = ban_until_min_tokens(apply_penalties(logits, reqs), reqs)
    assert torch.isinf(out[0]).tolist() == [False, False, True, False, False, True]
    assert not torch.isinf(out[1]).any()  # two tokens out: eos and stop ids are allowed again


def test_logit_bias_adds_to_its_tokens():
    logits = torch.zeros(1, 5)
    out = apply_penalties(logits, [request([1], [2], logit_bias={0: 2.5, 3: -100.0, 99: 1.0})])
    assert out.tolist() == [[2.5, 0.0, 0.0, -100.0, 0.0]]  # ids outside the vocabulary are ignored


def test_rows_without_penalties_are_untouched():
    logits = torch.randn(2, 8)
    assert torch.equal(
        apply_penalties(logits.clone(), [request([1, 2], [3]), request([4], [5, 6])]), logits
    )


def test_min_p_drops_unlikely_tokens():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert kept(logits, min_p=0.35) == [True, True, False, False]  # 0.15 < 0.35 * 0.5


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "bad",
    [
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3.0),
        dict(repetition_penalty=0.0),
        dict(min_p=1.5),
        dict(min_tokens=20, max_tokens=10),
        dict(min_tokens=-1),
        dict(logit_bias={3: 101.0}),
        dict(logprobs=21),
        dict(temperature=NAN),
        dict(temperature=INF),
        dict(temperature=-1e-9),
        dict(top_p=NAN),
        dict(top_p=0.0),
        dict(min_p=NAN),
        dict(presence_penalty=NAN),
        dict(frequency_penalty=-INF),
        dict(repetition_penalty=NAN),
        dict(repetition_penalty=1e-300),
        dict(repetition_penalty=INF),
        dict(logit_bias={3: NAN}),
        dict(logit_bias={-1: 1.0}),
        dict(seed=2**63),
        dict(seed=2**63 - 2, n=4),
        dict(seed=-(2**63) - 1),
        dict(n=0),
        dict(max_tokens=0),
        dict(stop=[""]),
        dict(stop_token_ids=[-1]),
        dict(top_k=-2),
        dict(temperature="1"),
    ],
)
def test_out_of_range_sampling_params_are_refused_naming_the_field(bad):
    with pytest.raises(ParamError) as info:
        SamplingParams(**bad)
    assert info.value.param in bad  # the field the error names is one that was set
    assert isinstance(info.value, ValueError)


def test_tiny_temperatures_are_greedy():
    for t in (1e-300, 5e-324, 1e-45, MIN_TEMPERATURE / 2):
        assert SamplingParams(temperature=t).greedy
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    assert SamplingParams(max_tokens=None).max_tokens is None  # as many as the context allows


def test_unusable_rows_fail_alone():
    logits = torch.tensor(
        [[0.0, 2.0, 1.0], [NAN, 1.0, 0.0], [INF, 0.0, 0.0], [-INF, -INF, -INF], [-INF, 0.5, -INF]]
    )
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0),
    ]
    gen = torch.Generator().manual_seed(0)
    assert unusable_rows(logits).tolist() == [False, True, True, True, False]
    assert sample(logits, params, [gen] * 5) == [1, None, None, None, 1]


def test_greedy_argmax_matches_torch_on_ties_and_broken_rows() -> None:
    """The CPU argmax (numpy's) picks what torch's does: the first maximum of tied rows, and rows with
    -inf, NaN or +inf logits (the last two are then reported unusable by sample())."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g)
    logits[1] = 0.0  # all tied
    logits[2, 10] = logits[2, 500] = 9.0  # two tied maxima
    logits[3, :] = float("-inf")
    logits[3, 7] = 1.0
    logits[4, 300] = float("nan")
    logits[5, 600] = float("inf")
    with torch.inference_mode():
        assert _argmax(logits).tolist() == logits.argmax(-1).tolist()
        assert _argmax(logits).tolist()[:4] == [int(logits[0].argmax()), 0, 10, 7]


def test_a_huge_temperature_draws_among_the_allowed_tokens():
    """1e308 is inf in float32, and -inf (a masked token) over it NaN: ``torch.multinomial`` raised
    for the whole batch."""
    logits = torch.tensor([[float("-inf"), 1.0, float("-inf"), 3.0]])
    gen = torch.Generator().manual_seed(0)
    draws = {sample(logits, [SamplingParams(temperature=1e308)], [gen])[0] for _ in range(50)}
    assert draws == {1, 3}  # uniform over the two allowed tokens


@pytest.mark.parametrize(
    "params", [dict(), dict(top_p=0.9), dict(top_k=3, top_p=0.9), dict(min_p=0.1)]
)
def test_logits_that_overflow_past_the_temperature_fail_the_row_alone(params):
    """3e38 / 1e-5 is inf in float32: the row fails (None), the batch goes on."""
    logits = torch.tensor([[3e38, 1.0, 0.0, -1e38], [0.0, 5.0, 0.0, 0.0]])
    p = SamplingParams(temperature=1e-5, **params)
    assert sample(logits, [p, p], [None, None]) == [None, 1]


@pytest.mark.parametrize("logit", [1e6, -1e6, 0.0])
def test_top_p_over_one_allowed_token_of_a_large_vocabulary(logit):
    """Every other token masked: the histogram of the logits has no width."""
    logits = torch.full((1, 9000), float("-inf"))
    logits[0, 4321] = logit
    assert sample(logits, [SamplingParams(temperature=1e-5, top_p=0.5)], [None]) == [4321]

"""Sampling written the plain way, as the reference the engine's sampler must equal
(tests/engine/test_sampler.py) and the baseline it is timed against (benchmarks/sampler.py): the
filters on the softmax, top-p by a sort of the whole row, the draw by ``torch.multinomial``. It was
plaserve's sampler until 2026-12-08."""

from __future__ import annotations

import torch

from plaserve.request import SamplingParams


def plain_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The probabilities of one row of logits ``[vocab]`` after temperature, min-p, top-k and top-p,
    in that order (top-p's cumulative sum in float64)."""
    x = row / p.temperature
    if p.min_p > 0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if 0 < p.top_k < len(x):
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = sorted_x.double().softmax(-1)
        # drop a token when the tokens strictly above it already cover top_p
        drop = probs.cumsum(-1) - probs > p.top_p
        x = x.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return x.softmax(-1)


def plain_sample(logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
    """One token a row of ``logits`` ``[N, vocab]``, drawn by ``torch.multinomial``."""
    return [int(torch.multinomial(plain_probs(row, p), 1)) for row, p in zip(logits, params)]

"""Token sampling: penalties, greedy, temperature, top-k, top-p, min-p, per-request seeds.

Penalties and the ``min_tokens`` ban change the logits first, for greedy and sampled requests alike (as
vLLM applies them); then greedy rows take the argmax and the others sample from the filtered softmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plaserve.engine.request import Request, SamplingParams, TokenLogprobs


@torch.inference_mode()
def apply_penalties(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """``logits`` ``[N, vocab]`` (row ``i`` for ``reqs[i]``) with each request's penalties applied (vLLM's
    semantics): the repetition penalty over prompt and output tokens, presence and frequency penalties
    over output tokens, and eos and stop token ids banned until ``min_tokens`` are out. Rows without any
    are left alone; the tensor is changed in place and returned."""
    vocab = logits.shape[-1]
    for i, req in enumerate(reqs):
        p, out = req.params, req.output_token_ids
        if p.min_tokens and len(out) < p.min_tokens:
            banned = [t for t in (*req.eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab]
            logits[i, banned] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.prompt_token_ids) | set(out)), device=logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if out and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(out, device=logits.device), minlength=vocab)[:vocab].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Mask (to -inf) every logit outside the top-k, the top-p nucleus and the min-p cut of one row."""
    if min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens strictly above it already cover top_p (keeps at least one).
        drop = probs.cumsum(-1) - probs > top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` ``[N, vocab]`` (float32)."""
    out = logits.argmax(-1).tolist()  # greedy rows are done; sampled rows overwrite below
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = _filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p, p.min_p)
        out[i] = int(torch.multinomial(row.softmax(-1), 1, generator=generators[i]).item())
    return out


def token_logprobs(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """The sampled ``token``'s entry of one row of log-probabilities ``[vocab]``, and the ``k`` largest."""
    top = torch.topk(logprobs, k) if k else None
    pairs = () if top is None else tuple(zip(top.indices.tolist(), top.values.tolist()))
    return TokenLogprobs(token, float(logprobs[token]), pairs)

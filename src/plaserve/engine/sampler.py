"""Token sampling: penalties, greedy, temperature, top-k, top-p, min-p, per-request seeds.

Penalties and the ``min_tokens`` ban change the logits first, for greedy and sampled requests alike (as
vLLM applies them; the ban after a grammar's mask, which it yields to); then greedy rows take the
argmax and the others sample from the filtered softmax.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from plaserve.request import Request, SamplingParams, TokenLogprobs


class PenaltyState:
    """What the penalties of one request read, as tensors on the logits' device: its banned ids (eos and
    stop ids, for ``min_tokens``), which tokens its prompt and output hold, how often each was output,
    and its logit bias. Built on the first penalised step and updated with each new output token, not
    rebuilt every step. Token ids outside the vocabulary are dropped."""

    def __init__(self, req: Request, vocab: int, device: torch.device) -> None:
        def ids(xs: Iterable[int]) -> torch.Tensor:
            return torch.tensor([t for t in xs if 0 <= t < vocab], dtype=torch.long, device=device)

        self.banned = ids((*req.eos_token_ids, *req.params.stop_token_ids))
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.seen[ids(req.prompt_token_ids)] = True
        self.counts = torch.zeros(vocab, device=device)
        self.counted = 0  # output tokens in counts and seen
        bias = {t: b for t, b in (req.params.logit_bias or {}).items() if 0 <= t < vocab}
        self.bias_ids, self.bias = ids(bias), torch.tensor(list(bias.values()), device=device)

    def update(self, output_token_ids: list[int]) -> None:
        """Count the output tokens sampled since the last update."""
        if len(output_token_ids) > self.counted:
            new = torch.tensor(
                output_token_ids[self.counted :], dtype=torch.long, device=self.counts.device
            )
            self.counts.index_add_(0, new, torch.ones(len(new), device=self.counts.device))
            self.seen[new] = True
            self.counted = len(output_token_ids)


@torch.inference_mode()
def apply_penalties(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """``logits`` ``[N, vocab]`` (row ``i`` for ``reqs[i]``) with each request's penalties applied (vLLM's
    semantics): the repetition penalty over prompt and output tokens, presence and frequency penalties
    over output tokens, and the logit bias (the ``min_tokens`` ban comes after the grammar masks:
    :func:`ban_until_min_tokens`). Rows without any are left alone; the tensor is changed in place
    and returned."""
    for i, req in enumerate(reqs):
        p = req.params
        if not p.penalised:
            continue
        if req.penalty_state is None:
            req.penalty_state = PenaltyState(req, logits.shape[-1], logits.device)
        state = req.penalty_state
        state.update(req.output_token_ids)
        row = logits[i]
        if p.repetition_penalty != 1.0:
            penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(state.seen, penalised, row))
        if p.presence_penalty or p.frequency_penalty:
            row -= p.frequency_penalty * state.counts + p.presence_penalty * (state.counts > 0).to(
                row.dtype
            )
        if p.logit_bias:
            row.index_add_(0, state.bias_ids, state.bias)
    return logits


@torch.inference_mode()
def ban_until_min_tokens(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """``logits`` (after :func:`apply_penalties` and the grammar masks) with eos and stop token ids at
    -inf in the rows of requests with fewer than ``min_tokens`` output tokens. Where a grammar allows
    nothing but those (it matches only the empty string, say), the grammar wins: the request ends
    before ``min_tokens``, as one whose grammar a token completed does, instead of failing with no
    token left to draw. Changed in place and returned."""
    for i, req in enumerate(reqs):
        if len(req.output_token_ids) >= req.params.min_tokens or req.penalty_state is None:
            continue
        row, banned = logits[i], req.penalty_state.banned
        kept = row[banned].clone() if req.grammar is not None else None
        row[banned] = float("-inf")
        if kept is not None and not torch.isfinite(row.max()):
            row[banned] = kept
    return logits


# The largest temperature the sampler divides float32 logits by: a larger one may not be a float32 at
# all (1e308 is inf there, and -inf / inf is NaN), and logits over 1e30 are all but equal anyway.
MAX_TEMPERATURE = 1e30


def _filter_top_k_top_p(
    logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:
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


def unusable_rows(logits: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: rows no token can be drawn from (a NaN or +inf logit, or every logit -inf).

    -inf alone is normal (banned and filtered tokens); NaN or +inf means the model's numbers broke for
    that row (an overflow in half precision, say), and ``torch.multinomial`` would raise on the whole
    batch. A row's maximum is NaN if any logit is, +inf if any is, -inf only if all are: one reduction
    over the batch (instead of three full passes) tells them all.
    """
    return ~torch.isfinite(logits.amax(-1))


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximal index. On the CPU through numpy: torch's argmax kernel took 4 ms for
    64 rows of a 32k vocabulary and 20 ms for 152k (one thread), numpy's 0.4 and 2 (same ties, the
    first maximum; a NaN counts as the maximum in both)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(-1))
    return logits.argmax(-1)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int | None]:
    """One token per row of ``logits`` ``[N, vocab]`` (float32); None for an unusable row (see
    :func:`unusable_rows`): that request fails alone, the rest of the batch goes on. Rows with
    structured outputs come with their masks applied (-inf where the grammar forbids a token:
    ``grammar.masks``)."""
    bad = unusable_rows(logits).tolist()
    # greedy rows are done; sampled rows overwrite below
    out: list[int | None] = _argmax(logits).tolist()
    for i, p in enumerate(params):
        if bad[i]:
            out[i] = None
        elif not p.greedy:
            # Above MAX_TEMPERATURE the draw is uniform over the allowed tokens in float32 anyway;
            # dividing by more made a masked token's -inf NaN (the temperature inf in float32).
            t = min(p.temperature, MAX_TEMPERATURE)
            row = _filter_top_k_top_p(logits[i] / t, p.top_k, p.top_p, p.min_p)
            probs = row.softmax(-1)
            if not torch.isfinite(probs.sum()):  # this request fails alone, not the whole batch
                out[i] = None
                continue
            out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out


def skip_draw(generator: torch.Generator, vocab: int) -> None:
    """Advance ``generator`` past one draw of :func:`sample` over ``vocab`` tokens. What a draw takes
    of the generator's sequence does not depend on the probabilities, so a seeded request continued
    on another worker (a decode worker, its first token sampled by the prefill worker) samples the
    tokens one worker would have."""
    torch.multinomial(torch.ones(vocab, device=generator.device), 1, generator=generator)


def token_logprobs(
    logprobs: torch.Tensor, tokens: Sequence[int], ks: Sequence[int]
) -> list[TokenLogprobs]:
    """Entries for rows of log-probabilities ``[R, vocab]``: row ``r``'s ``tokens[r]`` and its ``ks[r]``
    most likely tokens. All rows come to the host in two transfers, not a few per row."""
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[
        :, 0
    ].tolist()
    kmax = max(ks, default=0)
    # values first
    top_vals, top_ids = ([], []) if not kmax else (t.tolist() for t in torch.topk(logprobs, kmax))
    return [
        TokenLogprobs(token, lp, tuple(zip(top_ids[r][:k], top_vals[r][:k])) if k else ())
        for r, (token, lp, k) in enumerate(zip(tokens, chosen, ks))
    ]

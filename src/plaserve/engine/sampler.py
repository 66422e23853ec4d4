"""Token sampling: penalties, greedy, temperature, top-k, top-p, min-p, per-request seeds.

Penalties and the ``min_tokens`` ban change the logits first, for greedy and sampled requests alike (as
vLLM applies them; the ban after a grammar's mask, which it yields to); then greedy rows take the
argmax and the others draw from the filtered probabilities: one uniform number of the request's
generator a token, by inverse CDF (:func:`draw`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

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


# Top-p without sorting a large vocabulary (a sort of 152k logits costs over 100 passes over them): a
# histogram of the logits, _NUCLEUS_BINS bins from the maximum down to the lowest finite logit (at most
# _NUCLEUS_SPAN below, lower ones sharing the last bin), finds the bin the cut falls in, and only that
# bin is sorted. Rows of up to _NUCLEUS_SORT tokens are sorted whole: fewer operations.
_NUCLEUS_BINS = 1024
_NUCLEUS_SPAN = 32.0
_NUCLEUS_SORT = 4096


def draw_weights(
    logits: torch.Tensor, params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tokens one row ``[vocab]`` may draw after temperature, min-p, top-k and top-p (in that
    order, each on what the one before left), as ``(weights, ids)``: unnormalised probabilities and
    the token each is for, ``ids`` None when the weights cover the whole vocabulary."""
    x = logits / min(params.temperature, MAX_TEMPERATURE)
    ids = None
    if 0 < params.top_k < x.shape[-1]:
        x, ids = torch.topk(x, params.top_k)  # most likely first
    top = x.max()
    # float64 from here: the cumulative sums of a large vocabulary's weights need its precision
    weights = (x - top).exp().double()
    if params.min_p > 0:  # p < min_p * p_max; threshold() keeps what is above its bound: one below
        weights = F.threshold(weights, math.nextafter(params.min_p, 0.0), 0.0)
    if params.top_p < 1.0:
        if ids is None:
            return _nucleus(x, float(top), weights, params.top_p)
        weights.masked_fill_(~_top_p_cut(weights, params.top_p * weights.sum()), 0.0)
    return weights, ids


def _top_p_cut(
    weights: torch.Tensor, limit: torch.Tensor, above: torch.Tensor | float = 0.0
) -> torch.Tensor:
    """Which of ``weights`` (most likely first; ``above``: the mass of the tokens before them) top-p
    keeps: a token whose predecessors' mass is at most ``limit`` (top_p of the row's mass), so that
    the first is always kept."""
    return above + weights.cumsum(-1) - weights <= limit


def _nucleus(
    x: torch.Tensor, top: float, weights: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`draw_weights`' result for a row's top-p cut alone; ``weights`` are the logits ``x``'s
    relative to the most likely token (logit ``top``). See _NUCLEUS_BINS for how."""
    limit = top_p * weights.sum()
    if not torch.isfinite(limit):  # logits overflowed past the temperature: draw() refuses the row
        return weights, None
    if len(x) <= _NUCLEUS_SORT:
        w, order = torch.sort(weights, descending=True)
        return w.masked_fill_(~_top_p_cut(w, limit), 0.0), order
    low = max(float(x.nan_to_num(neginf=top).min()), top - _NUCLEUS_SPAN)
    # Bin 0 holds the most likely tokens; -inf falls in the last bin.
    scale = _NUCLEUS_BINS / max(top - low, 1e-30)
    bins = torch.sub(top, x).mul_(scale).clamp_(max=_NUCLEUS_BINS - 1).to(torch.int32)
    mass = torch.bincount(bins, weights=weights, minlength=_NUCLEUS_BINS)
    above = mass.cumsum(0) - mass
    over = (above + mass > limit).nonzero()[:, 0]
    if not len(over):  # top_p so near 1 that the rounding keeps every token
        return weights, None
    cut = int(over[0])  # the bin the cut falls in: the bins before it are kept, those after dropped
    weights.masked_fill_(bins > cut, 0.0)
    inside = (bins == cut).nonzero()[:, 0]
    w, order = torch.sort(weights[inside], descending=True)
    weights[inside[order[~_top_p_cut(w, limit, above[cut])]]] = 0.0
    return weights, None


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int | None:
    """Index of one draw from ``weights`` (unnormalised, >= 0) by inverse CDF: one uniform number of
    ``generator`` a draw, whatever the weights (:func:`skip_draw` relies on it), and one cumulative
    sum, where ``torch.multinomial`` costs many times more over a large vocabulary (docs/
    BENCHMARKS.md). None when the weights are not finite or all zero (an overflow past the
    temperature)."""
    cdf = weights.double().cumsum(-1)
    total = cdf[-1]
    if not bool(torch.isfinite(total) & (total > 0)):
        return None
    u = torch.rand(1, dtype=torch.float64, generator=generator, device=weights.device)
    i = int(torch.searchsorted(cdf, u * total, right=True))
    if i == len(cdf):  # u * total rounded up to total: the last token of weight > 0
        i = int(torch.searchsorted(cdf, total))
    return i


def unusable_rows(logits: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: rows no token can be drawn from (a NaN or +inf logit, or every logit -inf).

    -inf alone is normal (banned and filtered tokens); NaN or +inf means the model's numbers broke for
    that row (an overflow in half precision, say), and the row cannot be sampled. A row's maximum is
    NaN if any logit is, +inf if any is, -inf only if all are: one reduction over the batch (instead
    of three full passes) tells them all.
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
            weights, ids = draw_weights(logits[i], p)
            j = draw(weights, generators[i])  # None: this request fails alone, not the whole batch
            out[i] = j if j is None or ids is None else int(ids[j])
    return out


def skip_draw(generator: torch.Generator, vocab: int) -> None:
    """Advance ``generator`` past one draw of :func:`sample` over ``vocab`` tokens. What a draw takes
    of the generator's sequence does not depend on the probabilities, so a seeded request continued
    on another worker (a decode worker, its first token sampled by the prefill worker) samples the
    tokens one worker would have."""
    draw(torch.ones(vocab, device=generator.device), generator)


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

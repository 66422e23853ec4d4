"""A step's token masks: computed for the constrained rows only, on a worker thread while the forward
pass runs, and unpacked into the ``(rows, allowed)`` pair the sampler applies.

The mask of a step depends only on the tokens sampled before it, all known when the step starts, so
the runner starts the masks first and collects them once the logits exist; llguidance computes them
without the GIL, so they overlap with the forward pass. A batch with no constrained row starts
nothing and pays nothing.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import torch

_worker: concurrent.futures.ThreadPoolExecutor | None = None
_SHIFTS = torch.arange(32, dtype=torch.int32)


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _worker
    if _worker is None:
        _worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plaserve-masks")
    return _worker


def _fill(matchers: list[Any], bitmask: torch.Tensor) -> torch.Tensor:
    for k, m in enumerate(matchers):
        m.fill(bitmask, k)
    return bitmask


class PendingMasks:
    """The masks of one step's constrained requests, being computed (see :func:`start_masks`)."""

    def __init__(self, reqs: list[Any], future: concurrent.futures.Future[torch.Tensor]) -> None:
        self._index = {id(r): k for k, r in enumerate(reqs)}
        self._future = future

    def wait(
        self, reqs: Sequence[Any], vocab: int, device: torch.device
    ) -> tuple[torch.Tensor, ...]:
        """``(rows, allowed)``: the rows of ``reqs`` (the order of the logits) that are constrained,
        and their allowed tokens as a bool tensor ``[len(rows), vocab]`` on ``device``."""
        bitmask = self._future.result()
        rows = [i for i, r in enumerate(reqs) if id(r) in self._index]
        order = torch.tensor([self._index[id(reqs[i])] for i in rows], dtype=torch.long)
        packed = bitmask[order].to(device, non_blocking=True)
        bits = (packed.unsqueeze(-1) >> _SHIFTS.to(device)) & 1  # [k, words, 32], bit j of word w
        allowed = bits.reshape(len(rows), -1)[:, :vocab].bool()
        return torch.tensor(rows, dtype=torch.long, device=device), allowed


def start_masks(reqs: Sequence[Any]) -> PendingMasks | None:
    """Start computing the masks of ``reqs`` (the requests a step samples) that carry a grammar
    matcher (``req.grammar``); None when none does."""
    constrained = [r for r in reqs if r.grammar is not None]
    if not constrained:
        return None
    words = -(-constrained[0].grammar.vocab_size // 32)
    bitmask = torch.zeros((len(constrained), words), dtype=torch.int32)
    future = _pool().submit(_fill, [r.grammar for r in constrained], bitmask)
    return PendingMasks(constrained, future)

"""A step's token masks: computed for the constrained rows only, on a worker thread while the forward
pass runs, and unpacked into the ``(rows, allowed)`` pair the sampler applies.

The mask of a step depends only on the tokens sampled before it, all known when the step starts, so
the runner starts the masks first and collects them once the logits exist; llguidance computes them
without the GIL, so they overlap with the forward pass. A batch with no constrained row starts
nothing and pays nothing.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_worker: concurrent.futures.ThreadPoolExecutor | None = None
_SHIFTS = torch.arange(32, dtype=torch.int32)


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _worker
    if _worker is None:
        _worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plaserve-masks")
    return _worker


def _fill(matchers: list[Any], bitmask: torch.Tensor) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    for k, m in enumerate(matchers):
        m.fill(bitmask, k)
    return bitmask, time.perf_counter() - start


class PendingMasks:
    """The masks of one step's constrained requests, being computed (see :func:`start_masks`)."""

    def __init__(self, reqs: list[Any], future: concurrent.futures.Future) -> None:
        self._index = {id(r): k for k, r in enumerate(reqs)}
        self._future = future
        self.compute_s = 0.0  # the worker's time computing the masks
        self.wait_s = 0.0  # the part the sampler waited for (not hidden behind the forward pass)
        self.unpack_s = 0.0  # unpacking the bits into the banned-token rows

    def wait(
        self, reqs: Sequence[Any], vocab: int, device: torch.device
    ) -> tuple[list[int], torch.Tensor]:
        """``(rows, banned)``: the rows of ``reqs`` (the order of the logits) that are constrained,
        and the tokens each may not take next, a bool tensor ``[len(rows), vocab]`` on ``device``."""
        start = time.perf_counter()
        bitmask, self.compute_s = self._future.result()
        self.wait_s = time.perf_counter() - start
        rows = [i for i, r in enumerate(reqs) if id(r) in self._index]
        order = [self._index[id(reqs[i])] for i in rows]
        packed = bitmask[order] if order != list(range(len(bitmask))) else bitmask
        start = time.perf_counter()
        banned = _banned(packed, vocab, device)
        self.unpack_s = time.perf_counter() - start
        return rows, banned


def _banned(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """The complement of an allowed-token bitmask (int32 words, bit ``j`` of word ``w`` is token
    ``32 w + j``) as bools. On the CPU numpy unpacks the bytes in one pass (several times faster
    than torch's shifts); elsewhere the small bitmask goes to the device and unpacks there."""
    if device.type == "cpu":
        inverted = np.invert(bitmask.numpy()).view(np.uint8)
        bits = np.unpackbits(inverted, axis=1, bitorder="little")[:, :vocab]
        return torch.from_numpy(bits).view(torch.bool)
    return _banned_on_device(bitmask.to(device, non_blocking=True), vocab)


def _banned_on_device(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """:func:`_banned` by shifts, where ``bitmask`` is (a GPU's)."""
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1  # [k, words, 32]
    return bits.reshape(len(bitmask), -1)[:, :vocab] == 0


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

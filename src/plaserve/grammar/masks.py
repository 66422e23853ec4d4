"""A step's token masks: computed for the constrained rows only, on a worker thread while the forward
pass runs, and applied to those rows' logits once they exist.

The mask of a step depends only on the tokens sampled before it, all known when the step starts, so
the runner starts the masks first and applies them once the logits exist. The worker does all that
does not need the logits: llguidance fills the rows' bitmasks in one call for the whole batch
(without the GIL, and without a Python call per row, which would hand the GIL back and forth with
the forward pass). On CPUs where :func:`plaserve.model.kernels.token_mask` is built, that is all:
the step writes -inf into the banned logits straight from the bitmask (one masked store per 16
tokens), so the worker takes no CPU from the forward pass beyond llguidance's. Elsewhere on the CPU
numpy unpacks the bits on the worker into an additive mask, 0 where a token is allowed and -inf where
it is not, and the step adds it with one ``add_`` per run of adjacent constrained rows (branch-free: in
the benchmark's steps about half the time of a boolean ``masked_fill_`` over the same rows). Either
way the other rows are never touched. On a GPU the small bitmask goes to the device and unpacks
there. A batch with no constrained row starts nothing and pays nothing.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np
import torch

from plaserve.model.kernels import token_mask

_SHIFTS = torch.arange(32, dtype=torch.int32)
# float32 -inf's bits (0.0's are all zero): a banned token's bit times this is its -inf
_NEG_INF_BITS = np.uint32(0xFF800000)


def additive_on_cpu(bitmask: np.ndarray, vocab: int) -> torch.Tensor:
    """An allowed-token bitmask (int32 words, bit ``j`` of word ``w`` is token ``32 w + j``) as an
    additive float32 mask ``[rows, vocab]``: 0 where a token is allowed, -inf where not. numpy
    unpacks the inverted bytes in one pass (several times faster than torch's shifts on the CPU) and
    one multiply writes -inf's bits where a token is banned."""
    banned = np.unpackbits(
        np.invert(bitmask).view(np.uint8), axis=1, count=vocab, bitorder="little"
    )
    return torch.from_numpy(np.multiply(banned, _NEG_INF_BITS, dtype=np.uint32).view(np.float32))


def additive_on_device(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """:func:`additive_on_cpu` by shifts, on the bitmask's device (a GPU's)."""
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1  # [k, words, 32]
    banned = bits.reshape(len(bitmask), -1)[:, :vocab] == 0
    return torch.zeros(banned.shape, device=bitmask.device).masked_fill_(banned, float("-inf"))


_worker: concurrent.futures.ThreadPoolExecutor | None = None
_executor: llguidance.LLExecutor | None = None


def _pool() -> tuple[concurrent.futures.ThreadPoolExecutor, llguidance.LLExecutor]:
    global _worker, _executor
    if _worker is None:
        _worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plaserve-masks")
        _executor = llguidance.LLExecutor(1)  # one thread: the forward pass has the others
    assert _executor is not None
    return _worker, _executor


def _compute(matchers: list[Any], vocab: int, unpack: bool) -> tuple[torch.Tensor, float]:
    """The worker's part: the rows' bitmasks (int32), unpacked into additive masks if ``unpack``."""
    start = time.perf_counter()
    words = -(-vocab // 32)
    bitmask = np.zeros((len(matchers), words), dtype=np.int32)
    _, executor = _pool()
    executor.unsafe_compute_mask_ptr(
        [(m.inner, k) for k, m in enumerate(matchers)],
        bitmask.ctypes.data,
        words * 4,
        len(matchers),
    )
    out = additive_on_cpu(bitmask, vocab) if unpack else torch.from_numpy(bitmask)
    return out, time.perf_counter() - start


def _runs(rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """``rows`` as runs of adjacent ascending rows: ``(index in rows, first row, length)``."""
    out: list[tuple[int, int, int]] = []
    for k, r in enumerate(rows):
        if out and out[-1][1] + out[-1][2] == r:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((k, r, 1))
    return out


class PendingMasks:
    """The masks of one step's constrained rows, being computed (see :func:`start_masks`)."""

    def __init__(
        self, rows: list[int], future: concurrent.futures.Future, native: bool = False
    ) -> None:
        self.rows = rows  # the constrained rows of the step's logits, ascending: mask k is row k's
        self._future = future
        # The native kernel's row index, where it applies (a bitmask left packed on the CPU). Made
        # now, not in apply(): just after the step's inputs were made the same way, its code is
        # still in cache (after the forward pass the same call took ~20x as long).
        self._row_index = torch.tensor(rows) if native else None
        self.compute_s = 0.0  # the worker's time computing (and, on the CPU, unpacking) the masks
        self.wait_s = 0.0  # the part the step waited for (not hidden behind the forward pass)
        self.apply_s = 0.0  # applying them to the constrained rows' logits

    def apply(self, logits: torch.Tensor) -> None:
        """-inf into the constrained rows of ``logits`` (the step's ``[samples, vocab]``) wherever a
        row's grammar does not allow the token next; its allowed logits stay exactly as they are, and
        the other rows are not touched."""
        start = time.perf_counter()
        mask, self.compute_s = self._future.result()
        self.wait_s = time.perf_counter() - start
        start = time.perf_counter()
        if self._row_index is not None:
            native = token_mask()  # a bitmask left packed on the CPU: the native kernel is there
            assert native is not None and mask.dtype == torch.int32
            with torch.inference_mode():  # the logits are an inference tensor
                native(logits, mask, self._row_index)
            self.apply_s = time.perf_counter() - start
            return
        if mask.dtype == torch.int32:  # a bitmask for the device to unpack
            mask = additive_on_device(mask.to(logits.device), logits.shape[-1])
        with torch.inference_mode():  # the logits are an inference tensor
            for k, i, n in _runs(self.rows):
                logits[i : i + n].add_(mask[k : k + n])
        self.apply_s = time.perf_counter() - start


def start_masks(reqs: Sequence[Any], device: torch.device | None = None) -> PendingMasks | None:
    """Start computing the masks of ``reqs`` (the requests a step samples, in the order of its logits'
    rows, on ``device``: the CPU by default) that carry a grammar matcher (``req.grammar``); None
    when none does."""
    rows = [k for k, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return None
    on_cpu = device is None or device.type == "cpu"
    native = on_cpu and token_mask() is not None
    matchers = [reqs[k].grammar for k in rows]
    worker, _ = _pool()
    future = worker.submit(_compute, matchers, matchers[0].vocab_size, on_cpu and not native)
    return PendingMasks(rows, future, native)

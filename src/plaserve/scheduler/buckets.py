"""Length buckets: short prompts are grouped by the power of two they pad up to.

A right-padded batch of ``B`` prompts in bucket ``b`` costs about ``B * b`` tokens of work, so grouping
prompts of similar length keeps padding waste under 2x, and the set of shapes small enough that a
static runner (a CUDA graph on GPUs) exists for each.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")

MIN_BUCKET = 16


def make_buckets(max_len: int, min_bucket: int = MIN_BUCKET) -> list[int]:
    """Powers of two from ``min_bucket`` up to the first one that holds ``max_len - 1`` tokens
    (short prompts are those with fewer than ``max_len`` tokens)."""
    buckets = [min_bucket]
    while buckets[-1] < max_len - 1:
        buckets.append(buckets[-1] * 2)
    return buckets


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """Smallest bucket holding ``n`` tokens (None when ``n`` exceeds the largest)."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def batch_sizes(max_batch: int) -> list[int]:
    """Captured batch sizes: powers of two up to ``max_batch`` (a batch pads up to the next one)."""
    sizes = [1]
    while sizes[-1] * 2 <= max_batch:
        sizes.append(sizes[-1] * 2)
    return sizes


def pick_bucket_batch(
    items: Iterable[T],
    length: "callable[[T], int]",
    buckets: Sequence[int],
    max_batch_for: "callable[[int], int]",
) -> tuple[list[T], int] | None:
    """Group ``items`` (in priority order: the pla scheduler's deadline order) into one bucket batch.

    The bucket is that of the first item, so no short request is overtaken forever by a busier
    bucket; the batch takes the first items of exactly that bucket (no cross-bucket padding), up to
    ``max_batch_for(bucket)`` of them. Returns ``(items, bucket)``, or None if ``items`` is empty.
    """
    items = list(items)
    if not items:
        return None
    bucket = bucket_for(length(items[0]), buckets)
    assert bucket is not None, "a short request longer than the largest bucket"
    chosen = [it for it in items if bucket_for(length(it), buckets) == bucket][
        : max_batch_for(bucket)
    ]
    return chosen, bucket

"""The two counters that bound how long one kind of work can hold the machine in pla.

* ``K`` (``max_consecutive_short``): short batches in a row while a long prefill is pending; then a
  long chunk is due, so long prompts progress under any stream of shorts.
* ``D`` (``max_prefill_steps_between_decodes``): steps without decode tokens in a row while requests
  decode; then decodes are due, which bounds the time between two tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from plaserve.scheduler.base import ScheduledBatch


def carries_decodes(batch: ScheduledBatch) -> bool:
    """Whether ``batch`` computes a decode token (a one-token item of a request that has output)."""
    return any(it.num_tokens == 1 and it.request.output_token_ids for it in batch.items)


@dataclass
class Cadence:
    """Counts short batches since the last long chunk and steps since decodes last ran."""

    k: int
    d: int
    consecutive_short: int = 0
    steps_since_decode: int = 0

    def long_due(self, long_pending: bool) -> bool:
        """Whether the next prefill step must be a long chunk."""
        return long_pending and self.consecutive_short >= self.k

    def decode_due(self, decoding: bool) -> bool:
        """Whether the next step must carry the decodes."""
        return decoding and self.steps_since_decode >= self.d

    def record(self, batch: ScheduledBatch) -> None:
        """Count ``batch``, the step just scheduled (an empty one counts for nothing)."""
        if not batch:
            return
        self.steps_since_decode = 0 if carries_decodes(batch) else self.steps_since_decode + 1
        if batch.kind == "short":
            self.consecutive_short += 1
        elif batch.kind == "long":
            self.consecutive_short = 0

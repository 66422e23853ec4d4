"""The step policies, by name (``--policy``): what one engine step computes.

* ``fcfs`` — vLLM's default: first come first served; running requests (decodes and unfinished
  prefills) first, then new prompts, chunked to fill a per-step token budget; decodes share the step.
* ``spf`` — shortest prefill first: as fcfs, but waiting prompts start in order of their uncached
  length (SGLang's shortest-first style). Good for short TTFT; can starve long prompts.
* ``pla`` — prefill-length-aware (ours, :mod:`plaserve.scheduler.pla`): a short and a long queue;
  each step runs a short batch, a long chunk or a decode batch. Its guarantees are in
  docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from plaserve.request import Request
from plaserve.scheduler.base import BatchItem, ScheduledBatch, Scheduler
from plaserve.scheduler.pla import PlaScheduler


class FcfsScheduler(Scheduler):
    """First come, first served with chunked prefill and decode mixed in (vLLM's default)."""

    name = "fcfs"

    def waiting_order(self) -> list[Request]:
        """The order in which waiting requests may start."""
        return list(self.waiting)

    def schedule(self, now: float) -> ScheduledBatch:
        items: list[BatchItem] = []
        preempted: list[Request] = []
        # Running requests first (decodes and unfinished prefills), oldest first; then new ones.
        self.pack(
            [*self.running, *self.waiting_order()], self.max_num_batched_tokens, items, preempted
        )
        return ScheduledBatch(items, kind="mixed", preempted=preempted)


class SpfScheduler(FcfsScheduler):
    """Shortest (uncached) prefill first; otherwise identical to fcfs."""

    name = "spf"

    def waiting_order(self) -> list[Request]:
        # Stable sort: equal lengths keep arrival order. Lengths are the arrival-time estimates, so a
        # step does not re-hash every waiting prompt against the prefix cache.
        return sorted(self.waiting, key=lambda r: r.uncached_estimate)


POLICIES: dict[str, type[Scheduler]] = {
    cls.name: cls for cls in (PlaScheduler, FcfsScheduler, SpfScheduler)
}

"""A model-free batch runner and clock: the real scheduler runs, time comes from the cost model.

Tests use it to check scheduling guarantees deterministically; the cluster simulator uses it to run
the real policies at scale.
"""

from __future__ import annotations

from plaserve.cost import CostModel
from plaserve.scheduler.base import ScheduledBatch


class SimClock:
    """A clock that only moves when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)


class CostRunner:
    """Executes a batch by advancing ``clock`` by its predicted time; samples ``token`` every time.

    A padded short batch costs its padded work (``bucket`` tokens per row), as on the real engine.
    """

    def __init__(self, cost: CostModel, clock: SimClock, token: int = 65) -> None:
        self.cost, self.clock, self.token = cost, clock, token
        self.batches: list[tuple[float, float, ScheduledBatch]] = []  # (start, end, batch) log

    def batch_time(self, batch: ScheduledBatch) -> float:
        from plaserve.engine.engine import batch_work

        return self.cost.batch_time(batch_work(batch))

    def execute(self, batch: ScheduledBatch) -> dict[int, int]:
        start = self.clock.now
        self.clock.advance(self.batch_time(batch))
        self.batches.append((start, self.clock.now, batch))
        return {i: self.token for i, item in enumerate(batch.items) if item.samples}

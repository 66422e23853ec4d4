"""The engine thread publishes its load as each step starts, with the inbox taken in."""

from __future__ import annotations

import asyncio
import time

import pytest

from plaserve import EngineConfig, LLMEngine
from plaserve.cost import CostModel
from plaserve.engine.request import SamplingParams
from plaserve.server.engine_loop import EngineLoop, OutputSink, Submission


class RecordingRunner:
    """A model-free runner that, at every step, compares the published snapshot with the engine."""

    def __init__(self) -> None:
        self.loop: EngineLoop | None = None
        self.engine: LLMEngine | None = None
        self.checks: list[tuple[dict, dict, float]] = []  # (published load, the engine's load now, age)

    def execute(self, batch) -> dict[int, int]:
        snap = self.loop.snapshot()
        self.checks.append((snap.load, self.engine.load_report(), snap.age))
        time.sleep(0.005)  # the step takes time: requests submitted meanwhile wait in the inbox
        return {i: 65 for i, item in enumerate(batch.items) if item.samples}


def test_snapshot_is_the_state_as_each_step_starts():
    runner = RecordingRunner()
    config = EngineConfig.from_kwargs(kv_cache_memory="64MiB", max_model_len=4096, enable_prefix_caching=False, policy="fcfs",
                                      max_num_batched_tokens=256)
    engine = LLMEngine(config, runner=runner, cost=CostModel(g1=1e-4, g2=0.0))
    loop = EngineLoop(engine, snapshot_interval=0.0)
    runner.loop, runner.engine = loop, engine

    async def main() -> int:
        queue: asyncio.Queue = asyncio.Queue()
        sink = OutputSink(asyncio.get_running_loop(), queue)
        loop.start()
        finished = 0
        for i in range(6):  # arrivals while earlier requests prefill (in 256-token chunks) and decode
            loop.submit([Submission(f"r{i}", [7] * (100 + 300 * i), SamplingParams(max_tokens=3, ignore_eos=True),
                                    engine.clock(), sink)])
            await asyncio.sleep(0.004)
        while finished < 6:
            _, out = await asyncio.wait_for(queue.get(), 10)
            finished += out.finished
        loop.stop()
        return finished

    assert asyncio.run(main()) == 6
    assert len(runner.checks) > 6
    for published, now, age in runner.checks:
        # Taken after the inbox was applied and before the step: exactly the engine's state as it runs.
        assert published["backlog_s"] == {k: pytest.approx(v) for k, v in now["backlog_s"].items()}
        assert published["num_requests"] == now["num_requests"]
        assert 0 <= age < 1.0
    final = loop.snapshot().load
    assert final["num_requests"] == 0 and sum(final["backlog_s"].values()) == 0  # published on going idle

"""The engine thread publishes its load as each step starts, with the inbox taken in."""

from __future__ import annotations

import asyncio
import time

import pytest

from plaserve import EngineConfig, LLMEngine
from plaserve.cost import CostModel
from plaserve.request import SamplingParams
from plaserve.server.engine_loop import EngineLoop, OutputSink, Submission


class RecordingRunner:
    """A model-free runner that, at every step, compares the published snapshot with the engine."""

    def __init__(self) -> None:
        self.loop: EngineLoop | None = None
        self.engine: LLMEngine | None = None
        self.checks: list[
            tuple[dict, dict, float]
        ] = []  # (published load, the engine's load now, age)

    def execute(self, batch) -> dict[int, int]:
        snap = self.loop.snapshot()
        self.checks.append((snap.load, self.engine.load_report(), snap.age))
        time.sleep(0.005)  # the step takes time: requests submitted meanwhile wait in the inbox
        return {i: 65 for i, item in enumerate(batch.items) if item.samples}


def test_snapshot_is_the_state_as_each_step_starts():
    runner = RecordingRunner()
    config = EngineConfig.from_kwargs(
        kv_cache_memory="64MiB",
        max_model_len=4096,
        enable_prefix_caching=False,
        policy="fcfs",
        max_num_batched_tokens=256,
    )
    engine = LLMEngine(config, runner=runner, cost=CostModel(g1=1e-4, g2=0.0))
    loop = EngineLoop(engine, snapshot_interval=0.0)
    runner.loop, runner.engine = loop, engine

    async def main() -> int:
        queue: asyncio.Queue = asyncio.Queue()
        sink = OutputSink(asyncio.get_running_loop(), queue)
        loop.start()
        finished = 0
        # arrivals while earlier requests prefill (in 256-token chunks) and decode
        for i in range(6):
            loop.submit(
                [
                    Submission(
                        f"r{i}",
                        [7] * (100 + 300 * i),
                        SamplingParams(max_tokens=3, ignore_eos=True),
                        engine.clock(),
                        sink,
                    )
                ]
            )
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
    # published on going idle
    assert final["num_requests"] == 0 and sum(final["backlog_s"].values()) == 0


class TokenRunner:
    """A model-free runner: every sampling item gets token 65, after a short sleep per step."""

    def execute(self, batch) -> dict[int, int]:
        time.sleep(0.002)
        return {i: 65 for i, item in enumerate(batch.items) if item.samples}


def test_choices_wait_for_the_first_to_share_its_prefill():
    """Choices submitted ``after`` a sibling enter the engine only once it has its first token, then find
    its full prompt blocks in the prefix cache; one aborted while held is dropped; nothing leaks."""
    config = EngineConfig.from_kwargs(kv_cache_memory="64MiB", max_model_len=4096, policy="fcfs")
    engine = LLMEngine(config, runner=TokenRunner(), cost=CostModel(g1=1e-4, g2=0.0))
    loop = EngineLoop(engine, snapshot_interval=0.0)
    prompt, params = list(range(1, 101)), SamplingParams(max_tokens=3, ignore_eos=True)

    async def main() -> dict[str, float]:
        queue: asyncio.Queue = asyncio.Queue()
        sink = lambda i: OutputSink(asyncio.get_running_loop(), queue, i)  # noqa: E731
        loop.start()
        subs = [Submission("c-0", prompt, params, engine.clock(), sink(0))]
        subs += [
            Submission(f"c-{i}", prompt, params, engine.clock(), sink(i), after="c-0")
            for i in (1, 2, 3)
        ]
        loop.submit(subs)
        loop.abort("c-3")  # taken in with the submissions: c-3 is held, so it is just dropped
        first_tokens: dict[str, float] = {}
        finished = 0
        while finished < 3:
            i, out = await asyncio.wait_for(queue.get(), 10)
            first_tokens[out.request_id] = out.metrics.first_token_time
            finished += out.finished
        loop.stop()
        assert queue.empty()  # nothing ever came for c-3
        return first_tokens

    first_tokens = asyncio.run(main())
    assert set(first_tokens) == {"c-0", "c-1", "c-2"}
    assert first_tokens["c-1"] > first_tokens["c-0"] and first_tokens["c-2"] > first_tokens["c-0"]
    # 100 prompt tokens: 6 full blocks of 16 are shared with each later choice.
    assert engine.allocator.num_cache_hits == 2 * 96
    assert (
        engine.allocator.num_used_blocks == 0
        and engine.num_waiting == 0
        and not engine.has_unfinished()
    )


def test_on_own_thread_builds_and_steps_the_engine_on_one_thread():
    """libgomp gives each thread that runs parallel regions a team of its own; the server's engine is
    built, warmed up and stepped on one thread, so there is one (engine/omp_spin.py)."""
    import threading

    built_on: list[int] = []

    def build() -> LLMEngine:
        built_on.append(threading.get_ident())
        engine = LLMEngine(EngineConfig.from_kwargs(kv_cache_memory="64MiB", max_model_len=256))
        engine.warm_up()
        return engine

    loop = EngineLoop.on_own_thread(build, max_queue=4)
    try:
        assert loop.alive and loop.max_queue == 4
        assert built_on[0] != threading.get_ident()

        async def steps_on() -> int:
            return await loop.call(lambda _: threading.get_ident())

        assert asyncio.run(steps_on()) == built_on[0]
    finally:
        loop.stop()
    assert not loop.alive


def test_on_own_thread_raises_what_building_raised():
    def build() -> LLMEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        EngineLoop.on_own_thread(build)

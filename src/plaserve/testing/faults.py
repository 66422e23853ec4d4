"""Fault injection for supervision tests: a runner whose chosen steps raise, and a picklable builder of
an engine that has one (for an engine in its own process, where the test cannot reach the engine)."""

from __future__ import annotations

from typing import Any

from plaserve.config import EngineConfig
from plaserve.engine.engine import LLMEngine


class FailingRunner:
    """Wraps an engine's runner: the steps numbered in ``fail_at`` (counting from 1) raise."""

    def __init__(self, inner: Any, fail_at: set[int]) -> None:
        self.inner = inner
        self.fail_at = fail_at
        self.calls = 0

    def execute(self, batch: Any) -> Any:
        self.calls += 1
        if self.calls in self.fail_at:
            raise RuntimeError(f"injected failure at step {self.calls}")
        return self.inner.execute(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def failing_engine(fail_at: set[int], **engine_kwargs: Any) -> LLMEngine:
    """An engine (``EngineConfig.from_kwargs(**engine_kwargs)``) whose steps in ``fail_at`` raise."""
    engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs))
    engine.runner = FailingRunner(engine.runner, fail_at)
    return engine

"""The in-process policy comparison: one engine per policy, the same trace slice on the wall clock.

Each policy gets a fresh engine with identical settings; requests are added when their (scaled)
arrival time comes, with that time as their arrival, so time spent waiting for a running step counts
toward TTFT exactly as it would behind an HTTP server. Used by ``benchmarks/policies.py`` and
``plaserve demo``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from plaserve.config import EngineConfig
from plaserve.cost import CostModel
from plaserve.engine.engine import LLMEngine
from plaserve.model.loader import LoadedModel
from plaserve.request import Request, SamplingParams
from plaserve.sim.replay import random_prompt, replay_into
from plaserve.slo import SloRule  # the scheduler's rule (the benchmarks import it from here)
from plaserve.workload.report import RequestRecord
from plaserve.workload.trace import TraceRequest

log = logging.getLogger(__name__)


def fit_cost_model(
    engine: LLMEngine,
    lengths: Sequence[int] = (32, 128, 512, 1024, 2048),
    repeats: int = 3,
    seed: int = 0,
) -> CostModel:
    """Measure isolated prefill times on ``engine`` and fit ``c0 + g1*L + g2*L^2/2`` by least squares.

    (The calibration command does this thoroughly; the benchmark needs a quick, honest estimate to set
    its load and SLOs before it looks at any result.)
    """
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    best: dict[int, float] = {}
    for rep in range(repeats + 1):  # the first pass only warms up
        for n in lengths:
            req = engine.add_request(
                random_prompt(n, vocab, gen), SamplingParams(max_tokens=1, temperature=0)
            )
            while not req.finished:
                engine.step()
                if engine.last_batch is None:
                    engine.wait_for_work()
            took = sum(e - s for s, e, _ in req.metrics.prefill_chunks)
            if rep > 0:  # the fastest repeat: noise on a shared machine only ever adds time
                best[n] = min(best.get(n, took), took)
    a = np.array([[1.0, n, n * n / 2] for n in best])
    coef, *_ = np.linalg.lstsq(a, np.array(list(best.values())), rcond=None)
    c0, g1, g2 = (max(0.0, float(c)) for c in coef)
    return CostModel(g1=g1, g2=g2, c0=c0, source="fit")


@dataclass
class PolicyRun:
    """What one policy did on one slice."""

    policy: str
    requests: list[Request]
    wall_s: float
    busy_s: float  # time spent inside engine steps

    @property
    def utilization(self) -> float:
        return self.busy_s / self.wall_s if self.wall_s else 0.0


def run_policy(
    loaded: LoadedModel,
    config: EngineConfig,
    cost: CostModel,
    arrivals: Sequence[TraceRequest],
    *,
    seed: int = 0,
    deadline_s: float | None = None,
) -> PolicyRun:
    """Replay ``arrivals`` on the wall clock into a fresh engine; stops at ``deadline_s`` if given."""
    engine = LLMEngine(config, loaded=loaded, cost=cost)

    def sleep_until(t: float) -> None:
        time.sleep(max(0.0, t - engine.clock()))

    run = replay_into(engine, arrivals, sleep_until, horizon=deadline_s, seed=seed)
    return PolicyRun(config.scheduler.policy, run.requests, run.wall, run.busy)


def to_record(req: Request, slo: SloRule, cost: CostModel) -> RequestRecord:
    """A benchmark record of a replayed request (one without a first token counts as failed)."""
    m = req.metrics
    ttft = None if m.first_token_time is None else m.first_token_time - m.arrival_time
    e2e = None if m.finish_time is None or not req.finished else m.finish_time - m.arrival_time
    gaps = [b - a for a, b in zip(m.token_times, m.token_times[1:])]
    return RequestRecord(
        length_class=req.length_class,
        prompt_tokens=req.num_prompt_tokens,
        output_tokens=len(req.output_token_ids),
        arrival=m.arrival_time,
        ttft=ttft,
        e2e=e2e,
        tbts=gaps,
        slo_ttft=slo.ttft(cost, req.num_prompt_tokens),
        error=None if req.finished else "unfinished at the end of the run",
    )


def with_policy(config: EngineConfig, policy: str) -> EngineConfig:
    return dataclasses.replace(
        config, scheduler=dataclasses.replace(config.scheduler, policy=policy)
    )

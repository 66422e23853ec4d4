"""Replay arrivals into an engine on a simulated clock (the scheduler is the real one)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from plaserve.engine.engine import LLMEngine
from plaserve.request import Request, SamplingParams
from plaserve.sim.runner import SimClock


class Arrival(Protocol):
    arrival: float
    prompt_tokens: int
    output_tokens: int


def random_prompt(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    """``n`` random token ids; random enough that prompts share no cached prefix by accident."""
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


@dataclass
class Replay:
    """What a replay did: the requests in arrival order, its length and the time spent in steps."""

    requests: list[Request]
    wall: float  # seconds from the start to the end, on the engine's clock
    busy: float  # seconds of it spent inside steps that ran a batch


def replay_into(
    engine: LLMEngine,
    arrivals: Sequence[Arrival],
    wait_until: Callable[[float], None],
    *,
    start: float | None = None,
    horizon: float | None = None,
    seed: int = 0,
) -> Replay:
    """Feed ``arrivals`` to ``engine`` at their times (seconds after ``start``, by default the engine's
    clock now) and step until all finish or ``horizon`` seconds have passed. Any clock the engine reads
    serves: ``wait_until(t)`` makes it reach ``t`` when there is nothing to do (a simulated clock jumps
    there, the wall clock sleeps). Each request gets a random prompt of its length (drawn before the
    replay starts, so drawing costs no replay time), greedy, exactly its output length. Afterwards
    every timestamp of the requests is relative to ``start``."""
    pending = sorted(arrivals, key=lambda a: a.arrival)
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    prompts = [random_prompt(a.prompt_tokens, vocab, gen) for a in pending]
    t0 = engine.clock() if start is None else start
    reqs: list[Request] = []
    busy, i, stalls = 0.0, 0, 0
    while i < len(pending) or engine.has_unfinished():
        now = engine.clock()
        if horizon is not None and now - t0 > horizon:
            break
        while i < len(pending) and t0 + pending[i].arrival <= now:
            a = pending[i]
            params = SamplingParams(max_tokens=a.output_tokens, temperature=0, ignore_eos=True)
            reqs.append(engine.add_request(prompts[i], params, arrival_time=t0 + a.arrival))
            i += 1
        before = engine.clock()
        engine.step_requests()
        if engine.last_batch is not None:
            busy += engine.clock() - before
            stalls = 0
            continue
        # Idle: wait for the policy's next wake-up or the next arrival.
        nxt = t0 + pending[i].arrival if i < len(pending) else None
        events = [t for t in (engine.next_wakeup(), nxt) if t is not None]
        if not events:
            break
        stalls = stalls + 1 if min(events) <= engine.clock() and i >= len(pending) else 0
        if stalls > 2:  # the policy keeps promising work now and runs none
            raise RuntimeError(f"scheduler stalled with work left at t={engine.clock() - t0:.3f}")
        wait_until(min(events))
    wall = engine.clock() - t0
    for r in reqs:  # anything left unfinished at the horizon stays unfinished (no first token)
        m = r.metrics
        m.arrival_time -= t0
        for name in ("first_token_time", "finish_time", "first_scheduled_time"):
            if getattr(m, name) is not None:
                setattr(m, name, getattr(m, name) - t0)
        m.token_times = [t - t0 for t in m.token_times]
        m.prefill_chunks = [(s - t0, e - t0, n) for s, e, n in m.prefill_chunks]
    return Replay(reqs, wall, busy)


def replay(
    engine: LLMEngine,
    clock: SimClock,
    arrivals: Sequence[Arrival],
    *,
    horizon: float | None = None,
    seed: int = 0,
) -> list[Request]:
    """:func:`replay_into` on the simulated ``clock``, arrival times read as its times (from 0).
    Returns the requests in arrival order."""
    return replay_into(
        engine, arrivals, clock.advance_to, start=0.0, horizon=horizon, seed=seed
    ).requests

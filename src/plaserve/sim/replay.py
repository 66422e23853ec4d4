"""Replay arrivals into an engine on a simulated clock (the scheduler is the real one)."""

from __future__ import annotations

from collections.abc import Sequence
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


def replay(
    engine: LLMEngine,
    clock: SimClock,
    arrivals: Sequence[Arrival],
    *,
    horizon: float | None = None,
    seed: int = 0,
) -> list[Request]:
    """Feed ``arrivals`` (sorted by time) to ``engine`` at their times and step until all finish or the
    clock passes ``horizon``. Returns the requests in arrival order."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    pending = sorted(arrivals, key=lambda a: a.arrival)
    reqs: list[Request] = []
    i = 0
    while i < len(pending) or engine.has_unfinished():
        if horizon is not None and clock.now > horizon:
            break
        while i < len(pending) and pending[i].arrival <= clock.now:
            a = pending[i]
            params = SamplingParams(max_tokens=a.output_tokens, temperature=0, ignore_eos=True)
            reqs.append(
                engine.add_request(
                    random_prompt(a.prompt_tokens, vocab, gen), params, arrival_time=a.arrival
                )
            )
            i += 1
        engine.step_requests()
        if engine.last_batch is None:  # idle: jump to the next event
            wake = engine.next_wakeup()
            nxt = pending[i].arrival if i < len(pending) else None
            events = [t for t in (wake, nxt) if t is not None]
            if not events:
                break
            if min(events) <= clock.now and i >= len(pending):
                raise RuntimeError(f"scheduler stalled with work left at t={clock.now:.3f}")
            clock.advance_to(min(events))
    return reqs

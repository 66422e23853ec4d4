"""A burst on the simulated clock: what each policy's steps hold (docs/POLICIES.md, "Bursts").

    PYTHONPATH=src .venv/bin/python benchmarks/burst_steps.py [--policies fcfs,pla] [--verbose]

engine_vs_vllm.py's burst (Azure conversation trace rows 840-899, lengths x0.25, outputs <= 32, all
arriving at once; max-num-seqs 64, max-num-batched-tokens 2048) through the real schedulers on a
:class:`~plaserve.sim.runner.CostRunner`: the step model of docs/policy_slices_models.json times the
steps, the isolated prefill fit is the schedulers' model (as in the load sweep). Per policy: the
simulated time, the steps of each kind, prefill tokens and decode rows a step; ``--verbose`` lists every
step. Seconds to run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from plaserve.config import EngineConfig, SchedulerConfig  # noqa: E402
from plaserve.cost import CostModel  # noqa: E402
from plaserve.engine.engine import LLMEngine  # noqa: E402
from plaserve.sim.replay import replay  # noqa: E402
from plaserve.sim.runner import CostRunner, SimClock  # noqa: E402
from plaserve.workload.trace import load_trace  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", default="fcfs,pla")
    ap.add_argument(
        "--models", default=os.path.join(HERE, "..", "docs", "policy_slices_models.json")
    )
    ap.add_argument("--trace", default="/work/shared/traces/azure_conv_2023.csv")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    with open(args.models) as f:
        models = json.load(f)
    cost, step = CostModel(**models["cost_model"]), CostModel(**models["step_cost_model"])
    rows = load_trace(args.trace, start=840, limit=60, length_scale=0.25, max_output_tokens=32)
    burst = [replace(r, arrival=0.0) for r in rows]
    for policy in args.policies.split(","):
        sched = SchedulerConfig(policy=policy, max_num_seqs=64, max_num_batched_tokens=2048)
        clock = SimClock()
        engine = LLMEngine(
            EngineConfig(max_model_len=4608, scheduler=sched),
            runner=CostRunner(step, clock),
            cost=cost,
            clock=clock,
        )
        reqs = replay(engine, clock, burst)
        kinds: dict[str, list[tuple[float, int, int, int]]] = collections.defaultdict(list)
        for start, end, batch in engine.runner.batches:
            # Read after the replay, so a decode is told by its one token (a one-token prefill chunk,
            # rare, counts as a decode).
            prefill = [it for it in batch.items if it.num_tokens > 1]
            decodes = len(batch.items) - len(prefill)
            tokens = sum(it.num_tokens for it in prefill)
            kinds[batch.kind].append((end - start, tokens, len(prefill), decodes))
            if args.verbose:
                print(
                    f"  {start:7.3f} s {batch.kind:6s} prefill {tokens:5d} tokens of "
                    f"{len(prefill):2d} requests, {decodes:2d} decodes"
                )
        ttft = sorted(r.metrics.ttft for r in reqs)
        print(
            f"{policy}: {clock.now:.2f} s simulated, {len(engine.runner.batches)} steps, "
            f"TTFT p50 {ttft[len(ttft) // 2]:.2f} s, max {ttft[-1]:.2f} s"
        )
        for kind, steps in kinds.items():
            n = len(steps)
            print(
                f"  {kind:6s} {n:3d} steps, {sum(s[0] for s in steps):5.2f} s; a step: "
                f"{sum(s[1] for s in steps) / n:5.0f} prefill tokens of "
                f"{sum(s[2] for s in steps) / n:4.1f} requests, {sum(s[3] for s in steps) / n:4.1f} "
                f"decodes"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

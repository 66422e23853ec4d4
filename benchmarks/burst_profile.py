"""engine_vs_vllm.py's burst through an offline engine: wall time, the steps of each kind, and where
the time goes (torch profiler) -- the burst without HTTP (docs/BENCHMARKS.md).

The Azure conversation trace rows 840-899, lengths x 0.25, outputs <= 32, all at once; random prompt
ids; max-num-seqs 64, max-num-batched-tokens 2048, as the served run. A burst warms up, ``--runs``
more are timed, then one is profiled.

    PYTHONPATH=src .venv/bin/python benchmarks/burst_profile.py [--policy fcfs] [--model DIR] [--runs N]
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time

from plaserve import EngineConfig, LLMEngine, SamplingParams  # isort: skip  (before torch)

from torch.profiler import profile

from plaserve.workload.trace import load_trace


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--policy", default="fcfs")
    p.add_argument("--model", default=None, help="checkpoint dir (default: the embedded model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--trace", default="/work/shared/traces/azure_conv_2023.csv")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block, tokens")
    p.add_argument(
        "--runs",
        type=int,
        default=1,
        help="timed bursts before the profiled one (all walls printed)",
    )
    args = p.parse_args()
    reqs = load_trace(args.trace, start=840, limit=60, length_scale=0.25, max_output_tokens=32)
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=args.model,
            kv_cache_memory="2GiB",
            max_model_len=4608,
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            policy=args.policy,
            dtype=args.dtype,
            block_size=args.block_size,
        )
    )
    engine.warm_up()
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)

    def run() -> tuple[float, list[tuple[float, int, int]]]:
        for r in reqs:
            prompt = [rng.randrange(10, vocab) for _ in range(r.prompt_tokens)]
            engine.add_request(
                prompt, SamplingParams(max_tokens=r.output_tokens, temperature=0, ignore_eos=True)
            )
        steps = []
        start = time.perf_counter()
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            took = time.perf_counter() - t
            items = engine.last_batch.items if engine.last_batch is not None else []
            prefill = sum(i.num_tokens for i in items if i.num_tokens > 1)
            steps.append((took, prefill, sum(1 for i in items if i.num_tokens == 1)))
        return time.perf_counter() - start, steps

    print(
        f"{len(reqs)} requests, {sum(r.prompt_tokens for r in reqs)} prompt tokens, "
        f"{sum(r.output_tokens for r in reqs)} output tokens; policy {args.policy}, {engine.dtype}\n"
    )
    run()
    walls = []
    for _ in range(args.runs):
        wall, steps = run()
        walls.append(wall)
    with profile() as prof:
        profiled, _ = run()
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0, 0])
    for took, prefill, decode in steps:
        kind = "prefill" * bool(prefill) + "+decode" * bool(decode) or "empty"
        k = kinds[kind]
        k[0], k[1], k[2], k[3] = k[0] + 1, k[1] + took, k[2] + prefill, k[3] + decode
    print(
        f"wall {' / '.join(f'{w:.2f}' for w in walls)} s ({profiled:.2f} s profiled), "
        f"{len(steps)} steps (the last timed burst's below)\n"
    )
    print("| steps | n | s | prefill tokens | decode rows | ms a step |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, (n, took, prefill, decode) in kinds.items():
        print(f"| {kind} | {n} | {took:.2f} | {prefill} | {decode} | {took / n * 1e3:.1f} |")
    print()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""engine_vs_vllm.py's burst through vLLM's offline ``LLM`` (no HTTP), to set beside
``burst_profile.py``'s plaserve figure and the served bursts of both: how much of a served burst's time
each system's front end costs.

The Azure conversation trace rows 840-899, lengths x 0.25 (outputs too), outputs <= 32, all at once;
random prompt ids, greedy, ignore_eos; max-num-seqs 64, max-num-batched-tokens 2048, max-model-len
4608 and a 2 GiB KV cache, as the served runs. Five bursts, the first warming up; wall seconds each.

Run it with the vLLM venv's python (engine_vs_vllm.py creates it), with the OpenMP library and
thread binding engine_vs_vllm.py gives vLLM's server::

    LD_PRELOAD=/work/vllm-venv/lib/libiomp5.so /work/vllm-venv/bin/python \\
        benchmarks/vllm_offline_burst.py --model ~/.cache/plaserve/engine_vs_vllm/small

It reads the trace itself rather than importing plaserve, whose import sets OpenMP's spin policy.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import time


def burst(path: str, start: int = 840, limit: int = 60) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of the slice, scaled as ``plaserve.workload.trace`` scales."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))[start : start + limit]

    def scaled(n: str) -> int:
        return max(1, round(int(n) * 0.25))

    return [(scaled(r["ContextTokens"]), min(32, scaled(r["GeneratedTokens"]))) for r in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--trace", default="/work/shared/traces/azure_conv_2023.csv")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 2) - 1}")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    reqs = burst(args.trace)
    print(
        f"{len(reqs)} requests, {sum(a for a, _ in reqs)} prompt tokens, "
        f"{sum(b for _, b in reqs)} output tokens"
    )
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        max_model_len=4608,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
    )
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    for run in range(args.runs):
        prompts = [
            TokensPrompt(prompt_token_ids=[rng.randrange(10, vocab) for _ in range(a)])
            for a, _ in reqs
        ]
        params = [SamplingParams(max_tokens=b, temperature=0, ignore_eos=True) for _, b in reqs]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        print(f"run {run}: {time.perf_counter() - start:.2f} s", flush=True)


if __name__ == "__main__":
    main()

"""``plaserve demo`` and ``plaserve generate``: the engine end to end with no setup."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from plaserve import LLM, SamplingParams
from plaserve.model.default import DEFAULT_MODEL_NAME


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="local Hugging Face model directory (default: the embedded random-weight model)",
    )
    p.add_argument(
        "--kv-cache-memory",
        default="1GiB",
        help="KV cache size: bytes, 2GiB, or a fraction like 0.5",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="auto")


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)


def run_generate(args: argparse.Namespace) -> int:
    llm = LLM(
        args.model,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    for out in llm.generate(args.prompt, params):
        print(f"{out.prompt!r} -> {out.text!r} ({out.outputs[0].finish_reason})")
    return 0


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument(
        "--skip-comparison",
        action="store_true",
        help="skip the ~2 minute policy comparison on a slice of the Azure code trace",
    )


def run_demo(args: argparse.Namespace) -> int:
    print(f"plaserve demo — model: {args.model or DEFAULT_MODEL_NAME}")
    if args.model is None:
        print(
            "NOTE: the embedded default model has RANDOM WEIGHTS; its text is gibberish by design.\n"
        )
    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
    )
    # As `plaserve serve` does before it listens: the first-call costs (torch.compile's first compile
    # of the bfloat16 kernels, ~20 s on a fresh machine) belong to start-up, not to the TTFTs below.
    llm.engine.warm_up()
    print(f"engine ready in {time.perf_counter() - t0:.1f}s")
    prompts = ["The capital of France is", "def fibonacci(n):", "A" * 1500 + " summarize this."]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    print(f"\n{'prompt tokens':>13} {'cached':>6} {'TTFT ms':>8} {'out tokens':>10}  text")
    for o in outs:
        print(
            f"{len(o.prompt_token_ids):>13} {o.num_cached_tokens:>6} {o.metrics.ttft * 1000:>8.0f} "
            f"{len(o.token_ids):>10}  {o.text[:40]!r}"
        )
    print(f"\n{len(outs)} requests in one continuous batch: {wall:.2f}s wall")
    again = llm.generate(prompts[2:], params)[0]
    print(
        f"the long prompt again: {again.num_cached_tokens} of {len(again.prompt_token_ids)} tokens from the "
        f"prefix cache, TTFT {again.metrics.ttft * 1000:.0f} ms (first time {outs[2].metrics.ttft * 1000:.0f} ms)"
    )
    if args.skip_comparison or args.model is not None:
        return 0
    del llm  # free its KV cache before the comparison builds its own engines
    print(
        "\n=== Scheduling policies on a real trace slice (pla = ours, fcfs = vLLM default, spf = shortest first)"
    )
    # The comparison is an experiment, kept in the checkout's benchmarks/ rather than the package; it
    # runs in a process of its own. One thread: it times policies on the wall clock, and a
    # single-threaded engine is far less disturbed by whatever else runs on the machine.
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "policies.py"
    if not script.exists():
        print(f"(skipped: {script} is not here; the comparison runs from a checkout of plaserve)")
        return 0
    return subprocess.call([sys.executable, str(script), "--quick", "--threads", "1"])

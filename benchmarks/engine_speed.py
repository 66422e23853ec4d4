"""plaserve's engine alone, code against code: prefill and decode speed of two source trees, alternated.

For each tree (``--trees name=path/to/src,...``) a child process measures, in one dtype:

* the matmul peak (2048^3, best of 8) and the prefill FLOP rate at L = 2048 as a fraction of the
  highest peak any tree measured;
* prefill tokens/s at each L (our bare forward plus the sampled row's logits, best of N);
* the L = 2048 prompt through an ``LLMEngine`` that cuts it into 512-token chunks (fcfs with a 512-token
  step budget), each chunk attending to its cached prefix, as pla prefills a long prompt (best of N);
* decode tokens/s at each batch size: ``B`` requests of ``--decode-prompt``-token prompts (default 128)
  through an ``LLMEngine`` (fcfs, every prompt in the first step), from the fastest of the ~20 steps
  that decode the whole batch; longer prompts weigh the attention over the cache more.

The trees run in turn, ``--rounds`` times, and each figure is the best over the rounds: on a shared
machine the slowdowns others cause only ever add time. With ``--threads 1`` (the default) every time is
the process's CPU time, which excludes the time others' processes hold the core (it still includes
what they cost through shared caches and memory bandwidth); with more threads it is wall time, since
CPU time would count threads spinning at barriers.

Usage::

    git archive 5085a35 src | tar -x -C /tmp/before     # the tree to compare against
    .venv/bin/python benchmarks/engine_speed.py --trees before=/tmp/before/src,after=src --dtype bfloat16

It imports only APIs both trees have (``LLMEngine``, ``load_model`` / ``random_model``), so an older tree
runs unchanged. The markdown table goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

LENGTHS = (128, 1024, 2048, 4096)
BATCHES = (1, 16, 64)
DECODE_PROMPT = 128  # tokens of each decode request's prompt
FLOP_LENGTH = 2048
CHUNK = (
    512  # pla's long_chunk_size: the chunked-prefill figure cuts the FLOP_LENGTH prompt into these
)
# A random model with Qwen2.5-0.5B's layer shapes (its 151,936-token vocabulary, tied embeddings).
QWEN05_SHAPE = dict(
    architecture="Qwen2ForCausalLM",
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    qkv_bias=True,
    tie_word_embeddings=True,
)


def _engine_vs_hf() -> Any:
    """benchmarks/engine_vs_hf.py (not a package), for the helpers it shares with this script."""
    spec = importlib.util.spec_from_file_location(
        "engine_vs_hf", Path(__file__).with_name("engine_vs_hf.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def measure(
    dtype_name: str,
    model_name: str,
    threads: int,
    lengths: tuple[int, ...],
    batches: tuple[int, ...],
    reps: int,
    decode_prompt: int = DECODE_PROMPT,
) -> dict[str, Any]:
    """Every figure of one tree (the one on ``sys.path``), in this process; times by the process's CPU
    time on one thread, else by the wall clock."""
    # plaserve before torch, as in `plaserve serve` and a user's `import plaserve`: a tree that sets
    # OpenMP's spin count on import (plaserve/__init__.py) gets it applied.
    from plaserve import EngineConfig, LLMEngine, SamplingParams  # isort: skip

    import torch

    from plaserve.engine.host_memory import keep_freed_memory
    from plaserve.model.config import ModelConfig
    from plaserve.model.loader import load_model, random_model

    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    keep_freed_memory()  # as the engine does; the bare forwards below run outside one
    bench = _engine_vs_hf()
    dtype = bench.DTYPES[dtype_name]
    if model_name == "default":
        loaded = load_model(None, dtype, torch.device("cpu"))
    else:
        loaded = random_model(
            ModelConfig(**QWEN05_SHAPE), dtype, torch.device("cpu"), name="qwen2.5-0.5b-shape"
        )
    model, cfg = loaded.model, loaded.config

    def engine(batch: int) -> LLMEngine:
        """An fcfs engine on ``loaded`` with room for ``batch`` prompts of ``decode_prompt`` tokens
        (and their outputs) in its cache and in its first step."""
        kv_bytes = cfg.kv_bytes_per_token * dtype.itemsize
        kv_mib = max(512, -(-2 * batch * (decode_prompt + 32) * kv_bytes // 2**20))
        return LLMEngine(
            EngineConfig.from_kwargs(
                dtype=dtype_name,
                kv_cache_memory=f"{kv_mib}MiB",
                max_model_len=4096,
                policy="fcfs",
                max_num_seqs=max(64, batch),
                max_num_batched_tokens=max(2048, decode_prompt * batch),
                enable_prefix_caching=False,
            ),
            loaded=loaded,
        )

    # An engine sets the model up as it serves it (the tree's projection layouts, compiled kernels where
    # it has them): the bare forwards below run that model.
    engine(1)

    def best_of(fn: Callable[[], object], n: int) -> float:
        fn()  # warm-up (and, where the tree compiles, the compile)
        times = []
        for _ in range(n):
            start = clock()
            fn()
            times.append(clock() - start)
        return min(times)

    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {
        "prefill_s": {},
        "decode_tok_s": {},
        "model": loaded.name,
        "num_params": cfg.num_params,
    }
    out["peak_flop_s"] = bench.matmul_peak(2048, 8, dtype, clock)
    for n in lengths:
        ids = torch.randint(0, min(500, cfg.vocab_size), (n,), generator=gen)
        out["prefill_s"][n] = best_of(
            lambda: model.compute_logits(bench.our_forward(model, ids)[-1:]), reps
        )
        log(f"  prefill L={n}: {n / out['prefill_s'][n]:,.0f} tok/s")
    out["flops_2048"] = bench.prefill_flops(cfg, FLOP_LENGTH)
    if FLOP_LENGTH in lengths:
        # The same prompt through an engine that cuts it into CHUNK-token steps, each after its cached
        # prefix (as pla chunks a long prompt): scheduling, packing and the last step's sampling included.
        chunker = LLMEngine(
            EngineConfig.from_kwargs(
                dtype=dtype_name,
                kv_cache_memory="512MiB",
                max_model_len=4096,
                policy="fcfs",
                max_num_batched_tokens=CHUNK,
                enable_prefix_caching=False,
            ),
            loaded=loaded,
        )
        ids = torch.randint(0, min(500, cfg.vocab_size), (FLOP_LENGTH,), generator=gen).tolist()

        def chunked() -> None:
            chunker.add_request(ids, SamplingParams(max_tokens=1, temperature=0))
            while chunker.has_unfinished():
                chunker.step()

        out["chunked_s"] = best_of(chunked, reps)
        log(
            f"  prefill L={FLOP_LENGTH} in {CHUNK}-token chunks: {FLOP_LENGTH / out['chunked_s']:,.0f} tok/s"
        )
        del chunker
    for batch in batches:
        eng = engine(batch)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        reqs = [
            eng.add_request(
                torch.randint(
                    0, min(500, cfg.vocab_size), (decode_prompt,), generator=gen
                ).tolist(),
                params,
            )
            for _ in range(batch)
        ]
        steps = []
        while eng.has_unfinished():
            start = clock()
            eng.step()
            elapsed = clock() - start
            step = eng.last_batch
            if (
                step is not None
                and len(step.items) == batch
                and all(it.num_tokens == 1 for it in step.items)
                and all(len(r.output_token_ids) > 1 for r in reqs)
            ):
                steps.append(elapsed)
        # The first decode steps pay first-call costs; of the rest, the fastest (others' load only ever
        # slows a step down).
        out["decode_tok_s"][batch] = batch / min(steps[2:])
        log(f"  decode batch {batch}: {out['decode_tok_s'][batch]:,.0f} tok/s ({len(steps)} steps)")
        del eng
    return out


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_tree(src: str, args: argparse.Namespace) -> dict[str, Any]:
    """One child process on tree ``src``; its figures."""
    env = dict(os.environ, PYTHONPATH=src)
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--dtype",
        args.dtype,
        "--model",
        args.model,
        "--threads",
        str(args.threads),
        "--lengths",
        args.lengths,
        "--batches",
        args.batches,
        "--reps",
        str(args.reps),
        "--decode-prompt",
        str(args.decode_prompt),
    ]
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, check=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's best over the rounds."""
    first = runs[0]
    return {
        "model": first["model"],
        "num_params": first["num_params"],
        "flops_2048": first["flops_2048"],
        "peak_flop_s": max(r["peak_flop_s"] for r in runs),
        "prefill_s": {n: min(r["prefill_s"][n] for r in runs) for n in first["prefill_s"]},
        **({"chunked_s": min(r["chunked_s"] for r in runs)} if "chunked_s" in first else {}),
        "decode_tok_s": {b: max(r["decode_tok_s"][b] for r in runs) for b in first["decode_tok_s"]},
    }


def format_table(
    trees: dict[str, dict[str, Any]], args: argparse.Namespace, load: tuple[float, float] | None
) -> str:
    """The merged figures as markdown; ``load``: the load average at the start and end (None: unknown)."""
    names = list(trees)
    first = trees[names[0]]
    clock = (
        "CPU time of the process, 1 thread"
        if args.threads == 1
        else f"wall time, {args.threads} threads"
    )
    loads = "" if load is None else f"; load average {load[0]:.2f} at start, {load[1]:.2f} at end"
    out = [
        f"Model {first['model']} ({first['num_params'] / 1e6:.1f} M parameters), {args.dtype}; {clock}; best of "
        f"{args.rounds} rounds (trees alternating), prefill best of {args.reps} a round{loads}",
        "",
        "| figure | "
        + " | ".join(names)
        + (f" | {names[-1]} / {names[0]} |" if len(names) > 1 else " |"),
        "|---|" + "---:|" * (len(names) + (len(names) > 1)),
    ]

    def row(label: str, values: list[float], fmt: str) -> None:
        ratio = f" {values[-1] / values[0]:.2f}x |" if len(values) > 1 else ""
        out.append(f"| {label} | " + " | ".join(format(v, fmt) for v in values) + " |" + ratio)

    for n in first["prefill_s"]:
        row(f"prefill tok/s, L = {n}", [int(n) / trees[t]["prefill_s"][n] for t in names], ",.0f")
    row(
        f"matmul peak (2048^3 {args.dtype}), GFLOP/s",
        [trees[t]["peak_flop_s"] / 1e9 for t in names],
        ",.0f",
    )
    if str(FLOP_LENGTH) in first["prefill_s"]:
        # Against the highest peak of the run: the machine's, whichever tree's round measured it.
        peak = max(trees[t]["peak_flop_s"] for t in names)
        row(
            f"prefill at L = {FLOP_LENGTH}, % of the highest peak",
            [
                100 * trees[t]["flops_2048"] / trees[t]["prefill_s"][str(FLOP_LENGTH)] / peak
                for t in names
            ],
            ".1f",
        )
    if all("chunked_s" in trees[t] for t in names):
        row(
            f"prefill tok/s, L = {FLOP_LENGTH} in {CHUNK}-token chunks (engine)",
            [FLOP_LENGTH / trees[t]["chunked_s"] for t in names],
            ",.0f",
        )
    for b in first["decode_tok_s"]:
        row(
            f"decode tok/s, batch {b} ({args.decode_prompt}-token prompts)",
            [trees[t]["decode_tok_s"][b] for t in names],
            ",.0f",
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trees", default="this=src", help="name=path/to/src,... (default: this=src)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--model", default="default", choices=["default", "qwen0.5b-shape"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3, help="prefill repetitions a round")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument(
        "--decode-prompt",
        type=int,
        default=DECODE_PROMPT,
        help="prompt tokens of each decode request",
    )
    parser.add_argument("--out", help="also write every round's figures as JSON to this path")
    parser.add_argument(
        "--table", metavar="JSON", help="print the table of an earlier --out instead of measuring"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    lengths = tuple(int(x) for x in args.lengths.split(","))
    batches = tuple(int(x) for x in args.batches.split(","))
    if args.child:
        print(
            json.dumps(
                measure(
                    args.dtype,
                    args.model,
                    args.threads,
                    lengths,
                    batches,
                    args.reps,
                    args.decode_prompt,
                )
            )
        )
        return 0
    if args.table:
        with open(args.table) as f:
            runs = json.load(f)
        print(format_table({name: merge(r) for name, r in runs.items()}, args, None))
        return 0
    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    load_start = os.getloadavg()[0]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for rnd in range(args.rounds):
        for name, src in trees.items():
            log(
                f"round {rnd + 1}/{args.rounds}: {name} ({src}), load average {os.getloadavg()[0]:.2f}"
            )
            runs[name].append(run_tree(src, args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(runs, f, indent=2)
    print(
        format_table(
            {name: merge(r) for name, r in runs.items()}, args, (load_start, os.getloadavg()[0])
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

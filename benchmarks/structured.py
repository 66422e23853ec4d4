"""What structured outputs cost per decode step: batches of 1, 16 and 64 requests, all unconstrained,
all constrained by a JSON schema, and half and half (docs/STRUCTURED.md has the table).

Per batch size and mix it reports the fastest decode step (wall ms; the process's CPU ms, which
leaves out the time other processes hold the cores but counts the mask worker's; and the CPU ms of
the engine thread alone, the step's own path, which leaves out the worker's too), the grammar
engine's median time computing a step's masks on its worker (ms, all constrained rows together, the
bits unpacked into banned-token rows included), the median part of it the step had to wait for after
the forward pass (the rest was hidden behind the forward pass), the median time applying them (-inf
into the constrained rows' banned logits), and the step (and the engine thread's CPU) over the
unconstrained batch's. The mixes alternate over
``--rounds`` and each step figure is the best over all rounds: on a shared machine others' work only
adds time. The mixed batch's unconstrained rows sample exactly what they sample without constrained
company (checked: the masks touch only their own rows).

The model is random-weight with a realistic vocabulary: a 32,000-id byte-level BPE trained here on
the Python standard library's sources (the size of Llama 2's and Mistral's), 4 layers of 512.

    PYTHONPATH=src .venv/bin/python benchmarks/structured.py [--batches 1,16,64] [--steps 24]
    PYTHONPATH=src .venv/bin/python benchmarks/structured.py --paths   # the step's part, three ways
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from plaserve import EngineConfig, LLMEngine, SamplingParams
from plaserve.engine import runner as runner_module
from plaserve.grammar import masks as masks_module
from plaserve.model.config import ModelConfig
from plaserve.model.loader import random_model
from plaserve.model.tokenizer import HFTokenizer
from plaserve.request import StructuredOutputs

sys.path.insert(0, os.path.dirname(__file__))
from grammar_engines import bpe_tokenizer  # noqa: E402

# An answer that never ends before the step budget: records of a few typed fields, many of them.
SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0},
            "name": {"type": "string", "maxLength": 12},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "name", "ok"],
        "additionalProperties": False,
    },
}


def build_engine(vocab: int) -> LLMEngine:
    tok = bpe_tokenizer(vocab)
    directory = tempfile.mkdtemp(prefix="plaserve-structured-")
    tok.save(os.path.join(directory, "tokenizer.json"))
    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=tok.get_vocab_size(),
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        bos_token_id=0,
        eos_token_ids=(1,),
    )
    loaded = random_model(cfg, torch.float32, torch.device("cpu"))
    loaded.tokenizer = HFTokenizer(directory)
    config = EngineConfig.from_kwargs(
        dtype="float32", kv_cache_memory="1GiB", max_model_len=1024, policy="fcfs", max_num_seqs=64
    )
    return LLMEngine(config, loaded=loaded)


def run(engine: LLMEngine, batch: int, constrained: int, steps: int) -> dict:
    """Decode ``steps`` tokens for ``batch`` requests, the first ``constrained`` of them with the
    schema; per decode step its time and its masks' compute and wait times."""
    spec = StructuredOutputs(json=json.dumps(SCHEMA))
    reqs = []
    for i in range(batch):
        params = SamplingParams(
            max_tokens=steps + 1,
            temperature=0,
            ignore_eos=True,
            structured=spec if i < constrained else None,
        )
        reqs.append(engine.add_request([(13 * i + j) % 200 + 2 for j in range(16)], params))
    pending: list = []

    def recording(reqs_, device=None):
        p = masks_module.start_masks(reqs_, device)
        pending.append(p)
        return p

    runner_module.start_masks = recording
    times, cpu, main_cpu, compute, wait, apply = [], [], [], [], [], []
    try:
        while engine.has_unfinished():
            pending.clear()
            start, start_cpu, start_main = (
                time.perf_counter(),
                time.process_time(),
                time.thread_time(),
            )
            engine.step()
            elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            elapsed_main = time.thread_time() - start_main
            batch_ = engine.last_batch
            if batch_ is not None and all(it.num_tokens == 1 for it in batch_.items):
                times.append(elapsed)
                cpu.append(elapsed_cpu)
                main_cpu.append(elapsed_main)
                p = pending[0] if pending else None
                compute.append(p.compute_s if p else 0.0)
                wait.append(p.wait_s if p else 0.0)
                apply.append(p.apply_s if p else 0.0)
    finally:
        runner_module.start_masks = masks_module.start_masks
    med = statistics.median
    return {
        "step_ms": 1e3 * min(times),
        "cpu_ms": 1e3 * min(cpu),
        "main_ms": 1e3 * min(main_cpu),
        "mask_ms": 1e3 * med(compute),
        "wait_ms": 1e3 * med(wait),
        "apply_ms": 1e3 * med(apply),
        "tokens": [r.output_token_ids for r in reqs[constrained:]],
    }


def paths(engine: LLMEngine, rows_list: list[int], repeats: int = 60) -> None:
    """What applying the masks of ``rows`` constrained rows costs the step (the engine thread's CPU,
    10th percentile of ``repeats``), the additive rows plaserve adds against a boolean
    ``masked_fill_`` per row and per run of rows, and what the worker pays to make them, on the
    benchmark's masks (its matchers inside the first record's integer, where its steps are)."""
    vocab = engine.model_config.vocab_size
    spec = StructuredOutputs(json=json.dumps(SCHEMA))
    prefix = engine.tokenizer.encode('[{"id": 12', add_special_tokens=False)
    print(
        "| constrained rows | worker: bitmasks + additive rows (ms) | add_ per run (ms) | "
        "masked_fill_ per run (ms) | masked_fill_ per row (ms) |"
    )
    print("|---|---|---|---|---|")
    for n in rows_list:
        matchers = [engine.grammars.matcher(spec) for _ in range(n)]
        for m in matchers:
            for t in prefix:
                assert m.accept(t)
        logits = torch.randn(64, vocab)
        runs = masks_module._runs(list(range(n)))
        took: dict[str, list[float]] = {k: [] for k in ("worker", "add", "fill_run", "fill_row")}

        def timed(key: str, f) -> object:
            start = time.thread_time()
            out = f()
            took[key].append(time.thread_time() - start)
            return out

        for _ in range(repeats):
            mask = timed("worker", lambda: masks_module._compute(matchers, vocab, True)[0])
            banned = mask < 0
            timed("add", lambda: [logits[i : i + c].add_(mask[k : k + c]) for k, i, c in runs])
            timed(
                "fill_run",
                lambda: [
                    logits[i : i + c].masked_fill_(banned[k : k + c], -1e30) for k, i, c in runs
                ],
            )
            timed("fill_row", lambda: [logits[i].masked_fill_(banned[i], -1e30) for i in range(n)])
        p10 = {k: 1e3 * sorted(v)[len(v) // 10] for k, v in took.items()}
        print(
            f"| {n} | {p10['worker']:.2f} | {p10['add']:.2f} | {p10['fill_run']:.2f} | "
            f"{p10['fill_row']:.2f} |"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--paths",
        action="store_true",
        help="instead: what applying the masks costs the step, three ways (see paths())",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = build_engine(args.vocab)
    if args.paths:
        with torch.inference_mode():
            paths(engine, [8, 32, 64])
        return 0
    run(engine, 2, 1, 4)  # warm-up: kernels, the grammar engine's tokenizer index
    best: dict[tuple[int, int], dict] = {}
    for round_ in range(args.rounds):
        for batch in map(int, args.batches.split(",")):
            plain = None
            for constrained in (0, batch // 2, batch) if batch > 1 else (0, 1):
                r = run(engine, batch, constrained, args.steps)
                if constrained == 0:
                    plain = r
                elif constrained < batch:  # unconstrained rows: the same tokens in company
                    assert r["tokens"] == plain["tokens"][constrained:], (
                        "unconstrained rows changed"
                    )
                key = (batch, constrained)
                old = best.setdefault(key, r)
                for field in ("step_ms", "cpu_ms", "main_ms"):
                    old[field] = min(old[field], r[field])
                print(
                    f"round {round_} batch {batch} constrained {constrained}: {r['step_ms']:.2f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    print(
        f"vocabulary {engine.model_config.vocab_size}, {args.threads} thread(s), load average {os.getloadavg()[0]:.2f}"
    )
    print(
        "| batch | constrained rows | decode step (ms) | CPU (ms) | step thread CPU (ms) "
        "| masks computed (ms) | waited for (ms) | applied (ms) | step / unconstrained "
        "| step thread / unconstrained |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (batch, n), r in sorted(best.items()):
        ratio = r["step_ms"] / best[(batch, 0)]["step_ms"]
        main_ratio = r["main_ms"] / best[(batch, 0)]["main_ms"]
        print(
            f"| {batch} | {n} | {r['step_ms']:.2f} | {r['cpu_ms']:.2f} | {r['main_ms']:.2f} | "
            f"{r['mask_ms']:.2f} | {r['wait_ms']:.2f} | {r['apply_ms']:.2f} | {ratio:.3f} | "
            f"{main_ratio:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Which grammar engine: llguidance against xgrammar on plaserve's tokenizers (docs/STRUCTURED.md).

For each tokenizer and engine: the time to build the engine's tokenizer index (once per server), to
compile a JSON schema (once per request, or per distinct schema with a cache), and the per-step time
to compute one token mask while walking a valid answer token by token.

    PYTHONPATH=src .venv/bin/python benchmarks/grammar_engines.py

Needs both engines installed: ``llguidance`` (a plaserve dependency) and ``xgrammar`` (not one:
``pip install xgrammar==0.2.8``; it pulls ``transformers`` and ``triton`` along).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "email", "tags", "address", "role"],
    "additionalProperties": False,
}
ANSWER = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "email": "ada@example.com",
        "tags": ["math", "engines"],
        "address": {"city": "London", "zip": "W1"},
        "role": "admin",
    }
)


def bpe_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE of ``vocab_size`` ids trained on the Python standard library's sources (the
    shape of Llama 2's and Mistral's 32k vocabularies; no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:400]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    return tok


def measure_llguidance(tok: Any, steps: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.torch as llt

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=1)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matcher = llguidance.LLMatcher(lltok, grammar)
    t2 = time.perf_counter()
    assert not matcher.is_error(), matcher.get_error()
    mask = llt.allocate_token_bitmask(1, lltok.vocab_size)
    times = []
    for token in steps:
        s = time.perf_counter()
        llt.fill_next_token_bitmask(matcher, mask)
        times.append(time.perf_counter() - s)
        assert matcher.consume_token(token), matcher.get_error()
    return {"index_s": t1 - t0, "compile_s": t2 - t1, **_stats(times)}


def measure_xgrammar(tok: Any, steps: list[int]) -> dict[str, float]:
    import xgrammar as xgr

    vocab = [b""] * tok.get_vocab_size()
    t0 = time.perf_counter()
    from tokenizers import decoders

    dec = decoders.ByteLevel()
    for piece, i in tok.get_vocab().items():
        vocab[i] = dec.decode([piece]).encode("utf-8", errors="surrogateescape")
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=[1])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    matcher = xgr.GrammarMatcher(compiled)
    t2 = time.perf_counter()
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for token in steps:
        s = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - s)
        assert matcher.accept_token(token)
    return {"index_s": t1 - t0, "compile_s": t2 - t1, **_stats(times)}


def _stats(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    return {
        "steps": len(times),
        "mask_mean_us": 1e6 * statistics.fmean(times),
        "mask_p50_us": 1e6 * times[len(times) // 2],
        "mask_max_us": 1e6 * times[-1],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab-sizes", default="400,32000")
    args = p.parse_args()
    rows = []
    for size in map(int, args.vocab_sizes.split(",")):
        tok = bpe_tokenizer(size)
        steps = tok.encode(ANSWER).ids
        for name, fn in (("llguidance", measure_llguidance), ("xgrammar", measure_xgrammar)):
            try:
                r = fn(tok, steps)
            except ImportError as e:
                print(f"{name}: not installed ({e})", file=sys.stderr)
                continue
            rows.append({"engine": name, "vocab": tok.get_vocab_size(), **r})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nload average {os.getloadavg()[0]:.2f}")
    print(
        "| engine | vocab | tokenizer index (s) | schema compile (ms) | mask mean / p50 / max (us) |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['engine']} | {r['vocab']} | {r['index_s']:.2f} | {1e3 * r['compile_s']:.1f} | "
            f"{r['mask_mean_us']:.0f} / {r['mask_p50_us']:.0f} / {r['mask_max_us']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

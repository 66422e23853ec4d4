"""Smoke test of ``benchmarks/engine_vs_vllm.py``, plaserve side only (no vLLM venv needed).

Toy sizes on the small model in the dtype ``--dtype auto`` picks here: both plaserve policies start
as servers, every measurement runs, and the report has every row with a positive value. Timings
themselves are not checked.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from plaserve.workload.report import RequestRecord

pytest.importorskip("transformers")


def test_burst_flops_are_prefills_and_decode_steps(load_benchmark) -> None:
    """One prompt with one output token is its prefill; each further output token adds a decode step:
    the weights outside the embedding, its attention over the context, one logits row."""
    bench = load_benchmark("engine_vs_vllm")
    cfg = bench.ModelConfig(
        architecture="LlamaForCausalLM",
        max_position_embeddings=64,
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    request = bench.TraceRequest(0.0, 10, 1)
    assert bench.burst_flops(cfg, [request]) == bench.prefill_flops(cfg, 10)
    body = cfg.num_params - 2 * 100 * 64  # untied: embedding and LM head
    step = 2 * body + 2 * 64 * 100
    per_key = 4 * 4 * 16 * 2
    three = bench.burst_flops(cfg, [bench.TraceRequest(0.0, 10, 3)])
    assert three == bench.prefill_flops(cfg, 10) + 2 * step + per_key * (11 + 12)


def test_decode_after_prefills_counts_only_what_streams_once_every_prompt_is_in(
    load_benchmark,
) -> None:
    """Two requests: the second's first token at 2 s. Only tokens streamed after it count, over the
    time from it to the last token; an event of several tokens counts for each of them."""
    bench = load_benchmark("engine_vs_vllm")

    def result(*records: RequestRecord) -> SimpleNamespace:
        return SimpleNamespace(records=list(records))

    # first: tokens at 1.0, 1.5, 2.5, 3.5 (4 tokens, 4 events); second: at 2.0, 3.0 then 4.0 (3 events,
    # 6 tokens: 2 an event)
    first = RequestRecord("short", 8, 4, arrival=0.0, ttft=1.0, e2e=3.5, tbts=[0.5, 1.0, 1.0])
    second = RequestRecord("short", 8, 6, arrival=0.5, ttft=1.5, e2e=3.5, tbts=[1.0, 1.0])
    assert bench.decode_after_prefills(result(first, second)) == (2 + 2 * 2) / (4.0 - 2.0)
    # nothing after the last first token
    alone = RequestRecord("short", 8, 1, arrival=0.0, ttft=1.0, e2e=1.0)
    assert bench.decode_after_prefills(result(alone)) is None


def test_context_decode_sends_the_prompts_twice_and_warns_when_they_were_computed_again(
    load_benchmark, monkeypatch, capsys
) -> None:
    """The same prompts (same seed) first for one token, then for the measured decode; a measured
    pass whose first tokens come as late as the prefills did means the prefix cache lost them."""
    bench = load_benchmark("engine_vs_vllm")
    sizes = dataclasses.replace(bench.QUICK, context_batch=2, context_prompt=48, context_tokens=3)
    calls = []

    def fake_replay(url: str, requests: list, seed: int, first_token_at: float) -> SimpleNamespace:
        calls.append(([(r.prompt_tokens, r.output_tokens) for r in requests], seed))
        if len(calls) % 2:  # the prefills: 10 s
            return SimpleNamespace(duration_s=10.0, records=[])
        record = RequestRecord(
            "short", 48, 3, arrival=0.0, ttft=first_token_at, e2e=first_token_at + 2
        )
        record.tbts = [1.0, 1.0]
        return SimpleNamespace(duration_s=first_token_at + 2, records=[record, record])

    monkeypatch.setattr(bench, "replay", lambda u, r, s: fake_replay(u, r, s, 0.2))
    assert bench.measure_context_decode("http://x", sizes, seed=7) == 4 / 2.0
    assert calls == [([(48, 1)] * 2, 7), ([(48, 3)] * 2, 7)]
    assert "warning" not in capsys.readouterr().err
    monkeypatch.setattr(bench, "replay", lambda u, r, s: fake_replay(u, r, s, 9.0))
    bench.measure_context_decode("http://x", sizes, seed=7)
    assert "not all in the prefix cache" in capsys.readouterr().err


def test_ttft_floor_is_a_lower_bound_and_tight_where_it_can_be(load_benchmark) -> None:
    """Three 1 s prefills arriving together: one schedule gives TTFTs 1, 2, 3 s and none does better.
    Staggered arrivals: serving in arrival order meets the bound. Random instances: no single-queue
    schedule (first come or shortest first, each prefill run whole at the peak) gets below it."""
    bench = load_benchmark("engine_vs_vllm")
    floor = bench.ttft_floor
    assert [floor([0.0] * 3, [1.0] * 3, q) for q in (0, 50, 100)] == [1.0, 2.0, 3.0]
    assert floor([0.0, 0.5], [1.0, 1.0], 100) == 1.5  # the second starts at 1: waits 0.5 s
    assert floor([0.0, 5.0], [1.0, 2.0], 100) == 2.0  # apart: each its own prefill
    assert floor([], [], 99) == 0.0

    def served(arrivals: list[float], seconds: list[float], key) -> list[float]:
        waiting, ttfts, now, pending = [], [], 0.0, sorted(zip(arrivals, seconds))
        while pending or waiting:
            while pending and (pending[0][0] <= now or not waiting):
                waiting.append(pending.pop(0))
                now = max(now, waiting[-1][0])
            a, s = min(waiting, key=key)
            waiting.remove((a, s))
            now += s
            ttfts.append(now - a)
        return ttfts

    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 12))
        arrivals = list(np.round(rng.uniform(0, 3, n), 2))
        seconds = list(np.round(rng.uniform(0.05, 1, n), 2))
        for key in (lambda r: r[0], lambda r: r[1]):
            ttfts = served(arrivals, seconds, key)
            for q in (50, 99):
                assert floor(arrivals, seconds, q) <= np.percentile(ttfts, q) + 1e-9


def test_plaserve_side_has_every_row(
    load_benchmark, tmp_path: Path, native_dtype: str, capsys
) -> None:
    bench = load_benchmark("engine_vs_vllm")
    sizes = dataclasses.replace(
        bench.QUICK,
        prefill_lengths=(16, 64),
        flop_length=64,
        decode_batches=(1, 3),
        trace_requests=6,
        rounds=2,
    )
    results = bench.run_benchmark(
        sizes,
        ["small"],
        [native_dtype],
        ["pla", "fcfs"],
        tmp_path / "ckpt",
        reuse=False,
        vllm_venv=None,
        find_links=None,
    )
    assert results["systems"] == ["fcfs", "pla"]  # vLLM's place first, then fcfs, then pla
    block = results["runs"]["small"][native_dtype]
    assert block["calibrated_on"] == "fcfs" and block["num_params"] > 20e6
    assert block["burst_flops"] > 0 and len(block["prefill_flops"]) == 6
    for system in ("fcfs", "pla"):
        r = block["systems"][system]
        assert "error" not in r, r.get("error")
        assert set(r["prefill_tok_s"]) == {"16", "64"} and set(r["decode_tok_s"]) == {"1", "3"}
        assert min(r["prefill_tok_s"].values()) > 0 and min(r["decode_tok_s"].values()) > 0
        assert r["context_decode_tok_s"] == max(x["context_decode_tok_s"] for x in r["rounds"]) > 0
        assert r["sampled_decode_tok_s"] == max(x["sampled_decode_tok_s"] for x in r["rounds"]) > 0
        assert r["burst_wall_s"] > 0 and 0 < r["trace"]["busy"] <= 1
        assert r["trace"]["counts"]["short"] + r["trace"]["counts"]["long"] == 6
        assert r["trace"]["short_p50_ms"] > 0 and len(r["loadavg_start"]) == 3
    assert (
        block["systems"]["pla"]["trace"]["time_scale"]
        == block["systems"]["fcfs"]["trace"]["time_scale"]
    )
    # Every calibration replay has prompts of its own (the same ones again would hit the prefix cache);
    # the later systems replay the reported one's.
    calibration = block["systems"]["fcfs"]["calibration"]
    assert len({t["seed"] for t in calibration}) == len(calibration)
    assert block["systems"]["pla"]["trace"]["seed"] == block["systems"]["fcfs"]["trace"]["seed"]
    # Interleaved rounds: each system measured in every round; round 2 replays new prompts, the same
    # for both systems; the throughput figures are the best of the rounds.
    fcfs, pla = (block["systems"][s]["rounds"] for s in ("fcfs", "pla"))
    assert len(fcfs) == len(pla) == 2
    assert pla[1]["trace"]["seed"] == fcfs[1]["trace"]["seed"] != fcfs[0]["trace"]["seed"]
    best = block["systems"]["pla"]["decode_tok_s"]["3"]
    assert best == max(r["decode_tok_s"]["3"] for r in pla)
    assert results["peak_flop_s"][native_dtype]["used"] > 0

    report = bench.format_report(results, "cmd")
    rows = {
        line.split(" | ")[0].strip("| "): line.split(" | ")[1:]
        for line in report.splitlines()
        if line.startswith("| ") and not line.startswith("| metric")
    }
    for label in (
        "prefill tok/s, L = 16",
        "prefill tok/s, L = 64",
        "prefill at L = 64, % of matmul peak",
        "decode tok/s, batch 1",
        "decode tok/s, batch 3",
        "decode tok/s, batch 4, sampled (temperature 0.8, top-p 0.95)",
        "decode tok/s, batch 2 at a 48-token context",
        "burst of 6: wall s",
        "burst of 6: requests/s",
        "burst of 6: % of matmul peak",
        "trace: busy %",
        "trace: TTFT short p50, ms",
        "trace: TTFT short p99, ms",
    ):
        cells = rows[label]
        assert len(cells) == 2, (label, cells)  # fcfs, pla; no vLLM, so no ratio columns
        for cell in cells:
            assert float(re.sub(r"[ |,]", "", cell)) > 0, (label, cell)
    assert "Targets" in report and "prefill at L = 64 >= 60% of the matmul peak" in report
    # --report renders a saved run; one from before burst and prefill FLOPs were recorded gets them
    # from the checkpoint's config.
    saved = tmp_path / "run.json"
    del block["burst_flops"], block["prefill_flops"]
    saved.write_text(json.dumps(results))  # what --out writes must be JSON-serialisable
    assert bench.main(["--report", str(saved), "--checkpoints", str(tmp_path / "ckpt")]) == 0
    assert "burst of 6: % of matmul peak" in capsys.readouterr().out
    # A second build of the same model reuses the checkpoint.
    assert bench.build_checkpoint(
        bench.MODELS["small"], tmp_path / "ckpt" / "small", reuse=True
    ).exists()

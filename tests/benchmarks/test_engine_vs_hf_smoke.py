"""Smoke test of ``benchmarks/engine_vs_hf.py``: every section runs at toy sizes and every row is there.

Timings are not checked (they mean nothing at these sizes on a shared CPU); the point is that the
acceptance benchmark keeps working as the engine changes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from plaserve.model import layers

pytest.importorskip("transformers")


def test_quick_run_has_every_row(load_benchmark, tmp_path: Path) -> None:
    bench = load_benchmark("engine_vs_hf")
    # Smaller still than --quick, to keep the test to a few seconds.
    sizes = dataclasses.replace(
        bench.QUICK,
        prefill_lengths=(8, 16, 32),
        flop_length=32,
        peak_size=128,
        decode_batches=(1, 3),
        num_requests=3,
        prompt_range=(4, 16),
        output_range=(2, 4),
    )
    results = bench.run_benchmark(sizes)
    assert results["machine"]["dtype"] == "float32" and results["sections"] == list(bench.SECTIONS)

    assert [row["length"] for row in results["prefill"]] == [8, 16, 32]
    for row in results["prefill"]:
        for key in ("engine_tok_s", "forward_tok_s", "hf_tok_s", "engine_over_hf", "engine_ttft_s"):
            assert row[key] > 0
    flop = results["flop_rate"]
    assert flop["length"] == 32 and flop["peak"] == max(flop["peak_before"], flop["peak_after"])
    for system in ("engine", "forward", "hf"):
        assert flop[f"{system}_fraction"] > 0
    assert isinstance(flop["target_met"], bool)

    assert [row["batch"] for row in results["decode"]] == [1, 3]
    assert all(row["engine_tok_s"] > 0 and row["hf_tok_s"] > 0 for row in results["decode"])

    mixed = results["mixed"]
    assert set(mixed["runs"]) == {"plaserve_pla", "plaserve_fcfs", "hf_one_by_one", "hf_batched"}
    assert mixed["best_hf"] in ("hf_one_by_one", "hf_batched")
    for run in mixed["runs"].values():
        assert run["wall_s"] > 0 and run["speedup_vs_best_hf"] > 0
        # no retries in QUICK
        assert len(run["wall_s_runs"]) == sizes.mixed_rounds == len(run["others_cpu_s_runs"])
        # same weights, same greedy tokens
        assert run["identical_to_hf_one_by_one"] == mixed["num_requests"]
    # ignore_eos + min_new_tokens: every system generates exactly the requested lengths.
    assert mixed["runs"]["plaserve_pla"]["tokens_computed"] == mixed["output_tokens"]
    assert mixed["runs"]["hf_batched"]["tokens_computed"] >= mixed["output_tokens"]
    assert results["model"]["logits_max_abs_diff"] < 1e-3

    table = bench.format_table(results, "cmd")
    for needle in (
        "| 8 |",
        "| 32 |",
        "plaserve engine",
        "transformers `generate`, one by one",
        "left-padded batches",
        "fraction of matmul peak",
        "Decode throughput",
        "| 3 |",
    ):
        assert needle in table
    json.dumps(results)  # what --out writes must be JSON-serialisable


def test_sections_and_dtype_flags(load_benchmark, capsys, native_dtype: str) -> None:
    bench = load_benchmark("engine_vs_hf")
    bench.QUICK = bench.dataclasses.replace(bench.QUICK, decode_batches=(2,), decode_tokens=3)
    assert bench.main(["--quick", "--dtype", native_dtype, "--sections", "decode"]) == 0
    table = capsys.readouterr().out
    assert "--sections decode" in table and native_dtype in table and "| 2 |" in table
    assert "Prefill throughput" not in table and "Mixed workload" not in table


@pytest.mark.skipif(not layers._can_prepack(), reason="no oneDNN packed linear in this torch build")
def test_the_matmul_peak_is_the_faster_way_to_multiply(load_benchmark, monkeypatch) -> None:
    """On a fake clock every timed product takes 1 s, oneDNN's prepacked linear 0.5 s: the peak is the
    prepacked one's, as plaserve.cost takes it (engine_speed.py's % of the peak)."""
    bench = load_benchmark("engine_vs_hf")
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0  # 1 s from one read to the next: around each call
        return now[0]

    def packed_linear(x, packed, bias):
        now[0] -= 0.5
        return x

    monkeypatch.setattr(layers, "_packed_linear", packed_linear)
    assert bench.matmul_peak(8, 3, torch.float32, clock) == 2 * 8**3 / 0.5

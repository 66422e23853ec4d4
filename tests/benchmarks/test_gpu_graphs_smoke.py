"""Smoke test of ``benchmarks/gpu_graphs.py`` on CPU: the GPU check runs its eager half at toy sizes.

The graph half (capture, replay, launch time) needs CUDA; here the script must still build its model
and grid, find the padded static path equal to the varlen path, time every shape, free every KV block
and write its report, so that the one device run it is prepared for does not fail on a stale script.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


def test_cpu_run_checks_every_shape(load_benchmark) -> None:
    bench = load_benchmark("gpu_graphs")
    model = dataclasses.replace(bench.CPU.model, num_hidden_layers=2)
    setup = dataclasses.replace(
        bench.CPU,
        model=model,
        batches=(1, 2),
        buckets=(32, 64),
        launch_reps=1,
        latency_reps=1,
        e2e_requests=6,
        e2e_output=2,
        decode_batches=(1, 3),
        decode_contexts=(20, 40),
    )
    results = bench.run(setup)

    assert [(r["batch"], r["bucket"]) for r in results["rows"]] == [
        (1, 32),
        (2, 32),
        (1, 64),
        (2, 64),
    ]
    for row in results["rows"]:
        assert row["batch"] * row["bucket"] // 2 < row["tokens"] <= row["batch"] * row["bucket"]
        same = row["eager_vs_varlen"]
        assert same["logit_max_diff"] < 1e-4 and same["kv_max_diff"] < 1e-5
        assert same["argmax_agree"] == f"{row['batch']}/{row['batch']}"
        assert (
            row["launch_us_eager"] > 0
            and row["latency_ms_eager"] > 0
            and row["latency_ms_varlen"] > 0
        )
        # no CUDA: no graph columns
        assert "graph_vs_eager" not in row and "latency_ms_graph" not in row
    assert results["kv_blocks_leaked"] == 0
    assert results["capture"]["shapes"] == 3 * 2  # buckets 16, 32, 64 x batches 1, 2; none captured
    assert "capture_s" not in results["capture"] and results["capture"]["estimated_mib"] > 0

    decode = results["decode"]
    # batches of 1 and 3 rows x contexts of 20 and 40 tokens, none captured
    assert decode["capture"] == {"shapes": 4}
    assert [(r["batch"], r["context"]) for r in decode["rows"]] == [
        (1, 20),
        (3, 20),
        (1, 40),
        (3, 40),
    ]
    for row in decode["rows"]:
        same = row["eager_vs_varlen"]  # the static decode buffers run eagerly == the varlen path
        assert same["logit_max_diff"] < 1e-4 and same["kv_max_diff"] < 1e-5
        assert same["argmax_agree"] == f"{row['batch']}/{row['batch']}"
        assert row["launch_us_eager"] > 0 and row["latency_ms_varlen"] > 0
        assert "graph_vs_eager" not in row and "latency_ms_graph" not in row

    e2e = results["end_to_end"]
    assert set(e2e) == {"pla padded", "pla varlen", "fcfs", "fcfs, no graphs"}
    for name, r in e2e.items():
        assert r["wall_s"] > 0 and r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        # float32 on CPU: every path gives the same tokens
        assert r["identical_to_fcfs"] == setup.e2e_requests
    assert e2e["pla padded"]["grid_hits"] > 0 and e2e["pla varlen"]["grid_hits"] == 0

    report = bench.table(results)
    prefill_rows = ("\n| 1 | 32 |", "\n| 2 | 32 |", "\n| 1 | 64 |", "\n| 2 | 64 |")
    assert all(row in report for row in prefill_rows) and "not captured" in report
    assert "| pla padded |" in report and "| fcfs |" in report
    assert (
        "\n| 3 | 40 |" in report
        and "Decode graphs: 4 `(batch, blocks)` decode shapes, not captured" in report
    )


def test_main_writes_the_report(load_benchmark, tmp_path: Path) -> None:
    bench = load_benchmark("gpu_graphs")
    tiny = dataclasses.replace(
        bench.CPU,
        model=dataclasses.replace(bench.CPU.model, num_hidden_layers=1),
        batches=(1,),
        buckets=(32,),
        e2e_requests=2,
        e2e_output=1,
        decode_batches=(2,),
        decode_contexts=(24,),
    )
    bench.CPU = tiny  # main() picks the CPU setup without CUDA
    assert (
        bench.main(
            ["--device", "cpu", "--out", str(tmp_path), "--latency-reps", "1", "--launch-reps", "1"]
        )
        == 0
    )
    results = json.loads((tmp_path / "gpu_graphs.json").read_text())
    assert len(results["rows"]) == 1 and results["setup"]["latency_reps"] == 1
    assert [(r["batch"], r["context"]) for r in results["decode"]["rows"]] == [(2, 24)]
    assert (tmp_path / "gpu_graphs.md").read_text().startswith("Model: random-weight Llama")


def test_the_burst_alone_runs_its_systems_in_either_order(load_benchmark) -> None:
    bench = load_benchmark("gpu_graphs")
    tiny = dataclasses.replace(
        bench.CPU,
        model=dataclasses.replace(bench.CPU.model, num_hidden_layers=1),
        buckets=(32,),
        e2e_requests=3,
        e2e_output=2,
    )
    results = bench.run(tiny, e2e_only=True, reverse_e2e=True)
    assert "rows" not in results and "decode" not in results
    assert list(results["end_to_end"]) == list(reversed(bench.E2E_SYSTEMS))
    assert all(r["identical_to_fcfs"] == 3 for r in results["end_to_end"].values())
    report = bench.table(results)
    assert report.startswith("Model: random-weight Llama") and "| fcfs, no graphs |" in report

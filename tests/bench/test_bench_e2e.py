"""``plaserve bench`` end to end against a live server, and the client's request shaping."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from plaserve.bench.client import ClientConfig, prompt_token_ids
from plaserve.cli import main
from plaserve.launcher import ServerProcess
from plaserve.workload.trace import TraceRequest, fit_to_context, synthetic_bimodal


@pytest.fixture(scope="module")
def server(qwen2_ckpt: str) -> Iterator[ServerProcess]:
    with ServerProcess([qwen2_ckpt, "--kv-cache-memory", "64MiB", "--no-compile"]) as proc:
        yield proc


def test_prompts_are_reproducible_and_distinct() -> None:
    cfg = ClientConfig(url="http://x", token_id_range=(10, 500), seed=3)
    a = prompt_token_ids(300, 0, cfg)
    assert len(a) == 300 and all(10 <= t < 500 for t in a)
    assert a == prompt_token_ids(300, 0, cfg) and a != prompt_token_ids(300, 1, cfg)


def test_requests_are_fitted_to_the_context() -> None:
    assert fit_to_context(TraceRequest(0.0, 5000, 100), 2048) == TraceRequest(0.0, 1948, 100)
    assert fit_to_context(TraceRequest(0.0, 10, 9000), 2048) == TraceRequest(0.0, 1, 2047)
    assert fit_to_context(TraceRequest(0.0, 5000, 100), None) == TraceRequest(0.0, 5000, 100)


def test_bench_synthetic_run(
    server: ServerProcess, tmp_path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "bench"
    status = main(
        [
            "bench",
            "--url",
            server.url,
            "--synthetic",
            "--num-requests",
            "6",
            "--rate",
            "20",
            "--long-share",
            "0.5",
            "--seed",
            "1",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert status == 0
    # plaserve reports its cost model, so the SLO scales with the prompt
    assert "cost model" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"short", "long", "all"}
    assert summary["all"]["count"] == 6 and summary["all"]["errors"] == 0
    assert summary["short"]["count"] + summary["long"]["count"] == 6
    assert summary["short"]["count"] > 0 and summary["long"]["count"] > 0
    assert summary["all"]["ttft_ms"]["p50"] > 0 and summary["all"]["output_throughput_tok_s"] > 0
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 6
    # Prompts of exact lengths, and ignore_eos with max_tokens: every request produced exactly its output length.
    expected = [fit_to_context(r, 2048) for r in synthetic_bimodal(6, 20, seed=1, long_share=0.5)]
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in records] == [
        (e.prompt_tokens, e.output_tokens) for e in expected
    ]
    for name in ("ttft_cdf.png", "latency_over_time.png"):
        assert os.path.getsize(out / name) > 1000
    run = json.loads((out / "run.json").read_text())
    assert run["num_requests"] == 6 and run["max_model_len"] == 2048

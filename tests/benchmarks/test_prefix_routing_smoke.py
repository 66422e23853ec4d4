"""Smoke test of ``benchmarks/prefix_routing.py`` with plaserve workers at toy sizes: every router
configuration replays the same conversations, and the report has what the docs' table reads.
Timings themselves are not checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")


def test_every_configuration_replays_the_conversations(load_benchmark, tmp_path: Path) -> None:
    bench = load_benchmark("prefix_routing")
    out = tmp_path / "report.json"
    argv = ["--sessions", "2", "--turns", "3", "--doc-tokens", "300", "--rounds", "1"]
    argv += ["--think", "0.05", "--stagger", "0.05", "--max-tokens", "2"]
    argv += ["--worker-args", "--no-compile --kv-cache-memory 64MiB"]
    assert bench.main([*argv, "--checkpoints", str(tmp_path), "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == set(bench.CONFIGS)
    for rows in results.values():
        (row,) = rows
        assert sum(row["requests_per_worker"]) == 6 and 0 < row["later_p50_ms"]
        assert 0 <= row["cached_share"] < 1
    # prefix-aware: later turns found their history cached (how much is the benchmark's to say)
    assert results["pla (prefix-aware)"][0]["cached_share"] > 0

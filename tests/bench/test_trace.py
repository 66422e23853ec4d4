"""Trace loading, scaling and the synthetic bimodal generator."""

from __future__ import annotations

import statistics

import pytest

from plaserve.workload.trace import (
    TraceRequest,
    load_trace,
    parse_timestamp,
    scale_requests,
    synthetic_bimodal,
)

AZURE_CODE = "/work/shared/traces/azure_code_2023.csv"

CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:05.5000000,100,1
2023-11-16 18:17:09.0000001,7,250
"""


@pytest.fixture
def trace_file(tmp_path) -> str:
    path = tmp_path / "trace.csv"
    path.write_text(CSV)
    return str(path)


def test_timestamps_keep_seven_fractional_digits() -> None:
    a, b = (
        parse_timestamp("2023-11-16 18:17:03.9799600"),
        parse_timestamp("2023-11-16 18:17:04.0319600"),
    )
    assert b - a == pytest.approx(0.052, abs=1e-6)
    assert parse_timestamp("12.5") == 12.5


def test_load_trace_unscaled(trace_file: str) -> None:
    reqs = load_trace(trace_file)
    assert [r.prompt_tokens for r in reqs] == [4808, 3180, 100, 7]
    assert [r.output_tokens for r in reqs] == [10, 8, 1, 250]
    assert [r.arrival for r in reqs] == pytest.approx([0.0, 0.052, 1.52004, 5.0200401])


def test_slice_arrivals_start_at_its_first_row(trace_file: str) -> None:
    reqs = load_trace(trace_file, start=1, limit=2)
    assert [(r.arrival, r.prompt_tokens) for r in reqs] == [
        (0.0, 3180),
        (pytest.approx(1.46804), 100),
    ]


def test_time_scale_stretches_and_length_scale_shrinks(trace_file: str) -> None:
    base = load_trace(trace_file)
    slow = load_trace(trace_file, time_scale=2.0, length_scale=0.1)
    assert [r.arrival for r in slow] == pytest.approx([2 * r.arrival for r in base])
    assert [r.prompt_tokens for r in slow] == [481, 318, 10, 1]  # 0.7 rounds to 1, never to 0
    assert [r.output_tokens for r in slow] == [1, 1, 1, 25]  # 0.8 and 0.1 clamp to 1


def test_lengths_are_clamped(trace_file: str) -> None:
    reqs = load_trace(trace_file, max_prompt_tokens=1000, max_output_tokens=9)
    assert [r.prompt_tokens for r in reqs] == [1000, 1000, 100, 7]
    assert [r.output_tokens for r in reqs] == [9, 8, 1, 9]


def test_bad_scale_and_columns(tmp_path, trace_file: str) -> None:
    with pytest.raises(ValueError):
        load_trace(trace_file, time_scale=0)
    bad = tmp_path / "bad.csv"
    bad.write_text("time,prompt\n1,2\n")
    with pytest.raises(ValueError, match="missing column"):
        load_trace(str(bad))


def test_real_azure_trace_loads() -> None:
    reqs = load_trace(AZURE_CODE, start=100, limit=200, time_scale=4.0)
    assert len(reqs) == 200 and reqs[0].arrival == 0.0
    assert all(a.arrival <= b.arrival for a, b in zip(reqs, reqs[1:]))
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in reqs)


def test_scale_requests_matches_load_trace_convention() -> None:
    reqs = [TraceRequest(0.0, 10, 3), TraceRequest(1.5, 200, 40)]
    assert scale_requests(reqs, time_scale=0.5, length_scale=2.0, max_output_tokens=50) == [
        TraceRequest(0.0, 20, 6),
        TraceRequest(0.75, 400, 50),
    ]


def test_synthetic_bimodal() -> None:
    reqs = synthetic_bimodal(
        3000, rate=4.0, seed=7, short=(16, 256), long=(1024, 4096), long_share=0.25, output=(8, 64)
    )
    assert reqs == synthetic_bimodal(
        3000, rate=4.0, seed=7, short=(16, 256), long=(1024, 4096), long_share=0.25, output=(8, 64)
    )
    assert reqs != synthetic_bimodal(3000, rate=4.0, seed=8)
    assert reqs[0].arrival == 0.0
    gaps = [b.arrival - a.arrival for a, b in zip(reqs, reqs[1:])]
    assert min(gaps) >= 0 and statistics.mean(gaps) == pytest.approx(0.25, rel=0.1)
    long = [r for r in reqs if r.prompt_tokens >= 1024]
    assert all(16 <= r.prompt_tokens <= 256 for r in reqs if r.prompt_tokens < 1024)
    assert all(r.prompt_tokens <= 4096 for r in long)
    assert len(long) / len(reqs) == pytest.approx(0.25, abs=0.03)
    assert all(8 <= r.output_tokens <= 64 for r in reqs)

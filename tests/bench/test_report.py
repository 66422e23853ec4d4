"""Summaries, tables and plots from hand-made records."""

from __future__ import annotations

import os

import pytest

from plaserve.workload.report import RequestRecord, format_table, plot, summarize


def _records() -> list[RequestRecord]:
    # TTFT 1..100 ms
    short = [
        RequestRecord(
            "short",
            100,
            10,
            arrival=i * 0.1,
            ttft=(i + 1) / 1000,
            e2e=0.1 + i / 1000,
            tbts=[0.01, 0.02],
            slo_ttft=0.05,
        )
        for i in range(100)
    ]
    long = [
        RequestRecord("long", 2000, 20, arrival=1.0, ttft=0.5, e2e=1.0, tbts=[0.03], slo_ttft=1.0),
        RequestRecord("long", 3000, 20, arrival=2.0, ttft=2.0, e2e=3.0, tbts=[0.05], slo_ttft=1.0),
        RequestRecord(
            "long", 4000, 0, arrival=3.0, ttft=None, e2e=None, slo_ttft=1.0, error="HTTP 500: boom"
        ),
    ]
    return short + long


def test_summary_shape_and_values() -> None:
    s = summarize(_records(), duration_s=10.0)
    assert set(s) == {"short", "long", "all"}
    for cls in s.values():
        assert set(cls) == {
            "count",
            "errors",
            "ttft_ms",
            "tbt_ms",
            "e2e_ms",
            "slo_violation_rate",
            "output_throughput_tok_s",
            "goodput_req_s",
        }
        assert set(cls["ttft_ms"]) == {"p50", "p90", "p99"}
        assert set(cls["tbt_ms"]) == set(cls["e2e_ms"]) == {"p50", "p99"}
    short, long, both = s["short"], s["long"], s["all"]
    assert short["count"] == 100 and short["errors"] == 0
    assert short["ttft_ms"]["p50"] == pytest.approx(50.5)  # linear interpolation over 1..100
    assert short["ttft_ms"]["p90"] == pytest.approx(90.1)
    assert short["ttft_ms"]["p99"] == pytest.approx(99.01)
    assert short["tbt_ms"]["p50"] == pytest.approx(15.0)
    assert short["slo_violation_rate"] == pytest.approx(0.5)  # 51..100 ms miss the 50 ms SLO
    assert short["output_throughput_tok_s"] == pytest.approx(100.0)
    assert short["goodput_req_s"] == pytest.approx(5.0)
    assert long["count"] == 3 and long["errors"] == 1
    assert long["ttft_ms"]["p50"] == pytest.approx(1250.0)  # the failed request has no TTFT
    assert long["slo_violation_rate"] == pytest.approx(2 / 3)  # too slow, and failed
    assert long["output_throughput_tok_s"] == pytest.approx(4.0)
    assert both["count"] == 103 and both["errors"] == 1
    assert both["goodput_req_s"] == pytest.approx(5.1)


def test_requests_without_an_slo_only_need_to_succeed() -> None:
    recs = [
        RequestRecord("short", 10, 1, 0.0, ttft=9.0, e2e=9.0, slo_ttft=None),
        RequestRecord("short", 10, 1, 0.0, ttft=None, e2e=None, slo_ttft=None, error="x"),
    ]
    assert summarize(recs, 1.0)["short"]["slo_violation_rate"] == 0.5


def test_empty_classes_have_null_percentiles() -> None:
    s = summarize([RequestRecord("short", 10, 1, 0.0, ttft=0.01, e2e=0.02)], 1.0)
    assert s["long"]["count"] == 0 and s["long"]["ttft_ms"]["p50"] is None
    assert s["long"]["slo_violation_rate"] is None
    with pytest.raises(ValueError):
        summarize([], 0.0)


def test_table_has_a_row_per_class() -> None:
    table = format_table(summarize(_records(), 10.0))
    rows = {line.split()[0]: line for line in table.splitlines()[2:5]}
    assert set(rows) == {"short", "long", "all"}
    assert "50.0%" in rows["short"] and "66.7%" in rows["long"]


def test_plots_are_written(tmp_path) -> None:
    paths = plot(_records(), str(tmp_path / "plots"))
    assert sorted(os.path.basename(p) for p in paths) == ["latency_over_time.png", "ttft_cdf.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"

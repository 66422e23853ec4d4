"""Smoke test of ``benchmarks/engine_speed.py``: one round on this tree at toy sizes, every row there."""

from __future__ import annotations

import json
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_one_round_has_every_row(load_benchmark, tmp_path: Path, capsys) -> None:
    bench = load_benchmark("engine_speed")
    out = tmp_path / "runs.json"
    assert (
        bench.main(
            [
                "--trees",
                f"a={SRC},b={SRC}",
                "--rounds",
                "1",
                "--reps",
                "1",
                "--lengths",
                "16,2048",
                "--batches",
                "2",
                "--decode-prompt",
                "24",
                "--dtype",
                "float32",
                "--threads",  # wall time on both cores: the test's time halves, the rows are the same
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    for needle in (
        "| figure | a | b | b / a |",
        "prefill tok/s, L = 16",
        "% of the highest peak",
        "L = 2048 in 512-token chunks (engine)",
        "decode tok/s, batch 2 (24-token prompts)",
        "wall time, 2 threads",
    ):
        assert needle in table
    runs = json.loads(out.read_text())
    assert set(runs) == {"a", "b"} and runs["a"][0]["decode_tok_s"]["2"] > 0
    assert (
        bench.main(["--table", str(out), "--dtype", "float32", "--rounds", "1", "--reps", "1"]) == 0
    )
    assert "decode tok/s, batch 2" in capsys.readouterr().out

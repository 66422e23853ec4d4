"""benchmarks/sampler.py at toy sizes: every row of its table, with numbers."""

from __future__ import annotations


def test_every_setting_has_a_row(load_benchmark, capsys) -> None:
    bench = load_benchmark("sampler")
    bench.main(["--vocabs", "300,5000", "--rows", "2", "--reps", "1"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()]
    rows = [r for r in rows if r[0].startswith("| ") and r[0][2].isdigit()]
    assert len(rows) == 2 * len(bench.SPREADS) * len(bench.SETTINGS)
    for r in rows:
        plain, ours, ratio = float(r[4]), float(r[5]), float(r[6].rstrip("x |"))
        assert plain > 0 and ours > 0 and ratio > 0

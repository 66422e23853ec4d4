"""benchmarks/light_load_sim.py end to end on a wall-clock run's results (its fitted cost model)."""

from __future__ import annotations

from pathlib import Path

RUN = Path(__file__).resolve().parents[2] / "docs" / "policies_light_load_2348.json"


def test_light_load_sim_replays_both_slices_of_a_run(load_benchmark, capsys):
    script = load_benchmark("light_load_sim")
    assert script.main([str(RUN), "--c0-scale", "1,2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| c")]
    assert [row.split(" | ")[:2] for row in rows] == [
        ["| code, load 0.18", "1"],
        ["| code, load 0.18", "2"],
        ["| conv, load 0.06", "1"],
        ["| conv, load 0.06", "2"],
    ]
    # a doubled per-step cost keeps the machine busier (the steps are the same, each costs more)
    util = [float(row.split(" | ")[2].split(" / ")[1].rstrip("%")) for row in rows]
    assert util[1] > util[0] and util[3] > util[2]

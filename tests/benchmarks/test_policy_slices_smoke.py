"""benchmarks/policy_slices.py end to end, with a calibrated profile instead of the fit at the start."""

from __future__ import annotations

import json
from pathlib import Path

PROFILE = Path(__file__).resolve().parents[2] / "docs" / "profile_default_cpu.json"
MODELS = Path(__file__).resolve().parents[2] / "docs" / "policy_slices_models.json"


def test_policy_slices_runs_one_slice_of_each_trace(load_benchmark, tmp_path, capsys):
    script = load_benchmark("policy_slices")
    assert (
        script.main(
            [
                "--profile",
                str(PROFILE),
                "--code-starts",
                "0:0:1",
                "--conv-starts",
                "0:0:1",
                # the code slice's largest busy period would take the solver its default 30 s
                "--bound-seconds",
                "1",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert printed.count("| pla SLO violations vs fcfs | <= -70% |") == 2
    assert "no scheduler fewer than" in printed
    out = json.loads((tmp_path / "policy_slices.json").read_text())
    assert set(out["traces"]) == {"code", "conv"}
    assert out["cost_model"] == out["step_cost_model"]
    code_rows = out["traces"]["code"]["table"].splitlines()[2:]
    assert len(code_rows) == 1 and code_rows[0].startswith("| 0 | ")


def test_policy_slices_sweeps_the_load(load_benchmark, tmp_path, capsys):
    script = load_benchmark("policy_slices")
    assert (
        script.main(
            [
                "--models",
                str(MODELS),
                "--code-starts",
                "0:0:1",
                "--conv-starts",
                "0:0:1",
                "--sweep",
                "0.4",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert printed.count("| 40% | 1 | ") == 2
    out = json.loads((tmp_path / "policy_slices.json").read_text())
    assert set(out["sweep"]) == {"code", "conv"} and list(out["sweep"]["code"]["levels"]) == ["0.4"]

"""The wall-clock light-load slices of benchmarks/policies.py, replayed on the simulated clock.

    .venv/bin/python benchmarks/light_load_sim.py docs/policies_light_load_2348.json [--c0-scale 1,2,3]

A wall-clock run (``benchmarks/policies.py --loads code=0.18,conv=0.06 --policies pla,fcfs ...``)
takes five minutes and is one draw of a noisy machine. This replays the same slices (rows 0 of each
trace, the run's loads, lengths x0.25, outputs <= 64), sized with the cost model that run fitted, through
the real pla and fcfs schedulers on a simulated clock: seconds. The fitted model is the isolated
prefill's; the real engine pays more per step (decodes riding, Python, small steps less efficient), and
pla takes more, smaller steps than fcfs. ``--c0-scale`` multiplies the per-step constant ``c0`` of the
model that times the steps, to see whether a light-load rule survives a machine that charges more per
step. Prints pla's TTFT p50s against fcfs's and the SLO violations for each slice.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from plaserve.config import EngineConfig, SchedulerConfig  # noqa: E402
from plaserve.cost import CostModel  # noqa: E402
from plaserve.workload.report import summarize  # noqa: E402
from policy_study.offline import SloRule  # noqa: E402
from policy_study.policies import Slice, scaled_slice  # noqa: E402
from policy_study.slices import _simulate  # noqa: E402

SLICES = (("code", "azure_code_2023.csv", 2000), ("conv", "azure_conv_2023.csv", 4000))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "results", help="results.json of a benchmarks/policies.py run (its cost model, loads)"
    )
    p.add_argument("--c0-scale", default="1,2,3", help="factors on the step model's per-step c0")
    args = p.parse_args(argv)
    with open(args.results) as f:
        run = json.load(f)
    cost = CostModel(**run["cost_model"])
    slo = SloRule(**run["slo"])
    config = EngineConfig(
        kv_cache_memory="1GiB",
        max_model_len=4096,
        enable_prefix_caching=False,
        scheduler=SchedulerConfig(ttft_slo_factor=slo.factor, ttft_slo_floor=slo.floor),
    )
    print(
        "| slice | c0 x | util pla / fcfs | short p50 pla / fcfs (ms) | long p50 pla / fcfs (ms) "
        "| SLO viol. pla / fcfs |\n|---|---|---|---|---|---|"
    )
    for name, file, rows in SLICES:
        load = run["traces"][name]["load"]
        arrivals, _ = scaled_slice(Slice(name, file, 0, rows, load), cost, 0.25, load, 60.0)
        for scale in (float(x) for x in args.c0_scale.split(",")):
            step = dataclasses.replace(cost, c0=cost.c0 * scale)
            out = {}
            for policy in ("pla", "fcfs"):
                records, busy, end = _simulate(arrivals, config, policy, cost, step, slo)
                summary = summarize(records, end)
                late = sum(r.ttft is None or r.ttft > r.slo_ttft for r in records)
                out[policy] = (
                    busy,
                    *(summary[c]["ttft_ms"]["p50"] for c in ("short", "long")),
                    late,
                )
            (pu, ps, pl, pv), (fu, fs, fl, fv) = out["pla"], out["fcfs"]
            print(
                f"| {name}, load {load} | {scale:g} | {pu:.0%} / {fu:.0%} | {ps:.0f} / {fs:.0f} "
                f"({ps / fs - 1:+.0%}) | {pl:.0f} / {fl:.0f} ({pl / fl - 1:+.0%}) | {pv} / {fv} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

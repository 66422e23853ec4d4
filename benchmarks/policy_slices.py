"""The policy comparison of benchmarks/policies.py over many slices of each trace, on the simulated clock.

    .venv/bin/python benchmarks/policy_slices.py                  # ~2 min fit, then 9 code + 10 conversation slices (~30 s)
    .venv/bin/python benchmarks/policy_slices.py --out DIR        # also writes DIR/policy_slices.json
    .venv/bin/python benchmarks/policy_slices.py --models docs/policy_slices_models.json --sweep 0.2,0.4,0.6,0.75,0.9
                                                                  # the load sweep (below)

The same setup as benchmarks/policies.py (lengths x0.25, prompts capped at 4000 and outputs at 64;
arrivals rescaled so the predicted prefill work fills a share of a 60 s window; TTFT SLO = max(0.5 s,
5 x the predicted isolated prefill); short < 512 tokens; the same scheduler settings), but each slice
runs through the real schedulers on a simulated clock. The share (the load) is set per slice, by
bisection, so that fcfs keeps the simulated machine busy 75 % of the window (--fcfs-util), as the
issue asks of the load; slices differ in how much decode work comes with their prompts, so one load
for all would put fcfs anywhere from 65 to 87 %. --fcfs-util 0 uses the fixed loads of
benchmarks/policies.py (code 0.68, conversation 0.31).

Two cost models are fitted at the start, one thread, on the embedded default model:
* the isolated prefill fit of benchmarks/policies.py: it sizes the slices, sets the SLOs and is the
  schedulers' cost model, as on the wall clock;
* a step fit (benchmarks/sim_validation.py's warm-up): other trace rows (from row 1000) replayed under
  fcfs and pla on the real engine, every step timed and the cost model refitted on them, decode and
  mixed steps included. It times the simulated steps, standing in for the machine.
--profile PATH skips the fit and uses a calibrated profile's cost model for both; --models reuses the two
models of an earlier run's policy_slices.json, so that two versions of the scheduler meet the same ones.

Slices start every 1000 rows (code) and 2000 rows (conversation) from row 0, so the first is the slice
that benchmarks/policies.py measures on the wall clock.

--sweep U1,U2,...: the load sweep. The same slices, each at the loads where fcfs keeps the simulated
machine busy U1, U2, ... of the window; per trace and level, pla's TTFT p50 and p99 against fcfs (median
over the slices and the worst slice, and how many slices stay within +5 % on the p50s) and the SLO
violations pooled. A length-aware scheduler must do no harm where there is little to reorder: at 20 %
and 40 % pla should be within +5 % of fcfs on every slice. The bounds are not computed in a sweep.
docs/policy_slices_models.json holds the two models of the run of 2026-12-01 04:26, so that a sweep
needs no fit and two versions of the scheduler meet identical models.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from plaserve.config import EngineConfig, SchedulerConfig  # noqa: E402
from plaserve.cost import CostModel  # noqa: E402
from plaserve.profile import Profile  # noqa: E402
from policy_study.offline import SloRule, fit_cost_model, run_policy  # noqa: E402
from policy_study.policies import Slice  # noqa: E402
from policy_study.slices import (  # noqa: E402
    SliceResult,
    fcfs_load,
    pooled_lines,
    run_slice,
    slices_table,
    sweep_table,
)

HERE = os.path.dirname(os.path.abspath(__file__))
TRACES = {"code": ("azure_code_2023.csv", 0.68), "conv": ("azure_conv_2023.csv", 0.31)}


def describe(cost: CostModel) -> str:
    return (
        f"c0={cost.c0 * 1e3:.2f} ms g1={cost.g1 * 1e6:.1f} us/token g2={cost.g2 * 1e9:.2f} ns/pair "
        f"g3={cost.g3 * 1e6:.2f} us/cached token"
    )


def fit_models(warm_up_seconds: float = 30.0) -> tuple[CostModel, CostModel]:
    """The isolated prefill fit and the step fit on this machine, one thread (see the module docstring)."""
    import torch

    sys.path.insert(0, HERE)
    from plaserve.engine.engine import LLMEngine
    from plaserve.model.loader import load_model
    from sim_validation import StepLog, step_fit, trace_slice  # the simulator's own validation fits

    torch.set_num_threads(1)
    loaded = load_model(None, torch.float32, torch.device("cpu"))

    def config(policy: str) -> EngineConfig:
        return EngineConfig(
            kv_cache_memory="1GiB", max_model_len=4096, scheduler=SchedulerConfig(policy=policy)
        )

    iso = fit_cost_model(
        LLMEngine(config("fcfs"), loaded=loaded), lengths=(32, 128, 512, 1024, 2048), repeats=2
    )
    print(f"isolated prefill fit: {describe(iso)}", flush=True)
    log = StepLog()
    requests, _ = trace_slice(iso, 0.6, warm_up_seconds, start=1000)
    log.active = True
    for policy in ("fcfs", "pla"):
        run_policy(loaded, config(policy), iso, requests)
    log.active = False
    step = step_fit(log.take(), iso)
    print(f"step fit ({len(requests)} requests x 2 policies): {describe(step)}", flush=True)
    return iso, step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--profile",
        default=None,
        help="a calibrated profile whose cost model serves for both (default: fit both at the start)",
    )
    p.add_argument(
        "--models",
        default=None,
        help="policy_slices.json of an earlier run: reuse its two fitted models (to compare code changes)",
    )
    p.add_argument(
        "--code-starts",
        default="0:8000:1000",
        help="first rows of the code slices, START:STOP:STEP",
    )
    p.add_argument(
        "--conv-starts", default="0:18000:2000", help="first rows of the conversation slices"
    )
    p.add_argument("--length-scale", type=float, default=0.25)
    p.add_argument(
        "--fcfs-util",
        type=float,
        default=0.75,
        help="set each slice's load so that fcfs keeps the simulated machine busy this share of the "
        "window (0: the fixed loads of benchmarks/policies.py)",
    )
    p.add_argument(
        "--sweep",
        default=None,
        help="comma-separated fcfs utilisations (e.g. 0.2,0.4,0.6,0.75,0.9): the load sweep instead of "
        "the study at --fcfs-util",
    )
    p.add_argument(
        "--bound-seconds",
        type=float,
        default=30.0,
        help="solver time for the fewest-violations bound per busy period; past it the solver's own "
        "bound stands in (lower, still a bound)",
    )
    p.add_argument("--out", default=None, help="folder for policy_slices.json")
    args = p.parse_args(argv)

    if args.profile:
        cost = step = Profile.load(args.profile).cost_model
        print(f"cost model ({os.path.basename(args.profile)}): {describe(cost)}")
    elif args.models:
        with open(args.models) as f:
            saved = json.load(f)
        cost, step = (CostModel(**saved[key]) for key in ("cost_model", "step_cost_model"))
        print(f"models of {args.models}: isolated prefill {describe(cost)}; steps {describe(step)}")
    else:
        cost, step = fit_models()
    slo = SloRule(factor=5.0, floor=0.5)
    config = EngineConfig(
        kv_cache_memory="1GiB",
        max_model_len=4096,
        enable_prefix_caching=False,
        scheduler=SchedulerConfig(ttft_slo_factor=slo.factor, ttft_slo_floor=slo.floor),
    )
    out: dict = {"cost_model": cost.as_dict(), "step_cost_model": step.as_dict(), "traces": {}}
    if args.sweep:
        out["sweep"] = sweep(
            args, config, cost, step, slo, [float(u) for u in args.sweep.split(",")]
        )
        write(args.out, out)
        return 0
    for name, starts in (("code", args.code_starts), ("conv", args.conv_starts)):
        file, load = TRACES[name]
        start, stop, every = (int(x) for x in starts.split(":"))
        t0 = time.time()
        rows = []
        for s in slices_of(name, starts):
            rows.append(at_load(s, args.fcfs_util, args, config, cost, step, slo))
        loads = f"loads for fcfs at {args.fcfs_util:.0%}" if args.fcfs_util else f"load {load}"
        print(
            f"\n== {file}: {len(rows)} slices from rows {start}..{stop} every {every}, {loads} "
            f"({time.time() - t0:.0f} s)\n"
        )
        print(slices_table(rows))
        print(
            "\n(x: target missed; b: missed, and beyond the bound: no scheduler could meet it on the slice)\n"
        )
        pooled = pooled_lines(rows)
        print("\n".join(pooled))
        out["traces"][name] = {
            "loads": [r.load for r in rows],
            "fcfs_util_target": args.fcfs_util or None,
            "pooled": pooled,
            "table": slices_table(rows),
        }
    write(args.out, out)
    return 0


def at_load(
    s: Slice,
    fcfs_util: float,
    args: argparse.Namespace,
    config: EngineConfig,
    cost: CostModel,
    step: CostModel,
    slo: SloRule,
    bounds: bool = True,
) -> SliceResult:
    """Slice ``s`` run (:func:`run_slice`) at the load where fcfs keeps the simulated machine busy
    ``fcfs_util`` of the window (0: the slice's own load)."""
    if fcfs_util:
        load = fcfs_load(
            s, config, cost, slo, fcfs_util, step_cost=step, length_scale=args.length_scale
        )
        s = dataclasses.replace(s, load=load)
    return run_slice(
        s,
        config,
        cost,
        slo,
        step_cost=step,
        length_scale=args.length_scale,
        bounds=bounds,
        bound_seconds=args.bound_seconds,
    )


def slices_of(name: str, starts: str) -> list[Slice]:
    """The slices of trace ``name`` whose first rows ``START:STOP:STEP`` gives (STOP included)."""
    file, load = TRACES[name]
    start, stop, every = (int(x) for x in starts.split(":"))
    return [Slice(name, file, first, 4000, load) for first in range(start, stop + 1, every)]


def sweep(
    args: argparse.Namespace,
    config: EngineConfig,
    cost: CostModel,
    step: CostModel,
    slo: SloRule,
    levels: list[float],
) -> dict:
    """The load sweep (module docstring): prints one table per trace, returns what the JSON keeps."""
    out: dict = {}
    for name, starts in (("code", args.code_starts), ("conv", args.conv_starts)):
        t0 = time.time()
        by_level = {}
        for util in levels:
            rows = []
            for s in slices_of(name, starts):
                rows.append(at_load(s, util, args, config, cost, step, slo, bounds=False))
            by_level[util] = rows
        table = sweep_table(by_level)
        print(
            f"\n== {TRACES[name][0]}: load sweep over {len(by_level[levels[0]])} slices ({time.time() - t0:.0f} s)\n"
        )
        print(table)
        out[name] = {
            "table": table,
            "levels": {
                f"{util:g}": [
                    {
                        "start": r.start,
                        "load": r.load,
                        "fcfs_util": r.fcfs_utilization,
                        "violations": r.violations,
                        "ttft_ms": r.ttft_ms,
                    }
                    for r in rows
                ]
                for util, rows in by_level.items()
            },
        }
    return out


def write(folder: str | None, out: dict) -> None:
    if folder:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "policy_slices.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

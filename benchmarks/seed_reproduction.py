"""The seed's evaluation, reproduced in the cluster simulator with an ANALYTIC Qwen2.5-32B-on-H100 profile.

    .venv/bin/python benchmarks/seed_reproduction.py --out /tmp/seed            # ~30 min
    .venv/bin/python benchmarks/seed_reproduction.py --short-threshold 512 ...  # the engine default threshold

Every number here comes from the simulator driven by an analytic cost model (FLOP and byte counts
for Qwen2.5-32B on one H100, :mod:`plaserve.cost`), not from a GPU.

Setup, fixed before looking at results:

* rows (engine step policy + router policy): fcfs + round_robin, fcfs + least_tokens,
  spf + power_of_two, pla + pla;
* both Azure traces (one hour each, lengths as recorded);
* 8 instances take the whole trace at its own rate; 1 instance takes every 8th request of the hour,
  so each instance sees the same arrival rate in both settings;
* TTFT SLO of each request = max(250 ms, 5 x its predicted isolated prefill), plaserve bench's rule;
  a request that has not finished 300 s after the last arrival counts as a violation;
* short = prompt shorter than the profile's short threshold (the engines and router use the same);
* load skew = busy time of the busiest instance / mean busy time - 1 (8 instances);
* goodput capacity = the highest arrival rate whose SLO-violation share stays within --target (10 %:
  90 % SLO attainment), found by :func:`plaserve.sim.sweep.capacity` on a window of the trace
  (--capacity-window seconds; for 1 instance, every 8th request of the whole hour) rescaled to rate
  multiples of the trace's own, with two bisection steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from plaserve.router.config import RouterConfig  # noqa: E402
from plaserve.sim.cluster import ClusterConfig, SimResult, simulate  # noqa: E402
from plaserve.sim.profiles import analytic_profile  # noqa: E402
from plaserve.sim.sweep import capacity, mean_rate  # noqa: E402
from plaserve.workload.trace import TraceRequest, load_trace  # noqa: E402

TRACES = {
    "conv": "/work/shared/traces/azure_conv_2023.csv",
    "code": "/work/shared/traces/azure_code_2023.csv",
}
ROWS = (("fcfs", "round_robin"), ("fcfs", "least_tokens"), ("spf", "power_of_two"), ("pla", "pla"))
MULTIPLES = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
DRAIN_S = 300.0


def requests_for(
    trace: str, instances: int, window_s: float | None = None, load: float = 1.0
) -> list[TraceRequest]:
    """The trace (or its first ``window_s`` seconds) at ``load`` times its own rate; one instance gets
    every 8th request."""
    reqs = load_trace(TRACES[trace], time_scale=1.0 / load)
    window_s = None if window_s is None else window_s / load
    if window_s is not None:
        reqs = [r for r in reqs if r.arrival < window_s]
    if instances == 1:
        reqs = reqs[::8]
    return reqs


def row_dict(trace: str, instances: int, scheduler: str, router: str, result: SimResult) -> dict:
    s = result.summary()
    return {
        "trace": trace,
        "instances": instances,
        "scheduler": scheduler,
        "router": router,
        "n": s["all"]["count"],
        "short_n": s["short"]["count"],
        "short_ttft_p50_ms": s["short"]["ttft_ms"]["p50"],
        "short_ttft_p99_ms": s["short"]["ttft_ms"]["p99"],
        "long_ttft_p50_ms": s["long"]["ttft_ms"]["p50"],
        "long_ttft_p99_ms": s["long"]["ttft_ms"]["p99"],
        "slo_violation_rate": s["all"]["slo_violation_rate"],
        "short_slo_violation_rate": s["short"]["slo_violation_rate"],
        "tbt_p99_ms": s["all"]["tbt_ms"]["p99"],
        "load_skew": result.load_skew,
        "busy_share": [i.busy_s / result.duration_s for i in result.instances],
        "wall_s": result.wall_s,
        "duration_s": result.duration_s,
        "unfinished": s["all"]["errors"],
    }


def fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| trace | inst. | scheduler + router | short TTFT p50 | short p99 | long p50 | SLO viol. | "
        "short viol. | load skew | goodput capacity |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cap = r.get("capacity_req_s")
        cap_text = (
            "-"
            if "capacity_req_s" not in r
            else (
                f"< {r['capacity_lowest']:.2f} req/s"
                if cap is None
                else f"{cap:.2f} req/s" + ("" if r.get("capacity_bounded", True) else "+")
            )
        )
        skew = f"{r['load_skew'] * 100:.1f}%" if r["instances"] > 1 else "-"
        lines.append(
            f"| {r['trace']} | {r['instances']} | {r['scheduler']} + {r['router']} | "
            f"{fmt(r['short_ttft_p50_ms'])} ms | {fmt(r['short_ttft_p99_ms'])} ms | "
            f"{fmt(r['long_ttft_p50_ms'])} ms | {r['slo_violation_rate'] * 100:.1f}% | "
            f"{r['short_slo_violation_rate'] * 100:.1f}% | {skew} | {cap_text} |"
        )
    return "\n".join(lines)


def claims(rows: list[dict]) -> str:
    """The seed's claims beside ours, per trace and instance count (pla + pla against fcfs + round_robin)."""
    lines = [
        "| trace | inst. | short TTFT p50 change (seed: -39 %) | short p99 change | SLO violations "
        "(seed: 29.2 % -> 11.2 %) | goodput capacity ratio (seed: 1.35x) | load skew (seed: < 5.8 %) |",
        "|---|---|---|---|---|---|---|",
    ]
    keyed = {(r["trace"], r["instances"], r["scheduler"], r["router"]): r for r in rows}
    for trace in TRACES:
        for inst in (1, 8):
            base, ours = (
                keyed.get((trace, inst, "fcfs", "round_robin")),
                keyed.get((trace, inst, "pla", "pla")),
            )
            if base is None or ours is None:
                continue

            def change(key: str) -> str:
                a, b = ours[key], base[key]
                return "-" if a is None or b is None or b == 0 else f"{(a - b) / b * 100:+.0f}%"

            cap_a, cap_b = ours.get("capacity_req_s"), base.get("capacity_req_s")
            ratio = f"{cap_a / cap_b:.2f}x" if cap_a and cap_b else "-"
            skew = f"{ours['load_skew'] * 100:.1f}%" if inst > 1 else "-"
            lines.append(
                f"| {trace} | {inst} | {change('short_ttft_p50_ms')} | {change('short_ttft_p99_ms')} | "
                f"{base['slo_violation_rate'] * 100:.1f}% -> {ours['slo_violation_rate'] * 100:.1f}% | "
                f"{ratio} | {skew} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="/tmp/seed_reproduction")
    p.add_argument(
        "--short-threshold",
        type=int,
        default=None,
        help="override the profile's rule-chosen short threshold",
    )
    p.add_argument("--traces", default="conv,code")
    p.add_argument("--instances", default="1,8")
    p.add_argument(
        "--target", type=float, default=0.10, help="SLO-violation share for goodput capacity"
    )
    p.add_argument(
        "--capacity-window",
        type=float,
        default=1200.0,
        help="8 instances: seconds of the trace the capacity search replays",
    )
    p.add_argument("--no-capacity", action="store_true")
    p.add_argument(
        "--load", type=float, default=1.0, help="arrival rate as a multiple of the trace's own"
    )
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    profile = analytic_profile("qwen2.5-32b", "H100")
    if args.short_threshold is not None:
        profile = profile.with_short_threshold(args.short_threshold)
    pr = profile.profile
    print(
        f"ANALYTIC profile {profile.label}: {profile.cost}; short < {pr.short_threshold}, chunk "
        f"{pr.long_chunk_size}, max short batch {pr.max_short_batch}, W {pr.w_min * 1e3:.1f}-{pr.w_max * 1e3:.1f} ms, "
        f"KV {profile.kv_tokens} tokens",
        flush=True,
    )
    router_defaults = RouterConfig()
    started_at = subprocess.run(
        ["git", "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    ).stdout.strip()
    rows: list[dict] = []
    for trace in args.traces.split(","):
        for inst in (int(x) for x in args.instances.split(",")):
            reqs = requests_for(trace, inst, load=args.load)
            for scheduler, router in ROWS:
                config = ClusterConfig(
                    instances=inst,
                    scheduler=scheduler,
                    router=RouterConfig(policy=router),
                    drain_s=DRAIN_S,
                )
                result = simulate(reqs, profile, config)
                r = row_dict(trace, inst, scheduler, router, result)
                print(
                    f"{trace} x{inst} {scheduler}+{router}: {len(reqs)} requests at {mean_rate(reqs):.2f} req/s, "
                    f"short p50 {fmt(r['short_ttft_p50_ms'])} ms p99 {fmt(r['short_ttft_p99_ms'])} ms, "
                    f"SLO viol {r['slo_violation_rate'] * 100:.1f}%, skew {r['load_skew'] * 100:.1f}% "
                    f"(simulated {result.duration_s:.0f} s in {result.wall_s:.1f} s)",
                    flush=True,
                )
                if not args.no_capacity:
                    window = requests_for(
                        trace, inst, None if inst == 1 else args.capacity_window, args.load
                    )
                    native = mean_rate(window)
                    found = capacity(
                        window,
                        profile,
                        config,
                        [m * native for m in MULTIPLES],
                        target=args.target,
                        refine=2,
                    )
                    r.update(
                        capacity_req_s=found.capacity,
                        capacity_bounded=found.bounded,
                        capacity_lowest=found.points[0].rate,
                        capacity_native_rate=native,
                        capacity_points=[(pt.rate, pt.slo_violation_rate) for pt in found.points],
                    )
                    print(
                        f"   goodput capacity: {found.describe()} (window's own rate {native:.2f} req/s)",
                        flush=True,
                    )
                rows.append(r)
                with open(os.path.join(args.out, "seed_reproduction.json"), "w") as f:
                    json.dump(
                        {
                            "profile": profile.describe(),
                            "router_config": repr(router_defaults),
                            "target": args.target,
                            "load": args.load,
                            "commit": started_at,
                            "rows": rows,
                        },
                        f,
                        indent=1,
                    )
    text = table(rows) + "\n\n" + claims(rows)
    print("\n" + text)
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    ).stdout.strip()
    with open(os.path.join(args.out, "seed_reproduction.md"), "w") as f:
        f.write(
            f"ANALYTIC profile {profile.label}, short threshold {pr.short_threshold}, load x{args.load:g}, "
            f"commit {commit}\n\n{text}\n"
        )
    return 0


if __name__ == "__main__":
    t0 = time.time()
    code = main()
    print(f"\n(total {time.time() - t0:.0f} s)")
    sys.exit(code)

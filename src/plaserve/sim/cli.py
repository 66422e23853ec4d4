"""``plaserve simulate``: the real schedulers and router on a simulated cluster.

    plaserve simulate --trace T.csv --instances 8 --router pla --scheduler pla --profile analytic:qwen2.5-32b@H100

One run prints ``plaserve bench``'s table and writes its ``summary.json`` (with per-instance busy time,
load skew and the profile added), ``run.json``, ``requests.jsonl`` and plots to ``--out``. Several
values of ``--rate`` or ``--time-scale`` (a list ``1,2,4`` or a range ``START:STOP:STEP``) make a sweep
that ends with the goodput capacity: the highest rate whose SLO-violation share stays within
``--slo-target`` (see :mod:`plaserve.sim.sweep`). Every line that names an analytic profile says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from plaserve.plotting import pyplot
from plaserve.router.config import POLICIES as ROUTER_POLICIES
from plaserve.router.config import RouterConfig
from plaserve.scheduler.policy import POLICIES as SCHEDULER_POLICIES
from plaserve.sim.cluster import ClusterConfig, SimResult, simulate
from plaserve.sim.profiles import SimProfile, load_sim_profile
from plaserve.sim.sweep import SweepPoint, at_rate, capacity, mean_rate
from plaserve.slo import DEFAULT_FACTOR, DEFAULT_FLOOR_S
from plaserve.workload.report import format_table, plot, write_run
from plaserve.workload.trace import TraceRequest, load_trace


def parse_values(text: str) -> list[float]:
    """``"1,2,4"`` or ``"START:STOP:STEP"`` (STOP included when the steps land on it) as floats."""
    try:
        if ":" in text:
            start, stop, step = (float(x) for x in text.split(":"))
            if step <= 0 or stop < start:
                raise ValueError
            n = int(round((stop - start) / step + 1e-9))
            return [start + k * step for k in range(n + 1)]
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a list like 1,2,4 or a range START:STOP:STEP"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: values must be positive")
    return values


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    """The ``simulate`` subcommand's flags."""
    p.add_argument(
        "--trace", required=True, help="trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens)"
    )
    p.add_argument(
        "--instances", type=int, default=1, help="simulated instances (1 to 64 and beyond)"
    )
    p.add_argument(
        "--router", default="pla", choices=ROUTER_POLICIES, help="routing policy (default pla)"
    )
    p.add_argument(
        "--scheduler",
        default="pla",
        choices=sorted(SCHEDULER_POLICIES),
        help="every instance's step policy (default pla)",
    )
    p.add_argument(
        "--profile",
        required=True,
        help="calibrated profile JSON (plaserve calibrate) or analytic:MODEL@GPU, "
        "e.g. analytic:qwen2.5-32b@H100",
    )
    p.add_argument(
        "--short-threshold",
        type=int,
        default=None,
        help="override the profile's short threshold (engines, router and report)",
    )
    p.add_argument("--start", type=int, default=0, help="first trace row")
    p.add_argument("--num-requests", type=int, default=None, help="rows to simulate (default: all)")
    p.add_argument(
        "--duration", type=float, default=None, help="only arrivals in the slice's first SECONDS"
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--time-scale",
        type=parse_values,
        default=None,
        help="multiply inter-arrival times (2 = half the rate); several values sweep",
    )
    load.add_argument(
        "--rate",
        type=parse_values,
        default=None,
        help="rescale arrivals to this mean rate (req/s); several values sweep",
    )
    p.add_argument(
        "--length-scale", type=float, default=1.0, help="multiply prompt and output lengths"
    )
    p.add_argument("--max-prompt-tokens", type=int, default=None)
    p.add_argument("--max-output-tokens", type=int, default=None)
    p.add_argument(
        "--slo-factor",
        type=float,
        default=DEFAULT_FACTOR,
        help="TTFT SLO = max(floor, factor x predicted prefill)",
    )
    p.add_argument("--slo-floor-ms", type=float, default=DEFAULT_FLOOR_S * 1000)
    p.add_argument(
        "--slo-target", type=float, default=0.05, help="sweeps: allowed share of SLO violations"
    )
    p.add_argument("--refine", type=int, default=3, help="sweeps: bisection steps after the grid")
    p.add_argument(
        "--drain",
        type=float,
        default=None,
        help="stop this many simulated seconds after the last arrival (default: when all finish; "
        "sweeps: 300)",
    )
    p.add_argument(
        "--frontend-delay-ms",
        type=float,
        default=0.0,
        help="time from a client sending a request to the router placing it (HTTP, tokenizing, "
        "network); counts in TTFT",
    )
    p.add_argument("--seed", type=int, default=0, help="prompt token ids and power_of_two's draws")
    p.add_argument(
        "--out", default="sim-out", help="directory for summary.json, run.json and plots"
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def profile_line(profile: SimProfile) -> str:
    """One line naming the profile, loudly when it is analytic."""
    c = profile.cost
    kind = "ANALYTIC (FLOP/byte estimates, not measured)" if profile.analytic else "calibrated"
    p = profile.profile
    return (
        f"profile {profile.label} [{kind}]: c0={c.c0 * 1e3:.2f} ms g1={c.g1 * 1e6:.2f} us/token "
        f"g2={c.g2 * 1e9:.3f} ns/pair; short < {p.short_threshold} tokens, chunk {p.long_chunk_size}, "
        f"max short batch {p.max_short_batch}, KV {profile.kv_tokens} tokens"
    )


def instance_table(result: SimResult) -> str:
    """Per-instance busy time, work and requests, with the load skew."""
    lines = [
        f"{'instance':>8} {'busy s':>9} {'busy %':>7} {'steps':>8} {'requests':>8} {'prompt tok':>10} "
        f"{'pred. work s':>12} {'preempt':>7}"
    ]
    for s in result.instances:
        lines.append(
            f"{s.index:>8} {s.busy_s:>9.1f} {s.busy_s / result.duration_s * 100:>6.1f}% {s.steps:>8} "
            f"{s.requests:>8} {s.prompt_tokens:>10} {s.predicted_work_s:>12.1f} {s.preemptions:>7}"
        )
    lines.append(f"load skew (busiest / mean busy - 1): {result.load_skew * 100:.1f}%")
    return "\n".join(lines)


def plot_instances(result: SimResult, out_dir: str) -> str | None:
    """``instance_busy.png``: each instance's busy share of the run (None: no matplotlib)."""
    plt = pyplot()
    if plt is None:
        return None

    fig, ax = plt.subplots(figsize=(max(4, 0.3 * len(result.instances) + 2), 3))
    ax.bar(
        [s.index for s in result.instances],
        [s.busy_s / result.duration_s * 100 for s in result.instances],
    )
    ax.set_xlabel("instance")
    ax.set_ylabel("busy (% of the run)")
    ax.set_title(f"per-instance busy time (skew {result.load_skew * 100:.1f}%)")
    ax.grid(alpha=0.3, axis="y")
    path = os.path.join(out_dir, "instance_busy.png")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def sweep_table(points: list[SweepPoint]) -> str:
    """One row per simulated rate."""
    lines = [
        f"{'rate req/s':>10} {'x time':>7} {'SLO viol':>8} {'short p50':>9} {'p99':>8} {'long p50':>9} "
        f"{'p99':>8} {'skew':>6}"
    ]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    for pt in points:
        s, lg = pt.summary["short"]["ttft_ms"], pt.summary["long"]["ttft_ms"]
        lines.append(
            f"{pt.rate:>10.3f} {pt.time_scale:>7.3f} {pt.slo_violation_rate * 100:>7.1f}% "
            f"{ms(s['p50']):>9} {ms(s['p99']):>8} {ms(lg['p50']):>9} {ms(lg['p99']):>8} "
            f"{pt.load_skew * 100:>5.1f}%"
        )
    return "\n".join(lines)


def load_requests(args: argparse.Namespace) -> list[TraceRequest]:
    """The trace slice the flags describe (time scale applied only when it is a single value)."""
    single_scale = args.time_scale[0] if args.time_scale and len(args.time_scale) == 1 else 1.0
    requests = load_trace(
        args.trace,
        start=args.start,
        limit=args.num_requests,
        time_scale=single_scale,
        length_scale=args.length_scale,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
    )
    if args.duration is not None:
        requests = [r for r in requests if r.arrival < args.duration * single_scale]
    return requests


def run_simulate(args: argparse.Namespace) -> int:
    """Run the simulation ``args`` describe; prints tables. Returns the exit status."""
    try:
        profile = load_sim_profile(args.profile)
        if args.short_threshold is not None:
            profile = profile.with_short_threshold(args.short_threshold)
        requests = load_requests(args)
        config = ClusterConfig(
            instances=args.instances,
            scheduler=args.scheduler,
            router=RouterConfig(policy=args.router, seed=args.seed),
            slo_factor=args.slo_factor,
            slo_floor_s=args.slo_floor_ms / 1000,
            drain_s=args.drain,
            seed=args.seed,
            frontend_delay_s=args.frontend_delay_ms / 1000,
        )
    except (OSError, ValueError) as e:
        print(f"plaserve simulate: {e}", file=sys.stderr)
        return 2
    if len(requests) < 2:
        print("plaserve simulate: need at least two requests", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    print(profile_line(profile))
    native = mean_rate(requests)
    sweep_rates = None
    if args.rate and len(args.rate) > 1:
        sweep_rates = args.rate
    elif args.time_scale and len(args.time_scale) > 1:
        sweep_rates = [native / s for s in args.time_scale]
    setting = (
        f"{config.instances} instance(s), router {config.router.policy}, scheduler {config.scheduler}; "
        f"{len(requests)} requests from {args.trace} (rows {args.start}.., length x{args.length_scale:g})"
    )
    if sweep_rates is None:
        if args.rate:
            requests, _ = at_rate(requests, args.rate[0])
        print(f"simulating {setting} at {mean_rate(requests):.3f} req/s", flush=True)
        result = simulate(requests, profile, config)
        return _report_run(result, args, profile)
    config = dataclasses.replace(config, drain_s=300.0 if args.drain is None else args.drain)
    print(
        f"sweeping {setting}: rates {', '.join(f'{r:.3g}' for r in sorted(sweep_rates))} req/s "
        f"(trace's own {native:.3f}); SLO-violation target {args.slo_target:.0%}",
        flush=True,
    )
    found = capacity(
        requests,
        profile,
        config,
        sweep_rates,
        target=args.slo_target,
        refine=args.refine,
        on_point=lambda pt: print(
            f"  {pt.rate:.3f} req/s: SLO violations {pt.slo_violation_rate * 100:.1f}%", flush=True
        ),
    )
    print(sweep_table(found.points))
    label = " [ANALYTIC profile]" if profile.analytic else ""
    print(f"goodput capacity (SLO violations <= {args.slo_target:.0%}): {found.describe()}{label}")
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(
            {
                "profile": profile.describe(),
                "setting": setting,
                "target": args.slo_target,
                "capacity_req_s": found.capacity,
                "bounded": found.bounded,
                "points": [
                    {
                        "rate": pt.rate,
                        "time_scale": pt.time_scale,
                        "slo_violation_rate": pt.slo_violation_rate,
                        "load_skew": pt.load_skew,
                        "summary": pt.summary,
                    }
                    for pt in found.points
                ],
            },
            f,
            indent=1,
        )
    print(f"wrote {os.path.join(args.out, 'sweep.json')}")
    return 0


def _report_run(result: SimResult, args: argparse.Namespace, profile: SimProfile) -> int:
    summary = result.summary()
    print(result.slo.describe())
    print(format_table(summary))
    print(instance_table(result))
    print(
        f"simulated {result.duration_s:.1f} s in {result.wall_s:.1f} s wall ({result.events} events)"
        + (" [ANALYTIC profile]" if profile.analytic else "")
    )
    run = {
        "trace": args.trace,
        "start": args.start,
        "num_requests": len(result.records),
        "duration_s": result.duration_s,
        "profile": profile.describe(),
        "scaling": {
            "time_scale": args.time_scale,
            "rate": args.rate,
            "length_scale": args.length_scale,
            "max_prompt_tokens": args.max_prompt_tokens,
            "max_output_tokens": args.max_output_tokens,
        },
        "instances": args.instances,
        "router": args.router,
        "scheduler": args.scheduler,
        "frontend_delay_s": args.frontend_delay_ms / 1000,
        "short_threshold": result.slo.short_threshold,
        "slo": result.slo.describe(),
    }
    write_run(args.out, summary, run, result.records)
    if not args.no_plots:
        for path in [*plot(result.records, args.out), plot_instances(result, args.out)]:
            if path:
                print(f"wrote {path}")
    print(f"wrote {os.path.join(args.out, 'summary.json')}")
    unfinished = summary["all"]["errors"]
    if unfinished:
        print(
            f"{unfinished} request(s) unfinished when the simulation stopped (counted as SLO violations)",
            file=sys.stderr,
        )
    return 0

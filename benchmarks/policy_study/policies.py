"""The policy comparison behind ``benchmarks/policies.py`` and ``plaserve demo``.

See ``benchmarks/policies.py`` for the setup; everything is measured in one process, one policy after
the other on identical inputs, so the comparison is a ratio within one session.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass

from plaserve.config import EngineConfig, SchedulerConfig
from plaserve.cost import CostModel, chunk_size_for
from plaserve.engine.engine import LLMEngine
from plaserve.model.loader import load_model, resolve_device, resolve_dtype
from plaserve.plotting import pyplot
from plaserve.workload.report import RequestRecord, format_table, summarize
from plaserve.workload.trace import TraceRequest, load_trace
from policy_study.bounds import slice_bounds
from policy_study.offline import (
    PolicyRun,
    SloRule,
    fit_cost_model,
    run_policy,
    to_record,
    with_policy,
)

TRACE_DIR_CANDIDATES = ("../shared/traces", "../../shared/traces", "/work/shared/traces")
POLICIES = ("fcfs", "spf", "pla")


def find_trace(name: str) -> str:
    """Path of a shared trace file, looked up relative to the checkout and the working directory."""
    here = os.path.dirname(os.path.abspath(__file__))
    # the checkout: benchmarks/policy_study/..
    roots = [
        os.getcwd(),
        os.path.join(here, "..", ".."),
    ]
    for root in roots:
        for cand in TRACE_DIR_CANDIDATES:
            path = os.path.normpath(os.path.join(root, cand, name))
            if os.path.exists(path):
                return path
    raise FileNotFoundError(f"trace {name} not found in ../shared/traces")


@dataclass(frozen=True)
class Slice:
    """One trace slice, scaled to this machine."""

    name: str
    file: str
    start: int
    count: int
    load: float  # predicted prefill work / arrival window; the conversation trace's long outputs add decode work


def scaled_slice(
    s: Slice,
    cost: CostModel,
    length_scale: float,
    load: float,
    seconds: float,
    max_prompt: int = 4000,
    max_output: int = 64,
) -> tuple[list[TraceRequest], float]:
    """The first rows of the slice whose predicted prefill work fills ``load`` of ``seconds``, lengths
    scaled (then capped at the benchmark's ``max_prompt`` and ``max_output``), arrivals rescaled so the
    run lasts ``seconds``. Returns the requests and the time scale."""
    reqs = load_trace(
        find_trace(s.file),
        start=s.start,
        limit=s.count,
        length_scale=length_scale,
        max_prompt_tokens=max_prompt,
        max_output_tokens=max_output,
    )
    work, n = 0.0, 0
    while n < len(reqs) and work < load * seconds:
        work += cost.prefill_time(reqs[n].prompt_tokens)
        n += 1
    reqs = reqs[:n]
    span = reqs[-1].arrival or 1.0
    time_scale = work / load / span
    return [
        TraceRequest(r.arrival * time_scale, r.prompt_tokens, r.output_tokens) for r in reqs
    ], time_scale


def summarize_run(
    run: PolicyRun, slo: SloRule, cost: CostModel
) -> tuple[dict, list[RequestRecord]]:
    records = [to_record(r, slo, cost) for r in run.requests]
    return summarize(records, run.wall_s), records


def comparison_table(results: dict[str, dict]) -> str:
    """Markdown table: one row per policy with the issue's columns."""
    head = (
        "| policy | short TTFT p50 | p90 | p99 | long TTFT p50 | p99 | SLO viol. | out tok/s | goodput req/s |"
        " util |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for pol, r in results.items():
        s, lg, a = r["summary"]["short"], r["summary"]["long"], r["summary"]["all"]

        def ms(x):
            return "-" if x is None else f"{x:.0f}"

        rows.append(
            f"| {pol} | {ms(s['ttft_ms']['p50'])} | {ms(s['ttft_ms']['p90'])} | {ms(s['ttft_ms']['p99'])} | "
            f"{ms(lg['ttft_ms']['p50'])} | {ms(lg['ttft_ms']['p99'])} | {a['slo_violation_rate'] * 100:.1f}% | "
            f"{a['output_throughput_tok_s']:.1f} | {a['goodput_req_s']:.2f} | {r['utilization'] * 100:.0f}% |"
        )
    return "\n".join(rows)


@dataclass(frozen=True)
class Check:
    """One of the issue's targets for pla on one slice: ``measured`` is a relative change (``pla / base -
    1``) or, for ``times`` checks, a ratio (``pla / base``); ``best`` is the best any scheduler could
    reach (:func:`slice_bounds`), where a bound limits it."""

    name: str
    measured: float | None
    target: float
    best: float | None = None
    times: bool = False

    @property
    def met(self) -> bool | None:
        return None if self.measured is None else self.measured <= self.target

    @property
    def beyond_bound(self) -> bool:
        """Whether no scheduler could meet the target on the slice."""
        return self.best is not None and self.best > self.target

    @property
    def verdict(self) -> str:
        if self.met is None:
            return "-"
        if self.met:
            return "met"
        return "MISSED (beyond the bound)" if self.beyond_bound else "MISSED"

    def fmt(self, x: float | None) -> str:
        if x is None:
            return "-"
        if self.times:
            return f"{x:.2f}x"
        # One decimal where whole percent would round a value onto the target and hide which side it is on.
        close = f"{x * 100:+.0f}" == f"{self.target * 100:+.0f}" and x != self.target
        return f"{x * 100:+.1f}%" if close else f"{x * 100:+.0f}%"

    @property
    def target_text(self) -> str:
        return f"<= {self.target}x" if self.times else f"<= {self.target * 100:+.0f}%"


def target_checks(results: dict[str, dict], bounds: dict | None = None) -> list[Check]:
    """The issue's targets for pla against fcfs and spf (those whose policies are in ``results``)."""

    def ttft(pol, cls, q):
        return results[pol]["summary"][cls]["ttft_ms"][q]

    def change(a, b):
        return None if a is None or b is None or not b else (a - b) / b

    def ratio(a, b):
        return None if a is None or b is None or not b else a / b

    out: list[Check] = []
    if "pla" in results and "fcfs" in results:

        def violations(pol):
            return results[pol]["summary"]["all"]["slo_violation_rate"]

        short_bound = (bounds or {}).get("short_ttft_ms", {})
        out += [
            Check(
                "short TTFT p50 vs fcfs",
                change(ttft("pla", "short", "p50"), ttft("fcfs", "short", "p50")),
                -0.6,
                change(short_bound.get("p50"), ttft("fcfs", "short", "p50")),
            ),
            Check(
                "short TTFT p99 vs fcfs",
                change(ttft("pla", "short", "p99"), ttft("fcfs", "short", "p99")),
                -0.8,
                change(short_bound.get("p99"), ttft("fcfs", "short", "p99")),
            ),
            Check(
                "long TTFT p50 vs fcfs",
                change(ttft("pla", "long", "p50"), ttft("fcfs", "long", "p50")),
                0.1,
            ),
            Check(
                "SLO violations vs fcfs",
                change(violations("pla"), violations("fcfs")),
                -0.7,
                change((bounds or {}).get("slo_violation_rate"), violations("fcfs")),
            ),
        ]
    if "pla" in results and "spf" in results:
        out += [
            Check(
                f"{cls} TTFT p99 / spf",
                ratio(ttft("pla", cls, "p99"), ttft("spf", cls, "p99")),
                target,
                times=True,
            )
            for cls, target in (("short", 1.2), ("long", 1.0))
        ]
    return out


def ratio_lines(results: dict[str, dict], bounds: dict | None = None) -> list[str]:
    """The issue's targets (:func:`target_checks`) as a markdown table: the measured change or ratio, the
    target and, where ``bounds`` (:func:`slice_bounds`) limit it, the best any scheduler could reach."""
    checks = target_checks(results, bounds)
    rows = [
        f"| pla {c.name} | {c.fmt(c.measured)} | {c.target_text} | {c.fmt(c.best)} | {c.verdict} |"
        for c in checks
    ]
    return (
        ["| check | measured | target | best possible | |", "|---|---|---|---|---|", *rows]
        if rows
        else []
    )


def bounds_line(bounds: dict) -> str:
    """One sentence with the slice's bounds (:func:`slice_bounds`)."""
    parts = [f"SLO violations >= {bounds['slo_violation_rate'] * 100:.1f}%"]
    parts += [f"short TTFT {q} >= {ms:.0f} ms" for q, ms in bounds["short_ttft_ms"].items()]
    return f"No scheduler can do better on this slice under the fitted cost model (benchmarks/policy_study/bounds.py): {', '.join(parts)}."


def starvation_run(loaded, config: EngineConfig, cost: CostModel, seconds: float) -> str:
    """A steady stream of shorts keeps spf's step budget full; one long prompt arrives once the backlog
    exists. Reports whether (and when) each policy started and finished the long prompt."""
    short_len, long_len = 200, 2048
    # Shorts at 1.3x what fcfs-style batching can absorb (predicted), for `seconds`.
    per_short = cost.prefill_time(short_len) - cost.c0
    rate = 1.3 / per_short
    stream = [TraceRequest(i / rate, short_len, 1) for i in range(int(seconds * rate))]
    long_at = seconds * 0.25
    arrivals = sorted(stream + [TraceRequest(long_at, long_len, 1)], key=lambda r: r.arrival)
    k = config.scheduler.max_consecutive_short
    chunk = config.scheduler.long_chunk_size or chunk_size_for(
        cost,
        config.scheduler.short_threshold,
        config.scheduler.max_num_batched_tokens,
        config.scheduler.slo.floor,
    )
    chunks = -(-long_len // chunk)
    lines = [
        f"Starvation check: {len(stream)} shorts of {short_len} tokens at {rate:.0f}/s for {seconds:.0f} s "
        f"(1.3x the predicted short capacity); one {long_len}-token prompt at t={long_at:.1f} s.",
        f"pla's bound: {chunks} chunks x (K={k} short batches + 1 chunk) = {chunks * (k + 1)} prefill steps.",
        "",
        "| policy | long prompt started | long TTFT | prefill steps before its first token |",
        "|---|---|---|---|",
    ]
    for pol in ("spf", "pla"):
        run = run_policy(loaded, with_policy(config, pol), cost, arrivals, deadline_s=seconds)
        (long,) = [r for r in run.requests if r.num_prompt_tokens == long_len]
        m = long.metrics
        started = "no" if m.first_scheduled_time is None else f"at {m.first_scheduled_time:.1f} s"
        ttft = (
            "never (run ended)"
            if m.first_token_time is None
            else f"{m.first_token_time - m.arrival_time:.1f} s"
        )
        steps = "-"
        if m.first_token_time is not None:
            steps = str(_prefill_steps_between(run, m.arrival_time, m.first_token_time))
        lines.append(f"| {pol} | {started} | {ttft} | {steps} |")
    return "\n".join(lines)


def _prefill_steps_between(run: PolicyRun, t0: float, t1: float) -> int:
    """Distinct prefill steps (by their end time) that finished in ``(t0, t1]`` across all requests."""
    ends = {
        round(e, 6) for r in run.requests for _, e, _ in r.metrics.prefill_chunks if t0 < e <= t1
    }
    return len(ends)


def plot_cdfs(all_records: dict[str, list[RequestRecord]], title: str, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, cls in zip(axes, ("short", "long")):
        for pol, recs in all_records.items():
            v = np.sort(
                [r.ttft * 1000 for r in recs if r.length_class == cls and r.ttft is not None]
            )
            if len(v):
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=pol)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms, log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{cls} prompts")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="one short slice (~2 min): the demo")
    p.add_argument("--length-scale", type=float, default=0.25)
    p.add_argument(
        "--load",
        type=float,
        default=None,
        help="predicted prefill work / arrival window (default: code 0.68, conversation 0.31, "
        "which keep fcfs busy near 75 %% of the window on the development machine; the "
        "conversation trace's long outputs add much decode work)",
    )
    p.add_argument(
        "--loads",
        default=None,
        help="per-trace loads, e.g. code=0.18,conv=0.05 (over --load; a light-load run needs far "
        "less on the decode-heavy conversation trace)",
    )
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--out", default=None, help="folder for results.json and CDF plots")
    p.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="length of each policy run (default 60, quick 35)",
    )
    p.add_argument("--starvation-seconds", type=float, default=30.0)
    p.add_argument("--starvation-only", action="store_true", help="run only the starvation check")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (1 makes timings robust to other processes on a shared machine)",
    )
    args = p.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    logging.getLogger("plaserve").setLevel(logging.ERROR)

    device = resolve_device("auto")
    dtype = resolve_dtype("auto", device)
    loaded = load_model(None, dtype, device)
    import torch

    print(
        f"model: embedded default (RANDOM WEIGHTS), {str(dtype).removeprefix('torch.')} on {device}, "
        f"{torch.get_num_threads()} threads"
    )
    slo = SloRule(factor=5.0, floor=0.5)
    sched = SchedulerConfig(ttft_slo_factor=slo.factor, ttft_slo_floor=slo.floor)
    config = EngineConfig(kv_cache_memory="1GiB", max_model_len=4096, scheduler=sched)
    print("fitting the prefill cost model on this machine ...", flush=True)
    cost = fit_cost_model(
        LLMEngine(with_policy(config, "fcfs"), loaded=loaded),
        lengths=(32, 128, 512, 1024, 2048),
        repeats=2,
    )
    print(
        f"  c0={cost.c0 * 1e3:.2f} ms  g1={cost.g1 * 1e6:.1f} us/token  g2={cost.g2 * 1e9:.2f} ns/pair "
        f"(L=128: {cost.prefill_time(128) * 1e3:.0f} ms, L=2048: {cost.prefill_time(2048) * 1e3:.0f} ms)"
    )
    seconds = args.seconds or (35.0 if args.quick else 60.0)
    loads = {"code": args.load or 0.68, "conv": args.load or 0.31}
    for item in args.loads.split(",") if args.loads else []:
        name, value = item.split("=")
        loads[name] = float(value)
    slices = [Slice("code", "azure_code_2023.csv", 0, 2000, loads["code"])]
    if not args.quick:
        slices.append(Slice("conv", "azure_conv_2023.csv", 0, 4000, loads["conv"]))
    policies = args.policies.split(",")
    out: dict = {"cost_model": cost.as_dict(), "slo": vars(slo), "traces": {}}
    for s in [] if args.starvation_only else slices:
        arrivals, time_scale = scaled_slice(s, cost, args.length_scale, s.load, seconds)
        n_long = sum(a.prompt_tokens >= sched.short_threshold for a in arrivals)
        print(
            f"\n== {s.file} rows {s.start}..{s.start + len(arrivals)}: lengths x{args.length_scale}, outputs capped "
            f"at 64, load {s.load}, arrivals x{time_scale:.3f} ({len(arrivals) / arrivals[-1].arrival:.1f} req/s over "
            f"{arrivals[-1].arrival:.0f} s); {n_long} long of {len(arrivals)}",
            flush=True,
        )
        results, records = {}, {}
        # A run may overrun its slice while the queue drains; the quick run (the demo) is cut off at
        # twice its length so that it stays about two minutes even on a loaded machine.
        deadline = 2 * seconds if args.quick else None
        for pol in policies:
            run = run_policy(loaded, with_policy(config, pol), cost, arrivals, deadline_s=deadline)
            summary, recs = summarize_run(run, slo, cost)
            # Utilization over the arrival window, not the wall time: a run that overruns its slice to
            # drain a backlog was offered more work than it could do in time (> 100 %).
            util = run.busy_s / arrivals[-1].arrival
            results[pol] = {
                "summary": summary,
                "utilization": util,
                "busy_s": run.busy_s,
                "wall_s": run.wall_s,
            }
            records[pol] = recs
            print(
                f"-- {pol}: {run.wall_s:.0f} s wall, engine busy {run.busy_s:.0f} s = {util * 100:.0f}% of the "
                f"{arrivals[-1].arrival:.0f} s arrival window"
            )
            print(format_table(summary), flush=True)
        table = comparison_table(results)
        bounds = slice_bounds(
            [(a.arrival, a.prompt_tokens) for a in arrivals],
            cost,
            lambda n: slo.ttft(cost, n),
            sched.short_threshold,
        )
        checks = ratio_lines(results, bounds)
        print("\n" + table + "\n")
        print(bounds_line(bounds) + "\n")
        print("\n".join(checks))
        out["traces"][s.name] = {
            "time_scale": time_scale,
            "length_scale": args.length_scale,
            "load": s.load,
            "requests": len(arrivals),
            "results": results,
            "bounds": bounds,
            "table": table,
            "checks": checks,
        }
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            plot_cdfs(
                records,
                f"TTFT CDF, {s.file} slice (default model, CPU)",
                os.path.join(args.out, f"policies_ttft_cdf_{s.name}.png"),
            )
    if not args.quick and args.starvation_seconds > 0:
        text = starvation_run(loaded, config, cost, args.starvation_seconds)
        print("\n" + text)
        out["starvation"] = text
    if args.out:
        with open(os.path.join(args.out, "policies.json"), "w") as f:
            json.dump(out, f, indent=1)
    return 0

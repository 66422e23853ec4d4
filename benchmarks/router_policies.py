"""Routing policies on the Azure code trace, through the real router, in front of emulated GPUs.

Setup, all on loopback:

* **workers**: ``--workers`` fake GPUs (:mod:`plaserve.testing.fake_gpu`) in one child process, each a
  FCFS single-server prefill queue that sleeps the cost model's time per prompt, then streams its
  tokens 20 ms apart (sleeping costs no CPU, so 8 "GPUs" fit on a 2-core machine). They report
  ``/load`` in plaserve's shape. Cost model: Qwen2.5-32B on an H100
  (:func:`plaserve.cost.analytic_cost`: g1 = 1.05e-4 s/token, g2 = 2.9e-9 s/pair,
  c0 = 19 ms; a 512-token prompt takes 73 ms, a 7,437-token one 0.88 s).
* **router**: ``plaserve route --policy P`` in a child process, one run per policy.
* **load**: rows ``[start, start + count)`` of ``azure_code_2023.csv`` replayed open-loop by
  :func:`plaserve.bench.client.run_requests` (the code behind ``plaserve bench``), prompt lengths as in
  the trace, outputs clamped to ``--max-output`` tokens, inter-arrival times multiplied by the time
  scale that makes the predicted prefill work fill ``--load`` of the workers' time over the trace's
  span. The trace is bursty (at the 10-second scale its busiest stretch carries ~3x its average work),
  so bursts overload the cluster whatever the policy; that is where policies differ.

Reported per policy: short (< 512 tokens) and long TTFT p50/p99, the share of requests over their TTFT
SLO (``max(250 ms, 5 x predicted isolated prefill)``, ``plaserve bench``'s rule with the workers' cost
model), each worker's busy seconds (time in prefills, measured by the fake GPUs) and their coefficient
of variation, and the measured utilization (busy / (workers x run time)). Targets (issue 6), pla against
round_robin: busy-time CV under 5 %, short TTFT p99 at least 3x better. The client, the router and
the fake GPUs share the machine's CPUs: when other work loads them, event-loop delays add to every
TTFT (most visibly to pla's ~100-ms short TTFTs), so each run records the 1-minute load average
before and after.

    python benchmarks/router_policies.py [--workers 8] [--count 1500] [--load 0.75] [--out docs]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from plaserve.bench.client import ClientConfig, run_requests  # noqa: E402
from plaserve.cost import analytic_cost  # noqa: E402
from plaserve.launcher import (
    RouterProcess,  # noqa: E402
    free_port,  # noqa: E402
)
from plaserve.testing.fake_gpu import FakeGpuConfig, spawn  # noqa: E402
from plaserve.workload.report import summarize  # noqa: E402
from plaserve.workload.slo import TtftSlo  # noqa: E402
from plaserve.workload.trace import TraceRequest, load_trace  # noqa: E402
from policy_study.policies import find_trace  # noqa: E402

POLICIES = ("round_robin", "least_requests", "least_tokens", "power_of_two", "pla")
# pla without holding long requests in the router: what the hold horizon contributes.
VARIANTS = {"pla (no hold)": ("pla", ["--long-hold-horizon-ms", "inf"])}
MODEL, GPU = "qwen2.5-32b", "H100"


def scaled_trace(
    start: int, count: int, load: float, workers: int, max_output: int, cost
) -> tuple[list[TraceRequest], float]:
    """The trace rows, arrivals scaled so the predicted work is ``load`` of ``workers``' time."""
    reqs = load_trace(
        find_trace("azure_code_2023.csv"), start=start, limit=count, max_output_tokens=max_output
    )
    work = sum(cost.prefill_time(r.prompt_tokens) for r in reqs)
    time_scale = work / (load * workers) / reqs[-1].arrival
    return [dataclasses.replace(r, arrival=r.arrival * time_scale) for r in reqs], time_scale


def fake_stats(urls: list[str]) -> list[float]:
    return [httpx.get(u + "/fake/stats", timeout=5).json()["busy_s"] for u in urls]


def run_policy(
    label: str,
    policy: str,
    extra: list[str],
    urls: list[str],
    requests: list[TraceRequest],
    slo: TtftSlo,
) -> dict:
    with RouterProcess(urls, ["--policy", policy, *extra]) as router:
        time.sleep(1.0)  # a few /load polls, so the router knows the workers' cost model
        before = fake_stats(urls)
        load_before = os.getloadavg()[0]
        cfg = ClientConfig(url=router.url, short_threshold=slo.short_threshold, seed=0)
        result = asyncio.run(run_requests(requests, cfg, slo))
        busy = [b - a for a, b in zip(before, fake_stats(urls))]
        load_after = os.getloadavg()[0]
        workers_state = httpx.get(router.url + "/workers", timeout=5).json()
    records = [
        dataclasses.replace(r, slo_ttft=slo.for_prompt(r.prompt_tokens)) for r in result.records
    ]
    summary = summarize(records, result.duration_s)
    arr = np.asarray(busy)
    out = {
        "label": label,
        "policy": policy,
        "args": extra,
        "summary": summary,
        "busy_s": busy,
        "busy_cv": float(arr.std() / arr.mean()),
        "utilization": float(arr.sum() / (len(arr) * result.duration_s)),
        "duration_s": result.duration_s,
        "router": workers_state.get("policy"),
        "loadavg_1min": [load_before, load_after],
        "ttft_ms": {
            cls: sorted(
                r.ttft * 1000
                for r in records
                if r.ok and r.ttft is not None and r.length_class == cls
            )
            for cls in ("short", "long")
        },
    }
    s, lg = summary["short"], summary["long"]
    print(
        f"{label:>15}: short TTFT p50 {s['ttft_ms']['p50']:.0f} p99 {s['ttft_ms']['p99']:.0f} ms, long p50 "
        f"{lg['ttft_ms']['p50']:.0f} p99 {lg['ttft_ms']['p99']:.0f} ms, SLO viol {summary['all']['slo_violation_rate']:.1%}, "
        f"busy CV {out['busy_cv']:.1%}, util {out['utilization']:.0%}, errors {summary['all']['errors']}; "
        f"machine load {load_before:.1f} -> {load_after:.1f}",
        flush=True,
    )
    return out


def table(results: list[dict]) -> str:
    head = (
        "| policy | short TTFT p50 (ms) | short p99 (ms) | long TTFT p50 (ms) | long p99 (ms) | SLO viol. short | "
        "SLO viol. long | busy-time CV | utilization | errors |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for r in results:
        s, lg, a = r["summary"]["short"], r["summary"]["long"], r["summary"]["all"]
        rows.append(
            f"| {r['label']} | {s['ttft_ms']['p50']:.0f} | {s['ttft_ms']['p99']:.0f} | {lg['ttft_ms']['p50']:.0f} | "
            f"{lg['ttft_ms']['p99']:.0f} | {s['slo_violation_rate']:.1%} | {lg['slo_violation_rate']:.1%} | "
            f"{r['busy_cv']:.1%} | {r['utilization']:.0%} | {a['errors']} |"
        )
    return "\n".join(rows)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in results:
        for ax, cls in zip(axes[:2], ("short", "long")):
            xs = r["ttft_ms"][cls]
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=r["label"])
    for ax, cls in zip(axes[:2], ("short", "long")):
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms, log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{cls} prompts: TTFT CDF")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8, loc="lower right")
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        axes[2].bar(np.arange(len(r["busy_s"])) + i * width, r["busy_s"], width, label=r["label"])
    axes[2].set_xlabel("worker")
    axes[2].set_ylabel("busy seconds (prefill)")
    axes[2].set_title("per-worker busy time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--start", type=int, default=3000, help="first trace row")
    p.add_argument("--count", type=int, default=1500, help="trace rows to replay")
    p.add_argument(
        "--load",
        type=float,
        default=0.75,
        help="predicted prefill work / worker time over the span",
    )
    p.add_argument("--max-output", type=int, default=4, help="clamp on output tokens")
    p.add_argument("--policies", nargs="*", default=[*POLICIES, *VARIANTS])
    p.add_argument(
        "--out", default=None, help="directory for router_policies.json and img/router_policies.png"
    )
    args = p.parse_args()

    cost = analytic_cost(MODEL, GPU)
    requests, time_scale = scaled_trace(
        args.start, args.count, args.load, args.workers, args.max_output, cost
    )
    slo = TtftSlo(cost={"g1": cost.g1, "g2": cost.g2, "c0": cost.c0, "source": cost.source})
    short = sum(r.prompt_tokens < slo.short_threshold for r in requests)
    print(
        f"{len(requests)} requests (rows {args.start}-{args.start + len(requests) - 1} of azure_code_2023.csv, "
        f"{short} short), time x{time_scale:.3f} -> {requests[-1].arrival:.1f} s; {args.workers} fake GPUs "
        f"({cost.source}); {slo.describe()}",
        flush=True,
    )
    ports = [free_port() for _ in range(args.workers)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    gpus = spawn(
        ports, FakeGpuConfig(cost, tbt_s=0.02, max_output_tokens=args.max_output, model_name=MODEL)
    )
    results = []
    try:
        for label in args.policies:
            policy, extra = VARIANTS.get(label, (label, []))
            results.append(run_policy(label, policy, extra, urls, requests, slo))
    finally:
        gpus.terminate()
        gpus.wait(10)
    print()
    print(table(results))
    by = {r["label"]: r for r in results}
    if "pla" in by and "round_robin" in by:
        ratio = (
            by["round_robin"]["summary"]["short"]["ttft_ms"]["p99"]
            / by["pla"]["summary"]["short"]["ttft_ms"]["p99"]
        )
        print(
            f"\npla vs round_robin: short TTFT p99 {ratio:.1f}x better; busy-time CV {by['pla']['busy_cv']:.1%} "
            f"(round_robin {by['round_robin']['busy_cv']:.1%})"
        )
    if args.out:
        os.makedirs(os.path.join(args.out, "img"), exist_ok=True)
        meta = {
            "trace": "azure_code_2023.csv",
            "start": args.start,
            "count": len(requests),
            "time_scale": time_scale,
            "load": args.load,
            "workers": args.workers,
            "max_output_tokens": args.max_output,
            "cost_model": cost.as_dict(),
            "slo": slo.describe(),
        }
        with open(os.path.join(args.out, "router_policies.json"), "w") as f:
            json.dump(
                {
                    "setup": meta,
                    "results": [{k: v for k, v in r.items() if k != "ttft_ms"} for r in results],
                },
                f,
                indent=1,
            )
        plot(results, os.path.join(args.out, "img", "router_policies.png"))
        print(f"wrote {args.out}/router_policies.json and {args.out}/img/router_policies.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

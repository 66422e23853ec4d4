"""``plaserve bench``: replay a trace (or a synthetic bimodal mix) against a server and report by class.

Writes to ``--out``: ``summary.json`` (see :mod:`plaserve.workload.report`), ``run.json`` (the settings,
scaling and SLO of the run), ``requests.jsonl`` (one record per request) and the plots.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from plaserve.bench.client import ClientConfig, run_requests
from plaserve.slo import DEFAULT_FACTOR, DEFAULT_FLOOR_S
from plaserve.workload.report import format_table, plot, summarize, write_run
from plaserve.workload.slo import TtftSlo
from plaserve.workload.trace import load_trace, scale_requests, synthetic_bimodal


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's flags."""
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens)")
    src.add_argument(
        "--synthetic", action="store_true", help="Poisson arrivals, bimodal prompt lengths"
    )
    p.add_argument("--start", type=int, default=0, help="first trace row to replay")
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests to send (trace default: all rows; synthetic default: 100)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply inter-arrival times: 2 = half the arrival rate, 0.5 = double it",
    )
    p.add_argument(
        "--length-scale", type=float, default=1.0, help="multiply prompt and output lengths"
    )
    p.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="clamp prompt lengths (after scaling)"
    )
    p.add_argument(
        "--max-output-tokens", type=int, default=None, help="clamp output lengths (after scaling)"
    )
    p.add_argument("--rate", type=float, default=2.0, help="synthetic: arrivals per second")
    p.add_argument("--long-share", type=float, default=0.2, help="synthetic: share of long prompts")
    p.add_argument("--seed", type=int, default=0, help="synthetic arrivals and prompt token ids")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--short-threshold", type=int, default=512, help="prompts shorter than this are 'short'"
    )
    p.add_argument(
        "--slo-factor",
        type=float,
        default=DEFAULT_FACTOR,
        help="TTFT SLO = max(floor, factor x predicted prefill)",
    )
    p.add_argument("--slo-floor-ms", type=float, default=DEFAULT_FLOOR_S * 1000)
    p.add_argument(
        "--slo-short-ms",
        type=float,
        default=500.0,
        help="fixed short SLO when the server has no cost model",
    )
    p.add_argument(
        "--slo-long-ms",
        type=float,
        default=5000.0,
        help="fixed long SLO when the server has no cost model",
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="every request's")
    p.add_argument(
        "--out", default="bench-out", help="directory for summary.json, run.json and plots"
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; prints the table. Returns the exit status."""
    scaling = dict(
        time_scale=args.time_scale,
        length_scale=args.length_scale,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
    )
    try:
        if args.trace:
            requests = load_trace(args.trace, start=args.start, limit=args.num_requests, **scaling)
        else:
            raw = synthetic_bimodal(
                args.num_requests if args.num_requests is not None else 100,
                args.rate,
                seed=args.seed,
                long_share=args.long_share,
            )
            requests = scale_requests(raw, **scaling)
    except (OSError, ValueError) as e:
        print(f"plaserve bench: {e}", file=sys.stderr)
        return 2
    if not requests:
        print("plaserve bench: no requests to send", file=sys.stderr)
        return 2
    cfg = ClientConfig(
        url=args.url.rstrip("/"),
        model=args.model,
        api_key=args.api_key,
        short_threshold=args.short_threshold,
        request_timeout=args.request_timeout,
        seed=args.seed,
        temperature=args.temperature,
        top_p=args.top_p,
    )
    slo = TtftSlo(
        factor=args.slo_factor,
        floor_s=args.slo_floor_ms / 1000,
        short_s=args.slo_short_ms / 1000,
        long_s=args.slo_long_ms / 1000,
        short_threshold=args.short_threshold,
    )
    source = (
        args.trace
        or f"synthetic bimodal (rate {args.rate}/s, long share {args.long_share}, seed {args.seed})"
    )
    print(
        f"plaserve bench: {len(requests)} requests from {source} over {requests[-1].arrival:.1f} s "
        f"(time x{args.time_scale:g}, length x{args.length_scale:g}) against {cfg.url}",
        flush=True,
    )
    try:
        result = asyncio.run(run_requests(requests, cfg, slo))
    except Exception as e:  # the server is down, or not OpenAI-compatible
        print(f"plaserve bench: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(result.slo.describe())
    summary = summarize(result.records, result.duration_s)
    print(format_table(summary))
    run = {
        "url": cfg.url,
        "model": result.model,
        "source": source,
        "num_requests": len(requests),
        "duration_s": result.duration_s,
        "max_model_len": result.max_model_len,
        "scaling": scaling,
        "short_threshold": args.short_threshold,
        "slo": result.slo.describe(),
    }
    write_run(args.out, summary, run, result.records)
    if not args.no_plots:
        for path in plot(result.records, args.out):
            print(f"wrote {path}")
    print(f"wrote {os.path.join(args.out, 'summary.json')}")
    errors = summary["all"]["errors"]
    if errors:
        first = next(r.error for r in result.records if r.error)
        print(f"{errors} request(s) failed; first error: {first}", file=sys.stderr)
    return 0

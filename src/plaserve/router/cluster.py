"""``plaserve cluster --workers N [MODEL_DIR]``: N workers and a router on one machine;
``plaserve cluster --prefill N --decode M``: a prefill/decode cluster (docs/PD.md), N prefill workers
and M decode workers behind a router in PD mode.

Starts N ``plaserve serve`` processes on consecutive ports (the machine's CPU threads split evenly
between them; with ``--gpus`` each worker sees one of the listed GPUs, in turn), waits until each
answers ``/health``, then runs the router in this process in front of them and prints its URL.
Ctrl-C (or SIGTERM) stops the router and every worker it started.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import sys

from plaserve.router.cli import add_route_arguments, router_config_from_args, serve_router


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """The ``cluster`` subcommand's flags: the router's, plus how to start the workers."""
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="local Hugging Face model directory (default: the embedded random-weight model)",
    )
    p.add_argument("--workers", type=int, default=None, help="number of (colocated) workers")
    p.add_argument(
        "--prefill", type=int, default=None, help="prefill/decode mode: number of prefill workers"
    )
    p.add_argument(
        "--decode", type=int, default=None, help="prefill/decode mode: number of decode workers"
    )
    p.add_argument(
        "--worker-base-port",
        type=int,
        default=None,
        help="first worker's port; the others follow (default: free ports)",
    )
    p.add_argument(
        "--worker-policy", default=None, help="the workers' scheduling policy (pla, fcfs, spf)"
    )
    p.add_argument(
        "--kv-cache-memory", default=None, help="each worker's KV cache size (see plaserve serve)"
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--gpus", default=None, help="comma-separated GPU ids, given to the workers in turn"
    )
    p.add_argument(
        "--worker-args", default="", help="more flags for every worker's `plaserve serve`, quoted"
    )
    p.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds to wait for each worker"
    )
    add_route_arguments(p)
    p.set_defaults(worker_urls=[])


def worker_env(
    index: int, workers: int, gpus: list[str] | None, cpus: int | None = None
) -> dict[str, str]:
    """The environment of worker ``index`` of ``workers``: its share of CPU threads, its GPU."""
    env = dict(os.environ)
    threads = max(1, (cpus or os.cpu_count() or 1) // workers)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[index % len(gpus)]
    return env


def worker_args(args: argparse.Namespace) -> list[str]:
    """The ``plaserve serve`` flags every worker gets (the port is added per worker)."""
    out = [args.model] if args.model else []
    if args.worker_policy:
        out += ["--policy", args.worker_policy]
    if args.kv_cache_memory:
        out += ["--kv-cache-memory", args.kv_cache_memory]
    if args.max_model_len:
        out += ["--max-model-len", str(args.max_model_len)]
    return out + shlex.split(args.worker_args)


def run_cluster(args: argparse.Namespace) -> int:
    """Start the workers and the router; serve until interrupted. Returns the exit status."""
    from plaserve.launcher import ServerProcess, start_together

    pd = args.prefill is not None or args.decode is not None
    if pd and (args.workers is not None or not args.prefill or not args.decode):
        print(
            "plaserve cluster: give --prefill N and --decode M (each at least 1), or --workers N",
            file=sys.stderr,
        )
        return 2
    if pd:
        args.workers = args.prefill + args.decode
    if args.workers is None or args.workers < 1:
        print("plaserve cluster: --workers must be at least 1", file=sys.stderr)
        return 2
    try:
        config = router_config_from_args(args)
    except ValueError as e:
        print(f"plaserve cluster: {e}", file=sys.stderr)
        return 2
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()] if args.gpus else None
    base = worker_args(args)
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode if pd else [None] * args.workers
    procs = [
        ServerProcess(
            base + (["--pd-role", roles[i]] if roles[i] else []),
            port=(args.worker_base_port + i) if args.worker_base_port else None,
            env=worker_env(i, args.workers, gpus),
            startup_timeout=args.startup_timeout,
        )
        for i in range(args.workers)
    ]
    print(
        f"plaserve cluster: starting {args.workers} worker(s) on ports {', '.join(str(p.port) for p in procs)}",
        file=sys.stderr,
        flush=True,
    )
    try:
        start_together(procs)  # raises for a worker that failed to start
        if pd:
            args.prefill_urls = [p.url for p, r in zip(procs, roles) if r == "prefill"]
            args.decode_urls = [p.url for p, r in zip(procs, roles) if r == "decode"]
        else:
            args.worker_urls = [p.url for p in procs]
        print(
            f"plaserve cluster: {args.workers} worker(s) healthy; router at http://{args.host}:{args.port}",
            flush=True,
        )
        asyncio.run(serve_router(args, config))
    except KeyboardInterrupt:
        pass
    except (RuntimeError, ValueError, OSError) as e:
        print(f"plaserve cluster: {e}", file=sys.stderr)
        return 1
    finally:
        # a second Ctrl-C must not cut the clean-up short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for p in procs:
            p.stop()
        print("plaserve cluster: stopped", file=sys.stderr, flush=True)
    return 0

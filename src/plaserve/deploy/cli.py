"""``plaserve ray-serve [MODEL] --replicas N``: the Ray Serve application (:mod:`plaserve.deploy.app`)
on a local Ray instance or an existing cluster (``--ray-address``), serving until interrupted.

Ray is imported only when the command runs, so ``plaserve ray-serve --help`` works without the
``plaserve[ray]`` extra, and a missing Ray is one clear message.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading


def add_ray_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The ``ray-serve`` subcommand's flags."""
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="local Hugging Face model directory, the same path on every Ray node "
        "(default: the embedded random-weight model)",
    )
    p.add_argument("--replicas", type=int, default=2, help="worker replicas (default 2)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument(
        "--ray-address",
        default=None,
        help="an existing Ray cluster (e.g. auto, ray://head:10001); default: start a local one",
    )
    p.add_argument(
        "--threads-per-replica",
        type=int,
        default=1,
        help="CPU threads of each replica's engine, reserved as its Ray num_cpus (default 1)",
    )
    p.add_argument(
        "--gpus-per-replica", type=float, default=0.0, help="GPUs of each replica (default 0)"
    )
    p.add_argument(
        "--worker-args", default="", help="more flags for every replica's `plaserve serve`, quoted"
    )
    p.add_argument("--max-ongoing-requests", type=int, default=64, help="per replica (default 64)")
    p.add_argument(
        "--routing-stats-period-s",
        type=float,
        default=0.5,
        help="how often replicas report their load to the router (default 0.5 s)",
    )
    p.add_argument(
        "--max-hold-s",
        type=float,
        default=5.0,
        help="longest a long request waits in the router for a replica to qualify (default 5 s)",
    )
    p.add_argument("--short-threshold", type=int, default=512, help="short/long cut (tokens)")
    p.add_argument(
        "--trust-length-hints-from",
        default=None,
        metavar="CIDR[,CIDR...]",
        help="price requests by their x-prompt-tokens header when the HTTP peer (the gateway) is "
        "in one of these networks (default: trust no one)",
    )
    p.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas")
    p.add_argument(
        "--max-replicas",
        type=int,
        default=None,
        help="autoscaling on backlog seconds: most replicas (off unless above --min-replicas)",
    )
    p.add_argument(
        "--target-backlog-s",
        type=float,
        default=2.0,
        help="autoscaling: predicted prefill seconds queued per replica to aim at (default 2)",
    )


def options_from_args(args: argparse.Namespace) -> "object":
    """The :class:`~plaserve.deploy.app.RayServeOptions` the flags describe."""
    from plaserve.deploy.app import RayServeOptions

    return RayServeOptions(
        model=args.model,
        replicas=args.replicas,
        threads_per_replica=args.threads_per_replica,
        num_gpus_per_replica=args.gpus_per_replica,
        serve_args=shlex.split(args.worker_args),
        max_ongoing_requests=args.max_ongoing_requests,
        routing_stats_period_s=args.routing_stats_period_s,
        max_hold_s=args.max_hold_s,
        short_threshold=args.short_threshold,
        trust_length_hints_from=args.trust_length_hints_from,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_backlog_s=args.target_backlog_s,
    )


def run_ray_serve(args: argparse.Namespace) -> int:
    """Start (or join) Ray, run the application, serve until SIGINT/SIGTERM. Returns the exit status."""
    try:
        import ray
        from ray import serve
    except ImportError:
        print(
            "plaserve ray-serve needs Ray Serve: pip install 'plaserve[ray]'",
            file=sys.stderr,
        )
        return 2
    from plaserve.deploy.app import build_app

    try:
        options = options_from_args(args)
    except ValueError as e:
        print(f"plaserve ray-serve: {e}", file=sys.stderr)
        return 2
    ray.init(address=args.ray_address, include_dashboard=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(options), name="plaserve", route_prefix="/")
        print(
            f"plaserve ray-serve: {args.replicas} replica(s) ready; "
            f"OpenAI API at http://{args.host}:{args.port}/v1",
            flush=True,
        )
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
        print("plaserve ray-serve: stopped", file=sys.stderr, flush=True)
    return 0

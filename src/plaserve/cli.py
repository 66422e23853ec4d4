"""``plaserve`` command line: one subcommand per job; each lives in its own module and is imported
only when it runs, so ``plaserve demo`` does not pay for the server's imports."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One subcommand: the module holding it and that module's two functions, named here so that a
    reader finds every command's code from this table (the module is imported only when it runs)."""

    name: str
    module: str
    add_arguments: str  # (parser) -> None
    run: str  # (args) -> exit status
    help: str


COMMANDS = [
    Command(
        "demo",
        "plaserve.demo",
        "add_demo_arguments",
        "run_demo",
        "run the built-in demonstration on the embedded default model",
    ),
    Command(
        "generate",
        "plaserve.demo",
        "add_generate_arguments",
        "run_generate",
        "generate completions for prompts given on the command line",
    ),
    Command(
        "serve",
        "plaserve.server.cli",
        "add_serve_arguments",
        "run_serve",
        "serve a model behind an OpenAI-compatible HTTP API",
    ),
    Command(
        "bench",
        "plaserve.bench.cli",
        "add_bench_arguments",
        "run_bench",
        "replay a trace against an OpenAI-compatible server",
    ),
    Command(
        "route",
        "plaserve.router.cli",
        "add_route_arguments",
        "run_route",
        "length-aware router in front of plaserve or any OpenAI-compatible workers",
    ),
    Command(
        "cluster",
        "plaserve.router.cluster",
        "add_cluster_arguments",
        "run_cluster",
        "start N workers and a router in front of them",
    ),
    Command(
        "ray-serve",
        "plaserve.deploy.cli",
        "add_ray_serve_arguments",
        "run_ray_serve",
        "run N workers as a Ray Serve application, routed by pla (pip install 'plaserve[ray]')",
    ),
    Command(
        "calibrate",
        "plaserve.calibrate",
        "add_calibrate_arguments",
        "run_calibrate",
        "measure the prefill cost model and choose scheduling settings",
    ),
    Command(
        "simulate",
        "plaserve.sim.cli",
        "add_simulate_arguments",
        "run_simulate",
        "simulate a cluster: the real schedulers and router on a simulated clock",
    ),
]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="plaserve", description="prefill-length-aware LLM serving"
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    by_name = {c.name: c for c in COMMANDS}
    chosen = next((by_name[a] for a in argv if a in by_name), None)
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help)
        if cmd is chosen:  # only the chosen command's module is imported
            getattr(importlib.import_module(cmd.module), cmd.add_arguments)(p)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cmd = by_name[args.command]
    return int(getattr(importlib.import_module(cmd.module), cmd.run)(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

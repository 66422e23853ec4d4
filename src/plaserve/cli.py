"""``plaserve`` command line: one subcommand per job; each lives in its own module and is imported
only when it runs, so ``plaserve demo`` does not pay for the server's imports."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> (module with `add_arguments(parser)` and `run(args) -> int`, help line)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("plaserve.demo", "run the built-in demonstration on the embedded default model"),
    "generate": ("plaserve.demo", "generate completions for prompts given on the command line"),
    "serve": ("plaserve.server.cli", "serve a model behind an OpenAI-compatible HTTP API"),
    "bench": ("plaserve.bench.cli", "replay a trace against an OpenAI-compatible server"),
    "route": ("plaserve.router.cli", "length-aware router in front of plaserve or any OpenAI-compatible workers"),
    "cluster": ("plaserve.router.cluster", "start N workers and a router in front of them"),
    "calibrate": ("plaserve.calibrate", "measure the prefill cost model and choose scheduling settings"),
    "simulate": ("plaserve.sim.cli", "simulate a cluster: the real schedulers and router on a simulated clock"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="plaserve", description="prefill-length-aware LLM serving")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    name = next((a for a in argv if a in COMMANDS), None)
    for cmd, (_, help_line) in COMMANDS.items():
        p = sub.add_parser(cmd, help=help_line)
        if cmd == name:  # only the chosen command's module is imported
            getattr(importlib.import_module(COMMANDS[cmd][0]), f"add_{cmd}_arguments")(p)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(getattr(importlib.import_module(COMMANDS[args.command][0]), f"run_{args.command}")(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""Imports run one way: each module of plaserve imports only from its own package and the layers below
it (docs/ARCHITECTURE.md draws the picture). The test reads every ``import`` in ``src/plaserve``,
including the ones inside functions and under ``TYPE_CHECKING``, and fails on one that goes up or
sideways."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Bottom first. A unit is a subpackage of plaserve or a top-level module; units in one layer do not
# import each other.
LAYERS: list[set[str]] = [
    {
        "request",
        "kv_blocks",
        "json_body",
        "conversations",
        "plotting",
    },  # requests, blocks, bodies: no model, no torch model
    {"model"},  # the model, its layers and attention backends, tokenizers, weights
    {"cost", "grammar"},  # prefill cost models; structured outputs' grammars and token masks
    {"slo", "profile"},  # the TTFT objective; calibrated profiles
    {"config", "workload"},  # engine and scheduler settings; traces, request records, reports
    {"scheduler"},
    {"engine"},
    {"calibrate", "launcher"},
    {"server", "router"},  # peers: neither imports the other
    {"deploy"},  # Ray Serve: replicas of the server, the router's policy inside Ray
    {"sim", "testing"},
    {"bench"},
    {"demo", "cli"},
]
# The package itself: its __init__ imports nothing at import time (its public names load lazily).
ROOT = "plaserve"


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")


def unit(module: str) -> str:
    parts = module.split(".")
    return ROOT if len(parts) == 1 else parts[1]


def layer_of(u: str) -> int:
    return next(i for i, units in enumerate(LAYERS) if u in units)


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from plaserve import json_body` imports a module; `from plaserve import LLM` the package.
            names = (
                [node.module]
                if node.module != ROOT
                else [
                    f"{ROOT}.{a.name}"
                    if (SRC / ROOT / a.name).exists() or (SRC / ROOT / f"{a.name}.py").exists()
                    else ROOT
                    for a in node.names
                ]
            )
            found.update(n for n in names if n.split(".")[0] == ROOT)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == ROOT)
    return found


def test_every_unit_has_a_layer() -> None:
    units = {unit(module_name(p)) for p in (SRC / ROOT).rglob("*.py")}
    assert units - {ROOT} <= set().union(*LAYERS), units - set().union(*LAYERS)


def test_imports_run_one_way() -> None:
    bad = []
    for path in sorted((SRC / ROOT).rglob("*.py")):
        module = module_name(path)
        me = unit(module)
        for target in sorted(imports(path)):
            other = unit(target)
            if other == me or other == ROOT and target == ROOT:
                continue
            if me == ROOT:
                bad.append(f"{module} imports {target} (the package's __init__ loads names lazily)")
            elif other == ROOT:
                continue  # `import plaserve` for __version__: the lazy __init__ imports nothing
            elif layer_of(other) >= layer_of(me):
                bad.append(
                    f"{module} (layer {layer_of(me)}) imports {target} (layer {layer_of(other)})"
                )
    assert not bad, "\n".join(bad)

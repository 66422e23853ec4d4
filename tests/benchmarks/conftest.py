"""Shared by the benchmark smoke tests: import a script of ``benchmarks/`` (not a package) by name."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# The policy study (benchmarks/policy_study) is imported by its tests as the scripts import it.
sys.path.insert(0, str(BENCHMARKS))


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def load_benchmark() -> Callable[[str], ModuleType]:
    """``load_benchmark("engine_vs_hf")``: a fresh import of ``benchmarks/engine_vs_hf.py``."""
    return _load

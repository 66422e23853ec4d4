"""plaserve: a prefill-length-aware LLM serving system.

The public names are imported lazily, so tools that need no model (the router, the load generator,
the simulator) start without loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SchedulerConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

_WHERE = {
    "LLM": "plaserve.engine.llm",
    "LLMEngine": "plaserve.engine.engine",
    "EngineConfig": "plaserve.config",
    "SchedulerConfig": "plaserve.config",
    "RequestOutput": "plaserve.request",
    "SamplingParams": "plaserve.request",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'plaserve' has no attribute {name!r}")

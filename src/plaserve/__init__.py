"""plaserve: a prefill-length-aware LLM serving system."""

from plaserve.config import EngineConfig
from plaserve.engine.engine import LLMEngine
from plaserve.engine.llm import LLM
from plaserve.engine.request import RequestOutput, SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

"""SmartSpec: speculative decoding that pays off under load."""
from smartspec.config import EngineConfig
from smartspec.llm import LLM, CompletionOutput
from smartspec.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "CompletionOutput"]
__version__ = "0.1.0"

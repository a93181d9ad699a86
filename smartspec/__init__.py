"""SmartSpec: speculative decoding that pays off under load."""
from __future__ import annotations

from typing import TYPE_CHECKING

from smartspec.lazy import lazy_attributes

__all__ = ["LLM", "SamplingParams", "EngineConfig", "CompletionOutput"]
__version__ = "0.1.0"

__getattr__ = lazy_attributes(__name__, {"LLM": "smartspec.llm", "CompletionOutput": "smartspec.llm",
                                         "EngineConfig": "smartspec.config",
                                         "SamplingParams": "smartspec.types.sampling_params"})

if TYPE_CHECKING:
    from smartspec.config import EngineConfig
    from smartspec.llm import LLM, CompletionOutput
    from smartspec.types.sampling_params import SamplingParams

"""SmartSpec: speculative decoding that pays off under load."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["LLM", "SamplingParams", "EngineConfig", "CompletionOutput"]
__version__ = "0.1.0"

# Imported when first named: a process that only speaks the API (the HTTP ingress, the goodput controller) never
# loads torch, which costs a Serve replica 0.3 GB of memory.
_HOMES = {"LLM": "smartspec.llm", "CompletionOutput": "smartspec.llm", "EngineConfig": "smartspec.config",
          "SamplingParams": "smartspec.sampling_params"}

if TYPE_CHECKING:
    from smartspec.config import EngineConfig
    from smartspec.llm import LLM, CompletionOutput
    from smartspec.sampling_params import SamplingParams


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'smartspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value

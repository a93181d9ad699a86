"""Package attributes imported when first named (PEP 562), so that a process that only speaks the API (the HTTP
front, the goodput controller) never loads torch, which costs a Serve replica 0.3 GB of memory."""
from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_attributes(package: str, homes: dict[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` for `package`: name -> the module that defines it, imported on first use."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name]), name)
        namespace[name] = value  # found directly from now on
        return value

    return __getattr__

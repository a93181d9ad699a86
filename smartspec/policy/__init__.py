"""Speculation-length policies: each step, k_i in {0..K} for every decoding request.

The engine knows nothing of how k is chosen: it calls `choose` and reports each finished step to `observe`."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["Policy", "OffPolicy", "FixedPolicy", "BatchTablePolicy", "GoodputPolicy", "make_policy", "merge_states"]

# Imported when first named, so that merge_states (numpy only) serves the Serve controller without torch
_HOMES = {"Policy": "base", "OffPolicy": "baselines", "FixedPolicy": "baselines", "BatchTablePolicy": "baselines",
          "GoodputPolicy": "goodput_policy", "make_policy": "factory", "merge_states": "replica_state"}

if TYPE_CHECKING:
    from smartspec.policy.base import Policy
    from smartspec.policy.baselines import BatchTablePolicy, FixedPolicy, OffPolicy
    from smartspec.policy.factory import make_policy
    from smartspec.policy.goodput_policy import GoodputPolicy
    from smartspec.policy.replica_state import merge_states


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'smartspec.policy' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"smartspec.policy.{_HOMES[name]}"), name)
    globals()[name] = value
    return value

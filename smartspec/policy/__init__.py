"""Speculation-length policies: each step, k_i in {0..K} for every decoding request.

The engine knows nothing of how k is chosen: it calls `choose` and reports each finished step to `observe`."""
from __future__ import annotations

from typing import TYPE_CHECKING

from smartspec.lazy import lazy_attributes

__all__ = ["Policy", "OffPolicy", "FixedPolicy", "BatchTablePolicy", "GoodputPolicy", "make_policy", "merge_states"]

# merge_states (numpy only) serves the Serve controller without torch
__getattr__ = lazy_attributes(__name__, {
    "Policy": "smartspec.policy.base", "OffPolicy": "smartspec.policy.baselines",
    "FixedPolicy": "smartspec.policy.baselines", "BatchTablePolicy": "smartspec.policy.baselines",
    "GoodputPolicy": "smartspec.policy.goodput_policy", "make_policy": "smartspec.policy.factory",
    "merge_states": "smartspec.policy.replica_state"})

if TYPE_CHECKING:
    from smartspec.policy.base import Policy
    from smartspec.policy.baselines import BatchTablePolicy, FixedPolicy, OffPolicy
    from smartspec.policy.factory import make_policy
    from smartspec.policy.goodput_policy import GoodputPolicy
    from smartspec.policy.replica_state import merge_states

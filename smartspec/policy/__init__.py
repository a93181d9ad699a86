"""Speculation-length policies: each step, k_i in {0..K} for every decoding request.

The engine knows nothing of how k is chosen: it calls `choose` and reports each finished step to `observe`."""
from smartspec.policy.base import Policy
from smartspec.policy.baselines import BatchTablePolicy, FixedPolicy, OffPolicy
from smartspec.policy.factory import make_policy
from smartspec.policy.goodput_policy import GoodputPolicy, merge_states

__all__ = ["Policy", "OffPolicy", "FixedPolicy", "BatchTablePolicy", "GoodputPolicy", "make_policy", "merge_states"]

"""Speculation-length policies: each step, k_i in {0..K} for every decoding request.

The engine knows nothing of how k is chosen: it calls `choose` and reports each finished step to `observe`."""
from smartspec.policy.base import BatchTablePolicy, FixedPolicy, OffPolicy, Policy, StepRecord, make_policy
from smartspec.policy.smartspec_policy import SmartSpecPolicy, merge_states

__all__ = ["Policy", "OffPolicy", "FixedPolicy", "BatchTablePolicy", "SmartSpecPolicy", "StepRecord", "make_policy",
           "merge_states"]

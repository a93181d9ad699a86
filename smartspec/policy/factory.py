"""A policy from its configured name."""
from __future__ import annotations

from smartspec.policy.base import Policy
from smartspec.policy.baselines import BatchTablePolicy, FixedPolicy, OffPolicy, default_batch_table
from smartspec.policy.goodput_policy import GoodputOptions, GoodputPolicy


def make_policy(policy: str | Policy, k_max: int, batch_table: dict[int, int] | None = None,
                key: str = "default", options: dict | None = None, tree_depth: int | None = None) -> Policy:
    """policy: a name ("smartspec", "off", "fixed", "fixed:K", "batch_table") or a Policy, returned as it is.
    key: what acceptance priors are shared by; options: GoodputOptions' fields by name; tree_depth: the proposer
    grows token trees this deep, and k is a node budget."""
    if isinstance(policy, Policy):
        return policy
    if policy == "smartspec":
        return GoodputPolicy(key=key, tree_depth=tree_depth, options=GoodputOptions.of(options))
    if policy == "batch_table":
        return BatchTablePolicy(batch_table or default_batch_table(k_max))
    if policy == "off":
        return OffPolicy()
    if policy == "fixed":
        return FixedPolicy(k_max)
    if policy.startswith("fixed:"):
        try:
            k = int(policy.split(":", 1)[1])
        except ValueError:
            k = -1
        if not 0 <= k <= k_max:
            raise ValueError(f"policy {policy!r}: k must be an integer in [0, {k_max}]")
        return FixedPolicy(k)
    raise ValueError(f"unknown policy {policy!r}: use 'smartspec', 'off', 'fixed', 'fixed:K' or 'batch_table'")

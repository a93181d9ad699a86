from __future__ import annotations

from dataclasses import dataclass, field

from smartspec.engine.request import Request


@dataclass
class StepRecord:
    """What one engine step did and cost (what a learning policy fits on; written to traces)."""
    step: int
    batch_size: int  # requests in the forward
    ks: list[int]  # speculation length per decoding request (planned)
    proposed: list[int]  # draft tokens actually proposed per decoding request
    accepted: list[int]  # draft tokens accepted per decoding request
    request_ids: list[str]
    num_batched_tokens: int  # tokens in the target forward (decodes + drafts + prefill)
    num_prefill_tokens: int
    num_context_tokens: int  # sum of the context lengths the forward attends over
    draft_s: float
    verify_s: float
    total_s: float
    extra: dict = field(default_factory=dict)


class Policy:
    name = "base"

    def choose(self, requests: list[Request], k_max: int) -> list[int]:
        raise NotImplementedError

    def observe(self, record: StepRecord) -> None:
        """Called after every step; a policy that learns overrides it."""

    def release(self, request: Request) -> None:
        """Called when a request ends."""


class OffPolicy(Policy):
    """Never speculate: the draft never runs."""
    name = "off"

    def choose(self, requests, k_max):
        return [0] * len(requests)


class FixedPolicy(Policy):
    name = "fixed"

    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, requests, k_max):
        return [min(self.k, k_max)] * len(requests)


def make_policy(policy: str | Policy, k_max: int) -> Policy:
    if isinstance(policy, Policy):
        return policy
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
    raise ValueError(f"unknown policy {policy!r}: use 'off', 'fixed' or 'fixed:K'")

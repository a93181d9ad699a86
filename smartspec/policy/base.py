from __future__ import annotations

from collections.abc import Sequence
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
    predicted_s: float | None = None  # the policy's prediction of total_s, when it makes one
    draft_catchup_tokens: int = 0  # tokens the draft model fed to catch up (beyond one per request)
    extra: dict = field(default_factory=dict)


class Policy:
    name = "base"
    wants_profile = False  # True: the engine runs a short warm-up profile and passes it to observe_profile
    last_prediction: float | None = None  # predicted time of the step last chosen, if the policy predicts

    def choose(self, requests: list[Request], k_max: int, *, base_tokens: int = 0, base_context: int = 0,
               prefilling: Sequence[Request] = (), now: float | None = None) -> list[int]:
        """k in [0, k_max] per decoding request. base_tokens / base_context: the rest of the step (prefill
        chunks), which the verify forward carries anyway; prefilling: the requests those chunks belong to; now: the
        clock of the requests' arrival_time (time.monotonic() when None; a simulator passes its own)."""
        raise NotImplementedError

    def prune(self, requests: list[Request], ks: list[int], trees: list, draft_s: float) -> list:
        """Token trees as proposed for node budgets ks -> the trees to verify (a policy that weighs nodes drops
        some)."""
        return trees

    def observe_profile(self, records: list[StepRecord]) -> None:
        """The warm-up profile: measured step shapes that say nothing about acceptance."""

    def observe(self, record: StepRecord) -> None:
        """Called after every step; a policy that learns overrides it."""

    def release(self, request: Request) -> None:
        """Called when a request ends."""


class OffPolicy(Policy):
    """Never speculate: the draft never runs."""
    name = "off"

    def choose(self, requests, k_max, **_):
        return [0] * len(requests)


class FixedPolicy(Policy):
    name = "fixed"

    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, requests, k_max, **_):
        return [min(self.k, k_max)] * len(requests)


class BatchTablePolicy(Policy):
    """k by batch size from a table {batch size: k}: the static scheme other servers use. A batch uses the
    entry of the largest size not above it."""
    name = "batch_table"

    def __init__(self, table: dict[int, int]) -> None:
        if not table or any(int(b) < 1 or int(k) < 0 for b, k in table.items()):
            raise ValueError(f"batch_table needs {{batch size >= 1: k >= 0}}, got {table!r}")
        self.table = sorted((int(b), int(k)) for b, k in table.items())

    def k_for(self, batch: int) -> int:
        k = 0
        for size, value in self.table:
            if size <= batch:
                k = value
        return k

    def choose(self, requests, k_max, **_):
        return [min(self.k_for(len(requests)), k_max)] * len(requests)


def default_batch_table(k_max: int) -> dict[int, int]:
    return {1: k_max, 2: max(1, k_max - 1), 4: max(1, k_max // 2), 8: 1, 16: 0}


def make_policy(policy: str | Policy, k_max: int, batch_table: dict[int, int] | None = None,
                key: str = "default", options: dict | None = None, tree_depth: int | None = None) -> Policy:
    """tree_depth: the proposer grows token trees this deep, and k is a node budget."""
    if isinstance(policy, Policy):
        return policy
    if policy == "smartspec":
        from smartspec.policy.smartspec_policy import SmartSpecPolicy
        return SmartSpecPolicy(key=key, tree_depth=tree_depth, **(options or {}))
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

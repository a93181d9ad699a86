"""GoodputController: one per application. Replicas report their policy state and load every ~1 s; it merges the
acceptance evidence and cost-model state of the *other* replicas for each reporter (so no replica counts its own
evidence twice) and serves a status view. If it is gone, replicas keep their last parameters."""
from __future__ import annotations

import time

from ray import serve

from deployments.wire import ReplicaReport
from smartspec.policy.replica_state import merge_states


class ControllerState:
    """The merging logic, apart from Ray (unit-testable)."""

    def __init__(self, stale_after_s: float = 15.0) -> None:
        self.stale_after_s = stale_after_s
        self.reports: dict[str, tuple[float, ReplicaReport]] = {}

    def report(self, report: ReplicaReport) -> dict:
        """The other replicas' merged policy state for this one ({}: none shares its policy's key)."""
        now = time.monotonic()
        self.reports[report.replica_id] = (now, report)
        for rid in [r for r, (t, _) in self.reports.items() if now - t > self.stale_after_s]:
            del self.reports[rid]  # a replica gone (scaled down, crashed) stops counting
        own = report.policy_state
        if not own:
            return {}
        others = [r.policy_state for rid, (_, r) in self.reports.items()
                  if rid != report.replica_id and r.policy_state and r.policy_state.get("key") == own.get("key")]
        return merge_states(others) if others else {}

    def status(self) -> dict:
        """Per replica: where it runs (node_id, pid), its load (running, waiting, in_flight), its prefix cache
        (prefix_cache_hit_rate and the counts), what the policy chose (steps.chosen_k) and achieved (steps.
        goodput_tokens_per_s), its request speed by batch size, the speculation counters by proposer; and the
        merged policy state."""
        now = time.monotonic()
        replicas = {rid: {"age_s": round(now - t, 2), **r.stats,
                          "prefix_cache_hit_rate": _hit_rate(r.stats.get("prefix_cache")),
                          **{key: (r.policy_state or {}).get(key)
                             for key in ("alpha_prior", "alpha_prior_later", "prior_strength")}}
                    for rid, (t, r) in self.reports.items()}
        policies = [r.policy_state for _, r in self.reports.values() if r.policy_state]
        return {"replicas": replicas, "merged_policy": merge_states(policies) if policies else None}


def _hit_rate(counts: dict | None) -> float | None:
    return counts["hits"] / counts["queries"] if counts and counts.get("queries") else None


@serve.deployment(name="GoodputController", num_replicas=1, ray_actor_options={"num_cpus": 0.05},
                  max_ongoing_requests=1000, logging_config={"enable_access_log": False})
class GoodputController:
    def __init__(self, stale_after_s: float = 15.0) -> None:
        self.state = ControllerState(stale_after_s)

    def report(self, report: ReplicaReport) -> dict:
        return self.state.report(report)

    def status(self) -> dict:
        return self.state.status()

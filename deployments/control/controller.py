"""GoodputController: one per application. Replicas report their policy state and load every ~1 s; it merges the
acceptance evidence and cost-model state of the *other* replicas for each reporter (so no replica counts its own
evidence twice) and serves a status view. If it is gone, replicas keep their last parameters."""
from __future__ import annotations

import time

from ray import serve

from deployments.wire import ControllerStatus, ReplicaReport, ReplicaStatus
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

    def status(self) -> ControllerStatus:
        """Every replica that reports (its gauges and its own view) and the merged policy state."""
        now = time.monotonic()
        replicas = {rid: ReplicaStatus(round(now - t, 2), r.gauges, r.view) for rid, (t, r) in self.reports.items()}
        policies = [r.policy_state for _, r in self.reports.values() if r.policy_state]
        return ControllerStatus(replicas, merge_states(policies) if policies else None)


@serve.deployment(name="GoodputController", num_replicas=1, ray_actor_options={"num_cpus": 0.05},
                  max_ongoing_requests=1000, logging_config={"enable_access_log": False})
class GoodputController:
    def __init__(self, stale_after_s: float = 15.0) -> None:
        self.state = ControllerState(stale_after_s)

    def report(self, report: ReplicaReport) -> dict:
        return self.state.report(report)

    def status(self) -> ControllerStatus:
        return self.state.status()

"""The per-request oracle the goodput policy is measured against (scripts/bench_oracle.py): it knows each request's
true acceptance rate at its position and the machine's exact step cost, and each step takes the plan of highest
goodput over every draft depth (goodput.plans_by_depth, exact for the model; beside a prefill chunk, priced as
the policy prices such a step, chain_plan.prefill_step_price). A draft model's catch-up of a
request is charged as the policy charges it (goodput.charge_start_costs), spread over the steps the request has
left. It runs in no time: a reference, not a policy to serve."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from smartspec.policy.base import Policy
from smartspec.policy.cost_model import StepCostModel
from smartspec.policy.goodput import best_plan, charge_start_costs, plans_by_depth
from smartspec.policy.chain_plan import prefill_step_price
from smartspec.policy.step_numbers import StepNumbers
from smartspec.types.plan import SpecPlan, StepView
from smartspec.types.step_record import StepRecord


class OraclePolicy(Policy):
    name = "oracle"

    def __init__(self, cost: StepCostModel, rate_of: Callable[[str, int], float]) -> None:
        """cost: the machine's exact surface; rate_of(request id, output position): the true acceptance rate."""
        self.cost, self.rate_of = cost, rate_of
        self.seen: dict[str, int] = {}  # request -> tokens its draft has read

    def plan(self, view: StepView) -> SpecPlan:
        k_top = view.k_max
        if not view.requests or k_top == 0:
            return SpecPlan([0] * len(view.requests))
        step = StepNumbers.of(view, 0.0)
        caps = step.caps
        rates = np.array([[self.rate_of(r.request_id, r.num_output_tokens + j) for j in range(k_top)]
                          for r in view.requests])
        gains = np.cumprod(rates, axis=1)  # the j-th draft adds the chance that it and those before are accepted
        gains = charge_start_costs(gains, caps, self._catchup_in_tokens(view, gains))
        depth_of = np.arange(1, k_top + 1)
        # beside a prefill chunk, drafts must beat the decoding batch's own rate, as the policy prices them
        price = prefill_step_price(gains, step, depth_of, self.cost.predict) if view.prefill_tokens else None
        plan = best_plan(plans_by_depth(gains, caps, depth_of, self.cost.predict, step.tokens, step.context, price))
        return SpecPlan(plan.ks, None, plan.seconds)

    def _catchup_in_tokens(self, view: StepView, gains: np.ndarray) -> np.ndarray:
        """Each request's catch-up seconds, spread over the steps it has left, in tokens of the decoding batch's
        goodput without speculation."""
        requests = view.requests
        unread = np.array([max(0, r.num_tokens - 1 - self.seen.get(r.request_id, 0)) for r in requests], dtype=float)
        seconds = self.cost.predict_draft(0, 0, unread)
        left = np.array([max(1, r.max_tokens - r.num_output_tokens) for r in requests], dtype=float)
        steps = np.maximum(1.0, left / (1.0 + gains.sum(axis=1)))
        plain_s = float(self.cost.predict(len(requests), sum(r.num_tokens for r in requests)))
        return seconds / steps * (len(requests) / plain_s)

    def observe(self, record: StepRecord) -> None:
        for rid, proposed, accepted, length in zip(record.request_ids, record.proposed, record.accepted,
                                                   record.num_tokens):
            if proposed:
                self.seen[rid] = length + min(accepted, proposed - 1)

    def release(self, request_id: str) -> None:
        self.seen.pop(request_id, None)

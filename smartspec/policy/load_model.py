"""What routing and autoscaling read of a policy (`Policy.load`): a request's speed at each batch size and a step's
predicted time, from the goodput policy's fitted step cost and shared acceptance prior."""
from __future__ import annotations

from smartspec.policy.acceptance import ChainAcceptance
from smartspec.policy.cost_model import StepCostModel


class LoadModel:
    """A policy that models no load: routing and autoscaling fall back to measured rates."""

    def request_speed(self, batch_sizes: list[int], context: int, k_max: int) -> dict[int, float] | None:
        """Per b in batch_sizes: the tokens per second one request is expected to get while b requests of about
        `context` tokens decode together, at the speculation the policy would choose. None: not modelled."""
        return None

    def step_seconds(self, tokens: int, context: int) -> float | None:
        """The predicted time of a step of `tokens` batched tokens over `context` tokens of context, without drafts;
        None: not modelled."""
        return None


class FittedLoad(LoadModel):
    def __init__(self, cost: StepCostModel, acceptance: ChainAcceptance) -> None:
        self.cost, self.acceptance = cost, acceptance

    def request_speed(self, batch_sizes: list[int], context: int, k_max: int) -> dict[int, float] | None:
        """Per batch size b, the best over a common k of a request's expected tokens per step,
        1 + a1 (1 + a2 + ... + a2^(k-1)), over the predicted time of a step of b such requests. A small batch can
        afford a larger k, so its request speed rises by more than the step's time falls."""
        if not self.cost.ready:
            return None
        first, later = self.acceptance.first.prior, self.acceptance.later.prior
        speeds = {}
        for b in batch_sizes:
            best = 0.0
            for k in range(k_max + 1):
                tokens = 1.0 + first * sum(later ** j for j in range(k))
                seconds = float(self.cost.predict(b * (k + 1), b * context, k, b * k))
                if seconds > 0:
                    best = max(best, tokens / seconds)
            speeds[b] = best
        return speeds

    def step_seconds(self, tokens: int, context: int) -> float | None:
        return float(self.cost.predict_verify(tokens, context)) if self.cost.ready else None

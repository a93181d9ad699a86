"""Pure parts of planning chains over a step's numbers: what a draft must add in a step that carries prefill, and
the shape probe that gives the cost fit a draft length it has not seen."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from smartspec.policy.goodput import Plan, best_plan, select_from_gains
from smartspec.policy.step_numbers import StepNumbers, expected_tokens


def prefill_step_price(gains: np.ndarray, step: StepNumbers, depth_of: np.ndarray, cost: Callable) -> float:
    """Tokens per second a draft must add to a step that carries prefill: the goodput the decode batch would reach
    in a step of its own, times the requests this step holds (decoding + prefilling) per decoding request. Drafting
    in such a step makes the prefilling requests wait for tokens that are not theirs."""
    b, held = len(step.requests), len(step.view.prefilling)
    ks, t = select_from_gains(gains, step.caps, depth_of, cost, b, step.decode_context)
    return expected_tokens(gains, ks) / t * (b + max(1, held)) / b


def shape_probe(plans: list[Plan], due: bool, loss: float) -> tuple[Plan, bool]:
    """The best plan, or where a probe is due a plan of another draft length that is predicted to lose at most
    `loss` of its value; and whether it is such a probe.

    The cost model learns only the shapes the policy runs. In steady decoding the context grows with the batch, so a
    policy that always runs one draft length gives the fit no way to tell the cost of a verified token from the cost
    of context, and a fit that puts the cost on the wrong one keeps a draft length that a shorter one beats. Where
    the model's optimum is flat, running a nearby plan costs little by the model's own account and gives the fit the
    shape it lacks; where it is sharp, no plan qualifies and none is run."""
    best = best_plan(plans)
    if not due or best.depth == 0 or best.value <= 0:
        return best, False
    near = [p for p in plans if p.depth > 0 and p.tokens != best.tokens and p.value >= (1.0 - loss) * best.value]
    if not near:
        return best, False
    return max(near, key=lambda p: abs(p.tokens - best.tokens)), True  # the most different shape teaches the most

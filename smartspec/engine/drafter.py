"""Propose: the plan's drafts from the proposer, token trees weighed by the policy. A failed proposer (a dead
draft actor) costs speed, never a request: the step then verifies no drafts."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from smartspec.engine.planner import Speculation
from smartspec.spec_decode.proposer import Draft
from smartspec.types.plan import SpecPlan, StepView
from smartspec.types.request import Request

logger = logging.getLogger(__name__)


@dataclass
class Drafted:
    """What the propose stage hands the verify stage."""
    drafts: dict[str, Draft] = field(default_factory=dict)  # request -> its draft (requests with none are absent)
    catchup_tokens: int = 0  # tokens the draft model fed to catch up (beyond one per request)
    predicted_s: float | None = None  # the step's predicted time, once trees are pruned (else the plan's)


def propose(spec: Speculation, view: StepView | None, decoding: list[Request], plan: SpecPlan) -> Drafted:
    if spec.proposer is None or not any(plan.ks):
        return Drafted(predicted_s=plan.predicted_s)
    t0 = time.perf_counter()
    try:
        proposal = spec.proposer.propose(decoding, plan.ks, plan.methods)
    except Exception:
        logger.exception("proposer failed; this step runs without speculation")
        return Drafted(predicted_s=plan.predicted_s)
    catchup = proposal.catchup_tokens
    if proposal.trees is None:
        return Drafted({r.request_id: Draft(t, q) for r, t, q in zip(decoding, proposal.tokens, proposal.probs)
                        if t}, catchup, plan.predicted_s)
    if plan.methods is not None:  # the policy chose on the lookups themselves: nothing to prune
        return Drafted({r.request_id: Draft(t, q, tree) for r, t, q, tree in
                        zip(decoding, proposal.tokens, proposal.probs, proposal.trees) if t}, catchup, plan.predicted_s)
    trees, predicted = proposal.trees, plan.predicted_s
    try:
        pruned = spec.policy.prune(view, plan.ks, trees, time.perf_counter() - t0)
        trees = pruned.trees
        predicted = pruned.predicted_s if pruned.predicted_s is not None else predicted
    except Exception:
        logger.exception("policy %r failed to prune trees; verifying them whole", spec.policy.name)
    return Drafted({r.request_id: Draft(t.tokens, None, t) for r, t in zip(decoding, trees) if len(t)}, catchup,
                   predicted)

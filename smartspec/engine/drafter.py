"""Propose: the plan's drafts from the proposer, token trees weighed by the policy. A failed proposer (a dead
draft actor) costs speed, never a request: the step then verifies no drafts."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from smartspec.engine.planner import Speculation
from smartspec.spec_decode.hints import Hint
from smartspec.spec_decode.proposer import Draft
from smartspec.spec_decode.suffix import crop
from smartspec.structured.matcher import RequestGrammar
from smartspec.types.plan import LOOKUP, SpecPlan, StepView
from smartspec.types.request import Request

logger = logging.getLogger(__name__)


@dataclass
class Drafted:
    """What the propose stage hands the verify stage."""
    drafts: dict[str, Draft] = field(default_factory=dict)  # request -> its draft (requests with none are absent)
    catchup_tokens: int = 0  # tokens the draft model fed to catch up (beyond one per request)
    predicted_s: float | None = None  # the step's predicted time, once trees are pruned (else the plan's)


def propose(spec: Speculation, view: StepView | None, decoding: list[Request], plan: SpecPlan,
            hints: list[Hint] | None = None) -> Drafted:
    """The plan's drafts: requests that drew their hint (a lookup, where hints were offered) take its chain, the
    others what the proposer makes of their k."""
    if spec.proposer is None or not any(plan.ks):
        return Drafted(predicted_s=plan.predicted_s)
    hinted = {}
    if hints is not None and plan.methods is not None:
        hinted = {i: crop(h.tree, k) for i, (h, m, k) in enumerate(zip(hints, plan.methods, plan.ks))
                  if m == LOOKUP and h.source and k}
    drafted = _proposed(spec, view, decoding, SpecPlan([0 if i in hinted else k for i, k in enumerate(plan.ks)],
                                                       plan.methods, plan.predicted_s))
    for i, tree in hinted.items():
        drafted.drafts[decoding[i].request_id] = Draft(tree.tokens, None, tree, hints[i].source)
    return drafted


def _proposed(spec: Speculation, view: StepView | None, decoding: list[Request], plan: SpecPlan) -> Drafted:
    if not any(plan.ks):
        return Drafted(predicted_s=plan.predicted_s)
    t0 = time.perf_counter()
    try:
        proposal = spec.proposer.propose(decoding, plan.ks, plan.methods)
    except Exception:
        logger.exception("proposer failed; this step runs without speculation")
        return Drafted(predicted_s=plan.predicted_s)
    catchup = proposal.catchup_tokens
    # labelled by who drafted, not by the plan's choice: beside hints, the plan's DRAFT names whichever proposer
    # is configured (prompt lookup, say), not necessarily a draft model
    sources = [spec.proposer.source_of(m) for m in plan.methods or [None] * len(decoding)]
    if proposal.trees is None:
        return Drafted({r.request_id: Draft(t, q, None, m) for r, t, q, m in
                        zip(decoding, proposal.tokens, proposal.probs, sources) if t}, catchup, plan.predicted_s)
    if plan.methods is not None:  # the policy chose on the lookups themselves: nothing to prune
        return Drafted({r.request_id: Draft(t, q, tree, m) for r, t, q, tree, m in
                        zip(decoding, proposal.tokens, proposal.probs, proposal.trees, sources) if t}, catchup,
                       plan.predicted_s)
    trees, predicted = proposal.trees, plan.predicted_s
    try:
        pruned = spec.policy.prune(view, plan.ks, trees, time.perf_counter() - t0)
        trees = pruned.trees
        predicted = pruned.predicted_s if pruned.predicted_s is not None else predicted
    except Exception:
        logger.exception("policy %r failed to prune trees; verifying them whole", spec.policy.name)
    return Drafted({r.request_id: Draft(t.tokens, None, t, m) for r, t, m in zip(decoding, trees, sources) if len(t)},
                   catchup, predicted)


def cut_to_grammars(drafted: Drafted, grammars: dict[str, RequestGrammar]) -> Drafted:
    """Drafts of structured requests end before the first token their grammar forbids: no row is verified that
    could only be rejected. A sampled chain keeps the draft distribution of the cut position (`Draft.probs` one row
    longer than its tokens): the target's token there comes from the residual, exactly as if the forbidden token
    had been verified and rejected. A sampled tree is kept whole (its forbidden nodes are rejected, at probability
    0, by the recursive rule); other trees lose their forbidden nodes."""
    if not grammars:
        return drafted
    drafts = dict(drafted.drafts)
    for rid, draft in drafted.drafts.items():
        grammar = grammars.get(rid)
        if grammar is None:
            continue
        if draft.tree is None:
            n = grammar.valid_prefix(draft.tokens)
            if n == len(draft.tokens):
                continue
            if draft.probs is not None:
                drafts[rid] = draft._replace(tokens=draft.tokens[:n], probs=draft.probs[:n + 1])
            elif n:
                drafts[rid] = draft._replace(tokens=draft.tokens[:n])
            else:
                del drafts[rid]
        elif not draft.tree.child_probs:
            keep = [i for i, path in enumerate(draft.tree.paths()) if grammar.valid_prefix(path) == len(path)]
            if len(keep) == len(draft.tree):
                continue
            if keep:
                tree = draft.tree.select(keep)
                drafts[rid] = draft._replace(tokens=tree.tokens, tree=tree)
            else:
                del drafts[rid]
    return Drafted(drafts, drafted.catchup_tokens, drafted.predicted_s)

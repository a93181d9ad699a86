"""Per request, which proposer drafts and how many tokens: a draft model (each drafted token costs a share of a
draft forward, each new depth one lockstep forward of the batch) or a model-free lookup (suffix speculation: its
candidates are known before k is chosen, and drafting them costs nothing but the verify tokens).

The step's cost depends on the choice through three numbers: the verified tokens M (all drafts), the draft-model
tokens M_d and the draft depth D. For each depth bound D, each request takes the proposer whose drafts add more
tokens net of their price (at the batch's rate without speculation, each token's verify cost, and the draft
forward's per-token cost for a draft model); the drafts of all requests are then taken best first, with the exact
step cost of each prefix, as in `goodput.plans_by_depth`. D = 0 is the lookups alone; the plan without speculation
is always a candidate, so a step is never planned slower than plain decoding. Deeper bounds are tried in order until
a step drafting that deep could not beat the best plan even with the best gains of as many tokens as it verifies."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from smartspec.policy.goodput import plan_value
from smartspec.types.plan import DRAFT, LOOKUP


@dataclass
class MixedPlan:
    methods: list[str]
    ks: list[int]
    seconds: float
    value: float


def select_proposers(draft_gains: np.ndarray | None, lookup_gains: np.ndarray, k_max: list[int], cost: Callable,
                     base_tokens: int, base_context: int, price: float | None = None, bound: bool = True
                     ) -> MixedPlan:
    """draft_gains [B, K]: the expected tokens the j-th draft-model token adds (None: no draft model this step);
    lookup_gains [B, K]: the same for the j-th best node of the request's lookup tree (0 past its size); both
    non-increasing along j. cost(n_batched, n_context, depth, draft_tokens) -> seconds, vectorised over numpy
    arrays. base_tokens / base_context: the step at k = 0. price: as in goodput.select_from_gains. bound: stop at
    the first depth that no plan could beat from (False: scan every depth; the same plan, slower)."""
    b = len(k_max)
    t0 = float(cost(base_tokens, base_context, 0, 0))
    best = MixedPlan([LOOKUP] * b, [0] * b, t0, plan_value(b, t0, price) if b else 0.0)
    if b == 0:
        return best
    k_top = lookup_gains.shape[1]
    k_max_arr = np.minimum(np.asarray(k_max, dtype=np.int64), k_top)
    rank = np.arange(1, k_top + 1)
    allowed = rank[None, :] <= k_max_arr[:, None]
    rate = b / t0 if price is None else price  # what a second of this step is worth, in tokens
    verify_per_token = float(cost(base_tokens + 1, base_context + 1, 0, 0)) - t0
    draft_per_token = float(cost(base_tokens, base_context, 1, 2) - cost(base_tokens, base_context, 1, 1))
    lookup = np.where(allowed, lookup_gains, 0.0)
    lookup_net = _best_prefix_sum(lookup - rate * verify_per_token)
    depths = range(int(k_max_arr.max()) + 1) if draft_gains is not None else range(1)
    if draft_gains is not None:
        # reach[m]: the most any m verified tokens can add, the m best gains of either proposer's candidates
        candidates = np.concatenate([lookup.ravel(), np.where(allowed, draft_gains[:, :k_top], 0.0).ravel()])
        positive = np.sort(candidates[candidates > 0])[::-1]
        reach = b + np.concatenate([[0.0], np.cumsum(positive)])
    for depth in depths:
        use_draft = np.zeros(b, dtype=bool)
        rows = lookup
        if depth:
            # a plan at least D deep verifies m >= D tokens, D of them the draft's, in D draft forwards: once no m
            # could beat the best plan even with the m best gains, no deeper bound is tried either (each costs a
            # scan in Python)
            if bound:
                m = np.arange(depth, max(depth, len(positive)) + 1)
                most = plan_value(reach[np.minimum(m, len(positive))],
                                  cost(base_tokens + m, base_context + m, depth, depth), price)
                if most.max() <= best.value:
                    break
            draft = np.where(allowed & (rank[None, :] <= depth), draft_gains[:, :k_top], 0.0)
            draft_net = _best_prefix_sum(draft - rate * (verify_per_token + draft_per_token))
            use_draft = draft_net > lookup_net
            rows = np.where(use_draft[:, None], draft, lookup)
        plan = _best_prefix_plan(rows, use_draft, cost, base_tokens, base_context, price)
        if plan is not None and plan.value > best.value:
            best = plan
    return best


def _best_prefix_plan(rows: np.ndarray, use_draft: np.ndarray, cost: Callable, base_tokens: int, base_context: int,
                      price: float | None) -> MixedPlan | None:
    """The best plan that takes these per-request gains (the draft's where use_draft, else the lookup's) best first:
    each prefix of the ordered drafts priced at its exact step cost; None when no gain is positive."""
    b = len(rows)
    req, col = np.nonzero(rows > 0)
    if len(req) == 0:
        return None
    g = rows[req, col]
    order = np.lexsort((col, req, -g))  # best first; a request's drafts in order (gains are non-increasing)
    req, col, g = req[order], col[order], g[order]
    is_draft = use_draft[req]
    m = np.arange(1, len(g) + 1)
    m_draft = np.cumsum(is_draft)
    run_depth = np.maximum.accumulate(np.where(is_draft, col + 1, 0))
    seconds = cost(base_tokens + m, base_context + m, run_depth, m_draft)
    values = plan_value(b + np.cumsum(g), seconds, price)
    i = int(np.argmax(values))
    ks = np.bincount(req[: i + 1], minlength=b)
    methods = [DRAFT if use_draft[r] and ks[r] else LOOKUP for r in range(b)]
    return MixedPlan(methods, ks.tolist(), float(seconds[i]), float(values[i]))


def _best_prefix_sum(x: np.ndarray) -> np.ndarray:
    """Per row, the largest sum of a prefix (0 for the empty one)."""
    return np.maximum(np.cumsum(x, axis=1).max(axis=1, initial=0.0), 0.0)


def lookup_gains(values: list[np.ndarray], k: int) -> np.ndarray:
    """[B, k]: each request's node values, best first, 0 past its tree."""
    out = np.zeros((len(values), k))
    for i, v in enumerate(values):
        v = np.sort(np.asarray(v, dtype=np.float64))[::-1][:k]
        out[i, :len(v)] = v
    return out

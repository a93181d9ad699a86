"""k selection by goodput: expected generated tokens per second of step time.

    g(k, a) = 1 + a + ... + a^k          goodput(k) = sum_i g(k_i, a_i) / T(k)

A simple selection is greedy +1 increments while goodput rises. That greedy stalls when a new draft depth
has a fixed cost (d0: one more lockstep draft forward): no single increment pays for it, though several together
would (measured: 0.66 of the optimum on random instances). The step cost depends on k only through the number of
draft tokens M = sum k_i and the depth D = max k_i, so the optimum is found exactly: for each depth bound D, the best
choice of M tokens is the M largest marginal gains a_i^j (j <= D), which is automatically a prefix per request
because a^j falls with j. One sort per D and a scan of prefix sums: O(K * BK log BK), vectorised.

A step that also carries prefill chunks is priced differently (select_from_gains' price). Its prefill is paid
whatever k is, so in the ratio it makes every draft look cheap; and every second of drafting in it holds up the
prefilling requests, which gain nothing from the drafts. Such a step keeps the drafts whose marginal tokens per
second beat the decode batch's own goodput, scaled by the requests the step holds per request it serves."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np


def expected_tokens(k: int, alpha: float) -> float:
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def goodput(ks: list[int], alphas: list[float], step_time: float) -> float:
    return sum(expected_tokens(k, a) for k, a in zip(ks, alphas)) / step_time


def select_k(alphas: list[float], k_max: list[int], cost: Callable, base_tokens: int,
             base_context: int) -> tuple[list[int], float]:
    """alphas, k_max (max k) per request; cost(n_batched, n_context, depth, sum_k) -> seconds, taking numpy arrays
    for n_batched, n_context and sum_k. base_tokens / base_context: the step at k = 0 (its decode tokens plus any
    prefill). Returns k per request (all 0 unless speculating is predicted to raise goodput) and the predicted
    step time."""
    k_top = max(k_max, default=0)
    return select_from_gains(chain_gains(alphas, k_top), k_max, np.arange(1, k_top + 1), cost, base_tokens,
                             base_context)


def chain_gains(alphas, k: int) -> np.ndarray:
    """[B, k]: the expected tokens the j-th drafted token of a chain adds, alpha_i^j (see the module docstring)."""
    return np.asarray(alphas, dtype=np.float64)[:, None] ** np.arange(1, k + 1)[None, :]


@dataclass
class Plan:
    """One choice of k per request, with its predicted step time and its value (goodput, or tokens - price * T).
    Its ks are worked out when first read (ks_of): of a step's plans by depth, one or two are read."""
    ks_of: Callable[[], list[int]] = field(repr=False)
    seconds: float
    value: float
    depth: int  # draft forwards it takes (0: no speculation)
    tokens: int  # draft tokens it verifies

    @cached_property
    def ks(self) -> list[int]:
        return self.ks_of()


def plan_value(tokens, seconds, price: float | None = None):
    """What a plan is chosen by: goodput (tokens / seconds), or tokens - price * seconds (see select_from_gains).
    Numbers or numpy arrays."""
    return tokens / seconds if price is None else tokens - price * seconds


def plans_by_depth(gains: np.ndarray, k_max: list[int], depth_of: np.ndarray, cost: Callable, base_tokens: int,
                   base_context: int, price: float | None = None,
                   tokens_of: Callable[[np.ndarray | int, int], np.ndarray | int] | None = None) -> list[Plan]:
    """The best plan under each draft depth, the plan without speculation first (see select_from_gains).
    tokens_of(m, depth): the tokens the forward computes with m draft tokens at most `depth` a row, where that is
    not base_tokens + m (a runner that pads every row to the widest: StepNumbers.forward_tokens)."""
    b = len(k_max)
    t0 = float(cost(base_tokens if tokens_of is None else tokens_of(0, 0), base_context, 0, 0))

    plans = [Plan(lambda: [0] * b, t0, plan_value(b, t0, price) if b else 0.0, 0, 0)]
    k_max_arr = np.asarray(k_max, dtype=np.int64)
    k_top = int(k_max_arr.max()) if b else 0
    if k_top == 0:
        return plans
    gains, depth_of = gains[:, :k_top], np.asarray(depth_of[:k_top])
    rank = np.arange(1, k_top + 1)
    rows, cols = np.nonzero(rank[None, :] <= k_max_arr[:, None])  # every draft token a request may make
    g = gains[rows, cols]
    # sorted once, largest gain first: a depth bound's candidates in this order are those of a sort of their own,
    # since a stable sort of a subset keeps the subset's order within the whole's
    order = np.argsort(-g, kind="stable")
    depths = np.array(sorted(set(depth_of.tolist())))  # a few numbers: not np.unique, whose first call imports numpy.ma
    within = depth_of[cols[order]][None, :] <= depths[:, None]  # [depth bound, position]: a candidate under it
    m = np.cumsum(within, axis=1)  # draft tokens taken up to each position
    # every depth bound's prefixes priced in one call (adding the excluded positions' zeros changes no sum)
    tokens = base_tokens + m if tokens_of is None else np.stack(
        [np.broadcast_to(tokens_of(m[i], int(d)), m[i].shape) for i, d in enumerate(depths)])
    values = plan_value(b + np.cumsum(np.where(within, g[order], 0.0), axis=1),
                        cost(tokens, base_context + m, depths[:, None], m), price)
    values[~within] = -np.inf
    best = np.argmax(values, axis=1)  # the first of equals, as a scan of the depth's own candidates would take
    taken = within & (np.arange(len(order))[None, :] <= best[:, None])  # [depth bound, position]: its plan's drafts
    counts = m[np.arange(len(depths)), best]
    used = np.where(taken, depth_of[cols[order]][None, :], 0).max(axis=1)  # the deepest draft each plan takes
    if tokens_of is None:  # every plan priced in one call, at the float each would cost alone (cost_model)
        seconds = cost(base_tokens + counts, base_context + counts, used, counts).tolist()
    else:
        seconds = [float(cost(tokens_of(c, u), base_context + c, u, c))
                   for c, u in zip(counts.tolist(), used.tolist())]
    for i, (p, count, depth) in enumerate(zip(best.tolist(), counts.tolist(), used.tolist())):
        plans.append(Plan(lambda chosen=order[taken[i]]: np.bincount(rows[chosen], minlength=b).tolist(), seconds[i],
                          float(values[i, p]), depth, count))
    return plans


def best_plan(plans: list[Plan]) -> Plan:
    """The highest value; on a tie the shallower plan (no speculation unless it is predicted to pay): plans come
    shallowest first, and max keeps the first of equals."""
    return max(plans, key=lambda plan: plan.value)


def select_from_gains(gains: np.ndarray, k_max: list[int], depth_of: np.ndarray, cost: Callable, base_tokens: int,
                      base_context: int, price: float | None = None) -> tuple[list[int], float]:
    """gains [B, K]: the expected tokens the j-th speculated token (chain) or node (tree) of request i adds,
    non-increasing along j; depth_of [K]: the draft depth that j tokens need (chain: j; tree: min(j, max depth)).
    price None: maximise goodput, tokens / T. price p (tokens per second): maximise tokens - p * T instead, which
    keeps a draft only if it adds more than p tokens per second it adds to the step (see the module docstring)."""
    plan = best_plan(plans_by_depth(gains, k_max, depth_of, cost, base_tokens, base_context, price))
    return plan.ks, plan.seconds


def charge_start_costs(gains: np.ndarray, k_max: list[int], start_tokens: np.ndarray) -> np.ndarray:
    """gains [B, K] with a one-time cost for request i to draft at all (start_tokens[i], in tokens of goodput: a
    draft model reading a prompt it has not seen). The cost is spread evenly over the prefix of request i's draft
    tokens that pays it best (the concave envelope of its cumulative gain), so each row stays non-increasing within its
    cap and select_from_gains stays exact for the charged gains. A request whose start does not pay gets gains <= 0."""
    out = np.array(gains, dtype=np.float64, copy=True)
    k_max_arr, start = np.asarray(k_max, dtype=np.int64), np.asarray(start_tokens, dtype=np.float64)
    rows = np.nonzero((start > 0) & (k_max_arr > 0))[0]
    if len(rows) == 0:
        return out
    rank = np.arange(1, out.shape[1] + 1)
    mean = (np.cumsum(out[rows], axis=1) - start[rows, None]) / rank  # mean gain of the first j drafts, charged
    mean[rank[None, :] > k_max_arr[rows, None]] = -np.inf
    best = np.argmax(mean, axis=1)
    spread = rank[None, :] <= best[:, None] + 1
    out[rows] = np.where(spread, mean[np.arange(len(rows)), best][:, None], out[rows])
    return out

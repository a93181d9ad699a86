"""Where no plan could pay: the step context below which the goodput policy's exact plan, and any probe it could
run, is no speculation, so that the estimates, catch-ups and per-request planning need not be computed (a loaded
CPU's steady state, and a GPU's at hundreds of streams, where planning per request cost more host time than the
step had to spare).

A step's cost is affine in its context with the same slope s for every plan (StepCostModel.context_slope),
T_i(C) = A_i + s C. With every draft accepted at a ceiling alpha and no catch-up charged, the m drafts of plan i
add at most g_i tokens (rows of alpha, then of alpha^2, ...), and:

- a decoding step keeps plan i only where (rows + g_i) T_0(C) > rows T_i(C), i.e. s g_i C > rows A_i - (rows + g_i)
  A_0: past a context of its own;
- a step that carries prefill keeps drafts worth more than the price p = G (rows + prefilling) / rows tokens a second
  (chain_plan.prefill_step_price), G the decode batch's best goodput in a step of its own, at least rows / T_0(C_d):
  only where g_i T_0(C_d) > (rows + prefilling) (T_i - T_0). The drafts' seconds T_i - T_0 are the same at every
  context, so this is a threshold on the decoding requests' own context C_d.

Only the plans at the ends of each layer of drafts (m = j * rows and the one after) and at the cost's kinks
(cost_model.SEGMENT_EDGES) are priced: between two of them both the tokens a plan adds and its cost are affine in m
(on a padded runner the forward's cells are the same for every m of a depth), so the threshold is a ratio of affine
functions, monotone, least at an end. A few dozen plans, not rows * k_top. Without caps: more candidates only raise
the best value, so the bound holds for any caps."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BoundShape:
    """The step the bound prices."""
    k_top: int  # the most any request drafts
    rows: int  # decoding requests
    base_tokens: int  # the step's tokens at k = 0, prefill chunks included
    prefilling: int = 0  # requests prefilling in the step, at least 1 where it carries prefill (0: none)
    tokens_of: Callable | None = None  # a padded runner's cells for (m drafts, depth): StepNumbers.padded_tokens


def drafting_pays_above(shape: BoundShape, alpha: float, cost: Callable, context_slope: float,
                        kinks: np.ndarray) -> float:
    """The context (a decoding step's; the decoding requests' own in a step with prefill) above which some plan
    could beat no speculation with every draft accepted at `alpha`: -inf, at any context; inf,
    at none (see the module docstring)."""
    rows = shape.rows
    if shape.k_top < 1 or rows < 1:
        return np.inf
    m, cumulative = _candidates(shape.k_top, rows, alpha, shape.base_tokens, kinks)
    depths = np.arange(1, shape.k_top + 1)[:, None]
    tokens_of = shape.tokens_of if not shape.prefilling else None  # a step with prefill runs unpadded
    if tokens_of is None:
        plain, tokens = float(cost(shape.base_tokens, 0, 0, 0)), shape.base_tokens + m
    else:
        plain = float(cost(tokens_of(0, 0), 0, 0, 0))
        tokens = np.stack([np.broadcast_to(tokens_of(m, d), m.shape) for d in range(1, shape.k_top + 1)])
    drafted = cost(tokens, m, depths, m)  # [depth, m]
    if shape.prefilling:  # what s g C_d must beat: the drafts' seconds at the price, less the tokens they add
        need = (rows + shape.prefilling) * (drafted - plain) - cumulative * float(cost(rows, 0, 0, 0))
    else:
        need = rows * drafted - (rows + cumulative) * plain
    need[m[None, :] > rows * depths] = np.inf  # more drafts than `depth` a request
    if context_slope <= 0:
        return -np.inf if (need < 0).any() else np.inf
    with np.errstate(divide="ignore"):
        return float((need / (context_slope * cumulative)).min())


def _candidates(k_top: int, rows: int, alpha: float, base_tokens: int, kinks: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """The draft counts m the bound prices, and the m largest gains' sum for each: whole layers of rows * a^j
    below m's own layer, then the part of that layer."""
    ends = np.arange(k_top) * rows
    # sorted and deduplicated in Python: a few dozen numbers (np.unique's first call imports numpy.ma, slowly)
    m = np.array(sorted(set(np.concatenate((ends + 1, ends + rows, np.asarray(kinks, dtype=np.int64) - base_tokens))
                            .tolist())), dtype=np.int64)
    m = m[(m >= 1) & (m <= rows * k_top)]
    layer = (m - 1) // rows + 1
    below = np.concatenate(([0.0], np.cumsum(rows * alpha ** np.arange(1, k_top + 1, dtype=np.float64))))
    return m, below[layer - 1] + (m - (layer - 1) * rows) * alpha ** layer

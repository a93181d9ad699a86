"""Exploration: a request the plan leaves at k = 0 would never show that its drafts got better, so now and then it
probes, drafting one token. Probes are bounded (a share of the batch a step), backed off per request (a failed
probe waits twice as long for the next, up to max_interval; an accepted one resets the wait), and run only where
their outcome could change a choice (`worth_probing`) and, while the shared prior is still a guess, where what they
could reveal is worth what they cost (`probe_pays`)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from smartspec.policy.catchup import Starts
from smartspec.policy.goodput import Plan, best_plan, plan_value, plans_by_depth
from smartspec.policy.step_numbers import StepNumbers, expected_tokens


class Exploration:
    def __init__(self, interval: int, fraction: float, max_interval: int, min_prior_evidence: float) -> None:
        self.interval, self.fraction, self.max_interval = interval, fraction, max_interval
        # until the prior rests on this many outcomes, a probe's catch-up is weighed against what the proposer
        # could be worth (probe_pays), not capped at a share of the step: the initial prior is a guess, and a policy
        # that never drafts would never learn the proposer is better than that guess
        self.min_prior_evidence = min_prior_evidence
        self.due_at: dict[str, int] = {}  # request -> step at which a probe is next allowed
        self.wait: dict[str, int] = {}  # request -> current back-off between probes

    def is_due(self, request_id: str, step: int) -> bool:
        return step >= self.due_at.get(request_id, 0)

    def due_rows(self, request_ids: tuple[str, ...], ks: list[int], caps: list[int], step: int) -> list[int]:
        """The rows, in order, of the requests at k = 0 with room to draft whose probe is due at `step` (is_due):
        read in C and numpy, not tested in Python request by request (a full plan asks it of a loaded batch)."""
        n = len(request_ids)
        due_at = np.fromiter(map(self.due_at.get, request_ids, repeat(0, n)), dtype=np.int64, count=n)
        return np.flatnonzero((np.asarray(ks) == 0) & (np.asarray(caps) > 0) & (due_at <= step)).tolist()

    def budget(self, batch: int) -> int:
        """Probes a step may run."""
        return max(1, int(self.fraction * batch))

    def learning(self, evidence: float) -> bool:
        """Whether the shared prior is still a guess."""
        return evidence < self.min_prior_evidence

    def observed(self, request_ids: list[str], ks: list[int], accepted: list[int], step: int, probes: set[str]) -> None:
        """A step's outcomes: a probe (SpecPlan.probes) backs off when rejected; a chosen k puts the next probe
        off."""
        wait, due_at = self.wait, self.due_at
        for rid, k, taken in zip(request_ids, ks, accepted):
            if rid in probes:
                wait[rid] = self.interval if taken else min(self.max_interval, 2 * wait.get(rid, self.interval))
                due_at[rid] = step + wait[rid]
            elif k > 0:
                due_at[rid] = step + wait.get(rid, self.interval)

    def release(self, request_id: str) -> None:
        self.due_at.pop(request_id, None)
        self.wait.pop(request_id, None)


@dataclass(frozen=True)
class ChainStep:
    """What the chain plan of a step was chosen on (GoodputPolicy._plan_chains), as probes weigh it."""
    step: StepNumbers
    raw_gains: np.ndarray  # [B, K] the estimates' gains
    gains: np.ndarray  # [B, K] with catch-ups charged
    depth_of: np.ndarray  # [K] the draft forwards j tokens (or nodes) take
    starts: Starts
    price: float | None  # a step with prefill: tokens a second a draft must add (chain_plan.prefill_step_price)
    tokens_of: Callable | None  # a padded runner's cells (StepNumbers.padded_tokens); None: the real tokens


def worth_probing(chain: ChainStep, due: list[int], plan: Plan, together: bool, max_alpha: float,
                  charge: Callable[[np.ndarray], np.ndarray], cost: Callable) -> set[int]:
    """The requests in `due` (at k = 0 in the chosen plan) that would draft if their drafts were accepted almost
    surely (max_alpha, the estimator's ceiling), catch-up charged as usual (`charge`), each priced as the runner
    runs it (a padded runner widens every row to the deepest chain).

    A probe buys evidence of acceptance, and evidence is worth its cost only if it could change a choice: where even
    near-certain acceptance would leave the request at k = 0 (a batch whose verify tokens and draft forwards cost
    more than they add, a catch-up that does not pay), no outcome of the probe could. Without this check, probes in
    large batches on a CPU (where one draft forward is a sizeable share of a step) cost more than speculation ever
    gained there.
    together: while the prior is unlearned (or where the plan drafts nothing, below), what a probe tests is the
    proposer, so the due requests are optimistic together, in one plan: a draft forward serves the whole batch, so
    requests that could not pay for a depth alone may together (tried one at a time, a fresh policy in a small
    batch may never probe, and never learn that a good pair agrees on almost every token). What runs is still one
    request's probe, so it is run only where it costs less than what that plan would add over the steps the batch
    is expected to hold (probe_pays). Once the prior is learned, the plan already drafts wherever requests like the
    rest would pay together, and a probe tests one request: it is tried alone on top of the chosen plan, at every
    draft length up to its cap. Where that plan drafts nothing, one request alone would pay a whole draft forward,
    which in a large batch it never earns back, and a prior below the batch's acceptance (a calibration on a few
    questions) would never be corrected: there the due requests are judged together as well."""
    if not due:
        return set()
    step, raw_gains, price = chain.step, chain.raw_gains, chain.price
    k_top = raw_gains.shape[1]
    hopeful = np.array(raw_gains, dtype=np.float64, copy=True)
    hopeful[due] = max_alpha ** np.arange(1, k_top + 1)[None, :]
    hopeful = charge(hopeful)
    j = np.arange(1, k_top + 1)
    m, depths = plan.tokens + j, np.maximum(plan.depth, chain.depth_of)
    tokens = step.tokens + m if chain.tokens_of is None else np.array(
        [chain.tokens_of(int(mi), int(d)) for mi, d in zip(m.tolist(), depths.tolist())])
    t = cost(tokens, step.context + m, depths, m)  # [K]: j more drafts
    if together:
        hope = best_plan(plans_by_depth(hopeful, step.caps, chain.depth_of, cost, step.tokens, step.context, price,
                                        chain.tokens_of))
        return {i for i in due if hope.ks[i] > 0
                and probe_pays(hope, plan, raw_gains[i, 0], chain.starts.seconds[i], float(t[0]), price,
                               chain.starts.horizon_cap)}
    expected = expected_tokens(chain.gains, plan.ks)  # catch-up charged
    gained = expected + np.cumsum(hopeful[due], axis=1)  # [due, K]
    better = plan_value(gained, t[None, :], price) > plan.value
    better &= j[None, :] <= np.asarray(step.caps)[due][:, None]
    return {i for i, any_better in zip(due, better.any(axis=1).tolist()) if any_better}


def probe_pays(hope: Plan, plan: Plan, gain: float, start_s: float, probe_s: float, price: float | None,
               horizon_cap: float) -> bool:
    """Whether what a learning-time probe could reveal is worth what it costs, in tokens. Revealed: the hopeful
    plan's edge over the chosen one, for the steps a catch-up is spread over (the batch is not expected to hold
    longer). Cost: the probe's own seconds (probe_s: the step with one draft token on top of the plan; and its
    catch-up) at the plan's rate, less the token it is expected to add. Beside a prefill, for instance, a hopeful
    plan may beat the plain one by a fraction of a token a step while the probe's catch-up costs many tokens of the
    batch's time: such a probe does not run."""
    rate = plan.value if price is None else price  # tokens a second of this step is worth
    edge = (hope.value - plan.value) * (hope.seconds if price is None else 1.0)
    return edge * horizon_cap > (probe_s - plan.seconds + start_s) * rate - gain

"""A draft model's catch-up: before it drafts for a request it reads every token of it that it has not seen (a whole
prompt, the first time; what the request made at k = 0 since). The cost is paid once and serves the steps that
follow, so the policy charges it once, spread over at most `horizon` steps, or fewer where the batch is expected to
grow sooner (arrivals.py). The ledger keeps what the draft has read per request. (For prompt lookup the fitted
cost of catch-up tokens is zero, and so is every charge.)"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from smartspec.policy.arrivals import ArrivalGaps
from smartspec.policy.cost_model import StepCostModel
from smartspec.policy.goodput import charge_start_costs
from smartspec.policy.step_numbers import StepNumbers
from smartspec.types.plan import StepView


PRIOR_GAP_STEPS = 8.0  # the expected gap to the batch's growth before any arrival is seen, in drafting steps
MEMORY_HORIZONS = 4.0  # arrivals older than this many horizons are forgotten


@dataclass
class Starts:
    """Per request, the seconds of its catch-up, and the most steps one is spread over this step."""
    seconds: np.ndarray
    horizon_cap: float


class CatchupLedger:
    def __init__(self, horizon: float) -> None:
        self.horizon = horizon  # the most steps one catch-up is spread over when choosing k
        self.arrivals = ArrivalGaps()  # ... and the steps to the batch's next growth bound them
        self.seen: dict[str, int] = {}  # request -> tokens the draft has read

    def see(self, view: StepView, now: float) -> None:
        self.arrivals.see_each(view.requests, ids=view.requests.ids)
        self.arrivals.see_each(view.prefilling, now)

    def tokens(self, step: StepNumbers, rows: np.ndarray | None = None) -> np.ndarray:
        """Per request (or per row of `rows`), the tokens a draft model would read before drafting beyond the one it
        always reads: all of a context it never drafted for, or what the request generated at k = 0 since."""
        get, ids = self.seen.get, step.ids if rows is None else [step.ids[i] for i in rows.tolist()]
        seen = np.array([get(rid, 0) for rid in ids], dtype=np.float64)
        return np.maximum(0.0, (step.num_tokens if rows is None else step.num_tokens[rows]) - 1 - seen)

    def starts(self, step: StepNumbers, cost: StepCostModel, depth: Callable[[int], int]) -> Starts:
        return Starts(cost.predict_draft(0, 0, self.tokens(step)),
                      self._steps_to_growth(step, cost, depth))

    def charge(self, gains: np.ndarray, step: StepNumbers, starts: Starts, cost: StepCostModel) -> np.ndarray:
        """The gains with each request's catch-up charged (goodput.charge_start_costs)."""
        if not starts.seconds.any():
            return gains
        return charge_start_costs(gains, step.caps, self._in_tokens(step, gains, step.caps, step.remaining,
                                                                     starts, cost))

    def charge_rows(self, gains: np.ndarray, step: StepNumbers, rows: list[int], cost: StepCostModel,
                    depth: Callable[[int], int]) -> tuple[np.ndarray, np.ndarray]:
        """charge() for some of the step's requests alone (gains [len(rows), K]: theirs), and their catch-ups'
        seconds: a held plan's newcomers (PlanHold), priced as a full plan would price them."""
        index = np.asarray(rows, dtype=np.int64)
        seconds = cost.predict_draft(0, 0, self.tokens(step, index))
        if not seconds.any():
            return gains, seconds
        caps = [step.caps[i] for i in rows]
        starts = Starts(seconds, self._steps_to_growth(step, cost, depth))
        return charge_start_costs(gains, caps, self._in_tokens(step, gains, caps, step.remaining[index],
                                                                starts, cost)), seconds

    def _in_tokens(self, step: StepNumbers, gains: np.ndarray, caps: list[int], remaining: np.ndarray,
                   starts: Starts, cost: StepCostModel) -> np.ndarray:
        """A catch-up spread over the steps the request would take to finish while drafting (at most the horizon,
        since load may turn drafting off again), its seconds priced at the decoding batch's goodput without
        speculation. gains, caps, remaining: the rows charged.

        The decoding batch alone, not the step: beside a prefill chunk the step's own goodput is a few tokens a
        second (its time is the prefill's), which would price a catch-up's seconds at a fraction of what they are
        worth and let whole batches start drafting in prefill steps."""
        capped = np.where(np.arange(1, gains.shape[1] + 1)[None, :] <= np.asarray(caps)[:, None], gains, 0.0)
        per_step = 1.0 + capped.sum(axis=1)
        horizon = np.clip(remaining / per_step, 1.0, starts.horizon_cap)
        b = len(step.ids)
        decode_s = float(cost.predict(b, step.decode_context))
        return starts.seconds / horizon * (b / decode_s)

    def _steps_to_growth(self, step: StepNumbers, cost: StepCostModel, depth: Callable[[int], int]) -> float:
        """The most steps a catch-up is spread over: the horizon, or fewer where the batch is expected to grow
        sooner (an arrival no departure made room for). Steps are counted at the length of one in which every
        request drafts its cap (drafting steps are the ones a catch-up pays back in). The prior is one gap of
        PRIOR_GAP_STEPS such steps, and arrivals are remembered over `MEMORY_HORIZONS` horizons; with none seen,
        the bound is the prior. One stream sending request after request, or a closed loop of many, replaces each
        request that leaves: the batch holds its size, and a catch-up is spread over the request's own drafting
        steps up to the horizon (_in_tokens)."""
        sum_k = sum(step.caps)
        step_s = max(1e-9, float(cost.predict(step.tokens + sum_k, step.context + sum_k,
                                              depth(max(step.caps, default=0)), sum_k)))
        gap = self.arrivals.expected_gap(step.now, PRIOR_GAP_STEPS * step_s, MEMORY_HORIZONS * self.horizon * step_s)
        return float(np.clip(gap / step_s, 1.0, self.horizon))

    def observed(self, request_ids: list[str], lengths: list[int], proposed: list[int], accepted: list[int]) -> None:
        """A step's draft-model outcomes: the draft read each request's context (its length when the step was
        planned), then its drafts up to the last."""
        self.seen.update((rid, n + min(a, p - 1)) for rid, n, p, a in zip(request_ids, lengths, proposed, accepted)
                         if p)

    def release(self, request_id: str) -> None:
        self.seen.pop(request_id, None)
        self.arrivals.release(request_id)

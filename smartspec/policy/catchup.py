"""A draft model's catch-up: before it drafts for a request it reads every token of it that it has not seen (a whole
prompt the first time, less what the draft's prefix cache holds of it; what the request made at k = 0 since). The
cost is paid once and serves the steps that follow, so the policy charges it once, spread over at most `horizon`
steps, or fewer where the batch is expected to grow sooner to the size at which drafting stops paying (arrivals.py,
growths_drafting_lasts). The ledger keeps what the draft has read per request. (For prompt lookup the fitted cost
of catch-up tokens is zero, and so is every charge.)"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from smartspec.policy.arrivals import ArrivalGaps
from smartspec.policy.cost_model import StepCostModel
from smartspec.policy.goodput import charge_start_costs
from smartspec.policy.step_numbers import StepNumbers
from smartspec.types.plan import StepView


PRIOR_GAP_STEPS = 8.0  # the expected gap to the batch's growth before any arrival is seen, in drafting steps
MEMORY_HORIZONS = 4.0  # arrivals older than this many horizons are forgotten
# the growths of the batch looked at for the size where drafting stops paying (a few, not every size: one call of
# the cost fit over them, in the few full plans a loaded batch makes)
GROWTHS = np.array([0, 1, 2, 4, 8, 16, 32, 64], dtype=np.float64)


def growths_drafting_lasts(gains: np.ndarray, b: int, decode_context: int, cost: StepCostModel,
                           depth: Callable[[int], int]) -> int:
    """How many requests a batch of b decoding requests can grow by before drafting stops paying, were every request
    like the mean of `gains` ([rows, K]: gain curves) with the batch's mean context: one more than the largest of
    GROWTHS up to which some draft length's goodput still beats plain decoding's under the cost fit (1 where none
    does at b). One arrival rarely ends drafting; the size at which drafting stops does."""
    k_top = gains.shape[1] if gains.ndim == 2 else 0
    if not b or not k_top or not len(gains):
        return 1
    n = (b + GROWTHS)[:, None]  # [sizes, 1]
    k = np.arange(1, k_top + 1, dtype=np.float64)[None, :]  # [1, K]
    per_request = 1.0 + np.cumsum(gains.mean(axis=0))[None, :]  # tokens a request makes a step drafting k
    context = n * (decode_context / b)
    plain = cost.predict(n, context)
    drafting = cost.predict(n * (1 + k), context + n * k, np.array([depth(int(j)) for j in k[0]])[None, :], n * k)
    pays = (per_request * plain > drafting).any(axis=1)
    stops = int(np.argmin(pays)) if not pays.all() else len(GROWTHS)  # the first size where it does not
    return 1 + (int(GROWTHS[stops - 1]) if stops else 0)


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
        always reads: all of a context it never drafted for, less what its prefix cache holds of it (a shared
        system prompt, an earlier turn), or what the request generated at k = 0 since: past the more of what the
        ledger saw it read and what the proposer says it holds (RequestViews.draft_held, where it says)."""
        get, ids = self.seen.get, step.ids if rows is None else [step.ids[i] for i in rows.tolist()]
        held = step.view.requests.draft_held
        seen = map(get, ids, repeat(0, len(ids)))  # in C: a full plan reads every row of a loaded batch
        if held is not None:
            seen = map(max, seen, held if rows is None else [held[i] for i in rows])
        return np.maximum(0.0, (step.num_tokens if rows is None else step.num_tokens[rows]) - 1 -
                          np.fromiter(seen, dtype=np.float64, count=len(ids)))

    def starts(self, step: StepNumbers, cost: StepCostModel, depth: Callable[[int], int],
               gains: np.ndarray | None = None) -> Starts:
        """gains [B, K]: the requests' uncharged gains (None: drafting is taken to end at the batch's next
        growth)."""
        return Starts(self.starts_seconds(step, cost), self._steps_to_growth(step, cost, depth, gains))

    def starts_seconds(self, step: StepNumbers, cost: StepCostModel) -> np.ndarray:
        """[B] each request's catch-up in seconds (Starts.seconds) alone."""
        return cost.predict_draft(0, 0, self.tokens(step))

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
        starts = Starts(seconds, self._steps_to_growth(step, cost, depth, gains))
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

    def _steps_to_growth(self, step: StepNumbers, cost: StepCostModel, depth: Callable[[int], int],
                         gains: np.ndarray | None) -> float:
        """The most steps a catch-up is spread over: the horizon, or fewer where the batch is expected to grow to
        the size at which drafting stops paying sooner (growths_drafting_lasts arrivals that no departure made room
        for; one, without gains). Steps are counted at the length of one in which every request drafts its cap
        (drafting steps are the ones a catch-up pays back in). The prior is one gap of PRIOR_GAP_STEPS such steps,
        and arrivals are remembered over `MEMORY_HORIZONS` horizons; with none seen, the gap is the prior. One
        stream sending request after request, or a closed loop of many, replaces each request that leaves: the
        batch holds its size, and a catch-up is spread over the request's own drafting steps up to the horizon
        (_in_tokens)."""
        sum_k = sum(step.caps)
        step_s = max(1e-9, float(cost.predict(step.tokens + sum_k, step.context + sum_k,
                                              depth(max(step.caps, default=0)), sum_k)))
        gap = self.arrivals.expected_gap(step.now, PRIOR_GAP_STEPS * step_s, MEMORY_HORIZONS * self.horizon * step_s)
        if gap / step_s >= self.horizon:
            return float(self.horizon)
        growths = 1 if gains is None else growths_drafting_lasts(gains, len(step.ids), step.decode_context, cost,
                                                                 depth)
        return float(np.clip(growths * gap / step_s, 1.0, self.horizon))

    def observed(self, request_ids: list[str], lengths: list[int], proposed: list[int], accepted: list[int]) -> None:
        """A step's draft-model outcomes: the draft read each request's context (its length when the step was
        planned), then its drafts up to the last."""
        self.seen.update((rid, n + min(a, p - 1)) for rid, n, p, a in zip(request_ids, lengths, proposed, accepted)
                         if p)

    def release(self, request_id: str) -> None:
        self.seen.pop(request_id, None)
        self.arrivals.release(request_id)

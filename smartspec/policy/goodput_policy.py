"""The goodput policy (configured as "smartspec"): per request, per step, the k that maximises the batch's goodput."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from smartspec.policy.acceptance import ChainAcceptance
from smartspec.policy.arrivals import ArrivalGaps
from smartspec.policy.base import Policy
from smartspec.policy.cost_model import StepCostModel
from smartspec.policy.goodput import Plan, best_plan, charge_start_costs, plan_value, plans_by_depth, select_from_gains
from smartspec.policy.proposer_choice import lookup_gains, select_proposers
from smartspec.policy.tree_goodput import NodeCalibration, TreeGains, node_values, prune_trees
from smartspec.types.numbers import is_int
from smartspec.types.plan import DRAFT, RequestView, SpecPlan, StepView, TreePlan
from smartspec.types.step_record import StepRecord
from smartspec.types.tree import TokenTree


@dataclass
class _Step:
    """One step's numbers while its plan is made."""
    view: StepView
    caps: list[int]  # the most each request may draft
    tokens: int  # the step's tokens at k = 0: the decoding requests' last tokens and the prefill chunks
    context: int  # and the context they attend over
    now: float  # the clock of arrival_time

    @property
    def requests(self) -> list[RequestView]:
        return self.view.requests

    @property
    def decode_context(self) -> int:
        """The decoding requests' context alone."""
        return self.context - self.view.prefill_context


@dataclass
class _Starts:
    """A draft model's catch-up per request: seconds paid once before its first draft, spread over at most
    horizon_cap steps."""
    seconds: np.ndarray
    horizon_cap: float


def _expected_tokens(gains: np.ndarray, ks: list[int]) -> float:
    """Tokens a step is expected to generate: one per request, and the gains of each request's first k drafts."""
    taken = np.arange(gains.shape[1])[None, :] < np.asarray(ks)[:, None]
    return len(ks) + float(gains[taken].sum())


class GoodputPolicy(Policy):
    """Chooses k_i in {0..K} for every decoding request so as to maximise the batch's goodput,

        goodput(k) = sum_i g(k_i, alpha_i) / T(k),    g(k, a) = 1 + a + ... + a^k,

    the tokens the step is expected to generate per second of step time. Its parts:

    - acceptance (alpha_i): per request, first and later draft tokens apart, shrunk toward a prior per proposer
      (`ChainAcceptance`); token trees use calibrated node confidences instead (`TreeGains`, `NodeCalibration`).
    - step cost (T): `StepCostModel`, fitted online on every step (refitted every `refit_every` steps), seeded by
      the engine's warm-up profile.
    - selection: exact, per depth bound (`goodput.plans_by_depth`); k = 0 is always a candidate, so a step is
      never planned to be slower than plain decoding.
    - prices: a step that carries prefill keeps only drafts that beat the decoding batch's own rate
      (`_prefill_step_price`); a draft model's catch-up is charged once, spread over the steps it serves
      (`_start_cost_in_tokens`, `ArrivalGaps`).
    - learning: bounded exploration probes for requests at k = 0 (`_worth_probing`), and now and then a nearby
      draft length the cost fit has not seen (`_shape_probe`).

    docs/policy.md explains each part and links the evidence. Options are the constructor's keyword arguments
    (`speculative_config["policy_options"]`)."""

    name = "smartspec"
    wants_profile = True  # the engine seeds the cost model with a short warm-up profile

    def __init__(self, key: str = "default", prior_alpha: float = 0.5, explore_interval: int = 16,
                 explore_fraction: float = 0.1, max_explore_interval: int = 256, tree_depth: int | None = None,
                 catchup_horizon: float = 8.0, min_prior_evidence: float = 32.0, shape_probe_interval: int = 8,
                 shape_probe_loss: float = 0.1, refit_every: int = 4) -> None:
        self.key = key  # proposer and model pair: acceptance priors are shared only between equal keys
        self.acceptance = ChainAcceptance(prior_alpha=prior_alpha)
        # token trees (k is a node budget, trees this deep): node values from calibrated draft confidence
        self.tree_depth = tree_depth
        self.calibration = NodeCalibration()
        self.tree_gains: TreeGains | None = None
        self.prior_alpha = prior_alpha
        self.cost = StepCostModel()
        # the cost fit is redone once every refit_every steps, not after each: a fit is a few robust least-squares
        # solves (over a millisecond of Python and numpy, about 2% of a CPU decode step), and a fit a few steps
        # old predicts the next step as well as a fresh one
        if not (is_int(refit_every) and refit_every >= 1):
            raise ValueError(f"refit_every must be an integer >= 1, got {refit_every!r}")
        self.refit_every = refit_every
        self._steps_unfit = 0  # steps observed since the last fit
        self._drafts_unfit = False  # whether one of them ran draft forwards
        self.explore_interval = explore_interval
        self.explore_fraction = explore_fraction
        self.max_explore_interval = max_explore_interval
        self._probe_due: dict[str, int] = {}  # request -> step at which a probe is next allowed
        self._probe_wait: dict[str, int] = {}  # request -> current back-off between probes
        self._probing: set[str] = set()
        # a draft model reads every token it has not seen before it drafts (a whole prompt, the first time): the
        # tokens it has seen per request, and the length at which each request last asked for a draft
        self.catchup_horizon = catchup_horizon  # the most steps one catch-up is spread over when choosing k
        self.arrivals = ArrivalGaps()  # ... and the steps to the next arrival bound them (see arrivals.py)
        self._draft_seen: dict[str, int] = {}
        self._chosen_at: dict[str, int] = {}
        # until the prior rests on this many outcomes, a probe's catch-up is weighed against what the proposer could
        # be worth (_probe_pays), not capped at a share of the step: the initial prior is a guess, and a policy that
        # never drafts would never learn the proposer is better than that guess
        self.min_prior_evidence = min_prior_evidence
        # every shape_probe_interval-th decode step, the plan of another draft length whose predicted goodput is
        # within shape_probe_loss of the best (see _shape_probe); 0: never
        if not (isinstance(shape_probe_interval, int) and shape_probe_interval >= 0 and 0 <= shape_probe_loss < 1):
            raise ValueError(f"shape_probe_interval must be an integer >= 0 and shape_probe_loss in [0, 1): got "
                             f"{shape_probe_interval!r}, {shape_probe_loss!r}")
        self.shape_probe_interval = shape_probe_interval
        self.shape_probe_loss = shape_probe_loss
        self.shape_probes = 0
        self.step = 0

    def plan(self, view: StepView) -> SpecPlan:
        """One entry point: chains and trees of one proposer (a k per request), or, where the view holds lookups,
        the proposer and k per request."""
        step = self._begin_step(view)
        if step is None:  # nothing measured yet: plain decoding is the one safe plan
            return SpecPlan.none(view)
        if view.lookups is not None:
            return self._plan_proposers(step)
        return self._plan_chains(step)

    def _plan_chains(self, step: _Step) -> SpecPlan:
        """k per request for one proposer: draft tokens of a chain, or a tree's node budget."""
        requests, k_max, caps, tokens, context = step.requests, step.view.k_max, step.caps, step.tokens, step.context
        if self.tree_depth is None:
            raw_gains = self.acceptance.gains([r.request_id for r in requests], k_max)
            depth_of = np.arange(1, k_max + 1)
        else:
            if self.tree_gains is None or self.tree_gains.k_max != k_max:
                self.tree_gains = TreeGains(k_max, self.prior_alpha)
            raw_gains = np.stack([self.tree_gains.curve(r.request_id) for r in requests])
            depth_of = np.minimum(np.arange(1, k_max + 1), self.tree_depth)
        starts = self._starts(step)
        start_s = starts.seconds
        gains = self._charge_starts(raw_gains, step, starts)
        price = self._prefill_step_price(gains, step, depth_of) if step.view.prefill_tokens else None
        plans = plans_by_depth(gains, caps, depth_of, self.cost.predict, tokens, context, price)
        plan = best_plan(plans) if price is not None else self._shape_probe(plans)
        ks, predicted = list(plan.ks), plan.seconds
        self._probing = set()
        due = [i for i, r in enumerate(requests)
               if ks[i] == 0 and caps[i] > 0 and self.step >= self._probe_due.get(r.request_id, 0)]
        learning = self.acceptance.evidence < self.min_prior_evidence
        worth = self._worth_probing(step, due, raw_gains, gains, depth_of, starts, plan, price, together=learning)
        budget = max(1, int(self.explore_fraction * len(requests)))
        for i in sorted(due, key=lambda i: start_s[i]):  # the cheapest probes first
            # a bounded probe: a request at k = 0 would otherwise never show it improved; once the prior is
            # learned, not one whose catch-up would cost more than a small share of the step (the prior speaks
            # for it)
            r = requests[i]
            if budget and i in worth and (learning or start_s[i] <= self.explore_fraction * predicted):
                ks[i] = 1
                self._probing.add(r.request_id)
                budget -= 1
        if self._probing:
            sum_k = sum(ks)
            predicted = self.cost.predict(tokens + sum_k, context + sum_k, self._depth(max(ks)), sum_k)
        self._chosen_at = {r.request_id: r.num_tokens for r, k in zip(requests, ks) if k}
        return SpecPlan(ks, None, float(predicted + sum(s for s, k in zip(start_s, ks) if k)))

    def _begin_step(self, view: StepView) -> _Step | None:
        """Count the step and see its requests; the step's numbers, or None while the cost model has measured
        nothing."""
        self.step += 1
        for r in (*view.requests, *view.prefilling):
            self.arrivals.see(r.request_id, r.arrival_time)
        self.acceptance.tick(r.request_id for r in view.requests)
        if not self.cost.ready:
            return None
        return _Step(view, self._caps(view), *self._step_shape(view),
                     time.monotonic() if view.now is None else view.now)

    @staticmethod
    def _caps(view: StepView) -> list[int]:
        k_max = view.k_max
        return [max(0, min(k_max, r.max_tokens - r.num_output_tokens - 1,
                           k_max if r.max_speculative_tokens is None else r.max_speculative_tokens))
                for r in view.requests]

    @staticmethod
    def _step_shape(view: StepView) -> tuple[int, int]:
        """The step's tokens and context at k = 0: its decoding requests' last tokens and its prefill chunks."""
        return (view.prefill_tokens + len(view.requests),
                view.prefill_context + sum(r.num_tokens for r in view.requests))

    def _plan_proposers(self, step: _Step) -> SpecPlan:
        """Per request the proposer and k of highest batch goodput (proposer_choice.select_proposers): the lookup
        tree's nodes valued by their calibrated confidences, the draft model's tokens by the request's acceptance
        rate, its catch-up charged as for chains. While the draft's acceptance prior is unlearned, a request the plan
        leaves at k = 0, that the lookups do not serve and whose catch-up is cheap, now and then probes the draft
        model with one token."""
        view, caps, tokens, context = step.view, step.caps, step.tokens, step.context
        requests, k_max, use_draft = view.requests, view.k_max, view.draft_available
        b = len(requests)
        lookup = lookup_gains([node_values(t, self.calibration) for t in view.lookups], k_max)
        draft, start_s = None, np.zeros(b)
        if use_draft:
            starts = self._starts(step)
            start_s = starts.seconds
            draft = self._charge_starts(self.acceptance.gains([r.request_id for r in requests], k_max), step, starts)
        price = None
        if view.prefill_tokens:  # as in _prefill_step_price: drafts must beat the decoding batch's own rate
            alone = select_proposers(draft, lookup, caps, self.cost.predict, b, step.decode_context)
            price = alone.value * (b + max(1, len(view.prefilling))) / b
        plan = select_proposers(draft, lookup, caps, self.cost.predict, tokens, context, price)
        methods, ks = plan.methods, plan.ks
        self._probing = set()
        if use_draft and self.acceptance.evidence < self.min_prior_evidence:
            # a probe costs a draft catch-up (a whole prompt, the first time), and free drafts are there to lose:
            # only for a request the lookups do not serve, and whose catch-up costs a small share of the decoding
            # steps it would be spread over (longer prompts are drafted for once the prior says it pays). Decoding
            # steps alone: beside a prefill chunk the step is long, but the catch-up delays the batch all the same.
            decode_s = float(self.cost.predict(b, step.decode_context))
            due = [i for i, r in enumerate(requests)
                   if ks[i] == 0 and caps[i] > 0 and lookup[i, 0] < 0.5
                   and self.step >= self._probe_due.get(r.request_id, 0)
                   and start_s[i] <= self.explore_fraction * self.catchup_horizon * decode_s]
            if due:
                i = min(due, key=lambda i: start_s[i])
                methods[i], ks[i] = DRAFT, 1
                self._probing.add(requests[i].request_id)
        drafted = [k if m == DRAFT else 0 for m, k in zip(methods, ks)]
        m_all, m_draft = sum(ks), sum(drafted)
        predicted = float(self.cost.predict(tokens + m_all, context + m_all, max(drafted, default=0), m_draft)
                          + sum(s for s, k in zip(start_s, drafted) if k))
        self._chosen_at = {r.request_id: r.num_tokens for r, k in zip(requests, drafted) if k}
        return SpecPlan(ks, methods, predicted)

    def _starts(self, step: _Step) -> _Starts:
        return _Starts(self.cost.predict_draft(0, 0, self._catchup_tokens(step.requests)),
                       self._steps_to_next_arrival(step))

    def _charge_starts(self, gains: np.ndarray, step: _Step, starts: _Starts) -> np.ndarray:
        if not starts.seconds.any():
            return gains
        return charge_start_costs(gains, step.caps, self._start_cost_in_tokens(step, gains, starts))

    def _worth_probing(self, step: _Step, due: list[int], raw_gains: np.ndarray, gains: np.ndarray,
                       depth_of: np.ndarray, starts: _Starts, plan: Plan, price: float | None,
                       together: bool) -> set[int]:
        """The requests in `due` (at k = 0 in the chosen plan) that would draft if their drafts were accepted almost
        surely (the estimator's ceiling), catch-up charged as usual.

        A probe buys evidence of acceptance, and evidence is worth its cost only if it could change a choice:
        where even near-certain acceptance would leave the request at k = 0 (a batch whose verify tokens and draft
        forwards cost more than they add, a catch-up that does not pay), no outcome of the probe could. Without
        this check, probes in large batches on a CPU (where one draft forward is a sizeable share of a step) cost
        more than speculation ever gained there.
        together: while the prior is unlearned, what a probe tests is the proposer, so the due requests are
        optimistic together, in one plan: a draft forward serves the whole batch, so requests that could not pay
        for a depth alone may together (tried one at a time, a fresh policy in a small batch may never probe, and
        never learn that a good pair agrees on almost every token). What runs is still one request's probe, so it
        is run only where it costs less than what that plan would add over the steps the batch is expected to hold
        (_probe_pays). Once the prior is learned, the plan already drafts wherever requests like the rest would pay
        together, and a probe tests one request: it is tried alone on top of the chosen plan, at every draft length
        up to its cap."""
        if not due:
            return set()
        caps, tokens, context = step.caps, step.tokens, step.context
        k_top = raw_gains.shape[1]
        hopeful = np.array(raw_gains, dtype=np.float64, copy=True)
        hopeful[due] = self.acceptance.first.max_alpha ** np.arange(1, k_top + 1)[None, :]
        hopeful = self._charge_starts(hopeful, step, starts)
        j = np.arange(1, k_top + 1)
        m = plan.tokens + j
        t = self.cost.predict(tokens + m, context + m, np.maximum(plan.depth, depth_of), m)  # [K]: j more drafts
        if together:
            hope = best_plan(plans_by_depth(hopeful, caps, depth_of, self.cost.predict, tokens, context, price))
            return {i for i in due if hope.ks[i] > 0
                    and self._probe_pays(hope, plan, raw_gains[i, 0], starts.seconds[i], float(t[0]), price,
                                         starts.horizon_cap)}
        expected = _expected_tokens(gains, plan.ks)  # catch-up charged
        gained = expected + np.cumsum(hopeful[due], axis=1)  # [due, K]
        better = plan_value(gained, t[None, :], price) > plan.value
        better &= j[None, :] <= np.asarray(caps)[due][:, None]
        return {i for i, row in zip(due, better) if row.any()}

    @staticmethod
    def _probe_pays(hope: Plan, plan: Plan, gain: float, start_s: float, probe_s: float, price: float | None,
                    horizon_cap: float) -> bool:
        """Whether what a learning-time probe could reveal is worth what it costs, in tokens. Revealed: the hopeful
        plan's edge over the chosen one, for the steps a catch-up is spread over (the batch is not expected to hold
        longer). Cost: the probe's own seconds (probe_s: the step with one draft token on top of the plan; and its
        catch-up) at the plan's rate, less the token it is expected to add. Beside a prefill, for instance, a
        hopeful plan may beat the plain one by a fraction of a token a step while the probe's catch-up costs many
        tokens of the batch's time: such a probe does not run."""
        rate = plan.value if price is None else price  # tokens a second of this step is worth
        edge = (hope.value - plan.value) * (hope.seconds if price is None else 1.0)
        return edge * horizon_cap > (probe_s - plan.seconds + start_s) * rate - gain

    def _shape_probe(self, plans: list[Plan]) -> Plan:
        """The best plan, or now and then a plan of another draft length that is predicted to lose little.

        The cost model learns only the shapes the policy runs. In steady decoding the context grows with the batch,
        so a policy that always runs one draft length gives the fit no way to tell the cost of a verified token
        from the cost of context, and a fit that puts the cost on the wrong one keeps a draft length that a
        shorter one beats. Where the model's optimum is flat, running a nearby plan costs little by the model's
        own account and gives the fit the shape it lacks; where it is sharp, no plan qualifies and none is run."""
        best = best_plan(plans)
        if (not self.shape_probe_interval or self.step % self.shape_probe_interval or best.depth == 0
                or best.value <= 0):
            return best
        near = [p for p in plans if p.depth > 0 and p.tokens != best.tokens
                and p.value >= (1.0 - self.shape_probe_loss) * best.value]
        if not near:
            return best
        self.shape_probes += 1
        return max(near, key=lambda p: abs(p.tokens - best.tokens))  # the most different shape teaches the most

    def _prefill_step_price(self, gains: np.ndarray, step: _Step, depth_of: np.ndarray) -> float:
        """Tokens per second a draft must add to a step that carries prefill: the goodput the decode batch would
        reach in a step of its own, times the requests this step holds (decoding + prefilling) per decoding
        request. Drafting in such a step makes the prefilling requests wait for tokens that are not theirs."""
        b, held = len(step.requests), len(step.view.prefilling)
        ks, t = select_from_gains(gains, step.caps, depth_of, self.cost.predict, b, step.decode_context)
        expected = _expected_tokens(gains, ks)
        return expected / t * (b + max(1, held)) / b

    def _catchup_tokens(self, requests: list[RequestView]) -> np.ndarray:
        """Per request, the tokens a draft model would read before drafting beyond the one it always reads: all of
        a context it never drafted for, or what the request generated at k = 0 since. (For prompt lookup the fitted
        cost of these tokens is zero.)"""
        return np.array([max(0, r.num_tokens - 1 - self._draft_seen.get(r.request_id, 0)) for r in requests],
                        dtype=np.float64)

    def _start_cost_in_tokens(self, step: _Step, gains: np.ndarray, starts: _Starts) -> np.ndarray:
        """A catch-up is paid once and serves the steps that follow: spread it over the steps the request would
        take to finish while drafting (at most catchup_horizon, since load may turn drafting off again), and price
        its seconds at the decoding batch's goodput without speculation.

        The decoding batch alone, not the step: beside a prefill chunk the step's own goodput is a few tokens a
        second (its time is the prefill's), which would price a catch-up's seconds at a fraction of what they are
        worth and let whole batches start drafting in prefill steps (tested:
        test_a_catch_up_beside_a_prefill_is_priced_at_the_decoding_batch_rate)."""
        requests = step.requests
        capped = np.where(np.arange(1, gains.shape[1] + 1)[None, :] <= np.asarray(step.caps)[:, None], gains, 0.0)
        per_step = 1.0 + capped.sum(axis=1)
        remaining = np.array([max(1, r.max_tokens - r.num_output_tokens) for r in requests], dtype=np.float64)
        horizon = np.clip(remaining / per_step, 1.0, starts.horizon_cap)
        decode_s = float(self.cost.predict(len(requests), sum(r.num_tokens for r in requests)))
        return starts.seconds / horizon * (len(requests) / decode_s)

    def _steps_to_next_arrival(self, step: _Step) -> float:
        """The most steps a catch-up is spread over: catchup_horizon, or fewer where the next arrival is expected
        sooner. Steps are counted at the length of one in which every request drafts its cap (drafting steps are
        the ones a catch-up pays back in); the prior gap is catchup_horizon such steps, so with no arrivals seen
        the bound is catchup_horizon."""
        sum_k = sum(step.caps)
        step_s = max(1e-9, float(self.cost.predict(step.tokens + sum_k, step.context + sum_k,
                                                   self._depth(max(step.caps, default=0)), sum_k)))
        gap = self.arrivals.expected_gap(step.now, self.catchup_horizon * step_s)
        return float(np.clip(gap / step_s, 1.0, self.catchup_horizon))

    def _depth(self, k: int) -> int:
        """Draft forwards that k tokens (chain) or k nodes (tree) take."""
        return k if self.tree_depth is None else min(k, self.tree_depth)

    def prune(self, view: StepView, ks: list[int], trees: list[TokenTree], draft_s: float) -> TreePlan:
        values = [node_values(t, self.calibration) for t in trees]
        if self.tree_gains is not None:
            for r, k, v in zip(view.requests, ks, values):
                if k > 0:  # a request that asked for no tree says nothing about what its trees are worth
                    self.tree_gains.update(r.request_id, v)
        if not self.cost.ready:
            return TreePlan(trees)
        tokens, context = self._step_shape(view)
        return TreePlan(*prune_trees(trees, values, self.cost.predict_verify, tokens, context, draft_s))

    def observe(self, record: StepRecord) -> None:
        for tree, path in record.trees.values():
            self.calibration.observe(tree, path)
        methods = dict(zip(record.request_ids, record.methods)) if record.methods is not None else {}
        for rid, k, proposed, accepted in zip(record.request_ids, record.ks, record.proposed, record.accepted):
            if methods.get(rid, DRAFT) != DRAFT:  # a lookup's outcome went to the calibration above
                continue
            self.acceptance.observe(rid, proposed, accepted)
            if proposed and rid in self._chosen_at:  # the draft fed the context, then its drafts up to the last
                self._draft_seen[rid] = self._chosen_at[rid] + min(accepted, proposed - 1)
            if rid in self._probing:
                # a failed probe waits twice as long for the next; a successful one resets the wait
                wait = self.explore_interval if accepted else min(
                    self.max_explore_interval, 2 * self._probe_wait.get(rid, self.explore_interval))
                self._probe_wait[rid] = wait
                self._probe_due[rid] = self.step + wait
            elif k > 0:
                self._probe_due[rid] = self.step + self._probe_wait.get(rid, self.explore_interval)
        self.observe_cost(record)

    def observe_profile(self, records: list[StepRecord]) -> None:
        for record in records:
            self.observe_cost(record)
        self._refit()
        self.cost.hold_prior()

    def observe_cost(self, record: StepRecord) -> None:
        proposed = record.proposed
        if record.methods is not None:  # only the draft model's tokens cost draft forwards
            proposed = [p for m, p in zip(record.methods, proposed) if m == DRAFT]
        depth = self._depth(max(proposed, default=0))
        self.cost.observe(record.num_batched_tokens, record.num_context_tokens, depth, sum(proposed),
                          record.draft_s, record.total_s - record.draft_s, catchup=record.draft_catchup_tokens,
                          refit=False)
        self._steps_unfit += 1
        self._drafts_unfit |= depth > 0
        if not self.cost.ready or self._steps_unfit >= self.refit_every:
            self._refit()

    def _refit(self) -> None:
        self.cost.refit(draft=self._drafts_unfit)
        self._steps_unfit, self._drafts_unfit = 0, False

    def release(self, request_id: str) -> None:
        self.acceptance.forget(request_id)
        if self.tree_gains is not None:
            self.tree_gains.forget(request_id)
        for d in (self._probe_due, self._probe_wait, self._draft_seen, self._chosen_at):
            d.pop(request_id, None)
        self.arrivals.release(request_id)

    # ---- state shared across replicas ----------------------------------------------------------------------
    def export_state(self) -> dict:
        return {"key": self.key, "prior": self.acceptance.export_counts(), **self._acceptance_stats(),
                "cost": self.cost.export_state(), "steps": self.step,
                "calibration": self.calibration.export_state()}

    def import_state(self, state: dict) -> None:
        """Adopt other replicas' merged state: their acceptance evidence joins this one's own (which stays apart,
        so exporting never sends others' evidence back); their cost fit is used until this one has its own."""
        if state.get("key") == self.key and "prior" in state:
            self.acceptance.import_counts(state["prior"])
            if state.get("calibration"):
                self.calibration.import_state(state["calibration"])
        if state.get("cost"):
            self.cost.import_state(state["cost"])

    def request_speed(self, batch_sizes: list[int], context: int, k_max: int) -> dict[int, float] | None:
        """From the fitted step cost and the shared acceptance prior: per batch size b, the best over a common k of
        a request's expected tokens per step, 1 + a1 (1 + a2 + ... + a2^(k-1)), over the predicted time of a step
        of b such requests. A small batch can afford a larger k, so its request speed rises by more than the
        step's time falls."""
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

    def _acceptance_stats(self) -> dict:
        first, later = self.acceptance.first, self.acceptance.later
        return {"alpha_prior": first.prior, "alpha_prior_later": later.prior, "prior_strength": first.prior_strength}

    def stats(self) -> dict:
        return {**self._acceptance_stats(), "cost_coefficients": self.cost.v,
                "draft_coefficients": self.cost.d, "fits_refused": self.cost.refused,
                "mean_relative_error": self.cost.mean_relative_error, "steps": self.step,
                "shape_probes": self.shape_probes}

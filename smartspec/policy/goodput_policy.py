"""The goodput policy (configured as "smartspec"): per request, per step, the k that maximises the batch's goodput.
Its parts:

- acceptance (alpha_i): per request, first and later draft tokens apart, shrunk toward a prior per proposer
  (`ChainAcceptance`); token trees use calibrated node confidences instead (`TreeGains`, `NodeCalibration`).
- step cost (T): `StepCostModel`, fed every step and refitted every `refit_every` steps (`CostFeed`), seeded
  by the engine's warm-up profile.
- selection: exact, per depth bound (`goodput.plans_by_depth`); k = 0 is always a candidate, so a step is
  never planned to be slower than plain decoding. Where no plan could pay (`drafting_bound`) none is computed;
  a plan that keeps coming out the same is held for a few steps before the next full plan (`PlanHold`).
- prices: a step that carries prefill keeps only drafts that beat the decoding batch's own rate
  (`chain_plan.prefill_step_price`); a draft model's catch-up is charged once, spread over the steps it serves
  (`CatchupLedger`).
- learning: bounded exploration probes for requests at k = 0 (`Exploration`), now and then a nearby draft
  length the cost fit has not seen (`chain_plan.shape_probe`), and while nothing drafts, a draft token now and
  then that checks the draft's price (`DraftPriceCheck`).
- what routing and autoscaling read (`load`, `FittedLoad`) and what replicas share (`shared`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace
from itertools import compress

import numpy as np

from smartspec.policy.acceptance import ChainAcceptance
from smartspec.policy.base import Policy, SharedEvidence
from smartspec.policy.catchup import CatchupLedger
from smartspec.policy.chain_plan import prefill_step_price, shape_probe
from smartspec.policy.cost_feed import CostFeed
from smartspec.policy.cost_model import SEGMENT_EDGES, StepCostModel
from smartspec.policy.exploration import ChainStep, Exploration, worth_probing
from smartspec.policy.drafting_bound import BoundShape, drafting_pays_above
from smartspec.policy.goodput import Plan, best_plan, plans_by_depth
from smartspec.policy.load_model import FittedLoad
from smartspec.policy.plan_hold import DEPTH_TOLERANCE, NO_DRAFTS, AheadPlan, HeldPlan, HeldRule, PlanHold
from smartspec.policy.price_check import DraftPriceCheck
from smartspec.policy.proposer_choice import lookup_gains, select_proposers
from smartspec.policy.step_numbers import StepNumbers, shape_of
from smartspec.policy.tree_goodput import NodeCalibration, TreeGains, node_values, prune_trees
from smartspec.types.plan import DRAFT, SpecPlan, StepView, TreePlan
from smartspec.types.step_record import StepRecord
from smartspec.types.tree import TokenTree


PROBE_SPREAD_STEPS = 8  # the decoding steps a learning probe's catch-up is weighed against (_probe_draft)


@dataclass(frozen=True)
class GoodputOptions:
    """The goodput policy's tunables (`speculative_config["policy_options"]`; docs/policy.md explains each)."""
    prior_alpha: float = 0.5  # the acceptance prior before any outcome
    explore_interval: int = 16  # exploration probes of requests at k = 0 (Exploration)
    explore_fraction: float = 0.1
    max_explore_interval: int = 256
    catchup_horizon: float = 32.0  # the most steps a draft's catch-up is spread over (CatchupLedger)
    min_prior_evidence: float = 32.0
    # at most once every shape_probe_interval steps, at a full plan of a decode step, the plan of another draft
    # length whose predicted goodput is within shape_probe_loss of the best (chain_plan.shape_probe); 0: never
    shape_probe_interval: int = 8
    shape_probe_loss: float = 0.1
    refit_every: int = 4  # steps between two fits of the cost model, at least (CostFeed)

    def __post_init__(self) -> None:
        if not (isinstance(self.shape_probe_interval, int) and self.shape_probe_interval >= 0
                and 0 <= self.shape_probe_loss < 1):
            raise ValueError(f"shape_probe_interval must be an integer >= 0 and shape_probe_loss in [0, 1): got "
                             f"{self.shape_probe_interval!r}, {self.shape_probe_loss!r}")

    @classmethod
    def of(cls, options: dict | None) -> GoodputOptions:
        """From a configuration's dict, an unknown name refused by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options or {}) - known)
        if unknown:
            raise ValueError(f"unknown policy_options {unknown}; known: {sorted(known)}")
        return cls(**(options or {}))


class GoodputPolicy(Policy):
    """Chooses k_i in {0..K} for every decoding request so as to maximise the batch's goodput,

        goodput(k) = sum_i g(k_i, alpha_i) / T(k),    g(k, a) = 1 + a + ... + a^k,

    the tokens the step is expected to generate per second of step time (its parts: the module's docstring).
    docs/policy.md explains each part and links the evidence. Its tunables: GoodputOptions
    (`speculative_config["policy_options"]`)."""

    name = "smartspec"
    wants_profile = True  # the engine seeds the cost model with a short warm-up profile

    def __init__(self, key: str = "default", tree_depth: int | None = None, options: GoodputOptions | None = None,
                 **named: float) -> None:
        """key: the proposer and model pair (acceptance priors are shared only between equal keys); tree_depth:
        token trees this deep (k is then a node budget); options: the tunables (GoodputOptions), or given by name."""
        o = self.options = options if options is not None else GoodputOptions(**named)
        self.key = key
        self.prior_alpha = o.prior_alpha
        self.acceptance = ChainAcceptance(prior_alpha=o.prior_alpha)
        # token trees (k is a node budget, trees this deep): node values from calibrated draft confidence
        self.tree_depth = tree_depth
        self.calibration = NodeCalibration()
        self.tree_gains: TreeGains | None = None
        self.cost = StepCostModel()
        self.cost_feed = CostFeed(self.cost, o.refit_every, self._depth)
        self.exploration = Exploration(o.explore_interval, o.explore_fraction, o.max_explore_interval,
                                       o.min_prior_evidence)
        self.catchup = CatchupLedger(o.catchup_horizon)
        self.shape_probe_interval, self.shape_probe_loss, self.shape_probes = \
            o.shape_probe_interval, o.shape_probe_loss, 0
        self.last_shape_probe = 0  # the step of the last one
        self.draft_check = DraftPriceCheck()
        self.drafted_last = False  # whether the last chain plan drafted (plan: when the bound is worth trying)
        self.plan_hold = PlanHold()  # a plan that keeps coming out the same is planned in full only now and then
        self.pays_above: dict[tuple, float] = {}  # the bound's context, per batch shape and cost fit
        self.step = 0
        # requests released since the last observe: a step's record still names those that finished in it, and
        # their outcomes must not give them state again (it would be kept for good)
        self.left: set[str] = set()
        self.ahead: dict[bool, AheadPlan] = {}  # the next step's full plans (beside prefill or not), made ahead
        self.planned_ahead = 0  # such plans, in all (stats)
        self.load = FittedLoad(self.cost, self.acceptance)
        self.shared = GoodputEvidence(self)

    # ---- plan ---------------------------------------------------------------------------------------------------
    def plan(self, view: StepView) -> SpecPlan:
        """One entry point: chains and trees of one proposer (a k per request), or, where the view holds lookups,
        the proposer and k per request."""
        self.step += 1
        now = time.monotonic() if view.now is None else view.now
        self.catchup.see(view, now)
        self.acceptance.tick()
        if not self.cost.ready:  # nothing measured yet: plain decoding is the one safe plan
            return SpecPlan.none(view)
        step = StepNumbers.of(view, now)
        if view.lookups is not None:
            return self._plan_proposers(step)
        prefilling = bool(view.prefill_tokens)  # such a step prices drafts otherwise, and holds a plan apart
        ahead = self.ahead.get(prefilling)
        self.ahead = {}
        if ahead is not None and ahead.at != self.step:  # made beside a step that no step followed at once
            ahead = None
        if self.tree_depth is None:
            if ahead is not None and ahead.ids == step.ids:
                return self._plan_ahead_taken(step, ahead.plan)
            if self.plan_hold.holds_no_drafts(self.step, prefilling, view.requests.ids, len(view.requests)):
                if ahead is None:
                    return self._plan_none(step)
                held = HeldPlan([0] * len(step.ids), [], NO_DRAFTS)  # and the probes the plan made ahead ran
            else:
                held = self.plan_hold.held_plan(self.step, step.ids, prefilling)
            if held is not None:
                if ahead is not None:
                    return self._plan_held(step, ahead.overlaid(held, step.ids), prefilling, ahead.plan.probes)
                return self._plan_held(step, held, prefilling)
            if not self.drafted_last and self._nothing_can_pay(step):
                self.plan_hold.planned(self.step, step.ids, prefilling, [0] * len(step.ids), NO_DRAFTS)
                return self._plan_none(step)
        return self._plan_in_full(step, self.step, prefilling)

    def _plan_in_full(self, step: StepNumbers, at: int, prefilling: bool) -> SpecPlan:
        """The full plan for the policy's step `at`, held from then on (PlanHold) unless it is a shape probe."""
        shape_probes = self.shape_probes
        plan, planned_ks, rule = self._plan_chains(step, at)
        self.drafted_last = any(planned_ks)
        if self.tree_depth is None and self.shape_probes == shape_probes:
            # a shape probe is one step's detour, not what the hold compares
            self.plan_hold.planned(at, step.ids, prefilling, planned_ks, rule)
        return plan

    def plan_ahead(self, view: StepView) -> None:
        """Beside this step's forward (engine/step_observer.py), what the next step would otherwise plan before its
        own forward. Where the hold of a drafting plan runs out there, the full plan is made now on this step's
        requests (one step shorter), and is the next step's: taken as it is where its requests are these, or held
        (those gone dropped, those joined planned by its rule) where they changed. The requests whose prompt this
        step completes join the next step: where a drafting plan holds there, its rule plans them now. Both for the
        next step decoding alone (this step's prefill chunks end here) and, where this step carries prefill, for a
        next step that does too (a loaded replica's steps mostly do), priced as this one. On a GPU that work then
        costs a step nothing where the forward takes longer; on a CPU it costs what it would have a step later."""
        at = self.step + 1
        if self.tree_depth is not None or view.lookups is not None or not self.cost.ready:
            return
        now = time.monotonic() if view.now is None else view.now
        alone = replace(view, prefill_tokens=0, prefill_context=0, prefilling=[]) if view.prefill_tokens else view
        for prefilling, like in ((False, alone), (True, view))[:2 if view.prefill_tokens else 1]:
            ids = like.requests.ids
            if ids and self.plan_hold.plans_in_full(at, prefilling, ids):
                step = StepNumbers.of(like, now)
                if self.drafted_last or not self._nothing_can_pay(step):  # else the next step's bound says so
                    self.ahead[prefilling] = AheadPlan(at, step.ids, self._plan_in_full(step, at, prefilling))
                    self.planned_ahead += 1
            rule = self.plan_hold.rule_held_at(at, prefilling)
            if view.joining is not None and rule is not None:
                step = StepNumbers.of(replace(like, requests=like.requests.joined(view.joining), joining=None), now)
                rows = list(range(len(like.requests), len(step.ids)))
                self.plan_hold.adopt(prefilling, [step.ids[i] for i in rows], self._newcomer_ks(step, rows, rule)[0])

    def _plan_ahead_taken(self, step: StepNumbers, plan: SpecPlan) -> SpecPlan:
        """The plan made beside the last step's forward, for the same requests, within today's caps."""
        ks = list(map(min, plan.ks, step.caps))
        if ks == plan.ks:
            return plan
        sum_k, depth = sum(ks), max(ks, default=0)
        predicted = float(self.cost.predict(step.forward_tokens(sum_k, depth), step.context + sum_k, depth, sum_k))
        return SpecPlan(ks, None, predicted, [rid for rid, k in zip(step.ids, ks) if k and rid in plan.probes])

    def _nothing_can_pay(self, step: StepNumbers, alpha: float | None = None) -> bool:
        """Whether no plan could pay were every draft accepted at `alpha` (drafting_bound): by default the
        estimator's ceiling, where the exact plan and every probe it could run are then surely no speculation.
        Tried so only after a step that drafted nothing: where the last plan drafted, this one most likely does
        too, and the bound would be host time on top of the full plan."""
        context = step.decode_context if step.view.prefill_tokens else step.context
        return context <= self._pays_above(step, self.acceptance.first.max_alpha if alpha is None else alpha)

    def _plan_of_no_drafts(self, step: StepNumbers, ceiling: float, at: int) -> tuple[SpecPlan, list[int]] | None:
        """The full plan where, on this step's estimates, it is surely no speculation and no learning probe: no plan
        could pay were every draft accepted at the batch's highest estimate (`ceiling`; catch-ups only lower what
        drafts add), the prior is learned, and no request due a probe has a catch-up within its share of the plain
        step (_probe_chains). The plan the full selection makes there, the draft's price checked as it would be,
        without its catch-up charges, depth bounds and probes (a loaded batch at k = 0 is planned so every few
        dozen steps, at a millisecond or two of host time each); None where it may draft."""
        explore = self.exploration
        if explore.learning(self.acceptance.evidence):
            return None
        start_s = self.catchup.starts_seconds(step, self.cost)
        plain_s = float(self.cost.predict(step.forward_tokens(0, 0), step.context, 0, 0))
        ks = [0] * len(step.ids)
        due = explore.due_rows(step.ids, ks, step.caps, at)
        # the cheaper test first: where a probe is affordable the bound would be work on top of the full plan
        if due and (start_s[due] <= explore.fraction * plain_s).any() or not self._nothing_can_pay(step, ceiling):
            return None
        if self._check_draft_price(step, ks, start_s, at):
            plain_s = self.cost.predict(step.forward_tokens(1, 1), step.context + 1, self._depth(1), 1)
        return SpecPlan(ks, None, float(plain_s + sum(compress(start_s.tolist(), ks)))), [0] * len(ks)

    def _pays_above(self, step: StepNumbers, alpha: float) -> float:
        """drafting_bound.drafting_pays_above for this step, kept per batch shape and cost fit: a loaded batch's
        steps differ in their context alone, and between fits (cost_feed) one answer serves them all. Beside
        prefill the step's tokens past the last kink change no answer, and are keyed as one."""
        view = step.view
        prefilling = max(1, len(view.prefilling)) if view.prefill_tokens else 0
        tokens = min(step.tokens, int(SEGMENT_EDGES[-1])) if prefilling else step.tokens
        key = (view.k_max, len(view.requests), prefilling, tokens, view.shapes, alpha, tuple(self.cost.v),
               tuple(self.cost.d))
        above = self.pays_above.get(key)
        if above is None:
            if len(self.pays_above) >= 64:  # batch shapes of fits gone by
                self.pays_above.clear()
            shape = BoundShape(view.k_max, len(view.requests), tokens, prefilling, step.padded_tokens)
            above = self.pays_above[key] = drafting_pays_above(shape, alpha, self.cost.predict,
                                                               self.cost.context_slope, SEGMENT_EDGES)
        return above

    def _plan_none(self, step: StepNumbers) -> SpecPlan:
        """No speculation, where no plan could pay (_nothing_can_pay): nor could any probe's outcome make
        one pay. Only the draft's price is checked now and then, at one token."""
        ks = [0] * len(step.requests)
        if not self.draft_check.is_due(self.step) or not self._check_draft_price(
                step, ks, self.catchup.starts_seconds(step, self.cost), self.step):
            return SpecPlan(ks, None, float(self.cost.predict(step.forward_tokens(0, 0), step.context)))
        return SpecPlan(ks, None, float(self.cost.predict(step.forward_tokens(1, 1), step.context + 1, 1, 1)))

    def _plan_held(self, step: StepNumbers, held: HeldPlan, prefilling: bool, probes: list[str] = ()) -> SpecPlan:
        """The last full plan's draft lengths again, within today's caps, and a newcomer's by the plan's rule, held
        from then on with the plan's (PlanHold); no speculation with the draft's price checked as in _plan_none.
        probes: the requests whose k is a learning probe (a plan made ahead, AheadPlan.overlaid)."""
        ks, start_s = list(map(min, held.ks, step.caps)), 0.0
        if held.newcomers:
            newcomer_ks, seconds = self._newcomer_ks(step, held.newcomers, held.rule)
            self.plan_hold.adopt(prefilling, [step.ids[i] for i in held.newcomers], newcomer_ks)
            for i, k, s in zip(held.newcomers, newcomer_ks, seconds.tolist()):
                ks[i] = k
                start_s += s if k else 0.0
        if not any(ks):
            return self._plan_none(step)
        sum_k, depth = sum(ks), max(ks)
        return SpecPlan(ks, None, float(self.cost.predict(step.forward_tokens(sum_k, depth), step.context + sum_k,
                                                          depth, sum_k)) + start_s,
                        [rid for rid, k in zip(step.ids, ks) if k and rid in probes] if probes else [])

    def _newcomer_ks(self, step: StepNumbers, rows: list[int], rule: HeldRule) -> tuple[list[int], np.ndarray]:
        """The draft lengths of requests a held plan did not plan: of each one's gains, its catch-up charged as in
        a full plan, the prefix that beats the rule's threshold, no deeper than the plan; and their catch-ups'
        seconds. (Gains once charged fall with depth within a request's cap: goodput.charge_start_costs.)"""
        gains, seconds = self.catchup.charge_rows(self.acceptance.gains([step.ids[i] for i in rows], step.view.k_max),
                                                  step, rows, self.cost, self._depth)
        caps = [min(step.caps[i], rule.depth) for i in rows]
        return [int(np.count_nonzero(g[:cap] >= rule.threshold)) for g, cap in zip(gains, caps)], seconds

    def _held_rule(self, step: StepNumbers, plan: Plan, price: float | None, padded,
                   by_depth: list[Plan]) -> HeldRule:
        """How `plan` would plan one more request (PlanHold): a draft token is kept where its gain beats the
        plan's rate (its goodput, or the price of a step beside prefill) times the seconds one more draft token
        adds to the plan's step; and the other depths of `by_depth` (this step's plans by depth, in goodput) whose
        plans came within DEPTH_TOLERANCE of it."""
        if plan.depth == 0:
            return NO_DRAFTS
        m, depth = plan.tokens, plan.depth
        tokens = (lambda n: step.tokens + n) if padded is None else (lambda n: padded(n, depth))
        added = float(self.cost.predict(tokens(m + 1), step.context + m + 1, depth, m + 1)) - float(
            self.cost.predict(tokens(m), step.context + m, depth, m))
        near = frozenset(p.depth for p in by_depth
                         if 0 < p.depth != depth and p.value >= (1 - DEPTH_TOLERANCE) * plan.value > 0)
        return HeldRule((plan.value if price is None else price) * added, depth, near)

    def _plan_chains(self, step: StepNumbers, at: int) -> tuple[SpecPlan, list[int], HeldRule]:
        """k per request for one proposer: draft tokens of a chain, or a tree's node budget; the plan's draft
        lengths before learning probes, and how it would plan a request that joins while it is held. at: the policy's
        step the plan is for (plan_ahead's is the next one)."""
        k_max = step.view.k_max
        if self.tree_depth is None:
            raw_gains, ceiling = self.acceptance.gains_and_ceiling(step.ids, k_max)
            if (no_drafts := self._plan_of_no_drafts(step, ceiling, at)) is not None:
                return (*no_drafts, NO_DRAFTS)
            depth_of = np.arange(1, k_max + 1)
        else:
            if self.tree_gains is None or self.tree_gains.k_max != k_max:
                self.tree_gains = TreeGains(k_max, self.prior_alpha)
            raw_gains = np.stack([self.tree_gains.curve(rid) for rid in step.ids])
            depth_of = np.minimum(np.arange(1, k_max + 1), self.tree_depth)
        starts = self.catchup.starts(step, self.cost, self._depth, raw_gains)
        gains = self.catchup.charge(raw_gains, step, starts, self.cost)
        price = prefill_step_price(gains, step, depth_of, self.cost.predict) if step.view.prefill_tokens else None
        padded = step.padded_tokens if self.tree_depth is None else None  # a tree row is as wide as its nodes
        plans = plans_by_depth(gains, step.caps, depth_of, self.cost.predict, step.tokens, step.context, price,
                               padded)
        if price is not None:
            plan = best_plan(plans)
        else:
            due = self.shape_probe_interval and at - self.last_shape_probe >= self.shape_probe_interval
            plan, probed = shape_probe(plans, due, self.shape_probe_loss)
            if probed:
                self.shape_probes, self.last_shape_probe = self.shape_probes + 1, at
        ks, probes = self._probe_chains(ChainStep(step, raw_gains, gains, depth_of, starts, price, padded),
                                        list(plan.ks), plan, at)
        checked = not any(ks) and self._check_draft_price(step, ks, starts.seconds, at)
        predicted = plan.seconds
        if probes or checked:
            sum_k = sum(ks)
            tokens = step.forward_tokens(sum_k, max(ks)) if self.tree_depth is None else step.tokens + sum_k
            predicted = self.cost.predict(tokens, step.context + sum_k, self._depth(max(ks)), sum_k)
        rule = self._held_rule(step, plan, price, padded, plans if price is None else []) \
            if self.tree_depth is None else NO_DRAFTS
        return (SpecPlan(ks, None, float(predicted + sum(compress(starts.seconds.tolist(), ks))), probes),
                plan.ks, rule)

    def _probe_chains(self, chain: ChainStep, ks: list[int], plan: Plan, at: int) -> tuple[list[int], list[str]]:
        """The plan's ks with k = 1 for the requests that probe this step, and those requests: due, worth it,
        within the budget, the cheapest catch-ups first; once the prior is learned, not one whose catch-up costs
        more than a small share of the step (the prior speaks for it). Judged together (worth_probing) while the
        prior is unlearned and wherever the plan drafts nothing: there one request alone never pays a draft forward."""
        explore, probes, step, start_s = self.exploration, [], chain.step, chain.starts.seconds
        due = explore.due_rows(step.ids, ks, step.caps, at)
        learning = explore.learning(self.acceptance.evidence)
        # once the prior is learned, only a catch-up within a share of the step may probe: with none, nothing to weigh
        affordable = start_s[due] <= explore.fraction * plan.seconds
        if not learning and not affordable.any():
            return ks, probes
        worth = worth_probing(chain, due, plan, learning or plan.depth == 0, self.acceptance.first.max_alpha,
                              lambda g: self.catchup.charge(g, step, chain.starts, self.cost), self.cost.predict)
        budget = explore.budget(len(step.ids))
        cheapest_first = np.argsort(start_s[due], kind="stable")
        for i, cheap in zip(np.asarray(due, dtype=np.int64)[cheapest_first].tolist(),
                            affordable[cheapest_first].tolist()):
            if not budget:
                break
            if i in worth and (learning or cheap):
                ks[i] = 1
                probes.append(step.ids[i])
                budget -= 1
        return ks, probes

    def _check_draft_price(self, step: StepNumbers, ks: list[int], start_s: np.ndarray, at: int,
                           methods: list[str] | None = None) -> bool:
        """Where a plan drafts nothing with the draft model and its price is due a check (DraftPriceCheck), one
        draft token for the request whose catch-up is cheapest among those the plan leaves at k = 0 (ks and
        methods changed in place); whether one runs."""
        if not self.draft_check.is_due(at) or self.cost.predict_draft(1, 1) <= 0:
            return False  # not due, or a proposer without forwards (prompt lookup): no price to check
        rows = [i for i, cap in enumerate(step.caps) if cap > 0 and ks[i] == 0]
        if not rows:
            return False
        i = min(rows, key=lambda i: start_s[i])
        ks[i] = 1
        if methods is not None:
            methods[i] = DRAFT
        self.draft_check.ran(at)
        return True

    def _plan_proposers(self, step: StepNumbers) -> SpecPlan:
        """Per request the proposer and k of highest batch goodput (proposer_choice.select_proposers): the lookup
        tree's nodes valued by their calibrated confidences, the draft model's tokens by the request's acceptance
        rate, its catch-up charged as for chains."""
        view, caps, b = step.view, step.caps, len(step.requests)
        lookup = lookup_gains([node_values(t, self.calibration) for t in view.lookups], view.k_max)
        draft, start_s = None, np.zeros(b)
        if view.draft_available:
            draft = self.acceptance.gains(step.ids, view.k_max)
            starts = self.catchup.starts(step, self.cost, self._depth, draft)
            start_s = starts.seconds
            draft = self.catchup.charge(draft, step, starts, self.cost)
        price = None
        if view.prefill_tokens:  # as in prefill_step_price: drafts must beat the decoding batch's own rate
            alone = select_proposers(draft, lookup, caps, self.cost.predict, b, step.decode_context)
            price = alone.value * (b + max(1, len(view.prefilling))) / b
        plan = select_proposers(draft, lookup, caps, self.cost.predict, step.tokens, step.context, price)
        methods, ks = plan.methods, plan.ks
        probes = self._probe_draft(step, methods, ks, lookup, start_s)
        if view.draft_available and not view.prefill_tokens and not any(k for m, k in zip(methods, ks) if m == DRAFT):
            self._check_draft_price(step, ks, start_s, self.step, methods)
        drafted = [k if m == DRAFT else 0 for m, k in zip(methods, ks)]
        m_all, m_draft = sum(ks), sum(drafted)
        predicted = float(self.cost.predict(step.tokens + m_all, step.context + m_all, max(drafted, default=0),
                                            m_draft) + sum(compress(start_s.tolist(), drafted)))
        return SpecPlan(ks, methods, predicted, probes)

    def _probe_draft(self, step: StepNumbers, methods: list[str], ks: list[int], lookup: np.ndarray,
                     start_s: np.ndarray) -> list[str]:
        """While the draft's acceptance prior is unlearned, one request the plan leaves at k = 0 probes the draft
        model with one token (methods and ks changed in place; the prober returned): a request the lookups do not
        serve, whose catch-up costs at most `explore_fraction` of PROBE_SPREAD_STEPS decoding steps (longer prompts
        are drafted for once the prior says it pays: a probe buys one outcome, not a request's drafting). Decoding
        steps alone: beside a prefill chunk the step is long, but the catch-up delays the batch all the same."""
        explore = self.exploration
        if not step.view.draft_available or not explore.learning(self.acceptance.evidence):
            return []
        decode_s = float(self.cost.predict(len(step.requests), step.decode_context))
        due = [i for i, r in enumerate(step.requests)
               if ks[i] == 0 and step.caps[i] > 0 and lookup[i, 0] < 0.5 and explore.is_due(r.request_id, self.step)
               and start_s[i] <= explore.fraction * PROBE_SPREAD_STEPS * decode_s]
        if not due:
            return []
        i = min(due, key=lambda i: start_s[i])
        methods[i], ks[i] = DRAFT, 1
        return [step.requests[i].request_id]

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
        tokens, context = shape_of(view)
        return TreePlan(*prune_trees(trees, values, self.cost.predict_verify, tokens, context, draft_s))

    # ---- observe ------------------------------------------------------------------------------------------------
    def observe(self, record: StepRecord) -> None:
        for tree, path in record.trees.values():
            self.calibration.observe(tree, path)
        if len(record.num_tokens) != len(record.request_ids):
            raise ValueError(f"StepRecord.num_tokens holds {len(record.num_tokens)} lengths for "
                             f"{len(record.request_ids)} decoding requests")
        probes, methods, left = set(record.probes), record.methods, self.left
        # a lookup's outcome went to the calibration above; a request that neither drafted nor probed has no outcome
        # (most of a loaded batch: left out before anything is done per request, all of it where none drafted)
        rows = [i for i, (rid, k, proposed) in enumerate(zip(record.request_ids, record.ks, record.proposed))
                if (k or proposed or rid in probes) and (methods is None or methods[i] == DRAFT)
                and rid not in left] if probes or any(record.ks) or any(record.proposed) else []
        left.clear()
        if rows:
            ids = [record.request_ids[i] for i in rows]
            proposed, accepted = [record.proposed[i] for i in rows], [record.accepted[i] for i in rows]
            self.catchup.observed(ids, [record.num_tokens[i] for i in rows], proposed, accepted)
            self.exploration.observed(ids, [record.ks[i] for i in rows], accepted, self.step, probes)
            self.acceptance.observe_step(ids, proposed, accepted)
        draft_ratio = self.cost_feed.observe(record)
        if draft_ratio is not None and not self.draft_check.measured(self.step, draft_ratio):
            self.cost_feed.refit()  # the draft's price was wrong: plan the next step on the step just measured

    def observe_profile(self, records: list[StepRecord]) -> None:
        self.cost_feed.observe_profile(records)

    def observe_calibration(self, records: list[StepRecord]) -> None:
        for record in records:
            for proposed, accepted in zip(record.proposed, record.accepted):
                self.acceptance.calibrate(proposed, accepted)

    def observe_lookup_calibration(self, replayed: list[tuple[TokenTree, list[int]]]) -> None:
        for tree, path in replayed:
            self.calibration.observe(tree, path)

    def release(self, request_id: str) -> None:
        self.left.add(request_id)
        self.acceptance.forget(request_id)
        if self.tree_gains is not None:
            self.tree_gains.forget(request_id)
        self.exploration.release(request_id)
        self.catchup.release(request_id)

    def stats(self) -> dict:
        return {**self.shared.acceptance_stats(), "cost_coefficients": self.cost.v, "draft_coefficients": self.cost.d,
                "fits_refused": self.cost.refused, "mean_relative_error": self.cost.mean_relative_error,
                "steps": self.step, "planned_ahead": self.planned_ahead, "shape_probes": self.shape_probes,
                "speed_changes": self.cost.speed_changes,
                "draft_price_checks": self.draft_check.checks, "plans_held": self.plan_hold.held}


class GoodputEvidence(SharedEvidence):
    """The goodput policy's evidence shared across replicas (merged by replica_state.merge_states): acceptance
    counts, node calibration and the cost fit."""

    def __init__(self, policy: GoodputPolicy) -> None:
        self.policy = policy

    def export_state(self) -> dict:
        p = self.policy
        return {"key": p.key, "prior": p.acceptance.export_counts(), **self.acceptance_stats(),
                "cost": p.cost.export_state(), "steps": p.step, "calibration": p.calibration.export_state()}

    def import_state(self, state: dict) -> None:
        """Adopt other replicas' merged state: their acceptance evidence joins this one's own (which stays apart,
        so exporting never sends others' evidence back); their cost fit is used until this one has its own."""
        p = self.policy
        if state.get("key") == p.key and "prior" in state:
            p.acceptance.import_counts(state["prior"])
            if state.get("calibration"):
                p.calibration.import_state(state["calibration"])
        if state.get("cost"):
            p.cost.import_state(state["cost"])

    def acceptance_stats(self) -> dict:
        first, later = self.policy.acceptance.first, self.policy.acceptance.later
        return {"alpha_prior": first.prior, "alpha_prior_later": later.prior, "prior_strength": first.prior_strength}

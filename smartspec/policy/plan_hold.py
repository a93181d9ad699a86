"""How often a batch is planned in full.

A full plan (estimates, catch-ups, every depth, probes) costs the host from a fraction of a millisecond at one
request to a millisecond or more at hundreds, which on a GPU is a sizeable share of a step, and in steady decoding it
keeps coming out the same: the same draft lengths for the same requests, or no speculation for a loaded batch. So a
plan that comes out as the last one did is held for twice as many steps as the last (1, 2, 4, up to `max_hold`), the
steps in between running it again; one that comes out differently plans every step again. Learning probes
(exploration, shape probes) run in full plans alone, so a held batch probes at most `max_hold` steps late.

A loaded batch changes nearly every step (a request finishes, another joins), so a plan is held for the requests it
planned, and a request that joined since (a newcomer) is planned alone by the held plan's rule (`HeldRule`): the
exact selection keeps a draft token where its gain beats the plan's rate times what one more token adds to the step,
and a newcomer gets the draft tokens that beat that threshold, no deeper than the plan. A batch in which more than
`max_newcomers` of the requests are new plans in full. A newcomer is planned by the rule once, on the first step
it is held in, and its draft length is then held with the plan's (`adopt`), as the planned requests' are: asked
again every step, the rule gave the same answer (the newcomer's estimate and catch-up change only once it drafts)
at the cost of its estimates, a third of a held step's host time in a closed loop of 16 streams. Steps that carry a
prefill chunk price drafts otherwise
(chain_plan.prefill_step_price), so they keep a held plan of their own. What holding can cost is bounded: a change
that would make another plan pay (a request's acceptance drifts, the load falls) is acted on at most `max_hold`
steps late. No speculation is held up to `IDLE_HOLDS` times longer, while the batch keeps all but `IDLE_SHRINK` of
the requests it was planned for and few of them are new: what would make a loaded batch draft is mostly the load
falling, and that shows at once in the batch; a loaded GPU's batch, kept at k = 0 by its requests' catch-ups where
the cheap bound cannot see them (drafting_bound), was otherwise planned in full every few steps."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from smartspec.types.plan import SpecPlan


@dataclass(frozen=True)
class HeldRule:
    """What a newcomer's draft tokens must beat: `threshold`, in expected tokens a draft token adds; and the depth
    of the plan, which no newcomer exceeds (a deeper draft would lengthen every request's step). near: the other
    draft depths whose best plans were predicted within DEPTH_TOLERANCE of this plan's value."""
    threshold: float
    depth: int
    near: frozenset[int] = frozenset()


NO_DRAFTS = HeldRule(float("inf"), 0)
RULE_TOLERANCE = 0.1  # thresholds this close (relative) make the same plan (PlanHold.planned)
DEPTH_TOLERANCE = 0.01  # plans of two depths worth this close (relative) make the same plan too
IDLE_HOLDS = 2  # no speculation is held up to this many times max_hold, while the batch does not shrink ...
IDLE_SHRINK = 1 / 8  # ... by more than this share: a loaded batch loses a request or two between arrivals


@dataclass(frozen=True)
class HeldPlan:
    """A step's draft lengths from a held plan: every row's k (newcomers' 0), the rows that are newcomers, and the
    rule that plans them."""
    ks: list[int]
    newcomers: list[int]
    rule: HeldRule


@dataclass
class _Held:
    hold: int = 0  # steps the last full plan holds for (0: plan every step)
    next_plan: int = 0  # the step of the next full plan
    ks: dict[str, int] = field(default_factory=dict)  # the last full plan's draft length per request
    adopted: dict[str, int] = field(default_factory=dict)  # and its newcomers', as the rule planned them (adopt)
    rule: HeldRule = NO_DRAFTS
    rows: int = 0  # the requests it planned
    planned_at: int = 0  # its step

    @property
    def drafts(self) -> bool:
        return self.rule.depth > 0


class PlanHold:
    def __init__(self, max_hold: int = 16, max_newcomers: float = 0.25) -> None:
        if not (isinstance(max_hold, int) and max_hold >= 1 and 0 <= max_newcomers < 1):
            raise ValueError(f"max_hold must be an integer >= 1 and max_newcomers in [0, 1): got {max_hold!r}, "
                             f"{max_newcomers!r}")
        self.max_hold, self.max_newcomers = max_hold, max_newcomers
        self._by_prefill = {False: _Held(), True: _Held()}  # steps beside a prefill chunk apart
        self.held = 0  # steps held, in all (stats)

    def holds_no_drafts(self, step: int, prefilling: bool, ids: Iterable[str], rows: int) -> bool:
        """Whether this step of `rows` requests (`ids`, read only if need be) keeps the last full plan of a step
        like it, and that plan drafts nothing (no speculation suits any batch: within its hold the step's requests
        need not be read). Past its hold, such a plan that had held max_hold steps holds on, up to IDLE_HOLDS times
        as long, while the batch has not shrunk by more than IDLE_SHRINK and no more than `max_newcomers` of it is
        new."""
        last = self._by_prefill[prefilling]
        if last.drafts or (step >= last.next_plan and not self._idle_holds(last, step, ids, rows)):
            return False
        self.held += 1
        return True

    def _idle_holds(self, last: _Held, step: int, ids: Iterable[str], rows: int) -> bool:
        """Whether a plan of no speculation past its hold holds on (holds_no_drafts)."""
        if not (rows >= (1 - IDLE_SHRINK) * last.rows and last.hold == self.max_hold
                and step < last.planned_at + 1 + IDLE_HOLDS * self.max_hold):
            return False
        return _newcomers(last, ids, rows) <= self.max_newcomers * rows

    def plans_in_full(self, step: int, prefilling: bool, ids: tuple[str, ...]) -> bool:
        """Whether a step like it (beside prefill or not) at `step`, of these requests, plans in full: the hold of
        the last such plan ended there, or too many of the requests are new to a drafting plan (held_plan).
        GoodputPolicy.plan_ahead makes such a plan a step early, beside the forward."""
        last, rows = self._by_prefill[prefilling], len(ids)
        if step >= last.next_plan:
            return last.drafts or not self._idle_holds(last, step, ids, rows)
        return last.drafts and self._too_many_new(_newcomers(last, ids, rows), rows)

    def _too_many_new(self, joined: int, rows: int) -> bool:
        """Whether `joined` of `rows` requests new to a drafting plan make the step plan in full: more than
        max_newcomers of them, or all."""
        return bool(joined) and (joined == rows or joined > self.max_newcomers * rows)

    def held_plan(self, step: int, ids: tuple[str, ...], prefilling: bool) -> HeldPlan | None:
        """The draft lengths this step's requests keep from the last full plan of a step like it (beside prefill
        or not), or None where it plans in full."""
        last = self._by_prefill[prefilling]
        if step >= last.next_plan:
            return None
        if not last.drafts:
            ks, newcomers = [0] * len(ids), []  # no speculation suits any batch
        else:
            get = last.ks.get
            ks = [get(rid, -1) for rid in ids]
            joined = [i for i, k in enumerate(ks) if k < 0]  # the full plan did not plan them
            if self._too_many_new(len(joined), len(ids)):
                return None
            newcomers, adopted = [], last.adopted.get
            for i in joined:
                ks[i] = adopted(ids[i], -1)
                if ks[i] < 0:  # not yet planned by the rule
                    ks[i] = 0
                    newcomers.append(i)
        self.held += 1
        return HeldPlan(ks, newcomers, last.rule)

    def rule_held_at(self, step: int, prefilling: bool) -> HeldRule | None:
        """The rule of the drafting plan a step like it at `step` holds (None: none holds there), which plans the
        requests that join by then (GoodputPolicy.plan_ahead plans them a step early, adopt)."""
        last = self._by_prefill[prefilling]
        return last.rule if last.drafts and step < last.next_plan else None

    def adopt(self, prefilling: bool, ids: list[str], ks: list[int]) -> None:
        """The draft lengths the held plan's rule gave newcomers (`ids`), held with the plan's from now on."""
        self._by_prefill[prefilling].adopted.update(zip(ids, ks))

    def planned(self, step: int, ids: tuple[str, ...], prefilling: bool, ks: list[int], rule: HeldRule) -> None:
        """A full plan ran at `step` for requests `ids`: ks, each one's draft length as planned (a learning probe
        is that step's detour, left out); rule: how it would plan a newcomer (NO_DRAFTS where it drafts nothing).
        It counts as the last one again where both draft nothing, or both draft as deep and their thresholds differ
        by at most `RULE_TOLERANCE`: a request whose draft length flips between the two sits at the threshold, where
        either length is worth about the same. So does a plan whose depth differs from the last one's where the best
        plan at the last one's depth was worth within DEPTH_TOLERANCE of it (`rule.near`): a batch at the boundary
        of two depths (mixed acceptance, best k between 1 and 2) flipped between them every few steps, each flip
        planned in full from a hold of 1 again, a third of its steps."""
        last = self._by_prefill[prefilling]
        same = (rule.depth == last.rule.depth and (
            rule.depth == 0 or abs(rule.threshold - last.rule.threshold) <= RULE_TOLERANCE * last.rule.threshold)) \
            or (last.rule.depth > 0 and last.rule.depth in rule.near)
        last.hold = min(self.max_hold, 2 * last.hold if last.hold else 1) if same else 0
        last.next_plan = step + 1 + last.hold
        last.ks, last.rule, last.rows, last.planned_at = dict(zip(ids, ks)), rule, len(ids), step
        last.adopted = {}


def _newcomers(last: _Held, ids: Iterable[str], rows: int) -> int:
    """How many of the step's `rows` requests the last full plan did not plan (counted in C)."""
    return rows - sum(map(last.ks.__contains__, ids))


@dataclass(frozen=True)
class AheadPlan:
    """A full plan made beside a step's forward for the policy's next step `at` (GoodputPolicy.plan_ahead), on the
    requests `ids` of the step it was made beside."""
    at: int
    ids: tuple[str, ...]
    plan: SpecPlan

    def overlaid(self, held: HeldPlan, ids: tuple[str, ...]) -> HeldPlan:
        """The held plan of a step whose requests changed since, with this plan's draft lengths (learning probes
        included) for the requests both hold."""
        k_of = dict(zip(self.ids, self.plan.ks))
        return replace(held, ks=[k_of.get(rid, k) for rid, k in zip(ids, held.ks)])

"""PlanHold: a plan that keeps coming out the same is planned in full less often; a request that joins is planned by
the held plan's rule, and a batch of too many newcomers plans in full."""
import numpy as np
import pytest

from smartspec.policy.goodput import chain_gains, plans_by_depth
from smartspec.policy.plan_hold import NO_DRAFTS, HeldRule, PlanHold

RULE = HeldRule(0.5, 3)


def full_plan_steps(hold: PlanHold, plans, ids=("a", "b")) -> list[int]:
    """The steps that planned in full, given each full plan's draft lengths in turn."""
    full, plans = [], iter(plans)
    for step in range(1, 40):
        if hold.held_plan(step, ids, False) is None:
            full.append(step)
            hold.planned(step, ids, False, next(plans), RULE)
    return full


def test_the_same_plan_is_held_twice_as_long_each_time_up_to_the_cap():
    hold = PlanHold(max_hold=8)
    assert full_plan_steps(hold, [[3, 2]] * 40) == [1, 2, 4, 7, 12, 21, 30, 39]  # held 0, 1, 2, 4, 8, 8, 8
    assert hold.held == 39 - 8


def test_a_plan_whose_rule_changes_plans_every_step_again_one_that_flips_at_the_threshold_holds():
    hold = PlanHold(max_hold=8)
    for step in (1, 2, 4):
        assert hold.held_plan(step, ("a", "b"), False) is None
        hold.planned(step, ("a", "b"), False, [3, 2], RULE)
    assert hold.held_plan(5, ("a", "b"), False).ks == [3, 2]
    hold.planned(8, ("a", "b"), False, [3, 3], HeldRule(0.52, 3))  # b sat at the threshold: the same plan
    assert hold.held_plan(9, ("a", "b"), False).ks == [3, 3]
    hold.planned(16, ("a", "b"), False, [3, 3], HeldRule(0.7, 3))  # drafts must add more now
    assert hold.held_plan(17, ("a", "b"), False) is None
    hold.planned(17, ("a", "b"), False, [2, 2], HeldRule(0.7, 2))  # and no deeper
    assert hold.held_plan(18, ("a", "b"), False) is None


def test_a_newcomer_is_marked_for_the_rule_and_a_batch_mostly_new_plans_in_full():
    hold = PlanHold(max_newcomers=0.25)
    ids = tuple("abcdefgh")
    for step in (1, 2):
        hold.planned(step, ids, False, [2] * 8, RULE)
    held = hold.held_plan(3, ("a", "b", "c", "d", "e", "f", "g", "x"), False)  # h finished, x joined
    assert held.ks == [2] * 7 + [0] and held.newcomers == [7] and held.rule == RULE
    assert hold.held_plan(3, ("a", "b", "c", "d", "e", "f", "x", "y", "z"), False) is None  # 3 of 9 new
    assert hold.held_plan(3, ("x",), False) is None  # nothing the plan planned


def test_a_newcomer_is_planned_by_the_rule_once_and_then_held_with_the_plan():
    """The rule's answer for a newcomer is held as the planned requests' are, until the next full plan; it still
    counts as new where the batch turns mostly new."""
    hold = PlanHold(max_newcomers=0.25)
    ids = tuple("abcdefgh")
    for step in (1, 2, 3):  # held for 2 steps
        hold.planned(step, ids, False, [2] * 8, RULE)
    batch = ("a", "b", "c", "d", "e", "f", "g", "x")
    assert hold.held_plan(4, batch, False).newcomers == [7]
    hold.adopt(False, ["x"], [1])
    held = hold.held_plan(5, batch, False)
    assert held.ks == [2] * 7 + [1] and held.newcomers == []
    assert hold.held_plan(5, ("a", "b", "c", "d", "e", "f", "x", "y", "z"), False) is None  # 3 of 9 still new
    hold.adopt(False, ["y"], [3])
    hold.planned(6, batch, False, [2] * 8, RULE)  # a full plan: what the rule gave is dropped
    assert hold.held_plan(7, batch[:7] + ("y",), False).newcomers == [7]


def test_plans_of_two_depths_worth_about_the_same_keep_doubling_the_hold():
    """A batch at the boundary of two depths: a plan of depth 2 whose depth-1 plan came within DEPTH_TOLERANCE
    counts as the last (depth-1) plan again, and the hold doubles; one whose depth-1 plan did not resets it."""
    ids = tuple("ab")
    near, far = HeldRule(0.2, 2, frozenset({1})), HeldRule(0.2, 2)
    for rule, hold_after in ((near, 4), (far, 0)):
        hold = PlanHold()
        for step in (1, 2, 3):  # depth 1 the same three times: holds 1, 2
            hold.planned(step, ids, False, [1, 1], HeldRule(0.3, 1))
        assert hold._by_prefill[False].hold == 2
        hold.planned(4, ids, False, [2, 1], rule)
        assert hold._by_prefill[False].hold == hold_after
        assert hold._by_prefill[False].rule == rule  # the new plan is what is held either way


def test_steps_beside_prefill_hold_a_plan_of_their_own_and_no_speculation_suits_any_batch():
    hold = PlanHold()
    for step in (1, 2):
        hold.planned(step, ("a", "b"), False, [2, 2], RULE)
    assert hold.held_plan(3, ("a", "b"), True) is None  # beside a prefill chunk: priced otherwise
    assert hold.held_plan(3, ("a", "b"), False).ks == [2, 2]
    for step in (4, 5):
        hold.planned(step, ("a", "c"), True, [0, 0], NO_DRAFTS)
    held = hold.held_plan(6, ("x", "y", "z"), True)
    assert held.ks == [0, 0, 0] and held.newcomers == []
    assert hold.holds_no_drafts(6, True, "xyz", 3) and not hold.holds_no_drafts(3, False, "ab", 2)  # that drafts
    assert hold.holds_no_drafts(7, True, "ac", 2) and not hold.holds_no_drafts(8, True, "ac", 2)  # 2 after step 5


def test_the_rule_plans_a_newcomer_as_the_full_plan_would():
    """A request that joins a batch of many, planned by the threshold alone, gets the draft length the exact
    selection over the whole batch gives it: what HeldRule stands on (GoodputPolicy._held_rule)."""
    rng = np.random.default_rng(3)
    agree, tried = 0, 0
    for _ in range(200):
        b, k = int(rng.integers(16, 64)), 5
        alphas = rng.uniform(0.3, 0.95, b)
        v0, per_token, per_depth = rng.uniform(5e-3, 2e-2), rng.uniform(1e-5, 2e-4), rng.uniform(2e-4, 2e-3)

        def cost(n, c, depth=0, sum_k=0):
            return v0 + per_token * n + 1e-8 * c + per_depth * depth + 1e-5 * sum_k

        gains = chain_gains(alphas, k)
        plans = plans_by_depth(gains, [k] * b, np.arange(1, k + 1), cost, b, 500 * b)
        plan = max(plans, key=lambda p: p.value)
        if plan.depth == 0:
            continue
        m, d = plan.tokens, plan.depth
        threshold = plan.value * (cost(b + m + 1, 500 * b + m + 1, d, m + 1) - cost(b + m, 500 * b + m, d, m))
        rule_ks = [int(np.count_nonzero(g[:d] >= threshold)) for g in gains]
        tried += 1
        agree += sum(abs(a - e) <= 0 for a, e in zip(rule_ks, plan.ks)) / b
    assert tried > 100 and agree / tried > 0.99


def test_max_hold_and_max_newcomers_are_checked():
    with pytest.raises(ValueError, match="max_hold"):
        PlanHold(max_hold=0)
    with pytest.raises(ValueError, match="max_newcomers"):
        PlanHold(max_newcomers=1.0)


def test_no_speculation_holds_longer_while_the_batch_does_not_shrink_nor_turn_new():
    """Once no speculation has come out the same up to max_hold, it holds up to IDLE_HOLDS times as long while the
    batch keeps all but IDLE_SHRINK of its requests, few of them new: a batch that shrinks more (the load falling,
    where drafting may start to pay), or one mostly of requests the plan never saw, plans in full once the usual hold
    is over."""
    from smartspec.policy.plan_hold import IDLE_HOLDS, IDLE_SHRINK

    hold, ids = PlanHold(max_hold=4), tuple("abcdefgh")
    step = 0
    while hold._by_prefill[False].hold < 4:
        step += 1
        if not hold.holds_no_drafts(step, False, ids, 8):
            hold.planned(step, ids, False, [0] * 8, NO_DRAFTS)
    planned, joined = step, tuple("abcdefgz")  # h finished, z joined: one in eight new
    assert all(hold.holds_no_drafts(s, False, joined, 8) for s in range(planned + 1, planned + 1 + IDLE_HOLDS * 4))
    assert not hold.holds_no_drafts(planned + 1 + IDLE_HOLDS * 4, False, joined, 8)
    assert hold.holds_no_drafts(planned + 4, False, ids[:3], 3)  # within the usual hold, whatever the batch
    assert IDLE_SHRINK == 1 / 8 and hold.holds_no_drafts(planned + 5, False, ids[:7], 7)  # one finished: held
    assert not hold.holds_no_drafts(planned + 5, False, ids[:6], 6)  # past it, a smaller batch plans in full
    assert not hold.holds_no_drafts(planned + 5, False, ids[:3], 3)
    assert not hold.holds_no_drafts(planned + 5, False, tuple("stuvwxyz"), 8)  # and so does a new one


def test_a_step_ahead_plans_in_full_where_its_hold_ends_or_too_many_of_its_requests_are_new():
    hold, ids = PlanHold(max_hold=8, max_newcomers=0.25), tuple("abcdefgh")
    for step in (1, 2):
        hold.planned(step, ids, False, [2] * 8, RULE)  # held for one step: step 3, then 4 plans in full
    assert not hold.plans_in_full(3, False, ids) and hold.plans_in_full(4, False, ids)
    assert not hold.plans_in_full(3, False, ids[:7] + ("x",))  # one in eight new: the held plan's rule plans it
    assert hold.plans_in_full(3, False, ids[:6] + ("x", "y", "z"))  # three in nine: held_plan would plan in full
    assert hold.held_plan(3, ids[:6] + ("x", "y", "z"), False) is None

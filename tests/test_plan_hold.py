"""PlanHold: a plan that keeps coming out the same is planned in full less often, never for other requests."""
import pytest

from smartspec.policy.plan_hold import PlanHold


def full_plan_steps(hold: PlanHold, plans, batch=("a", "b")) -> list[int]:
    """The steps that planned in full, given each full plan's draft lengths in turn."""
    full, plans = [], iter(plans)
    for step in range(1, 40):
        if hold.held_ks(step, batch, 2) is None:
            full.append(step)
            hold.planned(step, batch, next(plans), False)
    return full


def test_the_same_plan_is_held_twice_as_long_each_time_up_to_the_cap():
    hold = PlanHold(max_hold=8)
    assert full_plan_steps(hold, [[3, 2]] * 40) == [1, 2, 4, 7, 12, 21, 30, 39]  # held 0, 1, 2, 4, 8, 8, 8
    assert hold.held == 39 - 8


def test_a_plan_that_changes_or_probes_plans_every_step_again():
    hold = PlanHold(max_hold=8)
    for step, ks in ((1, [3, 2]), (2, [3, 2]), (4, [3, 2])):
        assert hold.held_ks(step, ("a", "b"), 2) is None
        hold.planned(step, ("a", "b"), ks, False)
    assert hold.held_ks(5, ("a", "b"), 2) == [3, 2]
    hold.planned(8, ("a", "b"), [3, 1], False)  # came out differently
    assert hold.held_ks(9, ("a", "b"), 2) is None
    hold.planned(9, ("a", "b"), [3, 1], True)  # the same, but a request probed
    assert hold.held_ks(10, ("a", "b"), 2) is None


def test_drafts_are_held_only_for_the_same_batch_no_speculation_for_any():
    hold = PlanHold()
    hold.planned(1, (("a", "b"), False), [2, 2], False)
    hold.planned(2, (("a", "b"), False), [2, 2], False)
    assert hold.held_ks(3, (("a", "c"), False), 2) is None  # another request: its drafts were never planned
    assert hold.held_ks(3, (("a", "b"), True), 2) is None  # now beside a prefill chunk: priced otherwise
    assert hold.held_ks(3, (("a", "b"), False), 2) == [2, 2]
    hold.planned(4, (("a", "c"), False), [0, 0], False)
    hold.planned(5, (("a", "c"), False), [0, 0], False)
    assert hold.held_ks(6, (("x", "y", "z"), True), 3) == [0, 0, 0]  # no speculation suits any batch


def test_max_hold_is_checked():
    with pytest.raises(ValueError, match="max_hold"):
        PlanHold(max_hold=0)

"""Goodput for token trees: node calibration, pruning, node budgets, calibration shared between replicas."""

import numpy as np
import pytest
from policy_views import view

from smartspec import SamplingParams
from smartspec.policy.tree_goodput import NodeCalibration, node_values, prune_trees
from smartspec.types.request import Request
from smartspec.types.tree import TokenTree


def test_calibration_learns_acceptance_by_confidence():
    cal = NodeCalibration()
    rng = np.random.default_rng(0)
    for _ in range(3000):
        # an over-confident drafter: nodes it gives 0.9 are accepted 40% of the time
        tree = TokenTree([1], [-1], [0.9])
        cal.observe(tree, [0] if rng.random() < 0.4 else [])
    assert cal.probability(0.9) == pytest.approx(0.4, abs=0.05)
    assert cal.probability(0.15) == pytest.approx(0.15)  # no evidence: the confidence itself


def test_pruning_keeps_valuable_nodes_when_verification_is_cheap_and_none_when_steep():
    cal = NodeCalibration()
    trees = [TokenTree([1, 2, 3, 4], [-1, -1, 0, 2], [0.9, 0.05, 0.9, 0.9]), TokenTree([5], [-1], [0.1])]
    values = [node_values(t, cal) for t in trees]
    cheap = lambda n, c: 0.010 + 0.001 * n  # noqa: E731
    kept, _ = prune_trees(trees, values, cheap, 2, 100, draft_s=0.002)
    assert kept[0].tokens == [1, 3, 4] and len(kept[1]) == 0  # the confident chain; not the 0.05 or 0.1 nodes
    free = lambda n, c: 0.010 + 0 * n  # noqa: E731
    kept, _ = prune_trees(trees, values, free, 2, 100, draft_s=0.002)
    assert [len(t) for t in kept] == [4, 1]
    steep = lambda n, c: 0.010 + 0.2 * n  # noqa: E731
    kept, _ = prune_trees(trees, values, steep, 2, 100, draft_s=0.002)
    assert [len(t) for t in kept] == [0, 0]


def test_calibration_is_shared_between_replicas_without_echo():
    from smartspec.policy import GoodputPolicy, merge_states

    a, b = GoodputPolicy(key="k:tree", tree_depth=3), GoodputPolicy(key="k:tree", tree_depth=3)
    for _ in range(200):  # replica a learns that its drafter's 0.95 nodes are rejected
        a.calibration.observe(TokenTree([1], [-1], [0.95]), [])
    b.shared.import_state(merge_states([a.shared.export_state()]))
    assert b.calibration.probability(0.95) < 0.1
    assert sum(b.shared.export_state()["calibration"]["total"]) == 0  # b exports its own evidence only


def test_node_budgets_follow_the_last_trees_values():
    from smartspec.policy import GoodputPolicy

    policy = GoodputPolicy(tree_depth=3)
    policy.cost.v = [0.010, 0.0002, 0.0002, 0.0002, 0.0002, 0.0002, 0.0002, 0.0]  # cheap verification
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=64)) for i in range(2)]
    policy.plan(view(reqs, 8))
    confident = TokenTree([1, 2, 3, 4, 5], [-1, 0, 1, 2, 3], [0.99] * 5)  # r0's drafter is sure of a long path
    doubtful = TokenTree([6], [-1], [0.02])  # r1's is not
    policy.prune(view(reqs, 8), [8, 8], [confident, doubtful], draft_s=0.001)
    before = policy.tree_gains.curve("r0").copy()
    policy.prune(view(reqs, 8), [0, 8], [TokenTree([], [], []), doubtful], draft_s=0.001)  # r0 asked for nothing
    assert np.array_equal(policy.tree_gains.curve("r0"), before)
    ks = policy.plan(view(reqs, 8)).ks
    assert ks[0] >= 4 and ks[1] <= 1, ks

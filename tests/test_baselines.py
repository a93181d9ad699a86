"""Baseline policies and the policy factory."""

import pytest

from smartspec.policy import BatchTablePolicy, GoodputPolicy, OffPolicy, make_policy
from smartspec.spec_decode.config import SpeculativeConfig
from smartspec.types.plan import RequestView, StepView


def test_batch_table_policy():
    p = BatchTablePolicy({1: 4, 4: 2, 16: 0})
    assert [p.k_for(b) for b in (1, 2, 4, 8, 16, 64)] == [4, 4, 2, 2, 0, 0]
    assert make_policy("batch_table", 5).k_for(1) == 5
    with pytest.raises(ValueError, match="batch_table"):
        BatchTablePolicy({0: 1})


def batch(b: int, k_max: int) -> StepView:
    return StepView([RequestView(f"r{i}", 10, 0, 64, None, 0.0) for i in range(b)], k_max)


def test_policy_names_build_the_policy_they_name():
    assert make_policy("off", 5).plan(batch(3, 5)).ks == [0, 0, 0]
    assert make_policy("fixed", 5).plan(batch(2, 5)).ks == [5, 5]
    assert make_policy("fixed:3", 5).plan(batch(1, 5)).ks == [3]
    assert isinstance(make_policy("smartspec", 5), GoodputPolicy)
    mine = OffPolicy()
    assert make_policy(mine, 5) is mine
    for bad, message in (("fixed:9", r"k must be an integer in \[0, 5\]"), ("fixed:x", "k must be"),
                         ("sometimes", "unknown policy")):
        with pytest.raises(ValueError, match=message):
            make_policy(bad, 5)


def test_a_speculative_config_builds_its_policy_with_all_its_settings():
    """The table, the options, the prior key and the tree depth all reach the policy (none silently dropped)."""
    table = SpeculativeConfig(method="ngram", policy="batch_table", batch_table={1: 3, 8: 0}).make_policy()
    assert table.table == [(1, 3), (8, 0)]
    goodput = SpeculativeConfig(model="d", policy_options={"explore_interval": 3},
                                tree={"max_nodes": 6, "max_depth": 3, "branching": 2}).make_policy()
    assert (goodput.key, goodput.exploration.interval, goodput.tree_depth) == ("draft_model:d:tree", 3, 3)
    with pytest.raises(ValueError, match=r"unknown policy_options \['no_such_option'\]"):
        SpeculativeConfig(method="ngram", policy_options={"no_such_option": 1})

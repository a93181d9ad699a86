"""Baseline policies and the policy factory."""

import pytest

from smartspec.policy import BatchTablePolicy, make_policy


def test_batch_table_policy():
    p = BatchTablePolicy({1: 4, 4: 2, 16: 0})
    assert [p.k_for(b) for b in (1, 2, 4, 8, 16, 64)] == [4, 4, 2, 2, 0, 0]
    assert make_policy("batch_table", 5).k_for(1) == 5
    with pytest.raises(ValueError, match="batch_table"):
        BatchTablePolicy({0: 1})

"""The benchmarks' paired comparison at equal box speed (smartspec.report.plain_forward_ratio, paired_ratio)."""
import math

import pytest

from smartspec.report import paired_ratio, plain_forward_ratio


def _step(batch: int, verify_s: float, proposed: int = 0, prefill: int = 0) -> dict:
    return {"batch_size": batch, "verify_s": verify_s, "proposed": [proposed] + [0] * (batch - 1),
            "num_prefill_tokens": prefill}


def test_plain_forward_ratio_compares_plain_steps_of_equal_batch_size_only():
    slow = [_step(2, 0.2)] * 5 + [_step(4, 0.3)] * 3 + [_step(1, 9.0, proposed=3)] * 4 + [_step(2, 5.0, prefill=90)] * 4
    fast = [_step(2, 0.1)] * 6 + [_step(4, 0.15)] * 4 + [_step(3, 0.01)] * 5 + [_step(1, 0.01, proposed=3)] * 4
    ratio, compared = plain_forward_ratio(slow, fast)
    assert ratio == pytest.approx(2.0)  # drafting and prefill steps, and sizes only one run has, are left out
    assert compared == 5 + 3  # per size, the smaller of the two counts
    inverse, _ = plain_forward_ratio(fast, slow)
    assert inverse == pytest.approx(0.5)


def test_plain_forward_ratio_weights_sizes_by_steps_and_needs_enough_of_them():
    a = [_step(2, 0.2)] * 9 + [_step(5, 0.4)] * 3
    b = [_step(2, 0.1)] * 9 + [_step(5, 0.4)] * 3
    ratio, _ = plain_forward_ratio(a, b)
    assert ratio == pytest.approx(math.exp((9 * math.log(2.0) + 3 * 0.0) / 12))
    assert plain_forward_ratio(a[:2], b) is None  # two steps of size 2 are too few to compare
    assert plain_forward_ratio([_step(1, 0.1)] * 5, [_step(2, 0.1)] * 5) is None  # no shared size


def test_paired_ratio_is_a_geometric_mean_with_its_standard_error():
    mean, se = paired_ratio([2.0, 0.5])
    assert mean == pytest.approx(1.0)
    assert se == pytest.approx(math.log(2.0))  # sd of (ln 2, -ln 2) is ln 2 * sqrt 2; over sqrt 2 repeats
    assert paired_ratio([1.1]) == (pytest.approx(1.1), 0.0)

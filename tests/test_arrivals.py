"""The expected gap to the next arrival."""

import pytest

from smartspec.policy.arrivals import ArrivalGaps


def test_expected_gap_to_the_next_arrival():
    gaps = ArrivalGaps(window=4)
    assert gaps.expected_gap(now=100.0, prior_gap=8.0) == 8.0  # none seen: the prior
    for i in range(4):
        gaps.see(f"r{i}", 10.0 * i)
    gaps.see("r3", 30.0)  # seen again (a request is passed every step): counted once
    assert gaps.expected_gap(now=32.0, prior_gap=8.0) == pytest.approx((32.0 + 8.0) / 4)
    for i in range(4, 12):  # a faster stream pushes the slow one out of the window
        gaps.see(f"r{i}", 30.0 + (i - 3))
    assert gaps.expected_gap(now=39.0, prior_gap=8.0) == pytest.approx((39.0 - 35.0 + 8.0) / 4)
    # no arrival for a while: the gap grows with the wait, and arrivals older than memory * prior_gap (32 s) drop
    assert gaps.expected_gap(now=60.0, prior_gap=8.0) > gaps.expected_gap(now=40.0, prior_gap=8.0)
    assert gaps.expected_gap(now=90.0, prior_gap=8.0) == 8.0
    gaps.see("after", 90.0)  # a new burst after the quiet spell is measured on its own
    assert gaps.expected_gap(now=91.0, prior_gap=8.0) == pytest.approx(1.0 + 8.0)
    # a burst is not yet a rate: four requests at once still expect a quarter of the prior
    burst = ArrivalGaps(window=4)
    for i in range(4):
        burst.see(f"b{i}", 5.0)
    assert burst.expected_gap(now=5.0, prior_gap=8.0) == pytest.approx(2.0)
    for bad in ({"window": 0}, {"memory": 0.0}):
        with pytest.raises(ValueError, match="window"):
            ArrivalGaps(**bad)


# ---- baselines, state, engine ----------------------------------------------------------------------------------

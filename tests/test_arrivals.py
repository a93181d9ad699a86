"""The expected gap to the batch's next growth: arrivals less departures."""

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


def test_an_arrival_that_replaces_a_departure_does_not_grow_the_batch():
    """A closed loop: each request leaves as the next arrives (its departure timed at the next step's clock). The
    batch holds its size, so the expected gap is the whole span and the prior, not the arrivals' own gap; where
    fewer left than came, the gap is the span over the growth."""
    class Arrival:
        def __init__(self, rid, at):
            self.request_id, self.arrival_time = rid, at

    closed, growing = ArrivalGaps(window=4), ArrivalGaps(window=4)
    for i in range(8):
        for gaps in (closed, growing):
            gaps.see_each([Arrival(f"r{i}", float(i))], now=float(i))
        if i >= 2:  # in the closed loop the batch keeps two requests
            closed.release(f"r{i - 2}")
    closed.see_each([], now=8.0)  # the step after the last release times it
    assert growing.expected_gap(now=8.0, prior_gap=2.0) == pytest.approx((8.0 - 4.0 + 2.0) / 4)
    assert closed.expected_gap(now=8.0, prior_gap=2.0) == pytest.approx(8.0 - 4.0 + 2.0)
    closed.release("never seen")  # a request the gaps never counted is no departure
    closed.see_each([], now=8.5)
    assert closed.expected_gap(now=8.5, prior_gap=2.0) == pytest.approx(8.5 - 4.0 + 2.0)
    half = ArrivalGaps(window=4)  # four arrivals, two of which left: the batch grew by two over the span
    for i in range(4):
        half.see_each([Arrival(f"h{i}", float(i))], now=float(i))
    half.release("h0")
    half.release("h1")
    half.see_each([], now=4.0)
    assert half.expected_gap(now=4.0, prior_gap=2.0) == pytest.approx((4.0 + 2.0) / 2)

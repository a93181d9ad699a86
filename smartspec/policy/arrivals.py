"""How long until the batch is expected to grow: the next arrival that no departure makes room for, from the arrival
times of the requests seen and the times requests left.

A draft model's catch-up (reading a prompt it has not seen) is an investment that pays back over the steps the
request goes on drafting, and a growing batch ends that sooner than the request's remaining length suggests: each
request more lowers what drafting adds, and at some size drafting stops paying. A catch-up is therefore spread over
at most the steps until the batch is expected to have grown to that size (catchup.growths_drafting_lasts growths,
each expected after the gap estimated here; a learning-time probe is weighed the same way,
exploration.probe_pays); without this bound the policy drafted at loads where the catch-up never paid back
(docs/policy.md, "Draft catch-up"). An arrival that replaces a request that left does not grow the batch: in a closed
loop of 64 streams one arrives nearly every step, and counting each as growth priced every catch-up over one step,
which kept the batch at k = 0 where drafting paid.

Arrivals are taken as Poisson with an unknown rate, estimated from the last `window` arrivals seen and the time
since the oldest of them, less the departures over that time; a prior worth one gap of `prior_gap` seconds keeps a
few arrivals from saying much: a burst of requests that arrive together is not yet a high rate, and with none seen
the expected gap is the prior. Arrivals older than `memory` prior gaps are left out: after a quiet spell the old
ones would stretch the span and hide a new burst's rate until the window is all new (a policy kept across runs that
pause between them would draft at a high rate as if it were a low one). A departure is timed at the first step
after it (release carries no clock).
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable

from smartspec.policy.step_numbers import REQUEST_ID


class ArrivalGaps:
    """The expected gap to the batch's next growth (posterior mean under a Poisson model with a one-gap prior)."""

    def __init__(self, window: int = 8, memory: float = 4.0) -> None:
        if not (isinstance(window, int) and window >= 1 and memory > 0):
            raise ValueError(f"window must be an integer >= 1 and memory > 0, got {window!r}, {memory!r}")
        self.window, self.memory = window, memory
        self._times: list[float] = []  # the latest `window` arrival times, ascending
        self._seen: set[str] = set()  # requests counted and not yet released
        self._departures: list[float] = []  # the latest `window` departure times, ascending
        self._untimed = 0  # departures since the last step, timed at the next one

    def see(self, request_id: str, arrival_time: float) -> None:
        if request_id in self._seen:
            return
        self._seen.add(request_id)
        bisect.insort(self._times, arrival_time)
        if len(self._times) > self.window:
            del self._times[0]

    def see_each(self, requests, now: float | None = None, ids: Iterable[str] | None = None) -> None:
        """see() for each of these (views with request_id and arrival_time): the ones already counted, most of a
        step's, skipped by one set test in C on their ids (a loop in Python was a tenth of the policy's time at 256
        requests; ids: theirs, where the caller has them). now: the step's clock, which times the departures since
        the last."""
        if not self._seen.issuperset(map(REQUEST_ID, requests) if ids is None else ids):
            for r in requests:
                self.see(r.request_id, r.arrival_time)
        if now is not None and self._untimed:
            self._departures.extend([now] * self._untimed)
            del self._departures[:-self.window]
            self._untimed = 0

    def release(self, request_id: str) -> None:
        """The request left (finished or aborted)."""
        if request_id in self._seen:
            self._seen.discard(request_id)
            self._untimed += 1

    def expected_gap(self, now: float, prior_gap: float, remembered: float | None = None) -> float:
        """Seconds until the batch next grows: the posterior mean gap of n growths over the time since the oldest
        of the arrivals counted, with the prior counted as one more gap; n, those arrivals less the departures
        since the oldest (at least one: a batch that held its size over the span is expected to grow no sooner
        than in the span and the prior gap). remembered: the seconds of arrivals counted (default `memory` prior
        gaps)."""
        since = now - (self.memory * prior_gap if remembered is None else remembered)
        first = bisect.bisect_left(self._times, since)
        if first == len(self._times):
            return prior_gap
        oldest = self._times[first]
        left = len(self._departures) - bisect.bisect_left(self._departures, oldest)
        return (max(0.0, now - oldest) + prior_gap) / max(1, len(self._times) - first - left)

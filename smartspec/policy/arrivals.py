"""How long until the next request is expected to join the batch, from the arrival times of the requests seen.

A draft model's catch-up (reading a prompt it has not seen) is an investment that pays back over the steps the
request goes on drafting, and arrivals end that sooner than the request's remaining length suggests: each brings a
prefill step, in which drafting makes the prefilling request wait, and one more request, which lowers what
drafting adds. A catch-up is therefore spread over at most the steps to the next expected arrival (and a
learning-time probe is weighed the same way, GoodputPolicy._probe_pays); without this bound the policy drafted at
loads where the catch-up never paid back (docs/policy.md, "Draft catch-up").

Arrivals are taken as Poisson with an unknown rate, estimated from the last `window` arrivals seen and the time
since the oldest of them; a prior worth one gap of `prior_gap` seconds keeps a few arrivals from saying much: a
burst of requests that arrive together is not yet a high rate, and with none seen the expected gap is the prior.
Arrivals older than `memory` prior gaps are left out: after a quiet spell the old ones would stretch the span and
hide a new burst's rate until the window is all new (a policy kept across runs that pause between them would
draft at a high rate as if it were a low one).
"""
from __future__ import annotations

import bisect


class ArrivalGaps:
    """The expected gap to the next arrival (posterior mean under a Poisson model with a one-gap prior)."""

    def __init__(self, window: int = 8, memory: float = 4.0) -> None:
        if not (isinstance(window, int) and window >= 1 and memory > 0):
            raise ValueError(f"window must be an integer >= 1 and memory > 0, got {window!r}, {memory!r}")
        self.window, self.memory = window, memory
        self._times: list[float] = []  # the latest `window` arrival times, ascending
        self._seen: set[str] = set()  # requests counted and not yet released

    def see(self, request_id: str, arrival_time: float) -> None:
        if request_id in self._seen:
            return
        self._seen.add(request_id)
        bisect.insort(self._times, arrival_time)
        if len(self._times) > self.window:
            del self._times[0]

    def see_each(self, requests) -> None:
        """see() for each of these (views with request_id and arrival_time): the ones already counted, most of a
        step's, skipped by a set lookup alone."""
        seen = self._seen
        for r in requests:
            if r.request_id not in seen:
                self.see(r.request_id, r.arrival_time)

    def release(self, request_id: str) -> None:
        self._seen.discard(request_id)

    def expected_gap(self, now: float, prior_gap: float, remembered: float | None = None) -> float:
        """Seconds until the next arrival: the posterior mean gap of n arrivals over the time since the oldest of
        them, with the prior counted as one more gap (n - 1 gaps observed and the current one, still open).
        remembered: the seconds of arrivals counted (default `memory` prior gaps)."""
        since = now - (self.memory * prior_gap if remembered is None else remembered)
        recent = self._times[bisect.bisect_left(self._times, since):]
        if not recent:
            return prior_gap
        return (max(0.0, now - recent[0]) + prior_gap) / len(recent)

"""How long until the next request is expected to join the batch, from the arrival times of the requests seen.

A draft model's catch-up (reading a prompt it has not seen) is an investment that pays back over the steps the
request goes on drafting, and arrivals end that sooner than the request's remaining length suggests: each brings a
prefill step, in which drafting makes the prefilling request wait, and one more request, which lowers what
drafting adds. Measured in the simulator with the draft model's costs fitted on this CPU (150-token prompts,
catch-up 0.73 s, a plain step 0.28 s): spreading a catch-up over up to 8 steps left the policy 3.5-3.8% slower
than no speculation at 0.3-0.5 req/s; over at most the steps to the next arrival (and with learning-time probes
checked the same way, SmartSpecPolicy._probe_pays) 2.1% and 0.2% faster, while at 0.08 req/s it kept 23.5 points
of its 24.2% gain (docs/BENCH_POLICIES.md, runs 21-23).

Arrivals are taken as Poisson with an unknown rate, estimated from the last `window` arrivals seen and the time
since the oldest of them; a prior worth one gap of `prior_gap` seconds keeps a few arrivals from saying much: a
burst of requests that arrive together is not yet a high rate, and with none seen the expected gap is the prior.
Arrivals older than `memory` prior gaps are left out: after a quiet spell the old ones would stretch the span and
hide a new burst's rate until the window is all new (measured: a policy kept across bench_policies' runs, which
pause between them, drafted at 0.5 req/s as if at 0.08, +1.9% against off in the simulator; -0.6% without them).
"""
from __future__ import annotations

import bisect


class ArrivalGaps:
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

    def release(self, request_id: str) -> None:
        self._seen.discard(request_id)

    def expected_gap(self, now: float, prior_gap: float) -> float:
        """Seconds until the next arrival: the posterior mean gap of n arrivals over the time since the oldest of
        them, with the prior counted as one more gap (n - 1 gaps observed and the current one, still open)."""
        recent = self._times[bisect.bisect_left(self._times, now - self.memory * prior_gap):]
        if not recent:
            return prior_gap
        return (max(0.0, now - recent[0]) + prior_gap) / len(recent)

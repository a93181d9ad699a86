"""Telling a change of the machine's speed from a stall and from a fit still learning: the step-cost model's
(StepCostModel) cue to forget the steps before a load came or went.

A step's ratio is its measured time over the time a reference fit predicts for its shape. The reference is the
model's fit as it was some steps before (see reference_of), not the fit refitted on the steps judged: a fit that
sees one shape run faster bends its shape to match within a few steps, and the change would hide in it. A change
is a run of `steps` steps, 7 in 8 of them more than `factor` slower (or faster) than the reference predicts, right
after `steps` steps it predicted well (the median within 10%), or right after the warm-up profile. A stall is one
slow step, not a run of them; a young fit that is wrong about the shapes is not settled, and no change is read
from it."""
from __future__ import annotations

import statistics
from collections import deque


class SpeedChange:
    def __init__(self, steps: int = 16, factor: float = 1.3) -> None:
        if not (isinstance(steps, int) and steps >= 1 and factor > 1):
            raise ValueError(f"a speed change needs steps >= 1 and factor > 1, got {steps!r}, {factor!r}")
        self.steps, self.factor = steps, factor
        self.ratios: deque = deque(maxlen=2 * steps)  # the steps before the last `steps`, and those
        self.slow = self.fast = 0  # of the last `steps` ratios, those over factor, and those under 1 / factor
        self.reference = None  # the coefficients ratios are taken against (what the caller passed)
        self.judged = 0  # ratios taken against the reference
        self.after_profile = False  # whether the steps before the first `steps` count as settled
        self.changes = 0

    def reference_of(self, current):
        """The fit to judge this step by: `current` (the caller's coefficients, kept as given, so the caller must
        not change them in place) once the last reference has judged `steps` steps and predicted them well; one
        that did not is kept (a change may be under way, and the fit refitted on its first steps would hide it), for
        4 * steps steps at most."""
        if (self.reference is None or self.judged >= 4 * self.steps
                or (self.judged >= self.steps and _settled(list(self.ratios)[-self.judged:]))):
            self.reference, self.judged = current, 0
        return self.reference

    def profiled(self) -> None:
        """The warm-up profile was just fitted: the fit is settled, and the next steps are judged against it."""
        self._clear()
        self.reference, self.after_profile = None, True

    def _clear(self) -> None:
        self.ratios.clear()
        self.slow = self.fast = 0

    def _append(self, ratio: float) -> None:
        """The ratio in, and the counts of the last `steps` kept: the one that leaves them (the `steps`-th from the
        end) out. Counted as they come, not over the window every step (this runs every step)."""
        ratios, factor = self.ratios, self.factor
        if len(ratios) >= self.steps:
            leaving = ratios[-self.steps]
            self.slow -= leaving > factor
            self.fast -= leaving < 1.0 / factor
        ratios.append(ratio)
        self.slow += ratio > factor
        self.fast += ratio < 1.0 / factor

    def observe(self, ratio: float) -> int:
        """One step's measured over reference-predicted time. When it completes a change of speed: how many of the
        last steps ran at the new speed (the run of steps off the reference, this one included); else 0."""
        self._append(ratio)
        self.judged += 1
        if len(self.ratios) < self.steps:
            return 0
        full = len(self.ratios) == 2 * self.steps  # `steps` before the last `steps`
        after_profile = self.after_profile
        if full:
            self.after_profile = False
        slower = self.slow / self.steps >= 7 / 8
        if not (slower or self.fast / self.steps >= 7 / 8):
            return 0
        # in Python floats: a few dozen ratios, where numpy's per-call cost is most of the work
        ratios = list(self.ratios)
        if not (_settled(ratios[:-self.steps]) if full else after_profile):
            return 0
        off = [x > self.factor if slower else x < 1.0 / self.factor for x in ratios]
        run = len(off) - (max(i for i, o in enumerate(off) if not o) + 1 if not all(off) else 0)
        self._clear()
        self.reference, self.after_profile = None, False
        self.changes += 1
        return max(run, 1)


def _settled(ratios: list[float]) -> bool:
    """Whether a fit predicted these steps well: the median step within 10%."""
    return statistics.median(abs(x - 1.0) for x in ratios) < 0.1

"""Each step's measured time into the step-cost model, refitted once every `refit_every` steps and `REFIT_GAP_S`
seconds of steps rather than after each: a fit is a few robust least-squares solves in Python and numpy, and a fit
a fraction of a second old predicts the next step as well as a fresh one. Counted in steps alone, fits would take a
GPU step's worth of host time every few steps (a GPU's steps are tens of times shorter than a CPU's); with the gap,
one fit serves dozens of such steps and still follows a change of speed within a fifth of a second. Until the
model has a fit at all, it is refitted after every step.

A fit that keeps predicting the steps waits twice as long for the next, up to MAX_REFIT_GAP_S: a batch in steady
decoding, drafting or not, teaches it nothing new, and on a CPU at a few streams the fits were most of the policy's
host time. "Keeps predicting" is judged on the fit's bias, not step by step: `drift`, the signed misses averaged over
the last steps (weight DRIFT_WEIGHT each), stays within QUIET_ERROR. Step times on a shared CPU scatter widely
around any fit (one step off tells nothing; refitted on such noise, the fit does not predict the next step better),
while steps that run slower or faster than the fit, one after another, move the average within a few steps and
bring the gap back to REFIT_GAP_S at once. A step that ran more than STALL_MISS slower (a preempted core, 1% of a
shared CPU's steps) is left out of the average, as the robust fit leaves it out. A change of speed is followed
within a fifth of a second of steps, or, where every step is a stall to the old fit, once SpeedChange has read the
change; a drafting step whose draft time the fit missed by more than the price check's tolerance is refitted at
once (GoodputPolicy.observe)."""
from __future__ import annotations

from collections.abc import Callable

from smartspec.policy.cost_model import StepCostModel
from smartspec.types.numbers import is_int
from smartspec.types.plan import DRAFT
from smartspec.types.step_record import StepRecord

REFIT_GAP_S = 0.2  # the least step time between two fits (after refit_every steps)
MAX_REFIT_GAP_S = 1.6  # ... and the most, while fits keep predicting the steps
QUIET_ERROR = 0.15  # a fit whose misses average within this (relative) teaches the next nothing new
DRIFT_WEIGHT = 0.125  # each step's miss in that average: noise of 0.2 a step averages to 0.05, a bias of 0.3 shows in 5
STALL_MISS = 0.3  # a step that ran this much slower (relative to its time, 1.43x) is a stall, left out


class CostFeed:
    def __init__(self, cost: StepCostModel, refit_every: int, depth: Callable[[int], int]) -> None:
        if not (is_int(refit_every) and refit_every >= 1):
            raise ValueError(f"refit_every must be an integer >= 1, got {refit_every!r}")
        self.cost, self.refit_every, self.depth = cost, refit_every, depth
        self.steps_unfit = 0  # steps observed since the last fit
        self.seconds_unfit = 0.0  # and their measured time
        self.drafts_unfit = False  # whether one of them ran draft forwards
        self.drift = 0.0  # the fit's signed misses, averaged over the last steps (DRIFT_WEIGHT)
        self.quiet = True  # whether drift stayed within QUIET_ERROR since the last fit
        self.gap_s = REFIT_GAP_S  # the step time the next fit waits for

    def observe(self, record: StepRecord) -> float | None:
        """Feeds the step to the model; for a step that drafted, its draft time over the time the model predicted
        for it before (None where it drafted nothing or nothing was predicted)."""
        proposed = record.proposed
        if record.methods is not None:  # only the draft model's tokens cost draft forwards
            proposed = [p for m, p in zip(record.methods, proposed) if m == DRAFT]
        depth = self.depth(max(proposed, default=0))
        tokens = record.num_batched_tokens if record.forward_tokens is None else record.forward_tokens
        predicted = float(self.cost.predict_draft(depth, sum(proposed), record.draft_catchup_tokens)) \
            if depth and self.cost.ready else 0.0
        changes = self.cost.speed_changes
        miss = self.cost.observe(tokens, record.num_context_tokens, depth, sum(proposed), record.draft_s,
                                 record.total_s - record.draft_s, catchup=record.draft_catchup_tokens, refit=False)
        if miss is not None and miss <= STALL_MISS:
            self.drift += DRIFT_WEIGHT * (miss - self.drift)
        self.quiet &= miss is not None and abs(self.drift) <= QUIET_ERROR and self.cost.speed_changes == changes
        self.steps_unfit += 1
        self.seconds_unfit += record.total_s
        self.drafts_unfit |= depth > 0
        gap_s = self.gap_s if self.quiet else REFIT_GAP_S  # a fit gone off: the usual gap, at once
        if not self.cost.ready or (self.steps_unfit >= self.refit_every and self.seconds_unfit >= gap_s):
            self.refit()
        return record.draft_s / predicted if predicted > 0 else None

    def observe_profile(self, records: list[StepRecord]) -> None:
        """The warm-up profile: fitted at once, and held as the prior the running fit leans on."""
        for record in records:
            self.observe(record)  # what it predicted of them is not judged: the profile is the first word
        self.refit()
        self.cost.hold_prior()

    def refit(self) -> None:
        steady = self.quiet and self.steps_unfit >= self.refit_every
        self.gap_s = min(MAX_REFIT_GAP_S, 2 * self.gap_s) if steady else REFIT_GAP_S
        self.cost.refit(draft=self.drafts_unfit)
        self.steps_unfit, self.seconds_unfit, self.drafts_unfit, self.quiet, self.drift = 0, 0.0, False, True, 0.0

"""What makes a simulated replica run as a served one does, beyond the exact cost surface: noisy steps with the
occasional stall, a warm-up profile measured through that noise at the engine's own shapes (engine/profile.py),
and the policy's own host time in every step (its plan before the forward; its observing beside the forward, as
the engine runs it, counted where it outlasts a device's forward or, on a CPU, in full).

A policy judged on the exact surface, starting from it, is judged on what it never has: a served policy learns its
costs from a profile of a handful of noisy steps and from the steps it chose to run, and pays for its own planning
in every step. `Realism()` (the default) is the exact simulator."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from smartspec.engine.profile import CALIBRATION_TOKENS, UNPADDED_BATCHES
from smartspec.sim.profile import SimProfile
from smartspec.sim.workload import RequestAcceptance
from smartspec.types.step_record import StepRecord

PROFILE_CONTEXT = 64  # the engine's profile prompts (profile_steps' context)


@dataclass(frozen=True)
class StepNoise:
    """A step's measured time over its surface time: lognormal jitter of `sigma`, and with probability `stall_p`
    a stall that multiplies it by a factor drawn from `stall_factor` (a preempted core, a collector pause)."""
    sigma: float = 0.0
    stall_p: float = 0.0
    stall_factor: tuple[float, float] = (2.0, 5.0)

    def __post_init__(self) -> None:
        low, high = self.stall_factor
        if self.sigma < 0 or not 0 <= self.stall_p < 1 or not 1 <= low <= high:
            raise ValueError(f"StepNoise needs sigma >= 0, stall_p in [0, 1) and 1 <= stall factors: got {self}")

    def factor(self, rng: np.random.Generator) -> float:
        f = float(np.exp(rng.normal(0.0, self.sigma))) if self.sigma else 1.0
        if self.stall_p and rng.random() < self.stall_p:
            f *= float(rng.uniform(*self.stall_factor))
        return f


@dataclass(frozen=True)
class Realism:
    """noise: on every step and every profile step. host_s: seconds of the policy's own planning added to each step;
    "measured" takes planning and observing from the wall clock (a benchmark's choice: tests stay deterministic with a
    number). profile_batches: the batch sizes of the warm-up profile (engine/profile.py profile_batches; a padded
    GPU runner adds its row buckets). profile_scale: (verify, draft) factors the profile's steps ran slower by
    than the machine serves (a warm-up taken while something else loaded the machine; < 1: faster)."""
    noise: StepNoise = StepNoise()
    host_s: float | str = 0.0
    profile_batches: tuple[int, ...] = UNPADDED_BATCHES
    profile_scale: tuple[float, float] = (1.0, 1.0)

    def __post_init__(self) -> None:
        if not (self.host_s == "measured" or (isinstance(self.host_s, (int, float)) and self.host_s >= 0)):
            raise ValueError(f"host_s must be seconds >= 0 or 'measured', got {self.host_s!r}")
        if not self.profile_batches or min(self.profile_batches) < 1 or min(self.profile_scale) <= 0:
            raise ValueError(f"profile_batches must be sizes >= 1 and profile_scale positive: got {self}")


def profile_records(profile: SimProfile, realism: Realism, k_max: int, rng: np.random.Generator) -> list[StepRecord]:
    """The warm-up profile the engine takes (engine/profile.py profile_steps): per batch size and k in {0, 1, 2, K},
    two steps of the whole batch decoding prompts of PROFILE_CONTEXT tokens, the first after the draft's catch-up
    of the prompts, the second after none; each step's time from the surface, scaled as the profile ran, and noisy."""
    verify_scale, draft_scale = realism.profile_scale
    records = []
    for n in realism.profile_batches:
        for k in sorted({0, 1, 2, k_max}):
            for step, catchup in enumerate((n * (PROFILE_CONTEXT - 1) if k else 0, 0)):
                context = n * (PROFILE_CONTEXT + step * (k + 1))
                tokens = n * (k + 1)
                draft = float(profile.cost.predict_draft(k, n * k, catchup)) * draft_scale if k else 0.0
                verify = float(profile.cost.predict_verify(tokens, context + n * k)) * verify_scale
                noise = realism.noise.factor(rng)
                records.append(StepRecord(0, n, [k] * n, [k] * n, [0] * n, [], tokens, 0, context + n * k,
                                          draft * noise, verify * noise, (draft + verify) * noise,
                                          draft_catchup_tokens=catchup))
    return records


def calibration_records(answers: list[RequestAcceptance], k_max: int) -> list[StepRecord]:
    """The engine's acceptance calibration at start (engine/profile.py calibrate_acceptance): each question answered
    for CALIBRATION_TOKENS tokens, drafted at k_max, in one batch; here with the acceptance of requests like the
    workload's, one record per step."""
    made, records = [0] * len(answers), []
    while min(made) < CALIBRATION_TOKENS:
        live = [i for i, n in enumerate(made) if n < CALIBRATION_TOKENS]
        ks = [min(k_max, CALIBRATION_TOKENS - made[i] - 1) for i in live]
        accepted = [answers[i].accepted(k, made[i]) for i, k in zip(live, ks)]
        for i, a in zip(live, accepted):
            made[i] += a + 1
        records.append(StepRecord(len(records), len(live), ks, ks, accepted, [f"__calibration-{i}" for i in live],
                                  len(live) + sum(ks), 0, 0, 0.0, 0.0, 0.0))
    return records

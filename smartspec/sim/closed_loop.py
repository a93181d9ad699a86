"""A closed loop on one simulated replica: `concurrency` clients, each sending its next request as soon as its last
is answered, as a benchmark at fixed concurrency does. Throughput is taken while every client has a request in
flight, after the first wave (each client's first answer) so that every policy is measured past its start, and
before the last requests drain."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from smartspec.policy.base import Policy
from smartspec.sim.oracle import OraclePolicy
from smartspec.sim.profile import SimProfile
from smartspec.sim.realism import CALIBRATION_QUESTIONS, Realism, calibration_records
from smartspec.sim.simulator import SimReplica
from smartspec.sim.workload import Workload
from smartspec.types.request import Request
from smartspec.types.sampling_params import SamplingParams

BLOCK_SIZE = 16


@dataclass
class LoopResult:
    policy: str
    concurrency: int
    seed: int
    tokens: int  # output tokens committed within the measured window
    seconds: float  # the window's length
    steps: int
    mean_k: float  # draft tokens a decoding request per step, over the window
    host_s: float  # the policy's host time per step, over the window

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def closed_loop(profile: SimProfile, policy: str | Policy, k_max: int, concurrency: int, num_requests: int,
                workload: Workload, realism: Realism, seed: int) -> LoopResult:
    """policy: a configured name, a Policy, or "oracle" (OraclePolicy on the profile's exact cost)."""
    if not (concurrency >= 1 and num_requests >= 2 * concurrency + 1):
        raise ValueError(f"a closed loop needs concurrency >= 1 and more than two waves of requests: got "
                         f"{concurrency}, {num_requests}")
    longest = workload.prompt_len[1] + workload.max_tokens[1] + k_max + 1
    replica: SimReplica | None = None

    def rate_of(request_id: str, position: int) -> float:
        return replica.acceptance[request_id].rate(position)

    chosen: str | Policy = OraclePolicy(profile.cost, rate_of) if policy == "oracle" else policy
    replica = SimReplica(profile, chosen, k_max, np.random.default_rng([seed, 7]),
                         concurrency * (-(-longest // BLOCK_SIZE) + 1), BLOCK_SIZE, concurrency,
                         max(512, concurrency * (k_max + 1) + 256), longest + 1, realism)
    # the engine measures acceptance on a few questions before serving; here, questions like the workload's
    replica.speculation.policy.observe_calibration(calibration_records(
        [workload.request(seed, num_requests + i).acceptance for i in range(CALIBRATION_QUESTIONS)], k_max))
    started = 0

    def start(now: float) -> None:
        nonlocal started
        spec = workload.request(seed, started)
        replica.add(Request(f"q{started}", [1] * spec.prompt_len,
                            SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True), arrival_time=now),
                    spec.acceptance)
        started += 1

    for _ in range(concurrency):
        start(0.0)
    now, done, window_from = 0.0, 0, None
    tokens = steps = drafted = rows = 0
    host = 0.0
    while started < num_requests:
        step = replica.step(now)
        if window_from is not None:
            tokens += step.tokens
            steps += 1
            drafted += sum(step.ks)
            rows += len(step.ks)
            host += step.host_s
        now = step.end
        for _ in step.finished:
            done += 1
            if done == concurrency:  # the first wave is in: measure from here
                window_from = now
            if started < num_requests:
                start(now)
    return LoopResult(policy if isinstance(policy, str) else policy.name, concurrency, seed, tokens, now - window_from, steps, drafted / max(1, rows),
                      host / max(1, steps))

"""A closed loop on one simulated replica: `concurrency` clients, each sending its next request as soon as its last
is answered, as a benchmark at fixed concurrency does. Throughput is taken while every client has a request in
flight, after the first wave (each client's first answer) so that every policy is measured past its start, and
before the last requests drain."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from smartspec.policy.base import Policy
from smartspec.runtime.heap import frozen_heap
from smartspec.sim.oracle import OraclePolicy
from smartspec.sim.profile import SimProfile
from smartspec.engine.profile import CALIBRATION_QUESTIONS
from smartspec.sim.realism import Realism, calibration_records
from smartspec.sim.simulator import ReplicaSize, SimReplica, SimStep
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
    plan_s: float = 0.0  # of it, the plan before the forward (the rest runs beside it: engine/step_observer.py)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass
class _Window:
    """What the steps inside the measured window added up to."""
    tokens: int = 0
    steps: int = 0
    drafted: int = 0
    rows: int = 0
    host_s: float = 0.0
    plan_s: float = 0.0

    def add(self, step: SimStep) -> None:
        self.tokens += step.tokens
        self.steps += 1
        self.drafted += sum(step.ks)
        self.rows += len(step.ks)
        self.host_s += step.host_s
        self.plan_s += step.plan_s


def closed_loop(profile: SimProfile, policy: str | Policy, k_max: int, concurrency: int, num_requests: int,
                workload: Workload, realism: Realism, seed: int) -> LoopResult:
    """policy: a configured name, a Policy, or "oracle" (OraclePolicy on the profile's exact cost)."""
    if not (concurrency >= 1 and num_requests >= 2 * concurrency + 1):
        raise ValueError(f"a closed loop needs concurrency >= 1 and more than two waves of requests: got "
                         f"{concurrency}, {num_requests}")
    with frozen_heap():  # as a served replica's heap is once started (the policy's host time is measured)
        replica = _replica(profile, policy, k_max, concurrency, workload, realism, seed)
        return _run(replica, policy, k_max, concurrency, num_requests, workload, seed)


def _run(replica: SimReplica, policy: str | Policy, k_max: int, concurrency: int, num_requests: int,
         workload: Workload, seed: int) -> LoopResult:
    # the engine measures acceptance on a few questions before serving; here, questions like the workload's
    replica.speculation.policy.observe_calibration(calibration_records(
        [workload.request(seed, num_requests + i).acceptance for i in range(len(CALIBRATION_QUESTIONS))], k_max))
    started, done, now, window_from, window = 0, 0, 0.0, None, _Window()

    def start(at: float) -> None:
        nonlocal started
        spec = workload.request(seed, started)
        replica.add(Request(f"q{started}", [1] * spec.prompt_len,
                            SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True), arrival_time=at),
                    spec.acceptance)
        started += 1

    for _ in range(concurrency):
        start(0.0)
    while started < num_requests:
        step = replica.step(now)
        if window_from is not None:
            window.add(step)
        now = step.end
        for _ in step.finished:
            done += 1
            if done == concurrency:  # the first wave is in: measure from here
                window_from = now
            if started < num_requests:
                start(now)
    return LoopResult(policy if isinstance(policy, str) else policy.name, concurrency, seed, window.tokens,
                      now - window_from, window.steps, window.drafted / max(1, window.rows),
                      window.host_s / max(1, window.steps), window.plan_s / max(1, window.steps))


def _replica(profile: SimProfile, policy: str | Policy, k_max: int, concurrency: int, workload: Workload,
             realism: Realism, seed: int) -> SimReplica:
    """One replica sized for the loop: a row and the KV of the longest request per client, and a step budget that
    holds every row's drafts beside a prefill chunk."""
    longest = workload.prompt_len[1] + workload.max_tokens[1] + k_max + 1
    replica: SimReplica | None = None

    def rate_of(request_id: str, position: int) -> float:
        return replica.acceptance[request_id].rate(position)

    chosen = OraclePolicy(profile.cost, rate_of) if policy == "oracle" else policy
    size = ReplicaSize(concurrency * (-(-longest // BLOCK_SIZE) + 1), BLOCK_SIZE, concurrency,
                       max(512, concurrency * (k_max + 1) + 256), longest + 1)
    replica = SimReplica(profile, chosen, k_max, np.random.default_rng([seed, 7]), size, realism)
    return replica

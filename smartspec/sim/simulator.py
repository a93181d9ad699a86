"""The simulated step is the engine's (schedule -> plan -> propose -> verify -> accept -> commit -> observe) with
the model replaced: the real Scheduler, BlockManager, planning (engine/planner.py: the policy, caps, draft block
reservation), propose stage (engine/drafter.py, over a stand-in draft that tracks what a draft model would have
read) and commit (engine/commit.py); the policy observes the last step and plans ahead beside the forward, through
the engine's StepObserver; a step time from the profile's cost model, and accepted drafts sampled per
token with the request's acceptance rate. Replicas sit behind a router that sends each arrival to the less loaded
of two random replicas (Serve's power of two choices)."""
from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass

import numpy as np

from smartspec.engine.commit import TokenCommitter, finish_request
from smartspec.engine.drafter import propose
from smartspec.engine.planner import DraftRoom, Speculation, plan_step
from smartspec.engine.scheduler import Scheduler, split_batch
from smartspec.engine.step_observer import StepObserver
from smartspec.policy import Policy, make_policy
from smartspec.runtime.block_manager import BlockManager
from smartspec.sim.profile import SimProfile
from smartspec.sim.realism import Realism, profile_records
from smartspec.sim.workload import RequestAcceptance
from smartspec.spec_decode.proposer import Proposal, Proposer
from smartspec.types.plan import fed_context
from smartspec.types.request import Request
from smartspec.types.sampling_params import SamplingParams
from smartspec.types.step_record import StepRecord


class _SimProposer(Proposer):
    """Stands for the draft model: drafts of placeholder tokens (their acceptance is sampled, see SimReplica.step),
    and what a draft model would have read per request, so each proposal reports its catch-up as a real one does."""
    method = "sim"

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}  # tokens the draft has read per request (its catch-up is paid)
        self.fed: dict[str, tuple[int, int]] = {}  # request -> (its tokens, k) when it last drafted

    def propose(self, requests: list[Request], ks: list[int], methods: list[str] | None = None) -> Proposal:
        live = [(r, k) for r, k in zip(requests, ks) if k > 0]
        catchup = sum(r.num_tokens - 1 - self.seen.get(r.request_id, 0) for r, _ in live)
        self.fed.update((r.request_id, (r.num_tokens, k)) for r, k in live)
        return Proposal([[0] * k if k > 0 else [] for k in ks], [None] * len(requests), catchup_tokens=catchup)

    def sync(self, request: Request) -> None:
        """The target committed: the draft read the context and its drafts up to the last, or to the first
        rejected one."""
        fed = self.fed.pop(request.request_id, None)
        if fed is not None:
            num_tokens, k = fed
            accepted = request.num_tokens - num_tokens - 1
            self.seen[request.request_id] = num_tokens + min(accepted, k - 1)

    def release(self, request_id: str) -> None:
        self.seen.pop(request_id, None)
        self.fed.pop(request_id, None)


@dataclass
class SimStep:
    """One simulated step: when it ended, the requests it finished, and what its plan was worth on the machine's
    exact surface (expected tokens under the requests' true acceptance, over the surface's seconds for its shape,
    host time apart): what a trap test compares with a quiet policy's."""
    end: float
    finished: list[Request]
    ks: list[int]
    expected_tokens: float
    surface_s: float
    host_s: float  # the policy's host time: its plan before the forward, and its work beside it
    tokens: int  # output tokens the step committed
    plan_s: float = 0.0  # of host_s, the plan before the forward

    @property
    def goodput(self) -> float:
        return self.expected_tokens / self.surface_s


@dataclass(frozen=True)
class ReplicaSize:
    """A simulated replica's engine limits, as EngineConfig sets a real one's."""
    num_blocks: int = 4096
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int = 4096


@dataclass(frozen=True)
class Arrivals:
    """Requests to simulate: each one's arrival (seconds), prompt length and output length (one for all, or each
    request's own, to replay a measured run whose requests stopped at EOS)."""
    times: list[float]
    prompt_lens: list[int]
    max_tokens: int | list[int]

    @property
    def lengths(self) -> list[int]:
        return self.max_tokens if isinstance(self.max_tokens, list) else [self.max_tokens] * len(self.times)


class SimReplica:
    def __init__(self, profile: SimProfile, policy: str | Policy, k_max: int, rng: np.random.Generator,
                 size: ReplicaSize = ReplicaSize(), realism: Realism = Realism()) -> None:
        self.profile, self.rng, self.realism = profile, rng, realism
        self.blocks = BlockManager(size.num_blocks, size.block_size)
        self.scheduler = Scheduler(self.blocks, size.max_num_seqs, size.max_num_batched_tokens)
        self.speculation = Speculation(_SimProposer() if policy != "off" else None, make_policy(policy, k_max),
                                       k_max)
        if self.speculation.policy.wants_profile:  # the engine's warm-up profile, through the machine's noise
            self.speculation.policy.observe_profile(profile_records(profile, realism, k_max, rng))
        self.max_num_batched_tokens, self.max_model_len = size.max_num_batched_tokens, size.max_model_len
        self.committer = TokenCommitter(self.blocks, (), size.max_model_len)  # no tokenizer: ids stand for lengths
        self.acceptance: dict[str, RequestAcceptance] = {}
        self.steps = 0
        # the last step's record, observed beside the next step's forward (and, on an asynchronous device, the next
        # step planned there), as the engine does; a policy that fails here fails the simulation
        self.observer = StepObserver(plans_ahead=profile.asynchronous, raises=True)

    @property
    def load(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def add(self, req: Request, acceptance: RequestAcceptance | None = None) -> None:
        """acceptance: the request's (None: a constant rate drawn from the profile's measured requests)."""
        if acceptance is None:
            alpha = self.profile.sample_alpha(self.rng)
            acceptance = RequestAcceptance(alpha, alpha, 0, self.rng)
        self.acceptance[req.request_id] = acceptance
        self.scheduler.add(req)

    def step(self, now: float) -> SimStep:
        """Run one step starting at `now`."""
        batch = self.scheduler.schedule()
        decoding, prefill = split_batch(batch)
        lengths = [r.num_tokens for r in decoding]  # as planned, before the step commits tokens
        began = time.perf_counter()
        room = DraftRoom(self.max_num_batched_tokens - sum(s.num_tokens for s in batch), self.blocks,
                         self.max_model_len)
        view, plan = plan_step(self.speculation, decoding, prefill, room, now=now)
        host_s = time.perf_counter() - began
        ks = plan.ks
        catchup = propose(self.speculation, view, decoding, plan).catchup_tokens
        k_of = {r.request_id: k for r, k in zip(decoding, ks)}
        n_tokens = sum(s.num_tokens + k_of.get(s.request.request_id, 0) for s in batch)
        n_context = sum(fed_context(s.request.num_computed_tokens, s.num_tokens + k_of.get(s.request.request_id, 0),
                                    s.request.request_id not in k_of) for s in batch)
        surface_s = self.profile.step_time(n_tokens, n_context, max(ks, default=0), sum(ks), catchup)
        noise = self.realism.noise.factor(self.rng)
        duration = surface_s * noise
        draft_s = noise * float(self.profile.cost.predict_draft(max(ks, default=0), sum(ks), catchup)) if any(ks) \
            else 0.0
        expected = sum(self.acceptance[r.request_id].expected_tokens(k, r.num_output_tokens)
                       for r, k in zip(decoding, ks))
        observed_s = self._host(self.observer.beside_forward(self.speculation.policy, view))
        outcomes = self._accept(batch, k_of)
        accepted = [a for req, a, _ in outcomes if req.request_id in k_of]
        self.steps += 1
        num_prefill = sum(s.num_tokens for s in prefill)
        record = StepRecord(self.steps, len(batch), list(ks), list(ks), accepted,
                                  [r.request_id for r in decoding], n_tokens, num_prefill, n_context, draft_s,
                                  duration - draft_s, duration, predicted_s=plan.predicted_s if decoding else None,
                                  draft_catchup_tokens=catchup, num_tokens=lengths, probes=list(plan.probes))
        observed_s += self._host(self.observer.hold(self.speculation.policy, record))
        planned_s = host_s if self.realism.host_s == "measured" else float(self.realism.host_s)
        end = now + planned_s + self._forward_s(duration, draft_s, observed_s)
        finished = self._commit(outcomes, end)
        if not self.scheduler.has_unfinished():  # no forward follows to observe it beside (the replica idles)
            observed_s += self._host(self.observer.observe_waiting())
        return SimStep(end, finished, list(ks), expected, surface_s, planned_s + observed_s,
                       sum(a + 1 for _, a, _ in outcomes), planned_s)

    def _host(self, measured_s: float) -> float:
        """Host seconds as the simulation counts them: as measured, or none (Realism.host_s: a fixed planning time,
        or none, leaves observing out)."""
        return measured_s if self.realism.host_s == "measured" else 0.0

    def _forward_s(self, duration: float, draft_s: float, observed_s: float) -> float:
        """A step's time from its proposals to its commit: on an asynchronous device the observing runs while the
        target's forward does, and costs what it outlasts it; elsewhere it is added."""
        if self.profile.asynchronous:
            return draft_s + max(duration - draft_s, observed_s)
        return duration + observed_s

    def _accept(self, batch, k_of: dict[str, int]) -> list[tuple[Request, int, int]]:
        """The step's forward fed: per request that completes its part, (request, drafts accepted, drafts)."""
        outcomes = []
        for s in batch:
            req = s.request
            k = k_of.get(req.request_id, 0)
            req.num_computed_tokens += s.num_tokens + k
            if s.completes:
                outcomes.append((req, self.acceptance[req.request_id].accepted(k, req.num_output_tokens), k))
        return outcomes

    def _commit(self, outcomes: list[tuple[Request, int, int]], at: float) -> list[Request]:
        """Each outcome's tokens committed at `at`; the requests that finished."""
        finished = []
        for req, a, k in outcomes:
            # token ids stand for lengths (requests ignore EOS and have no stop tokens)
            done = self.committer.commit(req, [0] * (a + 1), k, self.speculation, at)
            if done.finish_reason is not None:
                finish_request(req, done.finish_reason, self.scheduler, self.speculation, at)
                finished.append(req)
            elif self.speculation.proposer is not None:
                self.speculation.proposer.sync(req)
        return finished


def simulate(profile: SimProfile, policy: str, k_max: int, requests: Arrivals, replicas: int = 1, seed: int = 0,
             size: ReplicaSize = ReplicaSize()) -> list[dict]:
    """Per request: arrival, ttft_s, latency_s, tpot_s, output_tokens, replica."""
    arrivals, prompt_lens, lengths = requests.times, requests.prompt_lens, requests.lengths
    rng = np.random.default_rng(seed)
    reps = [SimReplica(profile, policy, k_max, np.random.default_rng(seed + 1 + i), size) for i in range(replicas)]
    events: list[tuple[float, int, str, int]] = []  # (time, order, kind, index)
    order = itertools.count()
    for i, t in enumerate(arrivals):
        heapq.heappush(events, (t, next(order), "arrive", i))
    stepping = [False] * replicas
    placed: dict[str, tuple[int, float]] = {}  # request -> (replica, arrival)
    rows = []
    while events:
        now, _, kind, idx = heapq.heappop(events)
        if kind == "arrive":
            pair = rng.choice(replicas, size=min(2, replicas), replace=False)
            r = min(pair, key=lambda j: reps[j].load)
            req = Request(f"s{idx}", [1] * prompt_lens[idx], SamplingParams(max_tokens=lengths[idx], ignore_eos=True),
                          arrival_time=now)
            placed[req.request_id] = (int(r), now)
            reps[r].add(req)
        else:
            r = idx
            stepping[r] = False
        if not stepping[r] and reps[r].scheduler.has_unfinished():
            stepped = reps[r].step(now)
            end, finished = stepped.end, stepped.finished
            stepping[r] = True
            heapq.heappush(events, (end, next(order), "step_end", r))
            for req in finished:
                rep, arrival = placed[req.request_id]
                n = req.num_output_tokens
                rows.append({"request": req.request_id, "replica": rep, "arrival_s": arrival,
                             "ttft_s": req.first_token_time - arrival, "latency_s": req.finish_time - arrival,
                             "tpot_s": (req.finish_time - req.first_token_time) / max(1, n - 1),
                             "output_tokens": n, "alpha": reps[rep].acceptance[req.request_id].first})
    return sorted(rows, key=lambda x: x["arrival_s"])

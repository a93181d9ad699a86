"""The warm-up profile: a few measured step shapes, so a learning policy starts from measured costs."""
from __future__ import annotations

import itertools

from smartspec.engine.step_record import StepRecord
from smartspec.engine.step_stats import StepStats
from smartspec.policy.baselines import FixedPolicy
from smartspec.sampling_params import SamplingParams
from smartspec.spec_decode.proposer import Proposal, Proposer
from smartspec.spec_decode.speculator import Speculator

_prompts = itertools.count(1)  # numbers the profile requests of this process


class _PaddedProposer(Proposer):
    """For the warm-up profile: the real proposer's drafts, padded to k with filler, so that every profiled step
    verifies exactly the planned number of tokens (prompt lookup may find nothing in a synthetic prompt)."""

    def __init__(self, inner: Proposer) -> None:
        # a draft model beside lookups (MixedProposer): profile the draft, the one whose forwards cost
        self.inner = getattr(inner, "draft", inner)

    def propose(self, requests, ks):
        proposal = self.inner.propose(requests, ks)
        self.last_catchup_tokens = self.inner.last_catchup_tokens
        tokens = [t + [r.token_ids[-1]] * (k - len(t)) for r, t, k in zip(requests, proposal.tokens, ks)]
        return Proposal(tokens, [None] * len(tokens))  # profile requests are greedy: no draft distributions

    def sync(self, request):
        self.inner.sync(request)

    def release(self, request_id):
        self.inner.release(request_id)


def profile_steps(engine, batches=(1, 4), context: int = 64) -> list[StepRecord]:
    """Measure a few step shapes (batch x k, through the real step) and hand them to the policy's cost model
    only: a learning policy then starts from measured costs, not guesses. Leaves no trace behind."""
    spec, policy = engine.speculator, engine.speculator.policy
    records, trace, engine.trace = [], engine.trace, None
    for batch in batches:
        for k in sorted({0, 1, 2, spec.k_max}):
            engine.speculator = Speculator(_PaddedProposer(spec.proposer), FixedPolicy(k), max(spec.k_max, 1))
            for i in range(batch):  # max_tokens: one token from the prefill, then at least one full-k step
                # any valid tokens (only cost counts), but a prompt of its own, also across profiles (one per policy
                # a benchmark tries): a prefix cached by an earlier profile request would spare the draft model its
                # catch-up, and the fit would price catch-ups at nothing
                n = next(_prompts)
                prompt = [(17 + 13 * j + 7919 * n) % engine.vocab_size for j in range(context)]
                engine.add_request(prompt, SamplingParams(max_tokens=k + 2, ignore_eos=True),
                                   request_id=f"__profile-{batch}-{k}-{i}")
            while engine.has_unfinished():
                engine.step()
                if engine.last_step.num_prefill_tokens == 0:
                    records.append(engine.last_step)
    engine.speculator, engine.trace = spec, trace
    policy.observe_profile(records)
    engine.num_steps = 0
    engine.stats = StepStats()
    return records


"""The warm-up profile: a few measured step shapes, so a learning policy starts from measured costs."""
from __future__ import annotations

import itertools

from smartspec.engine.planner import Speculation
from smartspec.policy.baselines import FixedPolicy
from smartspec.spec_decode.proposer import Proposal, Proposer
from smartspec.types.sampling_params import SamplingParams
from smartspec.types.step_record import StepRecord

_prompts = itertools.count(1)  # numbers the profile requests of this process


class _PaddedProposer(Proposer):
    """For the warm-up profile: the real proposer's drafts, padded to k with filler, so that every profiled step
    verifies exactly the planned number of tokens (prompt lookup may find nothing in a synthetic prompt). It keeps
    nothing of the profile's outputs (`finish` is not passed on)."""

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner.drafting_part()  # a draft model beside lookups: the one whose forwards cost

    def propose(self, requests, ks, methods=None):
        proposal = self.inner.propose(requests, ks)
        tokens = [t + [r.token_ids[-1]] * (k - len(t)) for r, t, k in zip(requests, proposal.tokens, ks)]
        # profile requests are greedy: no draft distributions
        return Proposal(tokens, [None] * len(tokens), catchup_tokens=proposal.catchup_tokens)

    def sync(self, request):
        self.inner.sync(request)

    def release(self, request_id):
        self.inner.release(request_id)


def profile_steps(engine, batches=(1, 4), context: int = 64) -> list[StepRecord]:
    """Measure a few step shapes (batch x k, through the real step) and hand them to the policy's cost model
    only: a learning policy then starts from measured costs, not guesses. The profile's steps are not observed,
    counted or traced. A runner that captures CUDA graphs spends a shape's first step capturing it, so there each
    shape is run twice and only the second run measured."""
    spec = engine.speculation
    padded = _PaddedProposer(spec.proposer)
    records = []
    passes = (False, True) if engine.runner.captures_graphs else (True,)
    for batch, k, measured in itertools.product(batches, sorted({0, 1, 2, spec.k_max}), passes):
        fixed = Speculation(padded, FixedPolicy(k), max(spec.k_max, 1))
        for i in range(batch):  # max_tokens: one token from the prefill, then at least one full-k step
            # any valid tokens (only cost counts), but a prompt of its own, also across profiles (one per policy
            # a benchmark tries): a prefix cached by an earlier profile request would spare the draft model its
            # catch-up, and the fit would price catch-ups at nothing
            n = next(_prompts)
            prompt = [(17 + 13 * j + 7919 * n) % engine.vocab_size for j in range(context)]
            engine.add_request(prompt, SamplingParams(max_tokens=k + 2, ignore_eos=True),
                               request_id=f"__profile-{batch}-{k}-{i}")
        while engine.has_unfinished():
            record = engine.run_step(fixed).record
            if measured and record is not None and record.num_prefill_tokens == 0:
                records.append(record)
    spec.policy.observe_profile(records)
    return records

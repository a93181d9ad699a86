"""The warm-up profile: a few measured step shapes, so a learning policy starts from measured costs; and the
calibration: the draft model's acceptance and the lookups' worth on a little real text, so it starts from measured
acceptance too."""
from __future__ import annotations

import itertools
import time

from smartspec.engine.commit import finish_request
from smartspec.engine.planner import Speculation
from smartspec.engine.profile_cache import Calibration
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


UNPADDED_BATCHES = (1, 4)


def profile_batches(padded: bool, max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes the warm-up profile measures. A step that runs as it comes costs what its tokens cost, and
    the fit carries batches 1 and 4 over to larger ones (on a CPU a larger batch would add seconds to a start). A
    runner that pads steps into buckets (shapes: CUDA graphs) is another machine at every row bucket: a 64-row
    step, with one draft token a row, is a bucket of 128 cells that batches 1 and 4 never ran, and the fit cannot
    price drafting at the batch it serves (on a GPU it held k = 0 at 64 streams where k = 4 ran faster). There
    the profile also runs powers of four up to max_num_seqs, and max_num_seqs itself."""
    if not padded:
        return UNPADDED_BATCHES
    served = {4 ** i for i in range(max_num_seqs.bit_length()) if 4 ** i <= max_num_seqs}
    return tuple(sorted(served | set(UNPADDED_BATCHES) | {max_num_seqs}))


def profile_steps(engine, batches=UNPADDED_BATCHES, context: int = 64) -> list[StepRecord]:
    """Measure a few step shapes (batch x k, through the real step) and hand them to the policy's cost model
    only: a learning policy then starts from measured costs, not guesses. The profile's steps are not observed,
    counted or traced. Both models first run one warm-up request (warm_up_forwards): unwarmed, the first shape's
    first drafting step is the draft model's first forward in the process."""
    warm_up_forwards(engine, context)
    spec = engine.speculation
    padded = _PaddedProposer(spec.proposer)
    records = []
    for batch, k in itertools.product(batches, sorted({0, 1, 2, spec.k_max})):
        fixed = Speculation(padded, FixedPolicy(k), max(spec.k_max, 1))
        # max_tokens: one token from the prefill, then at least two full-k steps with the whole batch decoding: the
        # first drafts after the draft's catch-up of the prompt, the second after none, so the fit tells a draft
        # forward's cost from a catch-up token's (with only the first, each shape's catch-up grows with its batch
        # and the split was noise's: the draft's forward fitted well above what it takes); where the
        # first step's budget cannot prefill the batch, the prompts prefilled first decode (k + 1 tokens a step,
        # taken from the budget) for as many steps as the rest take
        budget, prompts = engine.config.max_num_batched_tokens, batch * context
        waiting = 0 if prompts <= budget else -(-(prompts - budget) // max(1, budget - batch * (k + 1)))
        max_tokens = min(2 * k + 3 + waiting * (k + 1), engine.max_model_len - context)  # a tiny budget: bounded
        for i in range(batch):
            # any valid tokens (only cost counts), but a prompt of its own, also across profiles (one per policy
            # a benchmark tries): a prefix cached by an earlier profile request would spare the draft model its
            # catch-up, and the fit would price catch-ups at nothing
            n = next(_prompts)
            prompt = [(17 + 13 * j + 7919 * n) % engine.vocab_size for j in range(context)]
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                               request_id=f"__profile-{batch}-{k}-{i}")
        full_steps = 0
        while engine.has_unfinished() and full_steps < 2:
            record = engine.run_step(fixed).record
            if record is not None and record.num_prefill_tokens == 0:
                full_steps += record.batch_size == batch
                records.append(record)
        _end(engine, fixed, [f"__profile-{batch}-{k}-{i}" for i in range(batch)])
    spec.policy.observe_profile(records)
    return records


def _end(engine, fixed: Speculation, request_ids: list[str]) -> None:
    """End the profile's requests still running after their measured steps (how many steps a request takes
    depends on how many padded drafts the model happens to accept; the profile's do not), through the profile's
    speculation: the serving proposer keeps nothing of them."""
    for request_id in request_ids:
        req = engine.requests.pop(request_id, None)
        if req is not None:
            finish_request(req, "abort", engine.scheduler, fixed, time.monotonic())


def warm_up_forwards(engine, context: int = 64) -> int:
    """Run one short request through the target and the draft model, observed by no one; its steps. A model's first
    forwards in a process cost several times the next ones (the draft's first drafting step, the target's first
    prefill). Paid by the profile's first measured step, that step tells the cost fit that a draft forward costs
    more than it does, and the policy leaves the draft model unused for the first requests; paid by the first
    request (a start from a kept profile runs no other forward), the fit learns the same from it."""
    spec = engine.speculation
    k = spec.k_max if spec.proposer is not None else 0
    fixed = Speculation(_PaddedProposer(spec.proposer), FixedPolicy(k), k) if k else Speculation.off()
    n = next(_prompts)
    length = max(1, min(context, engine.max_model_len - k - 2))  # prompt and answer within max_model_len
    prompt = [(17 + 13 * j + 7919 * n) % engine.vocab_size for j in range(length)]
    # one token from the prefill, then a step that drafts k (a step drafts no further than max_tokens)
    engine.add_request(prompt, SamplingParams(max_tokens=k + 2, ignore_eos=True), request_id=f"__warm-up-{n}")
    steps = 0
    while engine.has_unfinished():
        engine.run_step(fixed)
        steps += 1
    return steps


# One question of each kind a served model meets (new code, prose, an edit, a short answer), 48 tokens each: about
# 45 first-token outcomes, enough to put the prior near what requests later show; far fewer leave it close to the
# starting guess and the first requests at k = 0 (docs/policy.md).
CALIBRATION_QUESTIONS = (
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Explain in three sentences why the sky is blue.",
    "Add type hints to this function, changing nothing else:\n\ndef mean(xs):\n    total = 0\n    for x in xs:\n"
    "        total += x\n    return total / len(xs)",
    "What is the difference between a list and a tuple in Python?",
)
CALIBRATION_TOKENS = 48
# names a kept calibration (engine/profile_cache.py): one measured otherwise, or kept in another form, is not taken
CALIBRATION_KEY = (CALIBRATION_QUESTIONS, CALIBRATION_TOKENS, "draft outcomes and answers")


def calibrate_acceptance(engine, max_tokens: int = CALIBRATION_TOKENS) -> Calibration:
    """How often drafts are accepted on real text, measured before any request: each calibration question answered
    greedily for max_tokens, drafted at k_max through the real draft model where there is one. The policy takes the
    draft's outcomes as the first evidence of its acceptance prior, and the lookups suffix speculation would have
    offered along the answers as the first evidence of its node calibration (`take_calibration`), so the first
    requests speculate where it pays, with the proposer that pays, instead of starting from a guess and learning
    through probes. A draft model's token trees are left to be learned per node. Like the profile, its steps are
    not observed, counted or traced."""
    spec, config = engine.speculation, engine.config.speculative_config
    if spec.k_max < 1 or spec.proposer is None:
        return Calibration([], [])
    drafter = spec.proposer.drafting_part()
    # a draft model in this process or in its own actor (RemoteDraftProposer), drafting chains
    chains = drafter.method == "draft_model" and not (config and config.tree)
    if not chains and spec.proposer.lookups([], spec.k_max) is None:
        return Calibration([], [])
    run = Speculation(drafter, FixedPolicy(spec.k_max), spec.k_max) if chains else Speculation.off()
    prompts = {}
    for i, question in enumerate(CALIBRATION_QUESTIONS):
        ids = engine.tokenize(_question_text(engine.tokenizer, question))
        rid = engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                 request_id=f"__calibration-{next(_prompts)}-{i}")
        prompts[rid] = ids
    records, answers = [], {}
    while engine.has_unfinished():
        step = engine.run_step(run)
        answers.update((out.request_id, list(out.token_ids)) for out in step.outputs if out.finished)
        if step.record is not None and any(step.record.proposed):
            records.append(step.record)
    calibration = Calibration(records, [(prompts[rid], answers[rid]) for rid in prompts if rid in answers])
    take_calibration(spec, calibration)
    return calibration


def take_calibration(spec: Speculation, calibration: Calibration) -> None:
    """Hand a calibration, measured now or kept from an earlier start, to the policy."""
    spec.policy.observe_calibration(calibration.records)
    if spec.proposer is not None and spec.k_max > 0:
        spec.policy.observe_lookup_calibration(spec.proposer.replayed_lookups(calibration.answers, spec.k_max))


def _question_text(tokenizer, question: str) -> str:
    """The question as the model's chat template frames a user's turn; the bare text for a model without one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
    return question
